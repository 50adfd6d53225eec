"""Fake engine backends for orchestration tests only (crash handling, retries, resume).

They never stand in for the engine where a test is about engine output: they exist to make
the engine process die at a chosen moment, which the real engine cannot be asked to do.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np

from regress.backends.base import EngineBackend, GenerationRequest, LogprobRows, RawGeneration


class _Tokenizer:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))[:32] or [0]


class EchoBackend(EngineBackend):
    """Returns the first bytes of the prompt as 'tokens' (each plus FAKE_OUTPUT_OFFSET, modulo
    256, when set: another candidate's outputs; FAKE_LOGPROB_SHIFT moves every logprob it decodes by
    that much: another candidate's model). Dies with SIGILL on the shard given by
    FAKE_CRASH_ON_SHARD the first time only (a marker file in FAKE_CRASH_MARKER_DIR records it),
    or on every shard when FAKE_CRASH_ALWAYS=1. FAKE_LOAD_DELAY_S: a slow load (seconds).
    FAKE_CANNOT_RESET=1: it cannot say it cleared its cache (as a server regress does not run);
    FAKE_CANNOT_RESET=die: the process dies when asked to."""

    name = "echo"

    def load(self) -> dict[str, Any]:
        self.shards_seen = 0
        if os.environ.get("FAKE_LOAD_DELAY_S"):
            import time

            time.sleep(float(os.environ["FAKE_LOAD_DELAY_S"]))
        return {"resolved_path": None, "dtype": "none", "engine_args": {}}

    def get_tokenizer(self) -> Any:
        return _Tokenizer()

    def reset_cache(self) -> bool:
        if os.environ.get("FAKE_CANNOT_RESET") == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        return os.environ.get("FAKE_CANNOT_RESET") != "1"

    def _maybe_crash(self) -> None:
        if os.environ.get("FAKE_CRASH_ALWAYS") == "1":
            os.kill(os.getpid(), signal.SIGILL)
        target = os.environ.get("FAKE_CRASH_ON_SHARD")
        if target is not None and int(target) == self.shards_seen:
            marker = Path(os.environ["FAKE_CRASH_MARKER_DIR"]) / f"crashed-{target}"
            if not marker.exists():
                marker.write_text("x")
                os.kill(os.getpid(), signal.SIGILL)

    def generate(self, requests: list[GenerationRequest], progress) -> list[RawGeneration]:
        self._maybe_crash()
        self.shards_seen += 1
        out = []
        offset = int(os.environ.get("FAKE_OUTPUT_OFFSET", "0"))
        shift = float(os.environ.get("FAKE_LOGPROB_SHIFT", "0"))
        for r in requests:
            ids = [(t + offset) % 256 for t in r.prompt_token_ids[: r.sampling["max_tokens"]]]
            k = r.sampling["logprobs"]
            rows = LogprobRows(np.full(len(ids), -0.5 + shift, np.float32),
                               np.tile(np.arange(k, dtype=np.int32), (len(ids), 1)),
                               np.tile(-np.arange(1, k + 1, dtype=np.float32) + shift, (len(ids), 1)))
            out.append(RawGeneration(list(ids), bytes(ids).decode("utf-8", "replace"), "length", rows))
            progress(1)
        return out

    def teacher_force(self, sequences, k, progress) -> list[LogprobRows]:
        return [LogprobRows(np.zeros(len(c), np.float32), np.zeros((len(c), k), np.int32), np.zeros((len(c), k), np.float32))
                for _, c in sequences]
