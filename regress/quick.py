"""A quick check: the candidate prefills the golden's completions; nothing is generated.

For the many upgrades that change nothing, a full check pays for a generation to learn that every
output is the golden's. A quick check (``regress check NAME --quick``) runs one prefill per prompt
(prompt + the golden's completion, ``prompt_logprobs``), so the candidate says, at every position
of the golden's completion, how likely it finds the golden's token and what its own top-k is: the
teacher-forced measures of a full check, on every prompt, for the price of a prefill. It gives the
run-level fidelity verdict from them (:mod:`regress.noise.beyond`), and the per-prompt regressions
severe enough to gate on their own. It says nothing of quality (expected answers and choices need
the candidate's own outputs) and leaves out sampled prompts (what they test is new samples).

Prefill against prefill: the golden's own logprobs were computed decoding, and a prefill computes
the same positions with other kernels and batch shapes, a difference of the engine's, not of the
candidate. So the reference is the *baseline's* prefill of the same sequences in the same batches
(``quick/.baseline/run``, made once per golden, kept), and the noise arms run prefill-only too
(``quick/.baseline/run/noise-arms/``, their floor ``quick/.baseline/run/noise.json``): the
candidate's measures are paired with a noise of their own mode.

A fleet that screens every nightly build can prefill a stratified sample of the prompts instead
(``--quick-prompts N``, :mod:`regress.quick_sample`); its reference is the baseline's prefill of
the same sample (``quick/.baseline/sample-N/run``).

Everything a quick check writes is under ``quick/`` (``quick/<candidate>/run``, ``scores``,
``report``): never runs/, scores/, reports/ or the check history, so a quick verdict is never
taken for a full one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from regress.metrics.base import Output, Pair, Values, metric

if TYPE_CHECKING:
    from regress.config import Params
    from regress.datasets import PromptSet
    from regress.noise.floor import NoiseFloor
    from regress.quick_sample import QuickSample
    from regress.records import CandidateSpec, RunManifest, ScoredRun
    from regress.replay import Executor, ProgressSink
    from regress.runs import RunResult

QUICK_DIR = "quick"
"""Where quick checks go, beside runs/ (``quick/<candidate>/``)."""
BASELINE_DIR = ".baseline"
"""The baseline's own prefill under quick/: the reference every quick check is scored against."""


def quick_root(params: "Params") -> Path:
    return params.root / QUICK_DIR


def reference_dir(params: "Params", sample: "QuickSample | None" = None) -> Path:
    """The baseline's prefill of the golden's completions: ``quick/.baseline/run`` for every
    prompt, ``quick/.baseline/sample-N/run`` for a sample of N (each kept: alternating between the
    two does not make the baseline prefill again)."""
    if sample is None or sample.whole:
        return quick_root(params) / BASELINE_DIR / "run"
    return quick_root(params) / BASELINE_DIR / f"sample-{sample.chosen}" / "run"


@metric("prefill_identity", outputs=[
    Output("input_drift", "prompt token ids differ from the baseline's (tokenizer or chat template changed)"),
    Output("identical", "every teacher-forced logprob and top-k is exactly the baseline's prefill"),
])
def prefill_identity() -> "callable":
    """Not registered: a quick check's own. ``identical`` there means the candidate's logprobs of
    the golden's completion are the baseline's to the bit (a full check's means its outputs are)."""

    def score(pair: Pair) -> Values:
        ref, tf = pair.golden.free_run, pair.candidate.teacher_forced
        same = (tf is not None and len(tf.token_ids) == len(ref.token_ids)
                and np.array_equal(tf.token_ids, ref.token_ids)
                and np.array_equal(tf.token_logprobs, ref.token_logprobs)
                and np.array_equal(tf.top_ids, ref.top_ids)
                and np.array_equal(tf.top_logprobs, ref.top_logprobs))
        return {"input_drift": not np.array_equal(pair.golden.prompt_token_ids, pair.candidate.prompt_token_ids),
                "identical": bool(same)}

    return score


def quick_metrics(t: Any) -> list[tuple[Any, Any]]:
    """What a quick check scores with: the identity above, then the teacher-forced metric."""
    from regress.scoring import build_metrics

    forced = build_metrics(t.model_copy(update={"metrics": ["teacher_forced"]}))
    return [(prefill_identity.metric_info, prefill_identity()), *forced]  # type: ignore[attr-defined]


def as_reference(reference: "RunResult", golden: "RunResult") -> "RunResult":
    """The baseline's prefill (``reference``) as the golden a quick run is scored against: its
    teacher-forced rows become the "free run", under the golden's manifest (the quick runs were
    planned against that golden) and with the golden's texts."""
    from regress.runs import RunResult

    a = reference.arrays
    arrays = {"prompt_tokens": a["prompt_tokens"], "prompt_offsets": a["prompt_offsets"],
              "output_tokens": a["tf_tokens"], "output_offsets": a["tf_offsets"],
              "out_token_logprobs": a["tf_token_logprobs"], "out_top_ids": a["tf_top_ids"],
              "out_top_logprobs": a["tf_top_logprobs"]}
    rows = [golden.position(pid) for pid in reference.prompt_ids]
    return RunResult(reference.path, golden.manifest, list(reference.prompt_ids), [golden.texts[i] for i in rows],
                     [golden.finish_reasons[i] for i in rows], list(reference.sampling), arrays)


def _shown(path: Path) -> str:
    """``quick/.baseline/...`` of a reference's path: where it lives in the project."""
    parts = path.parts
    if QUICK_DIR not in parts:
        return str(path)
    return "/".join(parts[len(parts) - 1 - parts[::-1].index(QUICK_DIR):])


