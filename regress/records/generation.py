"""Per-prompt results of a run: numpy views over its columnar shard arrays, not stored records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from regress.records.sampling import ResolvedSampling


@dataclass(frozen=True, slots=True)
class LogprobTrack:
    """Per-position logprobs along one token sequence.

    ``token_ids[i]`` is the token at position i (sampled, or the golden's when teacher
    forced), ``token_logprobs[i]`` its logprob, ``top_ids[i]`` / ``top_logprobs[i]`` the k
    most likely tokens at that position, best first (padded with -1 / -inf).

    A view over a run's columnar arrays, not a stored record (the shard file is the record):
    a plain dataclass, because scoring 10,000 prompts builds tens of thousands of these.
    """

    token_ids: np.ndarray
    """int32 [n]."""
    token_logprobs: np.ndarray
    """float32 [n]."""
    top_ids: np.ndarray
    """int32 [n, k]."""
    top_logprobs: np.ndarray
    """float32 [n, k]."""


@dataclass(frozen=True, slots=True)
class ChoiceScores:
    """A multiple-choice prompt's choices as one run scored them (a view, like LogprobTrack).

    Each choice's log-likelihood is the sum of the engine's logprobs of the choice's tokens,
    teacher-forced after the prompt's tokens and the choice's earlier tokens (one prefill per
    choice, in the session that generated: :mod:`regress.engine.choices`)."""

    texts: tuple[str, ...]
    """The choices, as the prompt set gives them."""
    answer: int
    """Index of the right choice."""
    logprobs: np.ndarray
    """float64 [choices]: each choice's total log-likelihood (nat, <= 0)."""
    token_ids: tuple[np.ndarray, ...]
    """Per choice, int32: its tokens."""
    token_logprobs: tuple[np.ndarray, ...]
    """Per choice, float32: each token's logprob."""

    @property
    def token_counts(self) -> np.ndarray:
        """int64 [choices]: tokens per choice."""
        return np.array([len(t) for t in self.token_ids], np.int64)


CHOICES_FORMAT = 1
"""The version of the choice arrays and meta a shard holds (``choices_format``); written by
:mod:`regress.engine.choices`, which keeps its own copy (it runs where pydantic does not)."""

CHOICE_ARRAYS = ("choice_offsets", "choice_logprobs", "choice_token_offsets", "choice_tokens",
                 "choice_token_logprobs")
"""A shard's arrays of the choices; a shard without multiple-choice prompts has none."""

CHOICE_SUM_TOLERANCE = 1e-3
"""How far a stored total may lie from the float64 sum of its stored token logprobs (nat): the
engine writes exactly that sum, so anything wider is an edited or damaged file."""


