"""The engine process: ``python -m regress.engine.server``.

It is run with a candidate environment's interpreter.

This is the thin, dependency-light entry point of regress that candidate environments need:
standard library, numpy, and the engine the environment holds. It loads one engine and keeps
it warm while the orchestrator feeds it shards, one request per line on stdin
(:mod:`regress.engine.protocol` declares every message). Replies and progress events go back
on the file descriptor that was stdout at start; fd 1 itself is pointed at stderr so that
anything a library prints cannot corrupt the protocol.

A failed request is answered with an error reply and the process stays up; a dead process is
noticed by the orchestrator as end of stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from typing import IO, Any, Iterator

import numpy as np

from regress.backends import get_backend_class
from regress.backends.base import (
    ChatTemplateMissing,
    MAX_SAMPLING_APPLIED,
    EngineBackend,
    GenerationRequest,
    LogprobRows,
    RawGeneration,
    sampling_key,
)
from regress.engine import facts
from regress.engine.choices import score_choices
from regress.engine.protocol import (
    INPUT_ERROR,
    PROTOCOL_ERROR,
    EngineInfo,
    ErrorDetail,
    ErrorReply,
    ExitRequest,
    LoadReply,
    LoadRequest,
    MemoryReply,
    MemoryRequest,
    ProgressEvent,
    ProtocolError,
    Reply,
    Request,
    ResetReply,
    ResetRequest,
    ShardReply,
    ShardRequest,
    VocabReply,
    VocabRequest,
    decode_request,
    encode,
)
from regress.engine.vocabulary import vocabulary
from regress.errors import InputError, ServerReplyError
from regress.records.generation import NOT_GENERATED
from regress.storage import atomic_write_text, ragged, write_shard

_PROGRESS_INTERVAL_S = 0.25


class _Channel:
    """The protocol stream back to the orchestrator."""

    def __init__(self, out: IO[bytes]):
        self._out = out

    def send(self, message: Reply | ProgressEvent) -> None:
        self._out.write(encode(message))
        self._out.flush()


class _ThrottledProgress:
    """Counts finished prompts of one phase and sends them as progress events, at most one per
    interval: vLLM advances its bar per request, and a line per prompt would swamp the pipe."""

    def __init__(self, channel: _Channel, index: int, phase: str):
        self.channel, self.index, self.phase = channel, index, phase
        self._pending = 0
        self._last = 0.0

    def __call__(self, n: int) -> None:
        self._pending += n
        now = time.monotonic()
        if now - self._last >= _PROGRESS_INTERVAL_S:
            self._send()
            self._last = now

    def flush(self) -> None:
        """Send what is still counted (at the end of the phase)."""
        if self._pending:
            self._send()

    def _send(self) -> None:
        self.channel.send(ProgressEvent(index=self.index, phase=self.phase, done=self._pending))
        self._pending = 0


def _pad(rows: LogprobRows, k: int) -> LogprobRows:
    have = rows.top_ids.shape[1]
    if have == k:
        return rows
    n = rows.top_ids.shape[0]
    ids = np.full((n, k), -1, np.int32)
    lps = np.full((n, k), -np.inf, np.float32)
    ids[:, :have] = rows.top_ids
    lps[:, :have] = rows.top_logprobs
    return LogprobRows(rows.token_logprobs, ids, lps)


def _stack(rows: list[LogprobRows], k: int, prefix: str) -> dict[str, np.ndarray]:
    padded = [_pad(r, k) for r in rows]
    if padded:
        token_lp = np.concatenate([r.token_logprobs for r in padded]).astype(np.float32)
        top_ids = np.concatenate([r.top_ids for r in padded]).astype(np.int32)
        top_lp = np.concatenate([r.top_logprobs for r in padded]).astype(np.float32)
    else:
        token_lp, top_ids, top_lp = np.zeros(0, np.float32), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
    return {f"{prefix}token_logprobs": token_lp, f"{prefix}top_ids": top_ids, f"{prefix}top_logprobs": top_lp}


class EngineServer:
    """Holds one warm engine and serves the orchestrator's requests."""

    def __init__(self, channel: _Channel | None):
        self.channel = channel
        self.backend: EngineBackend | None = None
        self.chat_template: str | None = None

    def handle(self, request: Request) -> Reply:
        """Carry out one request (not ``exit``); raises on failure."""
        if isinstance(request, LoadRequest):
            reply = self.load(request.spec)
            if request.vocab_out:
                self.write_vocabulary(request.vocab_out)
            return reply
        if isinstance(request, ShardRequest):
            return self.shard(request)
        if isinstance(request, MemoryRequest):
            return MemoryReply(memory=facts.memory())
        if isinstance(request, VocabRequest):
            # A warm engine serving a new run (a Celery worker) writes the vocabulary there too.
            self.write_vocabulary(request.out)
            return VocabReply()
        if isinstance(request, ResetRequest):
            if self.backend is None:
                raise RuntimeError("no engine loaded")
            return ResetReply(reset=bool(self.backend.reset_cache()))
        raise ProtocolError(f"no handler for op {request.op!r}")

    def load(self, spec: dict[str, Any]) -> LoadReply:
        started = time.perf_counter()
        clock = facts.cpu_seconds()
        amx = facts.request_amx_permission()
        backend = get_backend_class(spec["backend"])(spec)
        loaded = backend.load()
        self.backend = backend
        if spec.get("chat_template"):
            with open(spec["chat_template"], encoding="utf-8") as fh:
                self.chat_template = fh.read()
        load_s = time.perf_counter() - started
        info: EngineInfo = {
            **loaded,  # type: ignore[typeddict-item]
            "snapshot_path": facts.resolve_hub_snapshot(spec["model"], spec.get("revision")),
            "amx_permission_requested": amx,
            "engine_load_s": load_s,
            # What else ran during the load (another engine starting, a pip build): the report
            # compares two loads only where this is about the same (regress.latency).
            "engine_load_beside_cores": facts.cores_beside(clock, facts.cpu_seconds(), load_s),
            "versions": backend.versions(),
            "hardware": facts.hardware(),
            "memory": facts.memory(),
        }
        return LoadReply(info=info)

    def write_vocabulary(self, path: str) -> None:
        """Every token id's text, so reports can show tokens without loading a tokenizer."""
        assert self.backend is not None
        try:
            data = vocabulary(self.backend.get_tokenizer())
        except Exception as exc:  # a tokenizer without these only costs the report its token texts
            print(f"regress: token texts not recorded: {exc}", file=sys.stderr)
            return
        atomic_write_text(path, json.dumps(data, ensure_ascii=False))

    def _progress(self, index: int, phase: str) -> _ThrottledProgress:
        assert self.channel is not None
        return _ThrottledProgress(self.channel, index, phase)

    def shard(self, request: ShardRequest) -> ShardReply:
        if self.backend is None:
            raise RuntimeError("no engine loaded")
        index = request.index
        prompts = request.prompts
        rendered: list[list[int]] = []
        for prompt in prompts:
            try:
                rendered.append(self.backend.render(prompt["payload"], self.chat_template))
            except ChatTemplateMissing as exc:
                raise ChatTemplateMissing(f"prompt '{prompt['id']}': {exc}") from exc
        requests = [GenerationRequest(ids, p["sampling"]) for ids, p in zip(rendered, prompts)]
        k = max(p["sampling"]["logprobs"] for p in prompts)

        progress = self._progress(index, "generate")
        load_before, cpu_before, clock = _load_avg(), time.process_time(), facts.cpu_seconds()
        started = time.perf_counter()
        if request.generate:
            with _naming(prompts, "generation"):
                outputs = self.backend.generate(requests, progress)
        else:  # prefill only (a quick check): the golden's completions are all there is to score
            outputs = [RawGeneration([], "", NOT_GENERATED, LogprobRows.empty(k)) for _ in prompts]
        generation_s = time.perf_counter() - started
        # What the engine had of the machine while it generated: its own CPU time (every thread),
        # the cores busy beside it and the load average, so that two runs' speeds are compared
        # only when comparable (the load average lags a minute: an engine that finished loading
        # beside this one still weighs on it).
        generation_cpu_s, load_after = time.process_time() - cpu_before, _load_avg()
        # (A prefill-only shard generated nothing: no time to measure the machine over.)
        beside = facts.cores_beside(clock, facts.cpu_seconds(), generation_s) if request.generate else None
        progress.flush()
        # Where the backend built the prompt itself (a server's chat template), its ids are the input.
        used = [list(o.prompt_token_ids) if getattr(o, "prompt_token_ids", None) is not None else None
                for o in outputs]
        rendered = [u if u is not None else r for u, r in zip(used, rendered)]

        prompt_tokens, prompt_offsets = ragged(rendered, np.int32)
        output_tokens, output_offsets = ragged([o.output_token_ids for o in outputs], np.int32)
        arrays = {
            "prompt_tokens": prompt_tokens,
            "prompt_offsets": prompt_offsets,
            "output_tokens": output_tokens,
            "output_offsets": output_offsets,
            **_stack([o.logprobs for o in outputs], k, "out_"),
        }
        teacher_forcing_s = 0.0
        cut: list[dict[str, int] | None] | None = None
        reused: list[bool] = []
        forced = request.teacher_force
        if forced is not None:
            # The golden's completion after the prompt the engine actually used (the golden's own
            # prompt ids unless the backend built the prompt itself); prefill only, after the
            # prompt as this engine renders it, so that a changed tokenizer or template shows.
            heads = used if request.generate else rendered
            sequences = [((h if h is not None else pair[0]), pair[1]) if pair else ([], [])
                         for h, pair in zip(heads, forced)]
            # A prompt whose context and output are the golden's already holds its teacher-forced
            # measures: the free run scored the golden's tokens after the golden's prompt (decode
            # against decode, the fairer comparison). Only the rest are prefilled again.
            reused = [bool(pair) and list(ids) == list(pair[0]) and list(o.output_token_ids) == list(pair[1])
                      for ids, o, pair in zip(rendered, outputs, forced)]
            todo = [i for i, same in enumerate(reused) if not same]
            progress = self._progress(index, "teacher_force")
            if len(todo) < len(reused):
                progress(len(reused) - len(todo))
            started = time.perf_counter()
            with _naming([prompts[i] for i in todo], "teacher forcing"):
                scored = self.backend.teacher_force([sequences[i] for i in todo], k, progress) if todo else []
            teacher_forcing_s = time.perf_counter() - started
            progress.flush()
            by_index = dict(zip(todo, scored))
            rows = [by_index[i] if i in by_index else outputs[i].logprobs for i in range(len(prompts))]
            tf_tokens, tf_offsets = ragged([s[1][: len(r.token_logprobs)] for s, r in zip(sequences, rows)], np.int32)
            arrays.update(tf_tokens=tf_tokens, tf_offsets=tf_offsets, **_stack(rows, k, "tf_"))
            cut = _teacher_force_cut(sequences, rows)
        # Every run scores the choices (a golden too, which teacher-forces nothing else), after the
        # prompt ids the generation used.
        choice_arrays, choice_meta = score_choices(self.backend, prompts if request.generate else [], rendered)
        arrays.update(choice_arrays)
        applied, truncated = self._sampling_applied(prompts)
        meta = {
            **({"sampling_applied": applied, "sampling_applied_truncated": truncated} if applied else {}),
            **request.meta,
            "shard_index": index,
            "prompt_ids": [p["id"] for p in prompts],
            "texts": [o.text for o in outputs],
            "finish_reasons": [o.finish_reason for o in outputs],
            "sampling": [p["sampling"] for p in prompts],
            "top_k": k,
            "teacher_forced": forced is not None,
            **({} if request.generate else {"prefill_only": True}),
            **({"teacher_force_reused": reused} if forced is not None else {}),
            **({"teacher_force_cut": cut} if cut is not None else {}),
            "generation_s": generation_s,
            "generation_cpu_s": generation_cpu_s,
            **({"load_avg": (load_before + load_after) / 2} if load_before is not None and load_after is not None else {}),
            **({"beside_cores": beside} if beside is not None else {}),
            "cpu_count": os.cpu_count(),
            "teacher_forcing_s": teacher_forcing_s,
            "prompt_tokens": int(prompt_tokens.size),
            "output_tokens": int(output_tokens.size),
            **_timing_meta(self.backend, outputs),
            **choice_meta,
        }
        write_shard(request.out, meta, arrays)
        return ShardReply(result={
            "index": index,
            "generation_s": generation_s,
            "teacher_forcing_s": teacher_forcing_s,
            "prompt_tokens": int(prompt_tokens.size),
            "output_tokens": int(output_tokens.size),
        })


    def _sampling_applied(self, prompts: list[Any]) -> tuple[list[dict[str, Any]], bool]:
        """The engine's parameters for each distinct sampling of a shard (at most
        :data:`MAX_SAMPLING_APPLIED`), as ``{"sampling", "applied"}``, and whether some were left
        out; empty when the backend builds no such object."""
        assert self.backend is not None
        seen: set[str] = set()
        out: list[dict[str, Any]] = []
        for prompt in prompts:
            key = sampling_key(prompt["sampling"])
            if key in seen:
                continue
            if len(out) >= MAX_SAMPLING_APPLIED:
                return out, True
            seen.add(key)
            applied = self.backend.sampling_applied(prompt["sampling"])
            if applied is None:
                return [], False
            out.append({"sampling": prompt["sampling"], "applied": applied})
        return out, False


