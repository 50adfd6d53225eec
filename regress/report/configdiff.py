"""The configuration of the baseline and the candidate, side by side, and what differs (packages too)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from regress.records import RunManifest
from regress.records.manifest import SERVER_DEFAULT_FIELDS
from regress.redact import masked_pair

if TYPE_CHECKING:
    from regress.config import Params

VALUE_CAP = 300
"""Characters of one shown value."""


@dataclass(frozen=True)
class Setting:
    """One setting of the two runs."""

    section: str
    name: str
    baseline: str
    candidate: str

    @property
    def changed(self) -> bool:
        return self.baseline != self.candidate


def _text(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return text if len(text) <= VALUE_CAP else text[:VALUE_CAP] + "…"


def _flatten(m: RunManifest) -> dict[tuple[str, str], Any]:
    c, v, mo, h = m.candidate, m.versions, m.model, m.hardware
    flat: dict[tuple[str, str], Any] = {
        ("engine", "package"): c.package,
        ("engine", "installed package"): v.engine_package,
        ("engine", "backend"): c.backend,
        ("engine", "vllm"): v.vllm,
        ("engine", "torch"): v.torch,
        ("engine", "transformers"): v.transformers,
        ("engine", "python"): v.python,
        ("engine", "extra requirements"): c.requirements or None,
        # Not the environment's directory: it says where a cache lives on this machine, not what
        # ran (the package, the versions above and the manifest's `packages` say that).
        ("model", "model"): mo.model,
        ("model", "revision"): mo.revision,
        ("model", "files sha256"): mo.files_sha256,
        ("model", "dtype requested"): c.dtype,
        ("model", "dtype used"): mo.dtype,
        ("model", "quantization requested"): c.quantization,
        ("model", "quantization used"): mo.quantization,
        ("model", "tokenizer"): c.tokenizer,
        ("model", "chat template"): c.chat_template,
        ("run", "shard size"): m.layout.shard_size,
        ("run", "prompt set"): f"{m.dataset.name} ({m.dataset.prompts} prompts, sha256 {m.dataset.sha256[:12]})",
        ("run", "regress"): v.regress + (f" ({v.regress_git_commit})" if v.regress_git_commit else ""),
        ("hardware", "cpu"): h.cpu_model,
        ("hardware", "cpus"): h.cpu_count,
        ("hardware", "memory GiB"): h.memory_gib,
        ("hardware", "gpus"): ", ".join(h.gpus) if h.gpus else None,
        ("hardware", "platform"): h.platform,
    }
    for key, value in sorted(c.sampling.set_fields().items()):
        flat[("sampling", key)] = value
    for key, value in sorted(m.engine_args.items()):
        flat[("engine arguments", key)] = value
    for key, value in sorted(m.env_vars.items()):
        flat[("environment variables", key)] = value
    flat.update(_effective_rows(m))
    flat.update(_input_default_rows(m))
    return flat


INPUT_DEFAULTS = "input defaults"
"""The section of what a server filled in for the fields regress's requests left unset."""
SERVER_APPLIED = "server defaults applied"


def server_defaults_applied(m: RunManifest) -> dict[str, float | None] | None:
    """The non-neutral defaults the run's server applied to fields its requests left unset (value,
    or None where only the probe showed one), by field; None when the run records nothing about
    it (another backend, a manifest from before it was recorded)."""
    e = m.effective
    if e is None or e.server_defaults is None:
        return None
    left: set[str] | None = None
    if e.sampling_applied and not e.sampling_applied_truncated:
        left = set()
        for entry in e.sampling_applied:
            named = entry.applied.get("left_to_server")
            if not isinstance(named, list):  # recorded before the field: not known which were left
                left = None
                break
            left |= {n for n in named if n in SERVER_DEFAULT_FIELDS}
    return e.server_defaults.applied(left)


def shown_defaults(applied: dict[str, float | None] | None) -> str:
    """``repetition_penalty 1.3, top_p 0.9`` ("none" when empty); a default only a probe saw shows
    as ``(not neutral, value not reported)``."""
    if not applied:
        return "none"
    return ", ".join(f"{k} {json.dumps(v)}" if v is not None else f"{k} (not neutral, value not reported)"
                     for k, v in applied.items())


