"""``regress power``: measure the gate's detection power on this golden and prompt set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from regress.cli_options import QuickPromptsOption
from regress.cli_output import out
from regress.errors import EXIT_OK, EXIT_REGRESSION, ConfigError
from regress.power.ladder import DEFAULT_STEPS


def _steps(text: str) -> list[float]:
    try:
        values = [float(v) / 100 for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"not a comma-separated list of percentages: '{text}'", field="--steps") from None
    return values


def _line(step) -> str:  # type: ignore[no-untyped-def]
    kl = f"{step.mean_teacher_forced_kl:.3g}" if step.mean_teacher_forced_kl is not None else "—"
    ratio = f"{step.kl_ratio:.2g}x" if step.kl_ratio is not None else "—"
    p = f"{step.p_value:.2g}" if step.p_value is not None else "—"
    return (f"  {step.label:<28} {step.verdict.upper():<5} KL {kl:<8} {ratio:>7} noise  p {p:<8} "
            f"{step.identical}/{step.prompts} identical, {step.regressions} regression(s)")


def power(
    params: Path = typer.Option(Path("params.yaml"), "--params", "-p", help="The params file (baseline, thresholds, noise)."),
    steps: str = typer.Option(",".join(f"{s * 100:g}" for s in DEFAULT_STEPS), "--steps",
                              help="The ladder: weight noise strengths, percent of each tensor's std, increasing."),
    seed: int = typer.Option(0, "--seed", help="The noise's seed (one direction for every step)."),
    force: bool = typer.Option(False, "--force", help="Replay every step even if an up-to-date run of it exists."),
    keep_models: bool = typer.Option(False, "--keep-models", help="Keep the perturbed models in power/models/."),
    as_json: bool = typer.Option(False, "--json", help="Print power/power.json."),
    no_fail: bool = typer.Option(False, "--no-fail", help="Exit 0 even when the gate is inconsistent (a pipeline "
                                 "stage: the figure says so in every report)."),
    quick: bool = typer.Option(False, "--quick", help="The ladder of the quick check (`regress check --quick`): every "
                               "step only prefills the golden's completions; written to power/quick/power.json "
                               "(power/quick/sample-N/power.json with --quick-prompts N)."),
    quick_prompts: Optional[int] = QuickPromptsOption,
) -> None:
    """Measure how small a change the gate fails: weight noise planted in the baseline's own model.

    Each step of the ladder is the baseline's model with Gaussian noise added to every linear layer (its strength a share of each weight tensor's std; one seed, so each step is the one below it, only stronger), replayed against the golden and scored with the thresholds and noise floor a check uses. With two or more noise arms each arm is also scored against the others' envelope: noise, which the gate must pass. Run it once per model and prompt set (after `regress golden`); the figure goes in power/power.json, and every later scoring shows it in metrics.json (detection_power) and the report.

    Exit codes: 0 measured, the gate monotone and passing every noise arm; 1 the gate is inconsistent (a larger step passes where a smaller one failed, or it fails a noise arm); 2 bad input or another regress command is writing the project; 3 could not run.
    """
    from regress.cli_guard import writing_project
    from regress.config import load_params
    from regress.datasets import load_prompt_set
    from regress.home import regress_home
    from regress.noise.floor import load_floor
    from regress.power.ladder import consistent, run_ladder
    from regress.progress import RichProgress
    from regress.runs import load_run
    from regress.scoring import build_metrics, expected_answers
    from regress.verdict import Thresholds

    p = load_params(params)
    ladder = _steps(steps)
    if quick_prompts is not None and not quick:
        raise ConfigError("--quick-prompts sets the sample of the quick ladder: add --quick", field="--quick-prompts")
    with writing_project(p):
        golden = load_run(p.golden_dir())
        spec = p.golden_baseline(golden.manifest) or p.baseline
        p.check_model_paths(spec)
        thresholds = Thresholds.from_params(p.thresholds, file=str(p.path))
        noise = load_floor(p.golden_dir(), golden.manifest.run_id)
        if noise is not None and p.noise is not None and p.noise.k != noise.k:
            noise = noise.model_copy(update={"k": p.noise.k})  # as scoring applies it
        prompt_set = load_prompt_set(p.dataset)
        metrics = build_metrics(thresholds, cache_dir=regress_home() / "cache")
        where, sample = p.power_dir(), None
        with RichProgress(f"detection power of the {'quick check' if quick else 'gate'} on '{spec.name}'") as sink:
            reference = None
            if quick:
                from regress.quick import baseline_reference
                from regress.quick_sample import quick_sample

                # The sample a quick check of the same size prefills: its ladder is that check's power.
                sample = quick_sample(prompt_set, golden, p.quick.size(quick_prompts))
                prompt_set = sample.prompts
                # Each sample size has its own ladder: a sampled one never overwrites the whole set's.
                where = where / "quick" if sample.whole else where / "quick" / f"sample-{sample.chosen}"
                if not sample.whole:
                    sink.status(f"the quick ladder prefills {sample.describe()}")
                reference, noise = baseline_reference(p, spec, sample, golden, thresholds, None, sink, False)
            result = run_ladder(spec, prompt_set, golden, where, thresholds=thresholds, metrics=metrics,
                                noise=noise, expected=expected_answers(prompt_set), steps=ladder, seed=seed,
                                progress=sink, force=force, keep_models=keep_models, reference=reference,
                                sample=sample)
    if as_json:
        out(json.dumps(json.loads(result.model_dump_json()), indent=2))
    else:
        out(f"ladder ({'run-level test against the noise floor' if result.basis == 'noise' else 'per-prompt thresholds'}):")
        for step in result.steps:
            out(_line(step))
        for arm in result.arms:
            out(f"  noise arm {arm.arm:<18} {arm.verdict.upper():<5} {arm.summary}")
        out(result.summary)
        out(f"written: {where / 'power.json'}")
    raise typer.Exit(EXIT_OK if consistent(result) or no_fail else EXIT_REGRESSION)


def register(app: typer.Typer) -> None:
    """Add the ``power`` command to the ``regress`` app."""
    app.command("power")(power)