@contextlib.contextmanager
def _naming(prompts: list[Any], phase: str) -> Iterator[None]:
    """Within: a :class:`ServerReplyError` about request ``index`` of the batch names its prompt."""
    try:
        yield
    except ServerReplyError as exc:
        if exc.prompt is not None or exc.index is None or not 0 <= exc.index < len(prompts):
            raise
        raise ServerReplyError(f"{exc.problem} ({phase})", url=exc.url, prompt=str(prompts[exc.index]["id"]),
                               index=exc.index) from exc


def _teacher_force_cut(sequences: list[tuple[list[int], list[int]]], rows: list[LogprobRows]) -> list[dict[str, int] | None]:
    """Per prompt (in order), None where teacher forcing scored every golden completion token,
    else ``{"scored": n, "of": m}``: the engine scored only the first n of the m tokens (a sequence
    longer than its max_model_len is cut to fit; n = 0: not teacher-forced at all)."""
    return [None if len(r.token_logprobs) >= len(s[1]) else {"scored": len(r.token_logprobs), "of": len(s[1])}
            for s, r in zip(sequences, rows)]


def _load_avg() -> float | None:
    """The machine's 1-minute load average (None where the platform has none)."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return None


def _timing_meta(backend: EngineBackend, outputs: list[Any]) -> dict[str, Any]:
    """Per-request timing (``ttft_s``, ``latency_s``: lists in prompt order, None where absent) and
    the backend's ``concurrency``, for backends that measure them (empty otherwise)."""
    out: dict[str, Any] = {}
    concurrency = getattr(backend, "concurrency", None)
    if isinstance(concurrency, int):
        out["concurrency"] = concurrency
    timings = [getattr(o, "timing", None) for o in outputs]
    if any(timings):
        out["ttft_s"] = [t.get("ttft_s") if t else None for t in timings]
        out["latency_s"] = [t.get("total_s") if t else None for t in timings]
    return out