def _input_default_rows(m: RunManifest) -> dict[tuple[str, str], Any]:
    e = m.effective
    if e is None or e.server_defaults is None:
        return {}
    d = e.server_defaults
    rows: dict[tuple[str, str], Any] = {(INPUT_DEFAULTS, SERVER_APPLIED): shown_defaults(server_defaults_applied(m))}
    if d.values:
        rows[(INPUT_DEFAULTS, "server defaults (start-up log)")] = d.values
    if "probe" in d.learnt_from:
        rows[(INPUT_DEFAULTS, "server defaults (probe)")] = (
            "inconclusive (the server answered the same request twice differently)" if d.inconclusive
            else "not neutral: " + ", ".join(d.changed_by_probe) if d.changed_by_probe
            else f"no effect seen ({', '.join(d.probed)} left unset)")
    sent = (e.server or {}).get("sampling_fields")
    if isinstance(sent, str):
        rows[(INPUT_DEFAULTS, "sampling fields sent")] = sent
    return rows


def input_defaults_drift(golden: RunManifest, candidate: RunManifest) -> str | None:
    """``input defaults: the server applied repetition_penalty 1.3 (golden: none)`` when the two
    runs met different server-side defaults; None when they met the same (or neither records
    them). A run without the record (offline, or from before it) counts as none applied: offline
    runs send every field."""
    a, b = server_defaults_applied(golden), server_defaults_applied(candidate)
    if a is None and b is None or (a or {}) == (b or {}):
        return None
    return f"{INPUT_DEFAULTS}: the server applied {shown_defaults(b)} (golden: {shown_defaults(a)})"


_EFFECTIVE_ROWS = (
    ("dtype", "dtype"), ("quantization", "quantization"), ("kv_cache_dtype", "KV-cache dtype"),
    ("max_model_len", "max model len"), ("enforce_eager", "enforce eager"), ("compilation_mode", "compilation mode"),
    ("attention", "attention"), ("enable_prefix_caching", "prefix caching"),
    ("enable_chunked_prefill", "chunked prefill"), ("max_num_seqs", "max num seqs"),
    ("max_num_batched_tokens", "max num batched tokens"), ("batch_invariant", "batch invariant"),
    ("generation_config", "generation_config"), ("server", "server"),
    ("teacher_force_positions", "teacher-forced positions"),
    ("teacher_force_prefix_cache", "teacher forcing's prefix cache"),
)


def _effective_rows(m: RunManifest) -> dict[tuple[str, str], Any]:
    """The configuration as the engine applied it (none for a manifest written before it was recorded)."""
    e = m.effective
    if e is None:
        return {}
    rows: dict[tuple[str, str], Any] = {("effective", label): getattr(e, name) for name, label in _EFFECTIVE_ROWS}
    rows[("effective", "model defaults the engine holds")] = e.engine_generation_defaults
    rows[("effective", "model defaults regress applied")] = e.generation_defaults_applied or None
    if e.tokenizer is not None:
        t = e.tokenizer
        rows[("effective", "tokenizer")] = t.class_name
        rows[("effective", "vocab size")] = t.vocab_size
        rows[("effective", "bos / eos token ids")] = f"{t.bos_token_id} / {t.eos_token_id}"
        rows[("effective", "chat template sha256")] = t.chat_template_sha256[:16] if t.chat_template_sha256 else None
    for i, entry in enumerate(e.sampling_applied, 1):
        # Compact k=v, unset fields left out: the whole SamplingParams in JSON is longer than a cell.
        rows[("effective", f"sampling applied #{i}")] = " ".join(
            f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in entry.applied.items() if v is not None)
    if e.sampling_applied_truncated:
        rows[("effective", "sampling applied")] = f"first {len(e.sampling_applied)} distinct samplings shown"
    return rows


def config_diff(baseline: RunManifest, candidate: RunManifest) -> list[Setting]:
    """Every setting of either run, in section order; unset on one side shows as '—'. Values are
    masked here too (:func:`regress.redact.masked_pair`: a secret engine argument or variable by
    its name, nested keys too, credentials in any text), as manifests written before the manifest
    masked them hold them in full; a masked value that differs between two such manifests shows
    ``*** (changed)``."""
    a, b = _flatten(baseline), _flatten(candidate)
    for mine, theirs in ((a, b), (b, a)):
        # A run that records no server defaults (offline: every field sent) applied none.
        if (INPUT_DEFAULTS, SERVER_APPLIED) in theirs:
            mine.setdefault((INPUT_DEFAULTS, SERVER_APPLIED), "none")
    keys = list(a) + [k for k in b if k not in a]
    sections = list(dict.fromkeys(k[0] for k in keys))
    keys.sort(key=lambda k: sections.index(k[0]))
    rows = [Setting(sec, name, *map(_text, masked_pair(name, a.get((sec, name)), b.get((sec, name)))))
            for sec, name in keys]
    return [r for r in rows if not (r.baseline == "—" and r.candidate == "—")]


