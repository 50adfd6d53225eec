"""The probes a diagnosis can run: each changes one thing about how the drifted prompts run.

A probe is named, has the source of drift it tests, says which side it changes (the candidate,
the baseline, or both) and what its output is compared with. Three kinds:

- **references**: ``reference`` (the baseline with the drifted prompts batched together) and
  ``control`` (the candidate, the same batch). Every other probe runs in that same batch, so
  that a difference it shows is its own change, not a new batch composition.
- **reverts** (``revert-<group>``): the candidate with one group of settings put back to the
  baseline's (its chat template and tokenizer, its generation defaults, its KV-cache dtype, its
  dtype, its compile mode, its scheduler settings, its sampling, its model, its engine
  package). When the candidate's output then equals the reference, that group caused the drift.
  A revert exists only for a group in which the two differ.
- **switches**: the same change on both sides (``float32``, ``batch-invariant``, ``alone``),
  compared with each other; or a setting turned off on the candidate (``prefix-caching-off``,
  ``chunked-prefill-off``, ``eager``) compared with the reference; or the candidate again
  (``rerun``) compared with the control.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from regress.diagnosis.record import Cause, Side
from regress.diagnosis.settings import AUTO, KNOWN, REVERT_GROUPS
from regress.effective import MITIGATION, Difference, differences
from regress.records import CandidateSpec

Layout = Literal["together", "alone"]
Compared = Literal["golden", "candidate run", "reference", "control", "each other"]


@dataclass(frozen=True)
class Probe:
    """One probe, ready to run."""

    name: str
    source: Cause | None
    changed: str
    side: Side
    compared_with: Compared
    explains: bool
    """Whether equality with what it is compared with removes the drift (False: it only shows
    sensitivity, like a rerun or the control)."""
    baseline: CandidateSpec | None = None
    """The baseline as this probe runs it (sides ``baseline`` and ``both``)."""
    candidate: CandidateSpec | None = None
    """The candidate as this probe runs it (sides ``candidate`` and ``both``)."""
    layout: Layout = "together"
    detail: str = ""
    """Which source in finer words (``KV cache``, ``dtype``, ``compile``), for the why line."""


@dataclass(frozen=True)
class Skipped:
    """A probe that does not apply, and why."""

    name: str
    source: Cause | None
    reason: str


# --------------------------------------------------------------------------------------
# Setting groups a revert puts back
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """Settings reverted together, the source they belong to, and how a revert is built."""

    name: str
    source: Cause
    detail: str
    fields: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    file_sources: tuple[str, ...] = ()
    """Sources whose file-level differences (``regress diff``: tokenizer files, chat template
    hash, weights) also count as the group differing."""
    file_names: tuple[str, ...] = ()
    """If set, only file-level differences whose name starts with one of these count."""
    extra: Callable[[CandidateSpec, CandidateSpec], dict[str, Any]] | None = field(default=None, compare=False)


def _tokenizer_of(spec: CandidateSpec) -> str:
    return spec.tokenizer or spec.model


def _generation_source(spec: CandidateSpec) -> str:
    """Where a candidate's generation defaults come from, as a value that means the same on another model."""
    setting = getattr(spec, "generation_config", "vllm")
    return spec.model if setting == "auto" else setting


def _revert_input(baseline: CandidateSpec, candidate: CandidateSpec) -> dict[str, Any]:
    # The tokenizer (and the chat template it carries) of the baseline, whatever the model; on
    # the baseline's own model that is its setting as it is (so the revert is the baseline's
    # engine configuration exactly, and can run on its warm engine).
    tokenizer = baseline.tokenizer if candidate.model == baseline.model else _tokenizer_of(baseline)
    return {"tokenizer": tokenizer, "chat_template": baseline.chat_template}


