"""A candidate's effective configuration, and what differs between two (``regress diff``).

The configuration is read without starting an engine; the differences between two candidates
are those that can change outputs.

Drift has four sources (the field guide this project grew from): the input (tokenizer, chat
template, special tokens, and the defaults a model ships in ``generation_config.json`` that an
engine applies to what a request leaves unset), scheduling and batching, kernels and precision,
and sampling randomness; beyond them, the model itself (weights, quantization). Every setting
read here is filed under the source it belongs to, so a difference says where to look before
anything runs. What only an engine knows (the token ids it renders, the sampling it applied) is
in each run's manifest and the report's configuration table.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from regress.errors import ConfigError
from regress.records import CandidateSpec
from regress.storage import sha256_file

Source = Literal["input", "input defaults", "scheduling and batching", "kernels and precision", "sampling", "model",
                 "engine"]
SOURCES: tuple[Source, ...] = ("input", "input defaults", "scheduling and batching", "kernels and precision",
                               "sampling", "model", "engine")

WHY: dict[Source, str] = {
    "input": "the prompt's token ids can change: tokenization, chat template or special tokens",
    "input defaults": "an engine applies a model's generation_config defaults to what a request leaves unset",
    "scheduling and batching": "a request can compute differently with what it is batched with",
    "kernels and precision": "other kernels or dtypes round differently (near-ties flip)",
    "sampling": "another sampler or seed draws other tokens",
    "model": "other weights: every output may change",
    "engine": "another engine build or setting",
}
MITIGATION: dict[Source, str] = {
    "input": "pin the tokenizer and chat template (chat_template:) and check the prompt token ids",
    "input defaults": "pin the generation defaults on both sides (generation_config, the server's --generation-config), "
                      "or set the field in the prompt set; server.sampling_fields: all sends every field explicitly",
    "scheduling and batching": "fixed batch sizes, batch-invariant kernels (VLLM_BATCH_INVARIANT=1), or measure the noise floor",
    "kernels and precision": "higher precision for checks (float32), the same KV-cache dtype, eager vs compiled on both sides",
    "sampling": "explicit sampling parameters and seeds",
    "model": "expected for a quantization: judge it by the teacher-forced measures",
    "engine": "pin the engine version",
}

# Engine arguments by the source of drift they touch; the rest are "engine".
ENGINE_ARG_SOURCES: dict[str, Source] = {
    "kv_cache_dtype": "kernels and precision", "enforce_eager": "kernels and precision",
    "compilation_config": "kernels and precision", "calculate_kv_scales": "kernels and precision",
    "enable_prefix_caching": "scheduling and batching", "enable_chunked_prefill": "scheduling and batching",
    "max_num_seqs": "scheduling and batching", "max_num_batched_tokens": "scheduling and batching",
    "async_scheduling": "scheduling and batching",
    "max_model_len": "input", "tokenizer_mode": "input", "skip_tokenizer_init": "input",
    "generation_config": "input defaults", "override_generation_config": "input defaults",
    "seed": "sampling",
}
ENV_SOURCES: dict[str, Source] = {"VLLM_BATCH_INVARIANT": "scheduling and batching"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "special_tokens_map.json")
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens")
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "max_new_tokens", "do_sample", "eos_token_id", "bos_token_id", "pad_token_id")
MODEL_CONFIG_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                     "tie_word_embeddings", "rope_theta", "rope_scaling")


GENERATION_CONFIG_FILE = "generation_config.json"
NO_MODEL_DEFAULTS = "vllm"
"""``generation_config`` value meaning: no model defaults (regress's built-in ones)."""
MODEL_DEFAULTS = "auto"
"""``generation_config`` value meaning: the model directory's own generation_config.json."""
GENERATION_SAMPLING_KEYS: dict[str, str] = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens",
}
"""generation_config.json keys regress applies, and the sampling field each fills."""
_SAMPLER_KEYS = ("temperature", "top_p", "top_k")
SERVER_GENERATION_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                          "top_p", "min_p", "max_new_tokens")
"""generation_config.json keys vLLM's server applies to the fields a request leaves unset
(``ModelConfig.get_diff_sampling_param``; ``max_new_tokens`` as ``max_tokens``)."""
LEARNT_AT_RUN = "learnt when it runs (the run's manifest: server defaults)"


def generation_config_dir(spec: CandidateSpec) -> Path | None:
    """The directory whose generation_config.json a candidate's ``generation_config`` names (None
    for ``vllm``). Raises :class:`ConfigError` naming the candidate and field when it is not a
    local directory (a hub id: regress reads only local files)."""
    setting = spec.generation_config
    if setting == NO_MODEL_DEFAULTS:
        return None
    if setting == MODEL_DEFAULTS:
        directory, what = spec.model, f"its model '{spec.model}'"
    else:
        directory, what = setting, f"'{setting}'"
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"candidate '{spec.name}': generation_config {setting!r} needs a local directory, and {what} is not "
            f"one (a hub id, or a directory that does not exist); use 'vllm' (no model defaults), 'auto' with a "
            f"local model directory, or the path of a directory holding {GENERATION_CONFIG_FILE}",
            field="generation_config")
    return path


