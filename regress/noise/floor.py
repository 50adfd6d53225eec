"""The baseline's own noise, measured (``golden/noise.json``), and how scoring applies it.

A noise arm is the baseline replayed against its own golden with one thing changed that should
not matter (nothing at all, the batch composition, each prompt alone), scored like any
candidate (:func:`regress.scoring.score_runs`). :func:`build_floor` folds the arms' scores into
a :class:`NoiseFloor`: per prompt, the worst each measure got under any arm (its *envelope*)
and whether any arm flipped it; per run, the ``quantile`` of those per-prompt values (the
*floor*).

Scoring applies it (:func:`run_thresholds`, :func:`prompt_thresholds`):

- run-level bounds follow the floor: ``benign_kl`` and ``regression_kl`` become
  max(configured, k x floor KL); ``benign_same_top1`` and ``regression_same_top1`` become
  min(configured, 1 - k x (1 - floor same-top-1));
- a prompt the baseline flipped itself gets its own thresholds: ``near_tie_margin`` just above
  the largest margin the baseline flipped it at, and the benign KL (x k), same-top-1 and
  semantic bounds widened to its envelope, so the same flip in a candidate is benign.

Because the file widens thresholds, scoring uses it only as ``regress noise`` wrote it for this
golden: :func:`write_floor` records its sha256 in the golden's manifest (``noise_sha256``, where
the golden run's identity lives), and :func:`load_floor` refuses, with
:class:`~regress.errors.NoiseFloorError` (exit 2, naming the file), a noise.json measured against
another golden, changed since, or never recorded. Every number in it must be finite.

See docs/verdicts.md, "Noise floor".
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from regress.errors import NoiseFloorError
from regress.noise.record import NoiseApplied
from regress.records import ScoredRun
from regress.storage import atomic_write_bytes, atomic_write_text

NOISE_FILE = "noise.json"
ARMS_DIR = "noise-arms"
NOISE_FORMAT_VERSION = 2
"""2: every prompt records the arms under which the baseline itself regressed (``PromptNoise.regressed``),
which the run-level count of regressed prompts is tested against; a format-1 file is refused."""
MARGIN_STEP = 1e-6
"""How far above the envelope's largest flipped margin a noisy prompt's ``near_tie_margin`` goes."""

KL, SAME, SEMANTIC, MARGIN, TF_MARGIN = (
    "tf_kl_mean", "tf_same_top1_rate", "semantic_similarity", "golden_margin", "tf_max_flipped_margin")
HIGHER_IS_WORSE = (KL, MARGIN, TF_MARGIN)
"""Measures whose envelope is the largest value under any arm; the others', the smallest."""
FLOOR_MEASURES = (KL, SAME, MARGIN, TF_MARGIN, SEMANTIC)


class _Stored(BaseModel):
    # NaN or infinity in a floor would widen a bound to infinity (or, compared, to nothing).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class NoiseArmResult(_Stored):
    """One arm as it ran."""

    name: str
    """The arm's key (``rerun``, ``batch``, ``batch-4``, ``alone``)."""
    kind: str
    """``rerun``, ``batch`` or ``alone``."""
    changed: str
    """What the arm changed against the golden, in words."""
    shard_size: int
    """Prompts per engine batch in this arm."""
    run_id: str
    """The arm's run (``golden/noise-arms/<name>``)."""
    prompts: int
    identical: int
    """Prompts with exactly the golden's tokens."""
    diverged: int
    """Prompts whose output differs from the golden's."""
    seconds: float | None = None
    """Engine load + generation + teacher forcing of the arm's run."""


class PromptNoise(_Stored):
    """One prompt's envelope: the worst of each measure under any arm."""

    prompt_id: str
    flipped: bool
    """Some arm changed its output tokens."""
    arms: list[str] = Field(default_factory=list)
    """The arms that flipped it."""
    tf_kl_mean: float | None = None
    """Largest teacher-forced mean KL under any arm."""
    tf_same_top1_rate: float | None = None
    """Smallest teacher-forced same-top-1 rate under any arm."""
    golden_margin: float | None = None
    """Largest golden margin at the first divergence, among the arms where it diverged."""
    golden_margin_arm: str | None = None
    """The arm that diverged at that margin."""
    tf_max_flipped_margin: float | None = None
    """Largest golden margin the baseline overturned teacher-forced, under any arm."""
    semantic_similarity: float | None = None
    """Smallest semantic similarity to the golden under any arm (the prompt's semantic floor)."""
    regressed: list[str] = Field(default_factory=list)
    """The arms under which the baseline itself was a regression here, scored with the configured
    thresholds (no floor): what the count of the candidate's regressed prompts is tested against
    (:mod:`regress.noise.beyond`)."""

    @property
    def flipped_margin(self) -> float | None:
        """The largest margin the baseline flipped this prompt at (first divergence or teacher-forced)."""
        found = [v for v in (self.golden_margin, self.tf_max_flipped_margin) if v is not None and math.isfinite(v)]
        return max(found) if found else None


