"""From what the probes showed for one prompt to the source(s) of its drift.

The rules, in order:

1. The prompt's token ids changed: **input** (tokenizer, chat template, special tokens), and
   only input: a probe that leaves the changed input in place (float32 on both sides, another
   revert) cannot explain the drift away, even when its output happens to match. A secondary
   cause is named only when putting the input back (``revert-input``) did not remove the drift,
   from the differences that are left (rule 4).
2. The candidate's output equals the baseline's when both run the same (diagnosis) batch: the
   drift does not reproduce outside the batch it ran in, so **scheduling and batching** (the
   batch composition) is what made it; settings the two differ in only made it batch-sensitive.
3. Otherwise every probe that removes the drift names its source: a revert (the candidate with
   one group of settings put back: input, input defaults, KV cache, dtype, compile mode,
   scheduler settings, sampling, model, engine) whose output equals the baseline's, a switch on
   both sides (float32, batch-invariant, alone) after which both agree, or a setting turned off.
4. Nothing removed it: the **model** when its weights or quantization differ (nothing else
   explains it), else every source whose differing settings were not put back by a probe (the
   engine package, say, when ``revert-engine`` did not run), else **scheduling and batching**
   when the output moved with the batch, else **unexplained**.

A rerun that differs from the control adds **sampling** (or, for greedy prompts, run-to-run
nondeterminism under scheduling and batching).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from regress.diagnosis.probes import GROUPS, Probe, group_differs, mitigation
from regress.diagnosis.record import Cause, Observation, PromptDiagnosis
from regress.effective import Difference
from regress.records import Generation, PromptScore

DETAIL_MITIGATION = {
    "KV cache": "keep the KV cache in the model's dtype (kv_cache_dtype: auto), or judge an FP8 KV cache by its "
                "teacher-forced measures and noise floor",
    "dtype": "compare in one dtype; run checks in float32 where the model allows it",
    "compile mode": "the same compile mode on both sides (enforce_eager), or judge compiled kernels by the noise floor",
    "precision": "higher precision for checks (float32 on both sides) separates rounding from real change",
    "batch composition": "fixed batch sizes, batch-invariant kernels (VLLM_BATCH_INVARIANT=1 where supported), "
                         "or measure the noise floor (noise: arms: [batch, alone])",
    "tokenizer and chat template": "pin the tokenizer and chat template (chat_template:) and check the prompt token ids",
    "generation_config defaults": "pin generation_config (a server's --generation-config) on both sides, or set the "
                                  "field in the prompt set; server.sampling_fields: all sends every field explicitly",
}


def _mitigation(cause: Cause, detail: str) -> str:
    return DETAIL_MITIGATION.get(detail) or mitigation(cause)


def attribute(prompt_id: str, score: PromptScore, observations: list[Observation], probes: list[Probe],
              found: list[Difference], *, golden: Generation, candidate_run: Generation) -> PromptDiagnosis:
    """One drifted prompt's diagnosis."""
    seen = {o.probe: o for o in observations}
    by_name = {p.name: p for p in probes}
    causes: list[Cause] = []
    details: list[str] = []
    whys: list[str] = []
    explained = False
    first = score.metrics.get("first_divergence")

    reference, control = seen.get("reference"), seen.get("control")
    concurrency = seen.get("concurrency")
    batch_variant = bool((reference and not reference.same) or (control and not control.same)
                         or (seen.get("alone") and not _alone_consistent(seen))
                         or (concurrency and not concurrency.same))

    def add(cause: Cause, detail: str, why: str) -> None:
        if cause not in causes:
            causes.append(cause)
            details.append(detail)
        whys.append(why)

    input_changed = (not np.array_equal(golden.prompt_token_ids, candidate_run.prompt_token_ids)
                     or score.prompt_class == "input_drift")
    same_batch = seen.get("same-batch")
    if input_changed:
        add("input", "tokenizer and chat template",
            "its prompt token ids changed (tokenizer, chat template or special tokens); `regress diff` names the file")
        explained = True
        reverted_input = seen.get("revert-input")
        if reverted_input is not None and not reverted_input.same:
            whys.append("with the input put back it still drifts, so something else differs too")
            _unprobed_sources(add, by_name, seen, found, batch_variant, skip_group="input")
    elif same_batch is not None and same_batch.same:
        differing = [g.detail for g in GROUPS if group_differs(g, _spec(by_name, "reference"), _spec(by_name, "control"), found)]
        add("scheduling and batching", "batch composition",
            "not reproduced when both sides run the same batch: the drift needs the batch it ran in"
            + (f" (the {', '.join(differing)} that differ only made it batch-sensitive)" if differing else ""))
        explained = True
    else:
        for p in probes:
            o = seen.get(p.name)
            if o is None or not p.explains or p.source is None or not o.same:
                continue
            add(p.source, p.detail, f"drift gone with {p.changed}")
            explained = True
    if not causes:
        _unprobed_sources(add, by_name, seen, found, batch_variant)
    rerun = seen.get("rerun")
    if rerun is not None and not rerun.same:
        sampled = candidate_run.sampling.temperature > 0
        add("sampling" if sampled else "scheduling and batching", "run to run" if sampled else "batch composition",
            "a rerun of the same batch gave other tokens" + (" (sampling randomness: check seeds)" if sampled
                                                              else " (run-to-run nondeterminism)"))
    return PromptDiagnosis(
        prompt_id=prompt_id, prompt_class=score.prompt_class,
        first_divergence=first if isinstance(first, int) and not isinstance(first, bool) else None,
        observations=observations, causes=causes, explained=explained, why="; ".join(whys),
        mitigation=_mitigation(causes[0], details[0]), batch_variant=batch_variant)


def _unprobed_sources(add: Callable[[Cause, str, str], None], by_name: dict[str, Probe],
                      seen: dict[str, Observation], found: list[Difference], batch_variant: bool,
                      skip_group: str | None = None) -> None:
    """Rule 4: no probe removed the drift, so name what differs and was not put back."""
    ref_spec, ctl_spec = _spec(by_name, "reference"), _spec(by_name, "control")
    differing = [g for g in GROUPS if g.name != skip_group and ref_spec and ctl_spec
                 and group_differs(g, ref_spec, ctl_spec, found)]
    unprobed = [g for g in differing if g.name != "model" and f"revert-{g.name}" not in seen]
    if any(g.name == "model" for g in differing):
        add("model", "weights and quantization",
            "no probe removed it and the weights or quantization differ: the model itself")
    elif unprobed:
        for g in unprobed:
            add(g.source, g.detail, f"no probe removed it; {g.detail}: differs from the baseline, not put "
                                    f"back (run probe revert-{g.name})")
    elif batch_variant:
        add("scheduling and batching", "batch composition",
            "its output moves with the batch, and no probe made both sides agree")
    else:
        add("unexplained", "", "no probe removed it and nothing else differs that regress can see")


def _spec(by_name: dict[str, Probe], name: str):  # type: ignore[no-untyped-def]
    p = by_name.get(name)
    if p is None:
        return None
    return p.baseline if p.side == "baseline" else p.candidate


def _alone_consistent(seen: dict[str, Observation]) -> bool:
    """Whether running alone left the sides as far apart as batched (no batch sensitivity shown)."""
    alone, same_batch = seen.get("alone"), seen.get("same-batch")
    if alone is None or same_batch is None:
        return True
    return alone.same == same_batch.same