def applied_differences(p: "Params", baseline: str, candidate: str) -> list[Setting] | None:
    """The effective-configuration rows that differ between two candidates' runs (the golden for
    the candidate that made it, runs/<name> for the others); None unless both have a manifest
    that records it."""
    ma, mb = _run_manifest(p, baseline), _run_manifest(p, candidate)
    if ma is None or mb is None:
        return None
    return [s for s in config_diff(ma, mb) if s.section in ("effective", INPUT_DEFAULTS) and s.changed]


def applied_input_defaults_drift(p: "Params", baseline: str, candidate: str) -> str | None:
    """:func:`input_defaults_drift` between two candidates' runs (as :func:`applied_differences`
    finds them); None unless both have run and met different server-side defaults."""
    ma, mb = _run_manifest(p, baseline), _run_manifest(p, candidate)
    return None if ma is None or mb is None else input_defaults_drift(ma, mb)


def _run_manifest(p: "Params", name: str, recorded: Callable[[RunManifest], bool] = lambda m: m.effective is not None
                  ) -> RunManifest | None:
    """The manifest of a candidate's run that records what ``recorded`` asks (by default its
    effective configuration): the golden for the candidate that made it, runs/<name> for the others.

    A place without a manifest has not run and is passed over (None where neither has one); a
    manifest that is there but cannot be read, is not JSON or is not a manifest is
    :class:`~regress.errors.StorageError` naming the file and the field (exit 2), as for every
    command that reads a run: skipping it would print less and look like "nothing differs"."""
    from regress.runs import MANIFEST, read_manifest

    for where in (p.golden_dir(), p.run_dir(name)):
        path = where / MANIFEST
        if not (path.exists() or path.is_symlink()):  # not run yet (or unfinished): nothing to compare
            continue
        m = read_manifest(where)
        if m.candidate.name == name and recorded(m):
            return m
    return None


@dataclass(frozen=True)
class PackageChange:
    """A distribution whose version differs between two runs' engine environments."""

    name: str
    baseline: str | None
    """None: not installed on that side."""
    candidate: str | None

    def row(self) -> dict[str, str | None]:
        return {"package": self.name, "baseline": self.baseline, "candidate": self.candidate}

    def shown(self) -> str:
        return f"{self.name} {self.baseline or '(not installed)'} -> {self.candidate or '(not installed)'}"


def _engine_names(m: RunManifest) -> set[str]:
    """The engine distribution of a run: its candidate's package and what was installed as it."""
    names = set()
    for spec in (m.candidate.package, m.versions.engine_package):
        try:
            names.add(canonicalize_name(Requirement(spec or "").name))
        except InvalidRequirement:  # "current", a path, or not recorded
            continue
    return names


def package_differences(baseline: RunManifest, candidate: RunManifest) -> list[PackageChange] | None:
    """The distributions whose versions differ between the two runs' engine environments, by
    name, the engine package itself left out (the difference asked for); None unless both
    manifests record their packages."""
    a, b = baseline.packages, candidate.packages
    if a is None or b is None:
        return None
    a = {canonicalize_name(k): v for k, v in a.items()}
    b = {canonicalize_name(k): v for k, v in b.items()}
    engine = _engine_names(baseline) | _engine_names(candidate)
    return [PackageChange(name, a.get(name), b.get(name)) for name in sorted(a.keys() | b.keys())
            if name not in engine and a.get(name) != b.get(name)]


def applied_package_differences(p: "Params", baseline: str, candidate: str) -> list[PackageChange] | None:
    """:func:`package_differences` between two candidates' runs (the golden for the candidate
    that made it, runs/<name> for the others); None unless both have run and record their packages."""
    def recorded(m: RunManifest) -> bool:
        return m.packages is not None

    ma, mb = _run_manifest(p, baseline, recorded), _run_manifest(p, candidate, recorded)
    return None if ma is None or mb is None else package_differences(ma, mb)


def shown_package_differences(changes: list[PackageChange]) -> str:
    """``packages: transformers 5.17.0 -> 5.19.0, tokenizers 0.22.1 -> 0.22.2`` (the same: said so)."""
    if not changes:
        return "packages: the same in both engine environments, beyond the engine package"
    return "packages: " + ", ".join(c.shown() for c in changes)