def score_quick(reference: "RunResult", golden: "RunResult", run: "RunResult", t: Any, *,
                tags: dict[str, list[str]] | None = None, noise: "NoiseFloor | None" = None,
                sample: "QuickSample | None" = None) -> "ScoredRun":
    """A prefill-only ``run`` scored against the baseline's prefill: fidelity only. ``sample``:
    what was prefilled, said in the verdict's basis when it is not every prompt."""
    from regress.scoring import score_runs

    scored = score_runs(as_reference(reference, golden), run, t, tags=tags, expected={}, metrics=quick_metrics(t),
                        noise=noise, gate="fidelity")
    basis = scored.metrics.verdict_basis
    if noise is not None and scored.metrics.noise_test is not None:
        basis = (f"the run-level test against the baseline's prefill-only noise ({_shown(reference.path)}/noise.json), "
                 "and regressions severe enough to gate on their own")
    if sample is not None and not sample.whole:
        basis = f"{basis}; on {sample.describe()}" if basis else f"on {sample.describe()}"
    if basis != scored.metrics.verdict_basis:
        scored = scored.model_copy(update={"metrics": scored.metrics.model_copy(update={"verdict_basis": basis})})
    return scored


def baseline_reference(params: "Params", baseline: "CandidateSpec", sample: "QuickSample", golden: "RunResult",
                       t: Any, executor: "Executor | None", progress: "ProgressSink | None",
                       force: bool) -> tuple["RunResult", "NoiseFloor | None"]:
    """The baseline's prefill of ``sample``'s prompts and its prefill-only noise floor. The runs
    are made once per golden (and again when the prompt set, the baseline or an arm changes: their
    plans' fingerprints), then reused; the floor is scored from them each time (seconds), so it
    always follows the arms in force."""
    from regress.noise.arms import run_arms
    from regress.noise.floor import load_floor
    from regress.replay import replay
    from regress.runs import load_run

    ref_dir, prompt_set = reference_dir(params, sample), sample.prompts
    if progress is not None:
        progress.status(f"the baseline '{baseline.name}' prefills the golden's completions (once per golden)")
    replay(baseline, prompt_set, ref_dir, golden=golden, generate=False, executor=executor, progress=progress,
           force=force)
    reference = load_run(ref_dir)
    if params.noise is None:
        return reference, None
    run_arms(baseline, prompt_set, golden.path, params.noise, executor=executor, progress=progress, force=force,
             generate=False, reference=reference, score=lambda run: score_quick(reference, golden, run, t))
    return reference, load_floor(ref_dir, reference.manifest.run_id)


@dataclass(frozen=True)
class QuickResult:
    """A finished quick check."""

    manifest: "RunManifest"
    report: "ScoredRun"
    scores_dir: Path
    page: Path
    sample: "QuickSample"
    """What was prefilled: every prompt run once, or a screening sample of them."""

    @property
    def gating_failed(self) -> bool:
        return self.report.metrics.gating_failed


def quick_check(params: "Params", spec: "CandidateSpec", *, executor: "Executor | None" = None,
                progress: "ProgressSink | None" = None, force: bool = False,
                prompts: int | None = None) -> QuickResult:
    """``spec`` prefills the golden's completions into quick/<name>/run, scored against the
    baseline's prefill (made first when missing) into quick/<name>/scores and report.
    ``prompts``: how many (0 every prompt run once, N a stratified sample: :mod:`regress.quick_sample`;
    None: params.yaml's ``quick.prompts``). The baseline's reference is made of the same prompts."""
    from regress.datasets import load_prompt_set
    from regress.errors import ConfigError
    from regress.prewarm import import_in_background
    from regress.quick_sample import quick_sample
    from regress.replay import replay
    from regress.report import write_candidate_report
    from regress.runs import load_run
    from regress.scoring import write_score_outputs
    from regress.verdict import Thresholds

    if executor is None:  # runs here: a missing model directory is an error now, not after an engine start
        params.check_model_paths(spec)
    import_in_background()  # the scoring's imports, while the prefills wait on their engines
    prompt_set = load_prompt_set(params.dataset)
    golden = load_run(params.golden_dir())
    baseline = params.golden_baseline(golden.manifest) or params.baseline
    if baseline.name == spec.name:
        raise ConfigError(f"'{spec.name}' made the golden: a quick check compares another candidate with it",
                          field="candidate")
    if executor is None:
        params.check_model_paths(baseline)
    t = Thresholds.from_params(params.thresholds, file=str(params.path))
    sample = quick_sample(prompt_set, golden, params.quick.size(prompts))
    whole_set, prompt_set = prompt_set, sample.prompts
    # --force reruns the candidate's prefill; the baseline's is redone only when its plan changed.
    reference, floor = baseline_reference(params, baseline, sample, golden, t, executor, progress, False)
    root = quick_root(params) / spec.name
    if progress is not None:
        progress.status(f"'{spec.name}' prefills the golden's completions (quick check: nothing generated)")
    manifest = replay(spec, prompt_set, root / "run", golden=golden, generate=False, executor=executor,
                      progress=progress, force=force)
    run = load_run(root / "run")
    tags = {p.id: p.tags for p in prompt_set.prompts}
    report = score_quick(reference, golden, run, t, tags=tags, noise=floor, sample=sample)
    write_score_outputs(report, root / "scores")
    page = write_candidate_report(report, as_reference(reference, golden), run, whole_set, root / "report",
                                  index_link=None)
    return QuickResult(manifest, report, root / "scores", page, sample)