def _revert_model(baseline: CandidateSpec, candidate: CandidateSpec) -> dict[str, Any]:
    # The baseline's weights, but the candidate's own input and generation defaults: a model
    # directory also carries a tokenizer and a generation_config, which are other sources.
    update: dict[str, Any] = {"model": baseline.model, "revision": baseline.revision,
                              "quantization": baseline.quantization, "tokenizer": _tokenizer_of(candidate)}
    if getattr(candidate, "generation_config", "vllm") == "auto":
        update["generation_config"] = candidate.model
    return update


def _revert_defaults(baseline: CandidateSpec, candidate: CandidateSpec) -> dict[str, Any]:
    update: dict[str, Any] = {"generation_config": _generation_source(baseline)} if hasattr(
        candidate, "generation_config") else {}
    if candidate.backend == "server":
        # A url: server's own defaults cannot be reverted from here; sending every field
        # explicitly keeps them from applying, which is what reverting them would do.
        from regress.records import ServerSettings

        update["server"] = (candidate.server or ServerSettings()).model_copy(update={"sampling_fields": "all"})
    return update


GROUPS: tuple[Group, ...] = (
    Group("input", "input", "tokenizer and chat template", fields=("tokenizer", "chat_template"),
          engine_args=("max_model_len", "tokenizer_mode", "skip_tokenizer_init"), file_sources=("input",),
          extra=_revert_input),
    Group("input-defaults", "input defaults", "generation_config defaults", fields=("generation_config",),
          engine_args=("generation_config", "override_generation_config"), file_sources=("input defaults",),
          extra=_revert_defaults),
    Group("kv-cache", "kernels and precision", "KV cache", engine_args=("kv_cache_dtype", "calculate_kv_scales")),
    Group("dtype", "kernels and precision", "dtype", fields=("dtype",)),
    Group("compile", "kernels and precision", "compile mode", engine_args=("enforce_eager", "compilation_config")),
    Group("scheduling", "scheduling and batching", "scheduler settings",
          engine_args=("enable_prefix_caching", "enable_chunked_prefill", "max_num_seqs", "max_num_batched_tokens",
                       "async_scheduling"), env=("VLLM_BATCH_INVARIANT",)),
    Group("sampling", "sampling", "sampling parameters", fields=("sampling",), engine_args=("seed",)),
    Group("model", "model", "weights and quantization", fields=("model", "revision", "quantization"),
          file_sources=("model",), file_names=("weights", "config."), extra=_revert_model),
    Group("engine", "engine", "engine package", fields=("package", "requirements", "backend")),
)
# The probe names (regress.diagnosis.settings.KNOWN) are listed where params.yaml is validated,
# which must not import this table: its group names are the same, in the same order.
assert tuple(g.name for g in GROUPS) == REVERT_GROUPS, "GROUPS and diagnosis.settings.REVERT_GROUPS differ"
_NAMED_ARGS = {a for g in GROUPS for a in g.engine_args}
_NAMED_ENV = {e for g in GROUPS for e in g.env}


def _merged(mine: dict[str, Any], theirs: dict[str, Any], keys: set[str] | None) -> dict[str, Any]:
    """``mine`` with ``keys`` (None: every key not named by a group) taken from ``theirs``."""
    out = dict(mine)
    for key in set(mine) | set(theirs):
        if keys is not None and key not in keys:
            continue
        if keys is None and key in (_NAMED_ARGS | _NAMED_ENV):
            continue
        if key in theirs:
            out[key] = theirs[key]
        else:
            out.pop(key, None)
    return out


