"""The detection-power ladder: planted weight noise at growing strength, checked like candidates.

Every step is the baseline's own model with every linear layer perturbed
(:func:`regress.model_variants.perturb_linear`, one seed: one direction at growing strength),
replayed against the golden into ``power/<step>/`` (resumable, reused when finished) and scored
with the thresholds and noise floor a check uses, so the step's verdict is the one the gate would
give a candidate of that size. The variant model lives in ``power/models/<step>`` only while its
step runs. With two or more noise arms, each arm is also scored against the envelope of the others:
the gate on a change that is only noise, which it must pass.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from regress.errors import ConfigError
from regress.power.record import POWER_FILE, ArmStep, DetectionPower, PowerFigure, PowerStep

if TYPE_CHECKING:
    from regress.datasets import PromptSet
    from regress.noise.floor import NoiseFloor
    from regress.quick_sample import QuickSample
    from regress.records import CandidateSpec, ScoredRun
    from regress.replay import ProgressSink
    from regress.runs import RunResult

DEFAULT_STEPS = (0.0025, 0.005, 0.01, 0.02, 0.05)
"""Noise as a fraction of each weight tensor's std: 0.25 % to 5 %. On SmolLM2-135M the measured
noise arms sit near the first step and the last changes almost every output (docs/verdicts.md)."""
REASONS_KEPT = 4
MODELS_DIR = "models"


def step_key(scale: float) -> str:
    """``weight-noise-2pct``, ``weight-noise-0p25pct``: a directory name (no dots)."""
    return f"weight-noise-{scale * 100:g}pct".replace(".", "p")


def step_label(scale: float) -> str:
    return f"weight noise {scale * 100:g} % of std"


def thresholds_digest(t: Any) -> str:
    """Identifies the gate: the thresholds in force, as scoring records them."""
    return hashlib.sha256(json.dumps(t.model_dump(), sort_keys=True, default=str).encode("utf-8")).hexdigest()


def _local_weights(spec: "CandidateSpec") -> Path:
    model = Path(spec.model).expanduser()
    if not (model / "model.safetensors").is_file():
        raise ConfigError(f"regress power plants weight noise in the baseline's model, which must be a local directory "
                          f"holding model.safetensors; '{spec.model}' is not", field="baseline.model")
    return model


def _test_fields(scored: "ScoredRun") -> dict[str, Any]:
    test = scored.metrics.noise_test
    if test is None:
        return {}
    kl = next((m for m in test.measures if m.measure == "tf_kl_mean"), None)
    return {"kl_ratio": kl.ratio if kl is not None else None,
            "p_value": min(m.p_adjusted for m in test.measures), "beyond_noise": test.beyond}


def run_ladder(
    baseline: "CandidateSpec",
    prompt_set: "PromptSet",
    golden: "RunResult",
    power_dir: Path,
    *,
    thresholds: Any,
    metrics: list[tuple[Any, Any]],
    noise: "NoiseFloor | None",
    expected: Mapping[str, Any] | None = None,
    steps: Sequence[float] = DEFAULT_STEPS,
    seed: int = 0,
    progress: "ProgressSink | None" = None,
    force: bool = False,
    keep_models: bool = False,
    reference: "RunResult | None" = None,
    sample: "QuickSample | None" = None,
) -> DetectionPower:
    """Check every step of the ladder and every noise arm against the others; write and return
    ``power/power.json``.

    ``reference``: the ladder of the quick check (:mod:`regress.quick`): every step only prefills
    the golden's completions and is scored against this baseline prefill, with ``noise`` the
    prefill-only floor and the arms the prefill-only ones under the reference. ``sample``: the
    quick check's screening sample ``prompt_set`` is, named in every step's verdict basis."""
    from regress.model_variants import perturb_linear
    from regress.replay import replay
    from regress.runs import load_run
    from regress.scoring import score_runs, write_score_outputs
    from regress.storage import atomic_write_text

    if reference is None:
        def score(run: "RunResult", floor: "NoiseFloor | None") -> "ScoredRun":
            return score_runs(golden, run, thresholds, expected=expected, metrics=metrics, noise=floor)
        arms_root = golden.path
    else:
        from regress.quick import score_quick

        def score(run: "RunResult", floor: "NoiseFloor | None") -> "ScoredRun":
            return score_quick(reference, golden, run, thresholds, noise=floor, sample=sample)
        arms_root = reference.path

    if not steps or any(not 0 < s < 10 for s in steps) or list(steps) != sorted(set(steps)):
        raise ConfigError("steps must be distinct noise strengths above 0 (percent of std), in increasing order",
                          field="--steps")
    source = _local_weights(baseline)
    results: list[PowerStep] = []
    for scale in steps:
        key = step_key(scale)
        out = power_dir / key
        model = power_dir / MODELS_DIR / key
        if progress is not None:
            progress.status(f"ladder step '{key}': {step_label(scale)} in every linear layer")
        if not model.is_dir():
            perturb_linear(source, model, scale=scale, seed=seed)
        spec = baseline.model_copy(update={"name": f"power-{key}", "model": str(model.resolve())})
        try:
            manifest = replay(spec, prompt_set, out, golden=golden, executor=None, progress=progress, force=force,
                              generate=reference is None)
        finally:
            if not keep_models:
                shutil.rmtree(model, ignore_errors=True)
        scored = score(load_run(out), noise)
        write_score_outputs(scored, out / "scores")
        m = scored.metrics
        results.append(PowerStep(
            key=key, scale=scale, label=step_label(scale), run_id=manifest.run_id, prompts=m.prompts,
            identical=m.identical, regressions=m.regression, severe_regressions=m.severe_regressions,
            mean_teacher_forced_kl=m.mean_teacher_forced_kl, verdict=m.verdict,
            reasons=scored.verdict_reasons[:REASONS_KEPT], **_test_fields(scored)))
    if not keep_models:
        shutil.rmtree(power_dir / MODELS_DIR, ignore_errors=True)
    arms = arm_checks(golden.manifest.run_id, noise, score, arms_root) if noise is not None else []
    power = conclude(golden.manifest.run_id, seed, results, arms, basis="noise" if noise is not None else "per-prompt",
                     digest=thresholds_digest(thresholds))
    atomic_write_text(power_dir / POWER_FILE, power.model_dump_json(indent=1))
    return power


IMPLEMENTATION_ARMS = ("float32", "compile")


def family(kind: str) -> str:
    """``implementation`` (another precision or kernels) or ``scheduling`` (the same computation
    grouped otherwise: rerun, batch, alone, concurrency): arms are draws of one noise only within a family."""
    return "implementation" if kind in IMPLEMENTATION_ARMS else "scheduling"


def arm_checks(golden_run_id: str, noise: "NoiseFloor",
               score: "Callable[[RunResult, NoiseFloor | None], ScoredRun]", arms_root: Path) -> list[ArmStep]:
    """Each noise arm (its run under ``arms_root``/noise-arms/) scored against the envelope of the
    other arms of its family (:func:`family`; an arm alone in its family is not checked): a change
    that is only the baseline's noise, which the gate must pass. ``score``: a run scored as a
    check scores it, against a floor (None: the plain thresholds)."""
    from regress.noise.arms import arm_dir
    from regress.noise.floor import build_floor
    from regress.runs import load_run

    kinds = {a.name: family(a.kind) for a in noise.arms}
    checked = [a for a in noise.arms if sum(1 for k in kinds.values() if k == kinds[a.name]) >= 2]
    if not checked:
        return []
    plain = {a.name: score(load_run(arm_dir(arms_root, a.name)), None) for a in noise.arms}
    checks = []
    for arm in checked:
        # Against the other arms of its family: a float32 run is not another draw of batch noise.
        others = [(a, plain[a.name]) for a in noise.arms if a.name != arm.name and kinds[a.name] == kinds[arm.name]]
        floor = build_floor(golden_run_id, others, k=noise.k, q=noise.quantile)
        scored = score(load_run(arm_dir(arms_root, arm.name)), floor)
        test = scored.metrics.noise_test
        summary = test.summary if test is not None else "; ".join(scored.verdict_reasons[:1])
        checks.append(ArmStep(arm=arm.name, verdict=scored.metrics.verdict, summary=summary, **_test_fields(scored)))
    return checks


def conclude(golden_run_id: str, seed: int, steps: list[PowerStep], arms: list[ArmStep], *, basis: str,
             digest: str) -> DetectionPower:
    """The smallest failing step, whether the ladder is monotone, and the sentence."""
    failing = [i for i, s in enumerate(steps) if s.verdict == "fail"]
    first = failing[0] if failing else None
    monotone = first is None or all(s.verdict == "fail" for s in steps[first:])
    prompts = steps[0].prompts if steps else 0
    if first is None:
        text = (f"with these {prompts} prompts, this gate passes every step up to {steps[-1].label}: it cannot "
                "see damage of that size")
    else:
        text = f"with these {prompts} prompts, this gate fails {steps[first].label}"
        if first > 0:
            text += f" and passes {steps[first - 1].label}"
    if arms:
        failed = [a.arm for a in arms if a.verdict == "fail"]
        if failed:
            text += f"; it also FAILS noise arm(s) {', '.join(failed)} scored against the others: it fails on noise"
        else:
            ratios = [a.kl_ratio for a in arms if a.kl_ratio is not None]
            text += f" and passes every noise arm scored against the others of its kind ({', '.join(a.arm for a in arms)})"
            if ratios and first is not None and steps[first].kl_ratio is not None:
                text += (f" (teacher-forced KL at most {max(ratios):.2g}x the envelope; the failing step is "
                         f"{steps[first].kl_ratio:.2g}x)")
    elif basis == "noise":
        text += ("; the noise arms were not scored against each other (measure two arms of one kind, e.g. rerun "
                 "and batch, for that margin)")
    else:
        text += "; no noise floor: the gate rests on fixed per-prompt thresholds, with no margin to the baseline's noise"
    if not monotone:
        text += "; NOT monotone: a larger step passes where a smaller one failed"
    return DetectionPower(golden_run_id=golden_run_id, prompts=prompts, seed=seed, basis=basis,  # type: ignore[arg-type]
                          thresholds_sha256=digest, steps=steps, arms=arms,
                          smallest_failing=steps[first].key if first is not None else None, monotone=monotone,
                          summary=text + ".")


def consistent(power: DetectionPower) -> bool:
    """The gate is monotone along the ladder and passes every noise arm."""
    return power.monotone and all(a.verdict == "pass" for a in power.arms)


def load_power(power_dir: Path, golden_run_id: str, thresholds: Any) -> PowerFigure | None:
    """The figure of ``power/power.json`` for a scoring: None when there is none or it is of another
    golden (stale: never shown as this golden's); ``current`` False when measured with other
    thresholds. An unreadable or invalid file is a warning, never a figure."""
    from regress.errors import StorageError
    from regress.progress import warn
    from regress.storage import read_record

    try:
        power = read_record(power_dir / POWER_FILE, DetectionPower, what="a regress power file", missing=None)
    except StorageError as exc:
        warn(f"{exc}; the report shows no detection power (run `regress power` again)")
        return None
    if power is None:
        return None
    if power.golden_run_id != golden_run_id:
        return None
    scale = next((s.scale for s in power.steps if s.key == power.smallest_failing), None)
    return PowerFigure(summary=power.summary, smallest_failing_scale=scale, monotone=power.monotone,
                       arms_pass=all(a.verdict == "pass" for a in power.arms) if power.arms else None,
                       measured_at=power.created_at, current=power.thresholds_sha256 == thresholds_digest(thresholds))