def _error(exc: BaseException, kind: str) -> ErrorDetail:
    return {"type": kind, "message": str(exc) or type(exc).__name__, "traceback": traceback.format_exc(limit=20)}


def serve(requests: IO[str], channel: _Channel) -> None:
    """Answer requests until ``exit`` or end of input."""
    server = EngineServer(channel)
    for line in requests:
        if not line.strip():
            continue
        try:
            request = decode_request(line)
        except ProtocolError as exc:
            channel.send(ErrorReply(op=None, error=_error(exc, PROTOCOL_ERROR)))
            continue
        if isinstance(request, ExitRequest):
            break
        try:
            reply: Reply = server.handle(request)
        except Exception as exc:  # every failure goes back to the orchestrator, which translates it
            # The request is wrong for this model: an input error, not an engine crash.
            # (Any InputError a backend raises: a chat template missing, a server that refuses the
            # key or serves another model.)
            kind = INPUT_ERROR if isinstance(exc, InputError) else type(exc).__name__
            reply = ErrorReply(op=request.op, error=_error(exc, kind))
        channel.send(reply)


def main() -> None:
    """Serve on stdin/stdout, then exit at once."""
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin, _Channel(protocol_out))
    # Everything the orchestrator needs is on disk and acknowledged. Skip the engine's orderly
    # teardown (about 5 s for vLLM on CPU, paid per candidate); the orchestrator reaps any child
    # processes through the process group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