def group_differs(group: Group, baseline: CandidateSpec, candidate: CandidateSpec,
                  found: list[Difference]) -> list[str]:
    """What differs in ``group`` between the two (setting names; empty when nothing does)."""
    names = [f for f in group.fields if getattr(baseline, f, None) != getattr(candidate, f, None)]
    args = set(group.engine_args) if group.name != "engine" else None
    names += [f"engine_args.{k}" for k in sorted(set(baseline.engine_args) | set(candidate.engine_args))
              if (k in args if args is not None else k not in _NAMED_ARGS)
              and baseline.engine_args.get(k) != candidate.engine_args.get(k)]
    env = set(group.env) if group.name != "engine" else None
    names += [f"env {k}" for k in sorted(set(baseline.env) | set(candidate.env))
              if (k in env if env is not None else k not in _NAMED_ENV) and baseline.env.get(k) != candidate.env.get(k)]
    for d in found:
        if d.source in group.file_sources and (not group.file_names or d.name.startswith(group.file_names)):
            names.append(d.name)
    # A model path alone (same weights, config and quantization) is not a different model.
    if group.name == "model" and names == ["model"]:
        return []
    return list(dict.fromkeys(names))


def reverted(group: Group, baseline: CandidateSpec, candidate: CandidateSpec) -> CandidateSpec:
    """The candidate with ``group``'s settings put back to the baseline's."""
    update: dict[str, Any] = {f: getattr(baseline, f) for f in group.fields if hasattr(candidate, f)}
    keys_args = set(group.engine_args) if group.name != "engine" else None
    keys_env = set(group.env) if group.name != "engine" else None
    if group.engine_args or group.name == "engine":
        update["engine_args"] = _merged(candidate.engine_args, baseline.engine_args, keys_args)
    if group.env or group.name == "engine":
        update["env"] = _merged(candidate.env, baseline.env, keys_env)
    if group.extra is not None:
        update.update(group.extra(baseline, candidate))
    update["name"] = f"{candidate.name}-revert-{group.name}"[:100]
    return candidate.model_copy(update=update)


# --------------------------------------------------------------------------------------
# The probes
# --------------------------------------------------------------------------------------



def _renamed(spec: CandidateSpec, suffix: str, **update: Any) -> CandidateSpec:
    return spec.model_copy(update={"name": f"{spec.name}-{suffix}"[:100], **update})


def _on(effective: dict[str, Any] | None, key: str, spec: CandidateSpec) -> bool | None:
    """Whether a boolean engine setting is on for a candidate: its engine_args, else what the
    engine reported applying (its manifest's effective configuration), else unknown (None)."""
    if key in spec.engine_args:
        return bool(spec.engine_args[key])
    if effective and effective.get(key) is not None:
        return bool(effective[key])
    return None


