"""Every message between the orchestrator and the engine process, and how they travel.

Both sides import this module: the orchestrator (:mod:`regress.engine.client`) and the engine
process (:mod:`regress.engine.server`), which runs in the candidate's environment where only
the standard library, numpy and the engine are importable. So this module imports the
standard library only.

A message is one JSON object on one line, stamped with :data:`PROTOCOL_VERSION`. The
orchestrator sends requests on the engine's stdin; the engine answers each with exactly one
reply, preceded by any number of progress events, on its protocol stream::

    orchestrator -> engine                               engine -> orchestrator
    {"op": "load", "spec": {...}, "vocab_out": ...}       {"ok": true, "op": "load", "info": {...}}
    {"op": "shard", "index": 0, "prompts": [...],         {"event": "progress", "index": 0,
     "teacher_force": [...] | null, "out": "...",          "phase": "generate", "done": 3} ...
     "meta": {...}}                                       {"ok": true, "op": "shard", "result": {...}}
    {"op": "memory"}                                      {"ok": true, "op": "memory", "memory": {...}}
    {"op": "vocab", "out": "path/tokens.json"}            {"ok": true, "op": "vocab"}
    {"op": "reset"}                                       {"ok": true, "op": "reset", "reset": true}
    {"op": "exit"}                                        (no reply: the process exits)

A request that fails is answered ``{"ok": false, "op": ..., "error": {"type", "message",
"traceback"}}`` and the engine stays up. Messages are dataclasses; the JSON objects nested in
them (engine facts, prompts, results) are TypedDicts, because they are stored as they came
(``engine-info.json``, Celery results, shard files) and must keep their plain JSON form.

:func:`decode_request` and :func:`decode_reply` check a received message against these
declarations and raise :class:`ProtocolError` naming what is wrong (not JSON, another protocol
version, an unknown op or event, a missing field, a field of the wrong type).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, TypedDict, TypeVar, Union

from regress.errors import ProtocolError  # noqa: F401  (part of this module's interface)

PROTOCOL_VERSION = 1
"""Version of the messages below; both sides must speak the same one."""

PHASES = ("generate", "teacher_force")
"""Counted phases of a shard, as named in progress events."""

INPUT_ERROR = "input"
"""``ErrorDetail.type`` of a request that is wrong for this model (the user's input, exit 2),
as opposed to an engine failure (the exception's class name)."""

PROTOCOL_ERROR = "protocol"
"""``ErrorDetail.type`` of a request the engine process could not decode."""


# --------------------------------------------------------------------------------------
# JSON payloads carried inside messages
# --------------------------------------------------------------------------------------


class _PromptFields(TypedDict):
    id: str
    payload: dict[str, Any]
    """``{"prompt": str}`` or ``{"messages": [...]}`` (``regress.datasets.PromptRecord.payload``)."""
    sampling: dict[str, Any]
    """Every field of ``regress.records.ResolvedSampling``."""


class PromptInput(_PromptFields, total=False):
    """One prompt of a shard, as the engine needs it. ``choices`` and ``answer`` only for a
    multiple-choice prompt (absent otherwise, so older shards' requests are unchanged)."""

    choices: list[str]
    """Continuations, each scored by its log-likelihood after the rendered prompt."""
    answer: int
    """Index of the right choice (recorded with the scores)."""


TeacherForcePair = list[list[int]]
"""``[prompt token ids, completion token ids]`` of one golden output, scored teacher-forced."""


class Hardware(TypedDict):
    """Where the engine runs (``regress.records.Hardware``)."""

    cpu_model: str | None
    cpu_count: int | None
    memory_gib: float | None
    gpus: list[str]
    platform: str


class MemoryUsage(TypedDict):
    """Peak memory of the engine process so far (``regress.records.Memory``)."""

    peak_rss_mib: float | None
    peak_gpu_mib: float | None


class EngineInfo(TypedDict, total=False):
    """What the engine process learned while loading (the load reply; recorded in the manifest).

    The backend's facts (``EngineBackend.load``: resolved_path, revision, dtype, quantization,
    engine_args, and any key of its own) come first; the server adds the rest. ``versions`` are
    the backend's own (``EngineBackend.versions``).
    """

    resolved_path: str | None
    revision: str | None
    dtype: str | None
    quantization: str | None
    engine_args: dict[str, Any]
    snapshot_path: str | None
    amx_permission_requested: bool
    engine_load_s: float
    engine_load_beside_cores: float | None
    versions: dict[str, str | None]
    hardware: Hardware
    memory: MemoryUsage


class ShardSummary(TypedDict):
    """What the engine reports after writing a shard file (the file holds the results)."""

    index: int
    generation_s: float
    teacher_forcing_s: float
    prompt_tokens: int
    output_tokens: int


class ErrorDetail(TypedDict):
    """Why a request failed."""

    type: str
    """:data:`INPUT_ERROR`, :data:`PROTOCOL_ERROR`, or the exception's class name."""
    message: str
    traceback: str


# --------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------


class _Message:
    """Base of every message: its JSON object is a fixed head plus its dataclass fields."""

    def _head(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this message (fields shallow, not copied: shards are large)."""
        data: dict[str, Any] = {"protocol": PROTOCOL_VERSION, **self._head()}
        for f in fields(self):  # type: ignore[arg-type]
            data[f.name] = getattr(self, f.name)
        return data


class _Request(_Message):
    op: ClassVar[str]

    def _head(self) -> dict[str, Any]:
        return {"op": self.op}


class _OkReply(_Message):
    op: ClassVar[str]

    def _head(self) -> dict[str, Any]:
        return {"ok": True, "op": self.op}


@dataclass(frozen=True)
class LoadRequest(_Request):
    """Load the engine for a candidate; with ``vocab_out``, also write its vocabulary there."""

    op: ClassVar[str] = "load"
    spec: dict[str, Any]
    """``regress.records.CandidateSpec.engine_spec``, local paths made absolute."""
    vocab_out: str | None = None


@dataclass(frozen=True)
class ShardRequest(_Request):
    """Run one shard (one batch) and write its result file to ``out``."""

    op: ClassVar[str] = "shard"
    index: int
    prompts: list[PromptInput]
    teacher_force: list[TeacherForcePair | None] | None
    """Per prompt, the golden's tokens to score teacher-forced; None: free-running only."""
    out: str
    meta: dict[str, Any] = field(default_factory=dict)
    """Stamped on the shard file (the plan's fingerprint, the run id)."""
    generate: bool = True
    """False: prefill only (a quick check): no generation and no choices, every prompt's golden
    completion teacher-forced after the prompt as this engine renders it."""


@dataclass(frozen=True)
class MemoryRequest(_Request):
    """Report peak memory so far."""

    op: ClassVar[str] = "memory"


@dataclass(frozen=True)
class VocabRequest(_Request):
    """Write every token id's text to ``out`` (a warm engine serving a new run's directory)."""

    op: ClassVar[str] = "vocab"
    out: str


@dataclass(frozen=True)
class ResetRequest(_Request):
    """Forget what earlier requests left in the engine (vLLM's prefix cache), so that the next run
    on this warm engine computes as a freshly started one would (a noise arm on the golden's engine)."""

    op: ClassVar[str] = "reset"


@dataclass(frozen=True)
class ExitRequest(_Request):
    """Exit; not answered."""

    op: ClassVar[str] = "exit"


@dataclass(frozen=True)
class LoadReply(_OkReply):
    """The engine is loaded; what it learned doing so."""

    op: ClassVar[str] = "load"
    info: EngineInfo


@dataclass(frozen=True)
class ShardReply(_OkReply):
    """The shard's result file is written; its counts and times."""

    op: ClassVar[str] = "shard"
    result: ShardSummary


@dataclass(frozen=True)
class MemoryReply(_OkReply):
    """Peak memory so far."""

    op: ClassVar[str] = "memory"
    memory: MemoryUsage


@dataclass(frozen=True)
class VocabReply(_OkReply):
    """The vocabulary file is written."""

    op: ClassVar[str] = "vocab"


@dataclass(frozen=True)
class ResetReply(_OkReply):
    """What a reset left."""

    op: ClassVar[str] = "reset"
    reset: bool
    """True: nothing earlier requests computed is left for a later one to reuse; False: the engine
    cannot say so (a server regress does not run, a backend without a way to clear its cache)."""


@dataclass(frozen=True)
class ErrorReply(_Message):
    """A request failed; the engine process is still up."""

    op: str | None
    """The failed request's op (None: the request could not be decoded)."""
    error: ErrorDetail

    def _head(self) -> dict[str, Any]:
        return {"ok": False}


@dataclass(frozen=True)
class ProgressEvent(_Message):
    """``done`` more prompts of shard ``index`` finished ``phase`` (sent while a shard runs)."""

    index: int
    phase: str
    done: int

    def _head(self) -> dict[str, Any]:
        return {"event": "progress"}


Request = Union[LoadRequest, ShardRequest, MemoryRequest, VocabRequest, ResetRequest, ExitRequest]
Reply = Union[LoadReply, ShardReply, MemoryReply, VocabReply, ResetReply, ErrorReply]
EngineMessage = Union[Reply, ProgressEvent]
"""What the engine process sends."""


def encode(message: _Message) -> bytes:
    """One message as one JSON line."""
    # default=str: a backend's extra load facts may hold values JSON lacks (a dtype object);
    # their text is what the manifest would show anyway.
    return (json.dumps(message.to_dict(), default=str) + "\n").encode("utf-8")


# --------------------------------------------------------------------------------------
# Decoding and validation
# --------------------------------------------------------------------------------------

Check = Callable[[Any], bool]
T = TypeVar("T")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_str(v: Any) -> bool:
    # A lone surrogate (JSON's "\ud800") is a str Python cannot encode: it would fail later, far
    # from here, when the manifest or a log is written.
    return isinstance(v, str) and _SURROGATE.search(v) is None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_count(v: Any) -> bool:
    """An index, a token count, a number of prompts done: never negative."""
    return _is_int(v) and v >= 0


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_amount(v: Any) -> bool:
    """Seconds or MiB: a finite number, not negative (json reads NaN, Infinity and 1e400 as floats)."""
    return _is_number(v) and math.isfinite(v) and v >= 0


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_dict(v: Any) -> bool:
    return isinstance(v, dict)


def _optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _is_pair(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and _is_token_ids(v[0]) and _is_token_ids(v[1])


def _is_versions(v: Any) -> bool:
    return isinstance(v, dict) and all(_is_str(k) and (x is None or _is_str(x)) for k, x in v.items())


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


class _Fields:
    """Reads the fields of one received JSON object, naming the first one that is wrong."""

    def __init__(self, data: Any, what: str):
        if not isinstance(data, dict):
            raise ProtocolError(f"{what}: expected a JSON object, got {_describe(data)}")
        self.data: dict[str, Any] = data
        self.what = what

    def get(self, name: str, check: Check, expected: str, *, optional: bool = False) -> Any:
        if name not in self.data:
            if optional:
                return None
            raise ProtocolError(f"{self.what}: field '{name}' is missing")
        value = self.data[name]
        if not check(value):
            raise ProtocolError(f"{self.what}: field '{name}' must be {expected}, got {_describe(value)}")
        return value

    def only(self, allowed: tuple[str, ...]) -> None:
        unknown = sorted(set(self.data) - set(allowed))
        if unknown:
            raise ProtocolError(f"{self.what}: unknown field(s) {', '.join(unknown)}; known: {', '.join(allowed)}")


def _parse(line: bytes | str, what: str) -> Any:
    try:
        data = json.loads(line)
    except RecursionError:  # "[[[[..." nested past the interpreter's stack: no message of ours
        raise ProtocolError(f"{what} is nested too deeply to be a message of this protocol") from None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        shown = text.strip()[:80]
        raise ProtocolError(f"{what} is not JSON ({exc}): {shown!r}") from None
    return data


def _check_version(f: _Fields) -> None:
    if "protocol" not in f.data:
        raise ProtocolError(f"{f.what}: no 'protocol' version field in {_describe(f.data)}")
    version = f.data["protocol"]
    if type(version) is not int or version != PROTOCOL_VERSION:  # true and 1.0 equal 1 in Python
        raise ProtocolError(f"{f.what}: protocol version {version!r}; this side speaks {PROTOCOL_VERSION} "
                            "(are both sides the same regress?)")


def _prompts(value: Any, what: str) -> list[PromptInput]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what}: field 'prompts' must be a list, got {_describe(value)}")
    for i, item in enumerate(value):
        f = _Fields(item, f"{what}, prompts[{i}]")
        f.get("id", _is_str, "a string")
        f.get("payload", _is_dict, "an object")
        f.get("sampling", _is_dict, "an object")
        choices = f.get("choices", _list_of(lambda c: isinstance(c, str) and bool(c)), "a list of non-empty strings",
                        optional=True)
        answer = f.get("answer", _is_int, "an integer", optional=True)
        if (choices is None) != (answer is None):
            raise ProtocolError(f"{f.what}: 'choices' and 'answer' come together")
        if choices is not None and not (len(choices) >= 2 and 0 <= answer < len(choices)):
            raise ProtocolError(f"{f.what}: 'answer' {answer} does not index {len(choices)} choices (at least 2)")
    return value


def _load_request(f: _Fields) -> LoadRequest:
    spec = f.get("spec", _is_dict, "an object")
    specs = _Fields(spec, f"{f.what}, spec")
    specs.get("backend", _is_str, "a string")
    specs.get("model", _is_str, "a string")
    return LoadRequest(spec=spec, vocab_out=f.get("vocab_out", _optional(_is_str), "a path or null", optional=True))


def _shard_request(f: _Fields) -> ShardRequest:
    prompts = _prompts(f.get("prompts", lambda v: True, "a list"), f.what)
    forced = f.get("teacher_force", _optional(_list_of(_optional(_is_pair))),
                   "null or a list of [prompt ids, completion ids] (or null) per prompt")
    if forced is not None and len(forced) != len(prompts):
        raise ProtocolError(f"{f.what}: field 'teacher_force' has {len(forced)} entries for {len(prompts)} prompts")
    return ShardRequest(
        index=f.get("index", _is_int, "an integer"),
        prompts=prompts,
        teacher_force=forced,
        out=f.get("out", _is_str, "a path"),
        meta=f.get("meta", _is_dict, "an object", optional=True) or {},
        generate=_generate_flag(f, forced),
    )


def _generate_flag(f: _Fields, forced: Any) -> bool:
    """A shard's ``generate`` (absent: true); a prefill-only shard without golden tokens would do nothing."""
    value = f.get("generate", _is_bool, "true or false", optional=True)
    if value is False and forced is None:
        raise ProtocolError(f"{f.what}: a shard with 'generate': false needs 'teacher_force'")
    return value is not False


_REQUESTS: dict[str, Callable[[_Fields], Request]] = {
    "load": _load_request,
    "shard": _shard_request,
    "memory": lambda f: MemoryRequest(),
    "vocab": lambda f: VocabRequest(out=f.get("out", _is_str, "a path")),
    "reset": lambda f: ResetRequest(),
    "exit": lambda f: ExitRequest(),
}


def request_from_dict(data: Any, what: str = "request") -> Request:
    """A request from its JSON object (as sent, or carried in a Celery task), checked."""
    f = _Fields(data, what)
    _check_version(f)
    op = f.get("op", _is_str, "a string")
    build = _REQUESTS.get(op)
    if build is None:
        raise ProtocolError(f"{what}: unknown op {op!r}; known: {', '.join(_REQUESTS)}")
    f.what = f"{op} request"
    return build(f)


def decode_request(line: bytes | str) -> Request:
    """The request on one received line, checked."""
    return request_from_dict(_parse(line, "the request"))


def _hardware(value: Any, what: str) -> Hardware:
    f = _Fields(value, what)
    f.only(tuple(Hardware.__annotations__))
    f.get("platform", _is_str, "a string")
    f.get("cpu_model", _optional(_is_str), "a string or null", optional=True)
    f.get("cpu_count", _optional(_is_int), "an integer or null", optional=True)
    f.get("memory_gib", _optional(_is_amount), "a finite number >= 0 or null", optional=True)
    f.get("gpus", _list_of(_is_str), "a list of strings", optional=True)
    return value


def _memory(value: Any, what: str) -> MemoryUsage:
    f = _Fields(value, what)
    f.only(tuple(MemoryUsage.__annotations__))
    for name in MemoryUsage.__annotations__:
        f.get(name, _optional(_is_amount), "a finite number >= 0 or null", optional=True)
    return value


def _engine_info(value: Any, what: str) -> EngineInfo:
    f = _Fields(value, what)
    f.get("versions", _is_versions, "an object of package -> version (or null)")
    f.get("engine_load_s", _is_amount, "a finite number >= 0")
    f.get("engine_load_beside_cores", _optional(_is_amount), "a finite number >= 0 or null", optional=True)
    _hardware(f.get("hardware", _is_dict, "an object"), f"{what}, hardware")
    _memory(f.get("memory", _is_dict, "an object"), f"{what}, memory")
    for name in ("resolved_path", "revision", "dtype", "quantization", "snapshot_path"):
        f.get(name, _optional(_is_str), "a string or null", optional=True)
    f.get("engine_args", _is_dict, "an object", optional=True)
    f.get("amx_permission_requested", _is_bool, "true or false", optional=True)
    return value


def checked_engine_info(value: Any, what: str) -> EngineInfo:
    """``value`` if it is an engine's facts as a load reply carries them (a worker's reply holds
    them too); else a ProtocolError naming the field."""
    return _engine_info(value, what)


def checked_memory(value: Any, what: str) -> MemoryUsage:
    """``value`` if it is a memory record of this protocol; else a ProtocolError naming the field."""
    return _memory(value, what)


def _shard_summary(value: Any, what: str) -> ShardSummary:
    f = _Fields(value, what)
    for name in ShardSummary.__annotations__:
        if name.endswith("_s"):
            f.get(name, _is_amount, "a finite number >= 0")
        else:
            f.get(name, _is_count, "an integer >= 0")
    return value


def _error_detail(value: Any, what: str) -> ErrorDetail:
    f = _Fields(value, what)
    for name in ("type", "message", "traceback"):
        f.get(name, _is_str, "a string")
    return value


_REPLIES: dict[str, Callable[[_Fields], Reply]] = {
    "load": lambda f: LoadReply(info=_engine_info(f.get("info", _is_dict, "an object"), f"{f.what}, info")),
    "shard": lambda f: ShardReply(result=_shard_summary(f.get("result", _is_dict, "an object"), f"{f.what}, result")),
    "memory": lambda f: MemoryReply(memory=_memory(f.get("memory", _is_dict, "an object"), f"{f.what}, memory")),
    "vocab": lambda f: VocabReply(),
    "reset": lambda f: ResetReply(reset=f.get("reset", _is_bool, "true or false")),
}


def reply_from_dict(data: Any, what: str = "reply") -> EngineMessage:
    """A reply or progress event from its JSON object, checked."""
    f = _Fields(data, what)
    _check_version(f)
    if "event" in f.data:
        event = f.get("event", _is_str, "a string")
        if event != "progress":
            raise ProtocolError(f"{what}: unknown event {event!r}; known: progress")
        f.what = "progress event"
        phase = f.get("phase", _is_str, "a string")
        if phase not in PHASES:
            raise ProtocolError(f"progress event: unknown phase {phase!r}; known: {', '.join(PHASES)}")
        return ProgressEvent(index=f.get("index", _is_count, "an integer >= 0"), phase=phase,
                             done=f.get("done", _is_count, "an integer >= 0"))
    ok = f.get("ok", _is_bool, "true or false")
    if not ok:
        f.what = "error reply"
        return ErrorReply(op=f.get("op", _optional(_is_str), "a string or null", optional=True),
                          error=_error_detail(f.get("error", _is_dict, "an object"), "error reply, error"))
    op = f.get("op", _is_str, "a string")
    build = _REPLIES.get(op)
    if build is None:
        raise ProtocolError(f"{what}: unknown op {op!r}; known: {', '.join(_REPLIES)}")
    f.what = f"{op} reply"
    return build(f)


def decode_reply(line: bytes | str) -> EngineMessage:
    """The reply or progress event on one line the engine process sent, checked."""
    return reply_from_dict(_parse(line, "the engine's message"), "the engine's message")
