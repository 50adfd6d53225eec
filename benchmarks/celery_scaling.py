"""Celery executor scaling: `regress golden` locally, on one Celery worker, on two, and two candidates.

Everything runs on this machine: a private redis-server (free loopback port, temporary
directory, append-only persistence as in production), fresh `regress worker` processes for
every configuration (so every measured run includes its engine loads), a fresh output
directory for every run. Configurations:

- local:           `regress golden` with the local executor (one engine in a subprocess);
- celery-1w:       `--executor celery`, one worker;
- celery-2w:       two workers, both free to use both cores;
- celery-2w-omp1:  two workers with OMP_NUM_THREADS=1 (one compute thread each, not pinned);
- celery-2w-pin:   two workers, each pinned to its own core (`taskset -c N` and OMP_NUM_THREADS=1;
                   the engine subprocess inherits both);
- celery-2w-2cand: two pinned workers, two candidates differing only in an unused environment
                   variable (so the workers cannot share a warm engine between them), replayed
                   one after the other: engine loads per run and in total.

The in-process vLLM CPU engine (regress sets VLLM_ENABLE_V1_MULTIPROCESSING=0) does not apply
VLLM_CPU_OMP_THREADS_BIND (only vLLM's multi-process executor does); its OpenMP threads follow
OMP_NUM_THREADS and the CPU affinity it inherits.

Timed per run: the wall time of the `regress golden` command (workers already up and idle,
engines not loaded), and from the manifest `timings.total_s`, `generation_s` (the sum over
shards, so with two workers in parallel it can exceed the wall time), `engine_load_s` (the sum
over engine loads) and `engine_loads`; from the worker logs each engine load and how many
shards each worker ran.

Usage: python benchmarks/celery_scaling.py [--prompts 320] [--repeats 2] [--shard-size 32]
       [--model DIR] [--configs local,celery-1w,...]
Writes benchmarks/results/celery_scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
ENGINE_ARGS = {"enforce_eager": True, "max_model_len": 4096}
BASE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
ALL_CONFIGS = ["local", "celery-1w", "celery-2w", "celery-2w-omp1", "celery-2w-pin", "celery-2w-2cand"]
# config -> (workers, OMP_NUM_THREADS=1 per worker, pin worker i to core i, candidates)
CELERY_CONFIGS = {
    "celery-1w": (1, False, False, ["baseline"]),
    "celery-2w": (2, False, False, ["baseline"]),
    "celery-2w-omp1": (2, True, False, ["baseline"]),
    "celery-2w-pin": (2, True, True, ["baseline"]),
    "celery-2w-2cand": (2, True, True, ["bench-a", "bench-b"]),
}


# -- inputs ------------------------------------------------------------------------------------


def write_prompt_set(n: int, path: Path) -> None:
    """``n`` distinct prompts (demo texts, numbered) and a card: greedy, 64 new tokens, top-5."""
    texts = []
    for line in (REPO / "regress/data/prompts/fixture.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if isinstance(record.get("prompt"), str) and "long-context" not in record.get("tags", []):
            texts.append(record["prompt"])
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"b{i:05d}", "prompt": f"{texts[i % len(texts)]} (#{i})"}) + "\n")
    path.with_suffix(".yaml").write_text(yaml.safe_dump({
        "description": f"Celery scaling benchmark: {n} prompts from the demo texts.",
        "defaults": {"temperature": 0, "max_tokens": 64, "logprobs": 5, "seed": 0},
    }), encoding="utf-8")


def write_params(work: Path, model: Path, dataset: Path, shard_size: int) -> Path:
    params = work / "params.yaml"
    params.write_text(yaml.safe_dump({
        "dataset": str(dataset),
        "shard_size": shard_size,
        "baseline": {"package": "current", "model": str(model), "dtype": "bfloat16",
                     "engine_args": ENGINE_ARGS, "env": BASE_ENV},
        # Workers key warm engines by everything but the name: these two differ in an
        # environment variable nothing reads, so each needs its own engine.
        "candidates": {"bench-a": {"env": {"REGRESS_BENCH": "a"}}, "bench-b": {"env": {"REGRESS_BENCH": "b"}}},
    }), encoding="utf-8")
    return params


# -- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Every process this benchmark starts, each in its own session; all killed on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.descendants: set[int] = set()

    def start(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def remember_children(self, proc: subprocess.Popen[bytes]) -> None:
        """Note the process's descendants (engine processes run in sessions of their own)."""
        try:
            import psutil

            self.descendants |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except Exception:
            pass

    def stop(self, proc: subprocess.Popen[bytes], *, timeout: float = 60) -> None:
        """SIGTERM the process group (a worker finishes its shard and closes its engine), then SIGKILL."""
        self.remember_children(proc)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        self._kill(proc)

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._kill_descendants()

    def _kill_descendants(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        for pid in list(self.descendants):
            try:
                p = psutil.Process(pid)
                # Only processes this benchmark started (children of its workers) are noted here;
                # pids can be reused, so check the command line still looks like an engine.
                if "regress" in " ".join(p.cmdline()):
                    os.kill(pid, signal.SIGKILL)
            except Exception:
                pass
            self.descendants.discard(pid)

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.remember_children(proc)
            self._kill(proc)


def start_redis(procs: Processes, directory: Path) -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs.start([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
                 "--appendonly", "yes", "--save", "", "--logfile", str(directory / "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0"
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("redis-server did not answer within 20 s")


def start_worker(procs: Processes, work: Path, env: dict[str, str], queue: str, name: str,
                 log: Path, *, one_thread: bool, cpu: int | None) -> subprocess.Popen[bytes]:
    args = [PYTHON, "-m", "regress.cli", "worker", "--queue", queue, "--name", name,
            "--params", str(work / "no-params.yaml")]
    worker_env = dict(env)
    if one_thread:
        worker_env["OMP_NUM_THREADS"] = "1"
    if cpu is not None:
        args = ["taskset", "-c", str(cpu), *args]
    with open(log, "ab") as out:
        return procs.start(args, cwd=work, env=worker_env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
        if "ready." in text:
            return time.monotonic() - started
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited:\n{text[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"worker not ready after {timeout} s")


# -- one run -----------------------------------------------------------------------------------


def run_golden(params: Path, candidate: str, out: Path, env: dict[str, str], *, queue: str | None) -> dict[str, Any]:
    args = [PYTHON, "-m", "regress.cli", "golden", "--params", str(params), "--candidate", candidate,
            "--out", str(out)]
    if queue is not None:
        args += ["--executor", "celery", "--queue", queue]
    started = time.perf_counter()
    done = subprocess.run(args, env=env, cwd=params.parent, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"regress golden failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    from regress.runs import load_run

    t = load_run(out).manifest.timings
    return {"candidate": candidate, "cli_wall_s": round(wall, 2), "total_s": t.total_s,
            "generation_s": t.generation_s, "engine_load_s": t.engine_load_s, "engine_loads": t.engine_loads,
            "output_tokens": t.output_tokens}


_LOADED = re.compile(r"engine for '([^']+)' loaded in ([0-9.]+) s")
_SUCCEEDED = re.compile(r"Task regress\.replay_shard\[[^\]]+\] succeeded")


def worker_facts(log: Path) -> dict[str, Any]:
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    return {"engine_loads": [{"candidate": c, "load_s": float(s)} for c, s in _LOADED.findall(text)],
            "shards": len(_SUCCEEDED.findall(text))}


def run_config(config: str, rep: int, procs: Processes, work: Path, params: Path,
               env: dict[str, str]) -> dict[str, Any]:
    run_root = work / f"{config}-{rep}"
    run_root.mkdir()
    if config == "local":
        run = run_golden(params, "baseline", run_root / "golden", env, queue=None)
        return {"config": config, "rep": rep, "workers": 0, "runs": [run]}
    n_workers, one_thread, pinned, candidates = CELERY_CONFIGS[config]
    queue = f"bench-{config}-{rep}"
    workers = []
    for i in range(n_workers):
        log = run_root / f"worker{i}.log"
        proc = start_worker(procs, work, env, queue, f"w{i}-{config}-{rep}@bench", log,
                            one_thread=one_thread, cpu=i if pinned else None)
        workers.append((proc, log))
    try:
        ready_s = [round(wait_ready(p, log), 2) for p, log in workers]
        runs = []
        for cand in candidates:
            runs.append(run_golden(params, cand, run_root / f"golden-{cand}", env, queue=queue))
            for p, _ in workers:
                procs.remember_children(p)
    finally:
        for p, _ in workers:
            procs.stop(p)
    return {"config": config, "rep": rep, "workers": n_workers, "omp_num_threads_1": one_thread, "pinned": pinned,
            "worker_ready_s": ready_s, "runs": runs, "worker_logs": [worker_facts(log) for _, log in workers]}


# -- main --------------------------------------------------------------------------------------


def summarise(results: list[dict[str, Any]], configs: list[str]) -> list[dict[str, Any]]:
    rows = []
    for config in configs:
        reps = [r for r in results if r["config"] == config]
        if not reps:
            continue
        walls = [sum(run["cli_wall_s"] for run in r["runs"]) for r in reps]
        totals = [sum(run["total_s"] for run in r["runs"]) for r in reps]
        gens = [sum(run["generation_s"] for run in r["runs"]) for r in reps]
        loads = [[run["engine_loads"] for run in r["runs"]] for r in reps]
        per_load = [x["load_s"] for r in reps for w in r.get("worker_logs", []) for x in w["engine_loads"]]
        if config == "local":
            per_load = [run["engine_load_s"] for r in reps for run in r["runs"]]
        rows.append({
            "config": config, "repeats": len(reps),
            "wall_s": walls, "median_wall_s": round(statistics.median(walls), 2),
            "wall_s_per_run": [[run["cli_wall_s"] for run in r["runs"]] for r in reps],
            "manifest_total_s": totals, "generation_s_sum": gens,
            "engine_loads_per_run": loads,
            "engine_load_s_each": per_load,
            "median_engine_load_s": round(statistics.median(per_load), 2) if per_load else None,
            "shards_per_worker": [[w["shards"] for w in r.get("worker_logs", [])] for r in reps],
        })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'config':16} {'wall (s), each rep':26} {'median':>7} {'loads/run':>12} {'load s (median)':>16} {'gen s (sum)':>14} shards/worker"
    print(header)
    print("-" * len(header))
    for row in rows:
        walls = ", ".join("+".join(f"{w:.1f}" for w in rep) for rep in row["wall_s_per_run"])
        loads = "; ".join("+".join(str(x) for x in rep) for rep in row["engine_loads_per_run"])
        gens = ", ".join(f"{g:.1f}" for g in row["generation_s_sum"])
        shards = "; ".join("/".join(str(s) for s in rep) for rep in row["shards_per_worker"])
        print(f"{row['config']:16} {walls:26} {row['median_wall_s']:7.1f} {loads:>12} "
              f"{row['median_engine_load_s'] or 0:16.1f} {gens:>14} {shards}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shard-size", type=int, default=32)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: build the fixture)")
    parser.add_argument("--configs", default=",".join(ALL_CONFIGS), help=f"comma-separated subset of {ALL_CONFIGS}")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/celery_scaling.json")
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(ALL_CONFIGS)
    if unknown:
        parser.error(f"unknown configs: {sorted(unknown)}")

    began = time.monotonic()
    load_before = os.getloadavg()
    procs = Processes()
    results: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="regress-celery-bench-") as tmp:
            work = Path(tmp)
            model = args.model.resolve() if args.model else None
            if model is None:
                from regress.fixture_model import build_fixture_model

                model = work / "fixture"
                t0 = time.monotonic()
                build_fixture_model(model)
                print(f"fixture model built in {time.monotonic() - t0:.0f} s", flush=True)
            dataset = work / "bench.jsonl"
            write_prompt_set(args.prompts, dataset)
            params = write_params(work, model, dataset, args.shard_size)
            broker = start_redis(procs, work / "redis")
            env = {**os.environ, "REGRESS_BROKER_URL": broker, "REGRESS_VISIBILITY_TIMEOUT_S": "3600",
                   "REGRESS_HOME": str(work / "home")}
            for k in ("REGRESS_QUEUE", "REGRESS_RESULT_BACKEND", "REGRESS_STALL_TIMEOUT_S", "OMP_NUM_THREADS"):
                env.pop(k, None)
            for rep in range(args.repeats):
                # Alternate the order so slow drift of the machine does not favour one configuration.
                order = configs if rep % 2 == 0 else list(reversed(configs))
                for config in order:
                    t0 = time.monotonic()
                    result = run_config(config, rep, procs, work, params, env)
                    results.append(result)
                    print(f"[{time.monotonic() - began:5.0f} s] {config} rep {rep}: "
                          + json.dumps({k: v for k, v in result.items() if k not in ("config", "rep")}), flush=True)
                    print(f"   ({time.monotonic() - t0:.0f} s with worker start/stop)", flush=True)
    finally:
        procs.close()

    rows = summarise(results, configs)
    summary = {
        "prompts": args.prompts, "shard_size": args.shard_size, "shards": -(-args.prompts // args.shard_size),
        "max_tokens": 64, "logprobs": 5, "engine_args": ENGINE_ARGS, "env": BASE_ENV,
        "cpu_count": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load_before],
        "benchmark_s": round(time.monotonic() - began, 1),
        "summary": rows, "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    print()
    print_table(rows)
    print(f"\nbenchmark took {summary['benchmark_s']:.0f} s; results in {args.out}")


if __name__ == "__main__":
    main()