def build_probes(baseline: CandidateSpec, candidate: CandidateSpec, chosen: list[str] | None = None, *,
                 effective: dict[str, Any] | None = None,
                 found: list[Difference] | None = None) -> tuple[list[Probe], list[Skipped]]:
    """The probes to run for ``candidate`` against ``baseline`` (``chosen``: names from
    :data:`KNOWN`; None means :data:`AUTO`), and those that do not apply, with why.

    ``effective``: the candidate run's effective configuration as the engine reported it (its
    manifest), which says whether prefix caching and chunked prefill were on."""
    wanted = list(dict.fromkeys(chosen if chosen is not None else AUTO))
    wanted = [*dict.fromkeys(["reference", "control", *wanted])]  # every probe is read against these
    found = differences(baseline, candidate) if found is None else found
    probes: list[Probe] = []
    skipped: list[Skipped] = []

    for name in wanted:
        if name == "reference":
            probes.append(Probe("reference", None, "the baseline, the drifted prompts batched together",
                                "baseline", "golden", False, baseline=baseline))
        elif name == "control":
            probes.append(Probe("control", None, "the candidate, the same batch as the reference",
                                "candidate", "candidate run", False, candidate=candidate))
        elif name == "rerun":
            probes.append(Probe("rerun", "sampling", "the candidate again, same batch and seeds", "candidate",
                                "control", False, candidate=candidate, detail="run to run"))
        elif name == "alone":
            probes.append(Probe("alone", "scheduling and batching", "each prompt alone (batch of 1), both sides",
                                "both", "each other", True, baseline=baseline, candidate=candidate, layout="alone",
                                detail="batch composition"))
        elif name == "revert" or name.startswith("revert-"):
            groups = GROUPS if name == "revert" else [g for g in GROUPS if f"revert-{g.name}" == name]
            for group in groups:
                what = group_differs(group, baseline, candidate, found)
                if not what:
                    if name != "revert":
                        skipped.append(Skipped(name, group.source, f"the {group.detail} do not differ"))
                    continue
                spec = reverted(group, baseline, candidate)
                probes.append(Probe(f"revert-{group.name}", group.source,
                                    f"the candidate with the baseline's {group.detail} ({', '.join(what[:4])})",
                                    "candidate", "reference", True, candidate=spec, detail=group.detail))
        elif name == "float32":
            if "float32" in (baseline.dtype, candidate.dtype) or "float" in (baseline.dtype, candidate.dtype):
                skipped.append(Skipped(name, "kernels and precision", "a side already runs in float32"))
            elif baseline.quantization or candidate.quantization:
                skipped.append(Skipped(name, "kernels and precision",
                                       "a quantized checkpoint: its kernels fix their own precision"))
            else:
                probes.append(Probe("float32", "kernels and precision", "float32 on both sides", "both", "each other",
                                    True, baseline=_renamed(baseline, "float32", dtype="float32"),
                                    candidate=_renamed(candidate, "float32", dtype="float32"), detail="precision"))
        elif name == "batch-invariant":
            env = {"VLLM_BATCH_INVARIANT": "1"}
            probes.append(Probe("batch-invariant", "scheduling and batching", "vLLM's batch-invariant mode, both sides",
                                "both", "each other", True,
                                baseline=_renamed(baseline, "bi", env={**baseline.env, **env}),
                                candidate=_renamed(candidate, "bi", env={**candidate.env, **env}),
                                detail="batch-invariant kernels"))
        elif name in ("prefix-caching-off", "chunked-prefill-off"):
            key = "enable_prefix_caching" if name == "prefix-caching-off" else "enable_chunked_prefill"
            if candidate.backend != "vllm":
                skipped.append(Skipped(name, "scheduling and batching", f"the {candidate.backend} backend has no {key}"))
            elif _on(effective, key, candidate) is False:
                skipped.append(Skipped(name, "scheduling and batching", f"{key} is already off in the candidate"))
            else:
                probes.append(Probe(name, "scheduling and batching", f"the candidate with {key}=False", "candidate",
                                    "reference", True,
                                    candidate=_renamed(candidate, name, engine_args={**candidate.engine_args, key: False}),
                                    detail=name.replace("-off", "").replace("-", " ")))
        elif name == "concurrency":
            if candidate.backend != "server":
                if chosen is not None:
                    skipped.append(Skipped(name, "scheduling and batching",
                                           "the candidate is not served over HTTP (backend: server)"))
                continue
            from regress.records import ServerSettings

            server = candidate.server or ServerSettings()
            n = 1 if server.concurrency > 1 else 8
            probes.append(Probe("concurrency", "scheduling and batching",
                                f"the candidate with {n} request(s) in flight instead of {server.concurrency}",
                                "candidate", "control", False,
                                candidate=_renamed(candidate, f"c{n}", server=server.model_copy(update={"concurrency": n})),
                                detail="requests in flight"))
        elif name == "eager":
            eager = bool(candidate.engine_args.get("enforce_eager", False))
            probes.append(Probe("eager", "kernels and precision",
                                "the candidate " + ("compiled (torch.compile)" if eager else "eager (no torch.compile)"),
                                "candidate", "reference", True,
                                candidate=_renamed(candidate, "eager", engine_args={**candidate.engine_args,
                                                                                      "enforce_eager": not eager}),
                                detail="compile mode"))
        else:
            raise ValueError(f"unknown probe '{name}'; known: {', '.join(KNOWN)}")
    return probes, skipped


def mitigation(cause: Cause) -> str:
    if cause == "unexplained":
        return "measure the noise floor (noise: arms) and run more probes (--probes eager,batch-invariant)"
    return MITIGATION[cause]