def choices_problem(meta: dict[str, Any], arrays: dict[str, np.ndarray], count: int) -> str | None:
    """What makes a shard's choice arrays and meta not a valid record of ``count`` prompts' choices
    (None: nothing; a shard with neither holds no multiple-choice prompt). Checked on load, so
    that a NaN, an infinity or a positive log-likelihood never reaches scoring."""
    present = [k for k in CHOICE_ARRAYS if k in arrays]
    if not present and "choices_format" not in meta:
        return None
    if meta.get("choices_format") != CHOICES_FORMAT:
        return (f"choices_format {meta.get('choices_format')!r}: this regress reads {CHOICES_FORMAT} "
                "(written by another version?)")
    missing = [k for k in CHOICE_ARRAYS if k not in arrays]
    if missing:
        return f"the choice array(s) {', '.join(missing)} are missing"
    texts, answers = meta.get("choice_texts"), meta.get("choice_answers")
    if not isinstance(texts, list) or len(texts) != count or not isinstance(answers, list) or len(answers) != count:
        return f"'choice_texts' and 'choice_answers' are not lists of {count} entries"
    offsets, totals = arrays["choice_offsets"], arrays["choice_logprobs"]
    if offsets.ndim != 1 or len(offsets) != count + 1 or offsets.dtype.kind not in "iu" or offsets[0] != 0 \
            or (np.diff(offsets) < 0).any() or offsets[-1] != len(totals):
        return f"'choice_offsets' does not index 'choice_logprobs' ({len(totals)} choices) over {count} prompts"
    for i, (text, answer) in enumerate(zip(texts, answers)):
        n = int(offsets[i + 1] - offsets[i])
        if text is None:
            if n or answer is not None:
                return f"prompt {i} has {n} choice scores but no choice texts"
            continue
        if not isinstance(text, list) or len(text) != n or n < 2 or not all(isinstance(t, str) for t in text):
            return f"prompt {i}: {n} choice scores for choice texts {str(text)[:60]}"
        if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < n:
            return f"prompt {i}: answer {answer!r} is not an index into its {n} choices"
    token_offsets, tokens, token_lp = (arrays["choice_token_offsets"], arrays["choice_tokens"],
                                       arrays["choice_token_logprobs"])
    if token_offsets.ndim != 1 or len(token_offsets) != len(totals) + 1 or token_offsets.dtype.kind not in "iu" \
            or token_offsets[0] != 0 or (np.diff(token_offsets) < 1).any() or token_offsets[-1] != len(tokens) \
            or len(token_lp) != len(tokens):
        return "'choice_token_offsets' does not give every choice one token or more of 'choice_tokens'"
    for what, values in (("a choice's log-likelihood", totals), ("a choice token's logprob", token_lp)):
        bad = ~np.isfinite(values) | (values > LOGPROB_LIMIT)
        if bad.any():
            where = int(np.argmax(bad))
            return f"{what} ({where}) is {float(values[where])!r}: a log-likelihood is a finite number <= 0"
    sums = np.add.reduceat(token_lp.astype(np.float64), token_offsets[:-1]) if len(totals) else totals
    off = np.abs(sums - totals) > CHOICE_SUM_TOLERANCE
    if off.any():
        where = int(np.argmax(off))
        return (f"choice {where}'s log-likelihood {float(totals[where])!r} is not the sum of its token logprobs "
                f"({float(sums[where])!r})")
    return None


LOGPROB_LIMIT = 1e-4
"""How far above 0 a stored logprob may lie (float rounding), as the engine side allows."""


def choice_scores(meta_texts: list[str], answer: int, arrays: dict[str, np.ndarray], first: int,
                  last: int) -> ChoiceScores:
    """Choices ``first .. last - 1`` of a run's (checked) choice arrays, as one prompt's view."""
    offsets = arrays["choice_token_offsets"]
    spans = [slice(int(offsets[c]), int(offsets[c + 1])) for c in range(first, last)]
    return ChoiceScores(
        texts=tuple(meta_texts), answer=answer, logprobs=arrays["choice_logprobs"][first:last],
        token_ids=tuple(arrays["choice_tokens"][s] for s in spans),
        token_logprobs=tuple(arrays["choice_token_logprobs"][s] for s in spans),
    )


NOT_GENERATED = "not_generated"
"""The finish reason of a prompt a prefill-only run (a quick check, :mod:`regress.quick`) did not
generate for: its result is the teacher-forced logprobs of the golden's completion alone."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One prompt's result in one run (a view over the run's arrays, like LogprobTrack)."""

    prompt_id: str
    """Id from the prompt set."""
    prompt_token_ids: np.ndarray
    """int32: the prompt as the candidate tokenized or rendered it."""
    output_token_ids: np.ndarray
    """int32: generated tokens."""
    text: str
    """Detokenized output."""
    finish_reason: str
    """``stop`` (EOS or stop string) or ``length`` (max_tokens)."""
    free_run: LogprobTrack
    """Logprobs along the generated tokens."""
    teacher_forced: LogprobTrack | None = None
    """Logprobs along the golden's completion, fed to this candidate (replays only)."""
    sampling_data: dict[str, Any] = field(default_factory=dict)
    """Sampling used for this prompt, as stored (see ``sampling``)."""
    choices: ChoiceScores | None = None
    """A multiple-choice prompt's choices with their log-likelihoods (None: no choices, or a run
    written before choices were scored)."""

    @property
    def sampling(self) -> ResolvedSampling:
        """Sampling used for this prompt."""
        return ResolvedSampling.model_validate(self.sampling_data)
