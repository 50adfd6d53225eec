"""An engine backend that hangs on purpose, for the phase-deadline tests (tests/test_deadlines.py) only.

:class:`HangingBackend` is the echo backend (``plugins.fake_backends``) hanging in the engine
process at the step ``FAKE_HANG_IN`` names (``load``, ``generate``, ``teacher_force``), after
writing its pid to ``FAKE_HANG_PID_FILE``. A real hang, not a mock: what it exercises is the
orchestrator's way out (tests/plugins/hanging_metric.py hangs the orchestrator itself).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from plugins.fake_backends import EchoBackend


def _hang_if(step: str) -> None:
    if os.environ.get("FAKE_HANG_IN") != step:
        return
    pid_file = os.environ.get("FAKE_HANG_PID_FILE")
    if pid_file:
        Path(pid_file).write_text(str(os.getpid()))
    while True:
        time.sleep(3600)


class HangingBackend(EchoBackend):
    """The echo backend, hanging where ``FAKE_HANG_IN`` says."""

    name = "hanging"

    def load(self) -> dict[str, Any]:
        _hang_if("load")
        return super().load()

    def generate(self, requests, progress):  # type: ignore[no-untyped-def]
        _hang_if("generate")
        outputs = super().generate(requests, progress)
        if os.environ.get("FAKE_HANG_IN") == "teacher_force":
            # Teacher forcing prefills only what diverged from the golden: this candidate's outputs
            # differ (its first token moved), so that the pass runs, and hangs.
            import dataclasses

            outputs = [dataclasses.replace(o, output_token_ids=[(o.output_token_ids[0] + 1) % 1000,
                                                                *o.output_token_ids[1:]])
                       if o.output_token_ids else o for o in outputs]
        return outputs

    def teacher_force(self, sequences, k, progress):  # type: ignore[no-untyped-def]
        _hang_if("teacher_force")
        return super().teacher_force(sequences, k, progress)
