"""A worker per GPU: `regress golden` through Celery workers each pinned to one GPU, against the
local executor on the same GPU.

Everything runs on this machine: a private redis-server on loopback (free port, temporary
directory, append-only persistence as in production), `regress worker` processes started fresh
for each configuration, worker i with CUDA_VISIBLE_DEVICES=i (its engine sees that GPU as
cuda:0), and the hf backend on the fixture model in bfloat16 (engine_args: device cuda, SDPA,
left-padded batches of --batch = the shard size). Configurations:

- local:       `regress golden` with the local executor (one engine process on GPU 0);
- celery-1w:   `--executor celery`, one worker (GPU 0); then `celery-1w-warm`: the same command
               again on the same worker (its engine is already loaded: 0 loads expected);
- celery-Nw:   N = the number of GPUs torch sees, one worker per GPU (only when N >= 2).

Recorded per run: the CLI's wall time, the manifest's timings (engine loads, load time,
generation time summed over shards, tokens), shards per worker (from the worker logs), and whether
the run's tokens and logprobs equal the local executor's, prompt by prompt (the same check as
tests/test_celery.py).

Usage (GPU):  python benchmarks/gpu_celery.py --out $OUT/gpu_celery.json [--redis-server .redis/bin/redis-server]
      (CPU):  python benchmarks/gpu_celery.py --device cpu --prompts 40 --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_common import REPO, Results, fixture_model, log, machine, write_prompt_set  # noqa: E402

PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """The processes this benchmark starts, each in a session of its own; all ended on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
        """SIGTERM the process group (a worker closes its engine; the engine also dies with its
        worker, by PR_SET_PDEATHSIG), then SIGKILL."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc, timeout=10)


def start_redis(procs: Processes, directory: Path, exe: str | None, lib: str | None) -> tuple[str, str]:
    exe = exe or shutil.which("redis-server")
    if exe is None:
        raise SystemExit("no redis-server: pass --redis-server (benchmarks/gpu/carry.sh unpacks one into .redis/)")
    env = dict(os.environ)
    if lib:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, env=env).stdout.strip()
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs.start([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--appendonly", "yes",
                 "--save", "", "--logfile", str(directory / "redis.log")],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0", version
        except OSError:
            pass
        time.sleep(0.05)
    log_text = (directory / "redis.log").read_text(errors="replace")[-2000:] if (directory / "redis.log").exists() else ""
    raise RuntimeError(f"redis-server did not answer within 20 s\n{log_text}")


def write_params(work: Path, model: Path, dataset: Path, *, device: str, batch: int) -> Path:
    import yaml

    params = work / "params.yaml"
    params.write_text(yaml.safe_dump({
        "dataset": str(dataset),
        "shard_size": batch,
        "baseline": {"package": "current", "backend": "hf", "model": str(model), "dtype": "bfloat16",
                     "engine_args": {"device": device, "attn_implementation": "sdpa", "max_batch_size": batch}},
    }), encoding="utf-8")
    return params


def start_worker(procs: Processes, work: Path, env: dict[str, str], queue: str, name: str, log_path: Path,
                 gpu: int | None) -> subprocess.Popen[bytes]:
    worker_env = dict(env)
    if gpu is not None:
        worker_env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    args = [PYTHON, "-m", "regress.cli", "worker", "--queue", queue, "--name", name,
            "--params", str(work / "no-params.yaml")]
    with open(log_path, "ab") as out:
        return procs.start(args, cwd=work, env=worker_env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 180) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
        if "ready." in text:
            return round(time.monotonic() - started, 2)
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited:\n{text[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"worker not ready after {timeout} s")


def run_golden(params: Path, out: Path, env: dict[str, str], *, queue: str | None) -> dict[str, Any]:
    from regress.runs import load_run

    args = [PYTHON, "-m", "regress.cli", "golden", "--params", str(params), "--out", str(out)]
    if queue is not None:
        args += ["--executor", "celery", "--queue", queue]
    started = time.perf_counter()
    done = subprocess.run(args, env=env, cwd=params.parent, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"regress golden failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    m = load_run(out).manifest
    t = m.timings
    return {"cli_wall_s": round(wall, 2), "total_s": t.total_s, "generation_s": t.generation_s,
            "engine_load_s": t.engine_load_s, "engine_loads": t.engine_loads, "output_tokens": t.output_tokens,
            "prompt_tokens": t.prompt_tokens, "tokens_per_s": t.tokens_per_s,
            "output_tokens_per_wall_s": round(t.output_tokens / wall, 1),
            "engine_args": m.engine_args, "hardware": m.hardware.model_dump(), "peak_gpu_mib": m.memory.peak_gpu_mib}


def compare_runs(a: Path, b: Path) -> dict[str, Any]:
    """Prompt by prompt: token ids and logprobs identical (tests/test_celery.py's check)."""
    import numpy as np

    from regress.runs import load_run

    left, right = load_run(a), load_run(b)
    same_order = [g.prompt_id for g in left] == [g.prompt_id for g in right]
    differing = []
    for g in left:
        r = right[g.prompt_id]
        if not (np.array_equal(g.prompt_token_ids, r.prompt_token_ids)
                and np.array_equal(g.output_token_ids, r.output_token_ids)
                and np.array_equal(g.free_run.token_logprobs, r.free_run.token_logprobs)
                and np.array_equal(g.free_run.top_ids, r.free_run.top_ids)
                and np.array_equal(g.free_run.top_logprobs, r.free_run.top_logprobs)):
            differing.append(g.prompt_id)
    return {"identical": same_order and not differing, "prompts": len(left), "differing": len(differing),
            "differing_ids": differing[:20], "same_layout": left.manifest.layout == right.manifest.layout}


_LOADED = re.compile(r"engine for '([^']+)' loaded in ([0-9.]+) s")
_SUCCEEDED = re.compile(r"Task regress\.replay_shard\[[^\]]+\] succeeded")


def worker_facts(log_path: Path) -> dict[str, Any]:
    text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
    return {"engine_loads": [{"candidate": c, "load_s": float(s)} for c, s in _LOADED.findall(text)],
            "shards": len(_SUCCEEDED.findall(text))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a small test of the flow)")
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64, help="shard size and the hf backend's max_batch_size")
    parser.add_argument("--fixture", type=Path, default=None, help="fixture model dir (default .gpumodel/fixture)")
    parser.add_argument("--gpus", type=int, default=None, help="workers in the many-worker run (default: all GPUs)")
    parser.add_argument("--redis-server", default=None, help="redis-server binary (default: the one on PATH)")
    parser.add_argument("--redis-lib", default=None, help="LD_LIBRARY_PATH for that binary only (carried libraries)")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gpu_celery.json")
    args = parser.parse_args()

    gpus = 0
    if args.device != "cpu":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise SystemExit("torch sees no GPU; use --device cpu for a CPU test of the flow")
    n_many = args.gpus or gpus
    results = Results(args.out, benchmark="gpu_celery", machine=machine(), device=args.device, gpus=gpus,
                      prompts=args.prompts, max_tokens=args.max_tokens, batch=args.batch,
                      shards=-(-args.prompts // args.batch))
    procs = Processes()
    work = args.work or Path(tempfile.mkdtemp(prefix="regress-gpu-celery-"))
    try:
        model = fixture_model(args.fixture)
        dataset = write_prompt_set(args.prompts, work / "prompts" / "celery.jsonl", max_tokens=args.max_tokens,
                                   description=f"GPU Celery benchmark: {args.prompts} prompts from the fixture texts.")
        params = write_params(work, model, dataset, device=args.device, batch=args.batch)
        broker, version = start_redis(procs, work / "redis", args.redis_server, args.redis_lib)
        results["redis"] = {"version": version, "binary": args.redis_server or shutil.which("redis-server")}
        env = {**os.environ, "REGRESS_BROKER_URL": broker, "REGRESS_VISIBILITY_TIMEOUT_S": "3600",
               "REGRESS_BROKER_KEY": secrets.token_hex(32), "REGRESS_HOME": str(work / "home")}
        for k in ("REGRESS_QUEUE", "REGRESS_RESULT_BACKEND", "REGRESS_STALL_TIMEOUT_S", "REGRESS_BROKER_KEY_FILE"):
            env.pop(k, None)
        if args.device != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = "0"  # the local executor on the GPU the first worker gets

        log("local executor")
        local = work / "runs" / "local"
        results.append("runs", {"config": "local", "workers": 0, **run_golden(params, local, env, queue=None)})
        log(f"local: {results.data['runs'][-1]['cli_wall_s']} s")

        configs = [1] + ([n_many] if n_many >= 2 else [])
        for n in configs:
            queue = f"gpu-{n}w"
            logs = [work / f"worker-{n}w-{i}.log" for i in range(n)]
            workers = [start_worker(procs, work, env, queue, f"gpu{i}-{n}w@bench", logs[i],
                                    i if args.device != "cpu" else None) for i in range(n)]
            ready = [wait_ready(p, lp) for p, lp in zip(workers, logs)]
            names = [f"celery-{n}w"] + (["celery-1w-warm"] if n == 1 else [])
            try:
                for name in names:
                    log(name)
                    out = work / "runs" / name
                    before = [worker_facts(lp) for lp in logs]
                    run = run_golden(params, out, env, queue=queue)
                    after = [worker_facts(lp) for lp in logs]
                    run.update(config=name, workers=n, worker_ready_s=ready,
                               shards_per_worker=[a["shards"] - b["shards"] for a, b in zip(after, before)],
                               worker_engine_loads=[a["engine_loads"][len(b["engine_loads"]):] for a, b in zip(after, before)],
                               same_as_local=compare_runs(local, out))
                    results.append("runs", run)
                    log(f"{name}: {run['cli_wall_s']} s, engine loads {run['engine_loads']}, shards/worker "
                        f"{run['shards_per_worker']}, identical to local: {run['same_as_local']['identical']}")
            finally:
                for p in workers:
                    procs.stop(p)
        results["not_measured"] = ([] if n_many >= 2 else
                                   [f"celery-2w and more: this machine has {gpus} GPU(s); one worker per GPU needs two"])
    finally:
        procs.close()
    results["finished"] = True
    log(f"done in {results.data['elapsed_s']} s; results in {args.out}")


if __name__ == "__main__":
    main()