def generation_defaults(spec: CandidateSpec) -> dict[str, Any]:
    """The sampling defaults a candidate's ``generation_config`` supplies, as sampling fields
    (``max_new_tokens`` becomes ``max_tokens``); empty for ``vllm`` and, as in vLLM, for ``auto``
    with a model that has no generation_config.json. Keys regress has no field for are ignored,
    and with ``do_sample: false`` the sampler keys (temperature, top_p, top_k) are too, since
    transformers would not sample (vLLM applies them regardless: the one place regress differs)."""
    directory = generation_config_dir(spec)
    if directory is None:
        return {}
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        if spec.generation_config == MODEL_DEFAULTS:
            return {}
        raise ConfigError(f"candidate '{spec.name}': no {GENERATION_CONFIG_FILE} in {directory}",
                          field="generation_config")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"candidate '{spec.name}': cannot read {path}: {exc}", field="generation_config") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"candidate '{spec.name}': {path} is not a JSON object", field="generation_config")
    skip = _SAMPLER_KEYS if data.get("do_sample") is False else ()
    return {field: data[key] for key, field in GENERATION_SAMPLING_KEYS.items()
            if data.get(key) is not None and key not in skip}


def server_defaults(spec: CandidateSpec) -> dict[str, Any] | str:
    """The defaults a server regress starts for ``spec`` will apply to fields a request leaves
    unset, as vLLM computes them: the ``generation_config`` engine argument (vLLM's default
    ``auto``: the model directory's file; ``vllm``: none; else a directory), then
    ``override_generation_config`` over it. A server at ``url`` (or a file regress cannot read
    here) is known only when it runs: :data:`LEARNT_AT_RUN`."""
    if spec.server is not None and spec.server.url:
        return LEARNT_AT_RUN
    source = spec.engine_args.get("generation_config", MODEL_DEFAULTS)
    found: dict[str, Any] = {}
    if source != NO_MODEL_DEFAULTS:
        directory = _local(spec.model if source == MODEL_DEFAULTS else str(source))
        if directory is None:
            return LEARNT_AT_RUN
        found = _json(directory / GENERATION_CONFIG_FILE)
    overrides = spec.engine_args.get("override_generation_config")
    if isinstance(overrides, dict):
        found = {**found, **overrides}
    out = {("max_tokens" if k == "max_new_tokens" else k): found[k] for k in SERVER_GENERATION_KEYS
           if found.get(k) is not None}
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Fact:
    """One setting of a candidate as it takes effect, filed under a source of drift."""

    source: Source
    name: str
    value: str
    """Shown form (JSON for structures, ``-`` when not set)."""


@dataclass(frozen=True)
class Difference:
    """A setting that differs between two candidates."""

    source: Source
    name: str
    baseline: str
    candidate: str

    @property
    def why(self) -> str:
        return WHY[self.source]

    @property
    def mitigation(self) -> str:
        return MITIGATION[self.source]

    def row(self) -> dict[str, str]:
        """As ``regress diff --json`` and diagnosis.json list it."""
        return {"source": self.source, "setting": self.name, "baseline": self.baseline, "candidate": self.candidate}


UNSET = "-"


def _shown(value: Any) -> str:
    if value is None:
        return UNSET
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _sha(path: Path) -> str | None:
    """A file's sha256, shortened for display (None if unreadable)."""
    try:
        return sha256_file(path)[0][:16]
    except OSError:
        return None


def chat_template(spec: CandidateSpec, model_dir: Path | None) -> str | None:
    """The chat template a candidate renders ``messages`` with: its own ``chat_template`` file, else
    the model's ``chat_template.jinja``, else ``tokenizer_config.json``'s."""
    if spec.chat_template:
        try:
            return Path(spec.chat_template).read_text(encoding="utf-8")
        except OSError:
            return None
    if model_dir is None:
        return None
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = _json(model_dir / "tokenizer_config.json").get("chat_template")
    return value if isinstance(value, str) else (_shown(value) if value else None)


def _local(path: str | None) -> Path | None:
    if not path:
        return None
    p = Path(path)
    return p if p.is_dir() else None