class NoiseFloor(_Stored):
    """``golden/noise.json``: the baseline's noise under its arms, per prompt and per run."""

    format_version: int = NOISE_FORMAT_VERSION
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    golden_run_id: str
    """The golden the arms were replayed against; another golden makes this file stale."""
    k: float
    """Multiplier on the floor for run-level bounds (params' ``noise.k`` wins when set)."""
    quantile: float
    """The per-prompt quantile the floor is."""
    arms: list[NoiseArmResult]
    floor: dict[str, float | None]
    """Run-level floor per measure: the ``quantile`` of the per-prompt envelopes (the lower
    quantile for measures where lower is worse: same-top-1, semantic similarity)."""
    prompts: list[PromptNoise]
    """Every prompt of the golden, in order."""

    def noisy(self) -> list[PromptNoise]:
        """The prompts some arm flipped."""
        return [p for p in self.prompts if p.flipped]

    def by_id(self) -> dict[str, PromptNoise]:
        return {p.prompt_id: p for p in self.prompts}


# ------------------------------------------------------------------ building

def _num(value: Any) -> float | None:
    """A finite number, else None: a NaN or infinite value is its prompt's regression (or an
    error) in the arm's scoring, never part of an envelope that widens bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _worst(values: list[float | None], measure: str) -> float | None:
    found = [v for v in values if v is not None]
    if not found:
        return None
    return max(found) if measure in HIGHER_IS_WORSE else min(found)


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile with linear interpolation between order statistics (numpy's default)."""
    vals = sorted(v for v in values if math.isfinite(v))
    if not vals:
        return None
    pos = q * (len(vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def build_floor(golden_run_id: str, arms: Sequence[tuple[NoiseArmResult, ScoredRun]], *,
                k: float, q: float) -> NoiseFloor:
    """The envelope of every prompt and the run-level floor, from each arm's scores."""
    if not arms:
        raise ValueError("no noise arm to build a floor from")
    order = [s.prompt_id for s in arms[0][1].scores]
    rows: dict[str, list[tuple[str, Any]]] = {pid: [] for pid in order}
    for arm, scored in arms:
        for s in scored.scores:
            rows.setdefault(s.prompt_id, []).append((arm.name, s))
    prompts = []
    for pid, seen in rows.items():
        flipped_by = [name for name, s in seen if s.prompt_class != "identical"]
        regressed_by = [name for name, s in seen if s.prompt_class == "regression"]
        values: dict[str, Any] = {}
        for measure in (KL, SAME, TF_MARGIN, SEMANTIC):
            values[measure] = _worst([_num(s.metrics.get(measure)) for _, s in seen], measure)
        margins = [(m, name) for name, s in seen if name in flipped_by
                   for m in [_num(s.metrics.get(MARGIN))] if m is not None and math.isfinite(m)]
        margin, margin_arm = max(margins) if margins else (None, None)
        if values[TF_MARGIN] is not None and not math.isfinite(values[TF_MARGIN]):
            values[TF_MARGIN] = None
        prompts.append(PromptNoise(prompt_id=pid, flipped=bool(flipped_by), arms=flipped_by, regressed=regressed_by,
                                   golden_margin=margin, golden_margin_arm=margin_arm, **values))
    floor: dict[str, float | None] = {}
    for measure in FLOOR_MEASURES:
        vals = [v for p in prompts for v in [getattr(p, measure)] if v is not None]
        floor[measure] = quantile(vals, q if measure in HIGHER_IS_WORSE else 1 - q)
    return NoiseFloor(golden_run_id=golden_run_id, k=k, quantile=q, arms=[a for a, _ in arms],
                      floor=floor, prompts=prompts)


def noise_path(golden_dir: str | Path) -> Path:
    return Path(golden_dir) / NOISE_FILE


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_floor(floor: NoiseFloor, golden_dir: str | Path) -> Path:
    """Write ``golden/noise.json`` and record its sha256 in the golden's manifest (both atomic).

    A crash between the two leaves a file whose digest the manifest does not hold: refused by
    :func:`load_floor` until ``regress noise`` runs again (its finished arms are reused)."""
    from regress.runs import MANIFEST, read_manifest

    golden_dir = Path(golden_dir)
    manifest = read_manifest(golden_dir)
    if manifest.run_id != floor.golden_run_id:
        raise ValueError(f"a floor measured against golden {floor.golden_run_id} written to {golden_dir}, "
                         f"whose run is {manifest.run_id}")
    path = noise_path(golden_dir)
    data = floor.model_dump_json(indent=1).encode("utf-8")
    atomic_write_bytes(path, data)
    recorded = manifest.model_copy(update={"noise_sha256": _sha256(data)})
    atomic_write_text(golden_dir / MANIFEST, recorded.model_dump_json(indent=2))
    return path


def load_floor(golden_dir: str | Path, golden_run_id: str) -> NoiseFloor | None:
    """``golden/noise.json``, if there is one, checked before it widens any threshold: it must be
    the file ``regress noise`` recorded in this golden's manifest (its sha256), measured against
    this golden (``golden_run_id``). Otherwise :class:`~regress.errors.NoiseFloorError` naming the
    file (exit 2), never a floor used anyway. None when there is none; a recorded floor whose file
    is gone is a warning (the configured thresholds, which only ever narrow, are used)."""
    from regress.progress import warn
    from regress.runs import MANIFEST, read_manifest

    path = noise_path(golden_dir)
    again = "run `regress noise` to measure this golden's floor again"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = None
    except OSError as exc:
        raise NoiseFloorError(f"{path}: cannot read it ({exc})") from exc
    if data is None:
        if (Path(golden_dir) / MANIFEST).is_file() and read_manifest(golden_dir).noise_sha256 is not None:
            warn(f"{path} is missing although the golden's {MANIFEST} records a noise floor; scoring with the "
                 "configured thresholds")
        return None
    manifest = read_manifest(golden_dir)
    try:  # the bytes that are hashed below, not the file read again
        floor = NoiseFloor.model_validate_json(data)
    except ValidationError as exc:
        raise NoiseFloorError(f"{path}: not a regress noise file ({exc.errors()[0]['msg']}); {again}") from exc
    if floor.format_version != NOISE_FORMAT_VERSION:
        raise NoiseFloorError(f"{path}: noise format {floor.format_version}, this regress reads "
                              f"{NOISE_FORMAT_VERSION} (format 2 records the prompts the baseline itself regressed "
                              f"on, which the run-level test counts against); {again} (finished arms are reused)")
    if manifest.run_id != golden_run_id or floor.golden_run_id != golden_run_id:
        raise NoiseFloorError(f"{path}: measured against golden {floor.golden_run_id}, but the golden is "
                              f"{golden_run_id}: a foreign or stale noise floor is never applied; {again}")
    if manifest.noise_sha256 is None:
        raise NoiseFloorError(f"{path}: not recorded in the golden's {MANIFEST} (copied in, or written by "
                              f"an older regress), so it cannot be checked and is not applied; {again}")
    digest = _sha256(data)
    if digest != manifest.noise_sha256:
        raise NoiseFloorError(f"{path}: changed since `regress noise` wrote it (sha256 {digest[:12]}..., the "
                              f"golden's {MANIFEST} records {manifest.noise_sha256[:12]}...); a noise floor "
                              f"widens thresholds, so it is applied only unchanged: {again}")
    return floor


# ------------------------------------------------------------------ applying

RUN_BOUNDS = ("benign_kl", "regression_kl", "benign_same_top1", "regression_same_top1")


def run_thresholds(t: Any, floor: NoiseFloor) -> Any:
    """``t`` with the run-level bounds widened to ``floor.k`` x the floor (never tightened)."""
    k = floor.k
    update: dict[str, float] = {}
    kl, same = floor.floor.get(KL), floor.floor.get(SAME)
    if kl is not None:
        for name in ("benign_kl", "regression_kl"):
            update[name] = max(getattr(t, name), k * kl)
    if same is not None:
        for name in ("benign_same_top1", "regression_same_top1"):
            update[name] = max(0.0, min(getattr(t, name), 1 - k * (1 - same)))
    return t.model_copy(update=update)


def prompt_thresholds(t: Any, noise: PromptNoise, k: float) -> Any:
    """A noisy prompt's own thresholds: a divergence within its envelope is benign."""
    update: dict[str, float] = {}
    margin = noise.flipped_margin
    if margin is not None:
        update["near_tie_margin"] = max(t.near_tie_margin, margin + MARGIN_STEP)
    if noise.tf_kl_mean is not None:
        update["benign_kl"] = max(t.benign_kl, k * noise.tf_kl_mean)
    if noise.tf_same_top1_rate is not None:
        update["benign_same_top1"] = min(t.benign_same_top1, noise.tf_same_top1_rate)
    if noise.semantic_similarity is not None:
        update["benign_semantic"] = min(t.benign_semantic, noise.semantic_similarity)
    return t.model_copy(update=update)


def envelope_reason(noise: PromptNoise) -> str:
    """Why a prompt is benign thanks to its envelope."""
    arm = noise.golden_margin_arm or (noise.arms[0] if noise.arms else "?")
    margin = noise.flipped_margin
    at = f" at margin {margin:.2g}" if margin is not None else ""
    return f"within its noise envelope: the baseline flipped it too under '{arm}'{at}"


def applied(t_configured: Any, t_run: Any, floor: NoiseFloor, made_benign: list[str]) -> NoiseApplied:
    """The record of what :func:`run_thresholds` and :func:`prompt_thresholds` did."""
    noisy = [p.prompt_id for p in floor.noisy()]
    return NoiseApplied(arms=[a.name for a in floor.arms], k=floor.k, quantile=floor.quantile, floor=dict(floor.floor),
                        bounds={n: float(getattr(t_run, n)) for n in RUN_BOUNDS},
                        configured={n: float(getattr(t_configured, n)) for n in RUN_BOUNDS},
                        noisy_prompts=len(noisy), noisy_ids=noisy, made_benign=made_benign)
