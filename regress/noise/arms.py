"""Running the noise arms: the baseline replayed against its own golden, scored like a candidate.

Each arm is a normal, resumable replay into ``golden/noise-arms/<arm>/`` (teacher-forced, with
the arm's shard size), then scored against the golden with the configured thresholds; the
arms' scores make ``golden/noise.json`` (:func:`regress.noise.floor.build_floor`). A quick
check's floor (:mod:`regress.quick`) is the same loop with prefill-only arms, under the
baseline's prefill reference and scored against it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from regress.noise.floor import ARMS_DIR, NoiseArmResult, NoiseFloor, build_floor, write_floor
from regress.noise.settings import NoiseSettings

if TYPE_CHECKING:
    from regress.datasets import PromptSet
    from regress.records import CandidateSpec, ScoredRun
    from regress.replay import Executor, ProgressSink
    from regress.replay.warm import WarmEngines
    from regress.runs import RunResult


def arm_dir(golden_dir: str | Path, key: str) -> Path:
    return Path(golden_dir) / ARMS_DIR / key


def _at_concurrency(baseline: "CandidateSpec", n: int) -> "CandidateSpec":
    """The baseline with ``n`` requests in flight (a ``server`` baseline only)."""
    from regress.errors import ConfigError

    if baseline.backend != "server":
        raise ConfigError(f"the 'concurrency' noise arm needs a baseline served over HTTP (backend: server); "
                          f"'{baseline.name}' uses the '{baseline.backend}' backend: use 'batch' or 'alone'",
                          field="noise.arms")
    from regress.records import ServerSettings

    server = baseline.server or ServerSettings()
    return baseline.model_copy(update={"server": server.model_copy(update={"concurrency": n})})


def _implementation(baseline: "CandidateSpec", arm: str) -> "CandidateSpec":
    """The baseline as the ``float32`` or ``compile`` arm runs it."""
    from regress.errors import ConfigError

    if arm == "float32":
        if baseline.dtype == "float32":
            raise ConfigError(f"the 'float32' noise arm measures the rounding of the baseline's dtype; "
                              f"'{baseline.name}' already runs in float32", field="noise.arms")
        return baseline.model_copy(update={"dtype": "float32"})
    eager = bool(baseline.engine_args.get("enforce_eager", False))
    return baseline.model_copy(update={"engine_args": {**baseline.engine_args, "enforce_eager": not eager}})


def arm_setup(baseline: "CandidateSpec", arm: Any, golden_size: int, golden_concurrency: int) -> tuple["CandidateSpec", int]:
    """The baseline as ``arm`` runs it, and the arm's shard size (the golden's had ``golden_size``
    prompts per shard and ``golden_concurrency`` requests in flight)."""
    spec = baseline
    if arm.name == "concurrency":
        spec = _at_concurrency(baseline, arm.concurrency_for(golden_concurrency))
    elif arm.name in ("float32", "compile"):
        spec = _implementation(baseline, arm.name)
    return spec, arm.shard_size_for(golden_size)


def arm_result(arm: Any, golden_size: int, golden_concurrency: int, manifest: Any, scored: Any) -> NoiseArmResult:
    """An arm's line in the floor: what it changed, its run and what it cost."""
    m, tm = scored.metrics, manifest.timings
    return NoiseArmResult(
        name=arm.key, kind=arm.name, changed=arm.changed(golden_size, golden_concurrency),
        shard_size=arm.shard_size_for(golden_size), run_id=manifest.run_id,
        prompts=m.prompts, identical=m.identical, diverged=m.prompts - m.identical,
        seconds=round(tm.engine_load_s + tm.generation_s + tm.teacher_forcing_s, 3))


def run_arms(
    baseline: "CandidateSpec",
    prompt_set: "PromptSet",
    golden_dir: str | Path,
    settings: NoiseSettings,
    *,
    thresholds: Any = None,
    expected: Mapping[str, Any] | None = None,
    executor: "Executor | None" = None,
    progress: "ProgressSink | None" = None,
    force: bool = False,
    metrics: list[tuple[Any, Any]] | None = None,
    write: bool = True,
    generate: bool = True,
    reference: "RunResult | None" = None,
    score: "Callable[[RunResult], ScoredRun] | None" = None,
    engines: "WarmEngines | None" = None,
) -> NoiseFloor:
    """Replay the baseline under every arm of ``settings`` against the golden in ``golden_dir``,
    score each, and build (and, with ``write``, store as ``golden/noise.json``) the floor.

    Finished arms of the same plan are reused (``force`` reruns them), interrupted ones resume.

    A quick check's floor: ``generate=False`` (the arms prefill the golden's completions only),
    ``reference`` (the baseline's own prefill: the arms' runs go under it, and the floor is its,
    written beside it) and ``score`` (how an arm's run is scored: against that reference).

    ``engines`` (local runs; ``executor`` is then not used): the arms run on these warm engines,
    those that run the golden's configuration first (:attr:`NoiseArm.on_golden_engine`), on the
    golden's engine if it is still there, each asking it to forget the earlier run's cache first;
    a ``rerun`` on an engine of its own. At most one engine is alive at a time when the pool
    keeps one.
    """
    from regress.replay import LocalExecutor, replay
    from regress.runs import load_run
    from regress.scoring import build_metrics, score_runs
    from regress.verdict import Thresholds

    t = thresholds or Thresholds()
    golden = load_run(golden_dir)
    owner = reference if reference is not None else golden
    golden_size = golden.manifest.layout.shard_size
    if score is None:
        metrics = metrics if metrics is not None else build_metrics(t)

        def score(run: "RunResult") -> "ScoredRun":
            return score_runs(golden, run, t, expected=expected, metrics=metrics)

    golden_concurrency = baseline.server.concurrency if baseline.server is not None else 1
    arms = list(settings.arms)
    shared = LocalExecutor.on(engines, fresh=True) if engines is not None else None
    # The arms that can reuse the golden's engine go first, while it is there; noise.json keeps the listed order.
    order = sorted(range(len(arms)), key=lambda i: not arms[i].on_golden_engine)
    done: dict[int, tuple[NoiseArmResult, "ScoredRun"]] = {}
    for i in order:
        arm = arms[i]
        out = arm_dir(owner.path, arm.key)
        spec, size = arm_setup(baseline, arm, golden_size, golden_concurrency)
        if progress is not None:
            kind = "noise arm" if generate else "prefill-only noise arm"
            progress.status(f"{kind} '{arm.key}': {arm.changed(golden_size, golden_concurrency)}")
        if engines is not None and not arm.on_golden_engine:
            engines.discard(spec)  # a rerun repeats the engine's start too; others start their own anyway
        manifest = replay(spec, prompt_set, out, golden=golden, shard_size=size, generate=generate,
                          executor=shared or executor, progress=progress, force=force)
        scored = score(load_run(out))
        done[i] = (arm_result(arm, golden_size, golden_concurrency, manifest, scored), scored)
    results = [done[i] for i in range(len(arms))]
    floor = build_floor(owner.manifest.run_id, results, k=settings.k, q=settings.quantile)
    if write:
        write_floor(floor, owner.path)
    return floor
