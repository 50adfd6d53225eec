"""Multiple-choice scoring in the engine process: every choice's log-likelihood after its prompt.

A prompt with ``choices`` (:class:`regress.records.PromptRecord`) gets, on every run (golden
included), each choice scored teacher-forced: the prompt's token ids as the engine used them for
the generation, then the choice's own tokens, one prefill per choice, through the backend's
``teacher_force`` (vLLM ``prompt_logprobs``, the HF forward pass, the server's completions
endpoint): the same machinery, engine session and prompt tokens as the rest of the shard.

A choice is tokenized alone, without special tokens (the tokenizer's ``encode(text,
add_special_tokens=False)``), and appended to the prompt's ids: nothing is stripped or added, so a
choice that follows a word carries its own leading space, as lm-evaluation-harness's target
delimiter does. Tokenizing apart keeps the prompt's tokens those of the generation on every side
(re-tokenizing prompt + choice as one text could merge tokens across the seam, and a chat prompt
rendered by the server's template has no local text to join).

Runs in candidate environments: standard library, numpy and the backend interface only.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from regress.backends.base import EngineBackend, LogprobRows, rows_problem
from regress.errors import InputError, ServerReplyError
from regress.storage import ragged

CHOICES_FORMAT = 1
"""Version of the choice arrays and meta in a shard (``choices_format`` in its meta)."""

# The reading side (regress.records.generation.CHOICE_ARRAYS, checked there) cannot be imported
# here: it needs pydantic, which candidate environments lack.


def _nothing(_: int) -> None:
    """Progress of the choices is not counted: the shard's phases count prompts, not choices."""


def score_choices(backend: EngineBackend, prompts: list[Any], prompt_ids: list[list[int]]
                  ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The choice arrays and meta of a shard (both empty when no prompt has choices).

    ``prompt_ids``: per prompt, the ids the generation used. Arrays, choices in prompt order:
    ``choice_offsets`` (int64 [prompts + 1], prompt i's choices ``[o[i], o[i+1])``),
    ``choice_logprobs`` (float64 [choices]: the sum of the choice's token logprobs),
    ``choice_token_offsets`` (int64 [choices + 1]), ``choice_tokens`` (int32) and
    ``choice_token_logprobs`` (float32): each choice's tokens and their teacher-forced logprobs.
    Meta: ``choices_format``, per prompt ``choice_texts`` and ``choice_answers`` (null without
    choices), and ``choice_scoring_s``.

    A choice that does not fit the engine's context is an :class:`InputError` naming it; a logprob
    that is not a finite number <= 0 is a :class:`ValueError` (the run fails: never a score).
    """
    asked = [(i, p) for i, p in enumerate(prompts) if p.get("choices")]
    if not asked:
        return {}, {}
    tokenizer = backend.get_tokenizer()
    sequences: list[tuple[list[int], list[int]]] = []
    owners: list[tuple[str, int]] = []
    per_prompt = [0] * len(prompts)
    for i, prompt in asked:
        for c, text in enumerate(prompt["choices"]):
            ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
            if not ids:
                raise InputError(f"prompt '{prompt['id']}', choice {c}: {text!r} tokenizes to no token")
            sequences.append((list(prompt_ids[i]), ids))
            owners.append((str(prompt["id"]), c))
        per_prompt[i] = len(prompt["choices"])
    started = time.perf_counter()
    try:
        rows = backend.teacher_force(sequences, 1, _nothing)
    except ServerReplyError as exc:
        if exc.prompt is not None or exc.index is None or not 0 <= exc.index < len(owners):
            raise
        pid, c = owners[exc.index]
        raise ServerReplyError(f"{exc.problem} (choice {c})", url=exc.url, prompt=pid, index=exc.index) from exc
    elapsed = time.perf_counter() - started
    totals = np.zeros(len(sequences), np.float64)
    for n, ((prompt, choice), r, (pid, c)) in enumerate(zip(sequences, rows, owners)):
        _check(r, choice, len(prompt), pid, c)
        # float64: a long choice's sum of float32 logprobs should not lose digits to its own rounding.
        totals[n] = float(np.sum(r.token_logprobs, dtype=np.float64))
    choice_offsets = np.zeros(len(prompts) + 1, np.int64)
    np.cumsum(per_prompt, out=choice_offsets[1:])
    tokens, token_offsets = ragged([s[1] for s in sequences], np.int32)
    token_lp, _ = ragged([r.token_logprobs for r in rows], np.float32)
    arrays = {"choice_offsets": choice_offsets, "choice_logprobs": totals, "choice_token_offsets": token_offsets,
              "choice_tokens": tokens, "choice_token_logprobs": token_lp}
    meta = {
        "choices_format": CHOICES_FORMAT,
        "choice_texts": [list(p["choices"]) if p.get("choices") else None for p in prompts],
        "choice_answers": [p["answer"] if p.get("choices") else None for p in prompts],
        "choice_scoring_s": elapsed,
    }
    return arrays, meta


def _check(rows: LogprobRows, choice: list[int], prompt_len: int, pid: str, c: int) -> None:
    """Refuse rows that are not a whole choice's logprobs."""
    if len(rows.token_logprobs) < len(choice):
        # teacher_force cuts a sequence to the context; a part of a choice has a higher
        # log-likelihood than the whole, so it must never be compared.
        raise InputError(f"prompt '{pid}', choice {c}: the prompt ({prompt_len} tokens) and the choice "
                         f"({len(choice)} tokens) do not fit the engine's context (only "
                         f"{len(rows.token_logprobs)} choice tokens could be scored): shorten them or raise "
                         "max_model_len")
    problem = rows_problem(rows, 1)
    if problem is None and len(rows.token_logprobs) != len(choice):
        problem = f"{len(rows.token_logprobs)} logprobs for {len(choice)} tokens"
    if problem is None:
        bad = [float(v) for v in rows.token_logprobs if not math.isfinite(float(v))]
        if bad:
            problem = f"a token logprob of {bad[0]!r} (the choice would have no finite log-likelihood)"
    if problem is not None:
        raise ValueError(f"prompt '{pid}', choice {c}: the engine's teacher-forced logprobs are not a score: {problem}")
