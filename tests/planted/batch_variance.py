"""Planted batch variance: a vLLM logits processor that makes a request's tokens depend on the
batch it runs in, the same way on every host.

Real batch variance on CPUs comes from the host's rounding (an exact bf16 tie on one machine is
no tie on another), so a test that needs a prompt to flip when it runs alone cannot count on
it. This processor plants it: a request that starts decoding alone in its batch (nothing else
sampled in the same step) has its first near-tie (top-1/top-2 logit gap below :data:`GAP`)
overturned: the runner-up is chosen. A request that starts inside a larger batch is never touched,
so a batched golden is exactly what the engine computes without the processor. Only prompts
whose token ids sum to a multiple of :data:`EVERY` are touched (a quarter of them: tokenization,
not the host, decides which), so a run alone keeps most prompts identical, as real batch
variance does.

Loaded by vLLM (``engine_args: {logits_processors: ["batch_variance:AloneFlipsNearTie"]}`` with
this directory on the engine's ``PYTHONPATH``); vLLM's logits-processor interface (vllm.v1.sample
.logits_processor) tells it which requests join, leave and move in the persistent batch.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

GAP = 0.25
"""Logit gap (nat) below which a lone request's position counts as a near-tie: under regress's
default ``near_tie_margin`` (0.3), so the planted flip is noise by the verdict's own rule."""

EVERY = 4
"""A prompt is planted when the sum of its token ids is divisible by this."""

PLANTED = "batch_variance:AloneFlipsNearTie"
"""The ``logits_processors`` entry that loads this processor."""


class AloneFlipsNearTie(LogitsProcessor):
    """Overturn the first near-tie of a request that started decoding alone."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # Per batch row: None until the request's first sampling step, then whether it was alone
        # then; and whether its one planted flip is spent.
        self.alone: dict[int, bool | None] = {}
        self.spent: dict[int, bool] = {}  # True from the start for a prompt that is not planted

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy tokens: that is its purpose

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.alone.pop(index, None)
            self.spent.pop(index, None)
        for index, _params, prompt_ids, _output_ids in batch_update.added:
            self.alone[index] = None
            self.spent[index] = not prompt_ids or sum(prompt_ids) % EVERY != 0
        for a, b, direction in batch_update.moved:
            alone_a, spent_a = self.alone.pop(a, None), self.spent.pop(a, False)
            if direction == MoveDirectionality.SWAP:
                self.alone[a], self.spent[a] = self.alone.pop(b, None), self.spent.pop(b, False)
            self.alone[b], self.spent[b] = alone_a, spent_a

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        for index in range(rows):
            if index not in self.alone:
                continue
            if self.alone[index] is None:
                self.alone[index] = rows == 1
            if not self.alone[index] or self.spent[index] or rows != 1:
                continue
            top = torch.topk(logits[index].float(), 2)
            if float(top.values[0] - top.values[1]) < GAP:
                # The runner-up wins by a clear step (even from an exact tie). vLLM reports the
                # logprobs of the raw logits, so the recorded distribution is the engine's own.
                second = int(top.indices[1])
                logits[index, second] = top.values[0].to(logits.dtype) + 1
                self.spent[index] = True
        return logits
