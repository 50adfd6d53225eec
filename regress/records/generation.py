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

    @property
    def sampling(self) -> ResolvedSampling:
        """Sampling used for this prompt."""
        return ResolvedSampling.model_validate(self.sampling_data)