def effective_config(spec: CandidateSpec, defaults: dict[str, Any] | None = None) -> list[Fact]:
    """What a candidate will run with, read from params and its model and tokenizer directories
    (a hub id that is not a local directory gives what params say only). ``defaults``: its
    :func:`generation_defaults` when the caller has read them (None: read here)."""
    facts: list[Fact] = []

    def add(source: Source, name: str, value: Any) -> None:
        facts.append(Fact(source, name, _shown(value)))

    add("engine", "package", spec.package)
    add("engine", "backend", spec.backend)
    if spec.backend == "server":
        # Requests in flight together are batched together by the server's scheduler.
        settings = spec.server
        add("scheduling and batching", "server.concurrency", settings.concurrency if settings else 1)
        add("engine", "server.url", (settings.url if settings else None) or "started by regress")
        # What a request leaves unset, the server fills in: what it will fill in, where it is
        # known or unknown (left out when none, as for every other backend).
        filled = server_defaults(spec)
        if filled:
            add("input defaults", "server defaults", filled)
    # Which sampling fields go out: every one (offline, hf, server's ``all``) or a client's.
    add("input defaults", "sampling fields sent",
        spec.server.sampling_fields if spec.backend == "server" and spec.server else
        "client" if spec.backend == "server" else "all")
    for key, value in sorted(spec.env.items()):
        add(ENV_SOURCES.get(key, "engine"), f"env {key}", value)
    for key, value in sorted(spec.engine_args.items()):
        add(ENGINE_ARG_SOURCES.get(key, "engine"), f"engine_args.{key}", value)
    add("kernels and precision", "dtype", spec.dtype)
    add("model", "quantization", spec.quantization)
    add("model", "model", spec.model)
    add("model", "revision", spec.revision)
    for key, value in sorted(spec.sampling.set_fields().items()):
        add("sampling", f"sampling.{key}", value)
    add("input defaults", "generation_config", spec.generation_config)
    try:
        applied: Any = (generation_defaults(spec) if defaults is None else defaults) or "none"
    except ConfigError as exc:
        applied = f"unreadable: {exc.message}"
    add("input defaults", "model defaults applied", applied)

    model_dir = _local(spec.model)
    tokenizer_dir = _local(spec.tokenizer) or model_dir
    if model_dir is not None:
        weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
        add("model", "weights sha256", {p.name: _sha(p) for p in weights} or None)
        config = _json(model_dir / "config.json")
        for key in MODEL_CONFIG_KEYS:
            if key in config:
                add("model", f"config.{key}", config[key])
        add("model", "config.quantization_config", config.get("quantization_config"))
        add("kernels and precision", "config.torch_dtype", config.get("torch_dtype", config.get("dtype")))
        add("input", "config.max_position_embeddings", config.get("max_position_embeddings"))
        generation = _json(model_dir / "generation_config.json")
        for key in GENERATION_KEYS:
            add("input defaults", f"generation_config.{key}", generation.get(key))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                add("input", f"tokenizer file {name}", _sha(tokenizer_dir / name))
        tokenizer_config = _json(tokenizer_dir / "tokenizer_config.json")
        special_map = _json(tokenizer_dir / "special_tokens_map.json")
        for key in SPECIAL_TOKENS:
            add("input", f"special token {key}", tokenizer_config.get(key, special_map.get(key)))
        add("input", "tokenizer_config.model_max_length", tokenizer_config.get("model_max_length"))
        add("input", "tokenizer_config.add_bos_token", tokenizer_config.get("add_bos_token"))
    template = chat_template(spec, model_dir)
    add("input", "chat template sha256",
        hashlib.sha256(template.encode("utf-8")).hexdigest()[:16] if template is not None else None)
    return facts


def differences(baseline: CandidateSpec, candidate: CandidateSpec, *,
                candidate_defaults: dict[str, Any] | None = None) -> list[Difference]:
    """Every setting whose effective value differs, ordered by source (input first) then name.
    ``candidate_defaults``: the candidate's :func:`generation_defaults`, when read already."""
    a = {(f.source, f.name): f.value for f in effective_config(baseline)}
    b = {(f.source, f.name): f.value for f in effective_config(candidate, candidate_defaults)}
    out = [Difference(source, name, a.get((source, name), UNSET), b.get((source, name), UNSET))
           for source, name in set(a) | set(b) if a.get((source, name), UNSET) != b.get((source, name), UNSET)]
    return sorted(out, key=lambda d: (SOURCES.index(d.source), d.name))


def template_lines(baseline: CandidateSpec, candidate: CandidateSpec) -> tuple[int, str, str] | None:
    """Where two chat templates first differ: (line number, baseline's line, candidate's line)."""
    a, b = chat_template(baseline, _local(baseline.model)), chat_template(candidate, _local(candidate.model))
    if a is None or b is None or a == b:
        return None
    la, lb = a.splitlines(keepends=True), b.splitlines(keepends=True)  # a newline is a difference too
    for i in range(max(len(la), len(lb))):
        x, y = (la[i] if i < len(la) else ""), (lb[i] if i < len(lb) else "")
        if x != y:
            return i + 1, x, y
    return None
