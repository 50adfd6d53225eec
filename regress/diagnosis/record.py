"""``diagnosis.json``: why each drifted prompt of a candidate drifted, as the probes found it.

Written by :func:`regress.diagnosis.run.diagnose` beside the candidate's scores
(``scores/<candidate>/diagnosis.json``); read by the report (its "Why" column and the summary by
source) and by people. Only pydantic here: the report reads it without the engine side.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DIAGNOSIS_FILE = "diagnosis.json"
DIAGNOSIS_FORMAT = 1
"""Version of diagnosis.json."""

Cause = Literal["input", "input defaults", "scheduling and batching", "kernels and precision", "sampling",
                "model", "engine", "unexplained"]
"""Sources of drift in the field guide's terms (:data:`regress.effective.SOURCES`), plus
``unexplained`` when no probe removed the drift and the model did not change either."""

Side = Literal["baseline", "candidate", "both"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProbeRun(_Record):
    """One probe: what was run, on which side, against what it was compared, and what it cost."""

    name: str
    """``reference`` (the baseline, the drifted prompts batched together), ``control`` (the
    candidate, same batch), ``alone``, ``rerun``, ``revert-<source>``, ``float32``,
    ``prefix-caching-off``, ``chunked-prefill-off``, ``eager``, ``batch-invariant``, ``concurrency``."""
    source: Cause | None = None
    """The source of drift this probe tests; None for the reference and control runs."""
    changed: str
    """What the probe changed, in words."""
    side: Side
    """Which side ran changed: the candidate, the baseline, or both (then compared with each other)."""
    compared_with: str
    """What a prompt's output is compared with to say whether the drift went away."""
    run_dirs: list[str] = Field(default_factory=list)
    """Where its runs are (kept: each is a normal run directory, resumable)."""
    engine_loads: int = 0
    """Engines started for it (0: it reused a warm engine of the same configuration)."""
    seconds: float = 0.0
    """Wall time of its runs (engine start, generation, teacher forcing)."""
    skipped: str | None = None
    """Why it did not run (the engine does not support it, nothing to change, ...); None when it ran."""


class Observation(_Record):
    """What one probe showed for one prompt."""

    probe: str
    """The probe's name."""
    same: bool
    """Whether the prompt's output tokens equal what the probe compares with."""
    first_divergence: int | None = None
    """First output position where they differ (None: the same)."""


class PromptDiagnosis(_Record):
    """One drifted prompt: what the probes showed, and the source(s) they point to."""

    prompt_id: str
    prompt_class: str
    """Its class in the candidate's scores (regression, drift, input_drift)."""
    first_divergence: int | None = None
    """Where the candidate's output left the golden's in the scored run."""
    observations: list[Observation] = Field(default_factory=list)
    causes: list[Cause]
    """The source(s) of its drift, most specific first."""
    explained: bool
    """True when a probe removed the drift (the cause is shown, not inferred by elimination)."""
    why: str
    """One line in words: what removed it or what is left."""
    mitigation: str
    """What would have prevented it (the field guide's mitigations)."""
    batch_variant: bool = False
    """Its output changed with the batch it was in (baseline or candidate), whatever the cause."""


class Diagnosis(_Record):
    """A candidate's diagnosis."""

    format_version: int = DIAGNOSIS_FORMAT
    candidate: str
    baseline: str
    golden_run_id: str
    run_id: str
    """The candidate run whose drifted prompts were diagnosed."""
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    drifted: int
    """Prompts of the run in classes regression, drift or input drift."""
    differences: list[dict[str, str]] = Field(default_factory=list)
    """The settings that differ (``regress diff``): source, setting, baseline, candidate."""
    probes: list[ProbeRun]
    prompts: list[PromptDiagnosis]
    """The diagnosed prompts (the worst first; at most ``max_prompts``)."""
    by_cause: dict[str, int]
    """Diagnosed prompts per cause (a prompt with two causes counts under each)."""
    engine_loads: int
    seconds: float
    left_out: list[str] = Field(default_factory=list)
    """Drifted prompts not diagnosed (over the limit, or sampled prompts: those are compared as distributions)."""


def load_diagnosis(scores_dir: "str | Path", run_id: str | None = None) -> Diagnosis | None:
    """``diagnosis.json`` of a candidate's scores directory, or None when there is none, it cannot
    be read, or it was made for another run than ``run_id`` (a stale diagnosis is never shown)."""
    import logging

    from regress.errors import StorageError
    from regress.storage import read_record

    path = Path(scores_dir) / DIAGNOSIS_FILE
    try:
        diagnosis = read_record(path, Diagnosis, what="a diagnosis", missing=None, loads=True)
    except StorageError as exc:  # the reason is the exception it chains, as json or pydantic said it
        logging.getLogger(__name__).warning("%s: not used (%s)", path, str(exc.__cause__).splitlines()[0])
        return None
    if diagnosis is None:
        return None
    if run_id is not None and diagnosis.run_id != run_id:
        logging.getLogger(__name__).warning("%s: made for run %s, not %s; not used (run `regress diagnose` again)",
                                            path, diagnosis.run_id, run_id)
        return None
    return diagnosis
