"""The ``server`` backend (issue 16): replay through vLLM's OpenAI-compatible server.

One real server (the current environment's vLLM, fixture model, the golden's engine settings,
an API key) serves the module as a ``url:`` server; one test has regress start its own. The
replays are scored against the offline golden. Pre-run errors (a refused key, another model, no
logprobs) use a tiny fake server on loopback; an unreachable URL uses a port nobody listens on.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import ENGINE_BASE, run_cli
from fake_openai_server import FakeOpenAIServer

KEY_VARIABLE = "REGRESS_TEST_SERVER_KEY"  # looks like a secret of regress: stripped unless passed through
KEY_VALUE = "sk-test-9f3c2b7a-never-in-a-file"


# -- no engine --------------------------------------------------------------------------


def test_server_settings_validation():
    from pydantic import ValidationError

    from regress.records import CandidateSpec

    spec = CandidateSpec(name="s", model="m", backend="server",
                         server={"url": "https://h.example:8443/", "api_key_env": "MY_KEY", "concurrency": 8})
    assert spec.server.url == "https://h.example:8443" and spec.engine_spec()["server"]["concurrency"] == 8
    # Unset: not in the stored form, so fingerprints of existing candidates do not change.
    assert "server" not in CandidateSpec(name="s", model="m").model_dump()
    assert "server" not in CandidateSpec(name="s", model="m", backend="server").model_dump()
    for bad in ({"url": "http://user:pass@h"}, {"url": "ftp://h"}, {"url": "h:8000"}, {"api_key_env": "my-key"},
                {"api_key_env": "REGRESS_BROKER_KEY"}, {"api_key_env": "REGRESS_GITHUB_TOKEN"},
                {"concurrency": 0}, {"concurrency": 1025}, {"colour": 1}):
        with pytest.raises(ValidationError):
            CandidateSpec(name="s", model="m", backend="server", server=bad)
    with pytest.raises(ValidationError, match="only to backend 'server'"):
        CandidateSpec(name="s", model="m", server={})


def test_chat_endpoint_payload_and_rows():
    """``endpoint: chat``: a chat prompt goes out as messages for the server to render (token ids and
    logprobs asked back), a plain prompt as token ids; chat logprob rows are read from token ids."""
    from regress.backends.base import GenerationRequest
    from regress.backends.server_wire import chat_rows
    from regress.backends.vllm_server import CHAT_ENDPOINT, VllmServerBackend
    from regress.records import CandidateSpec, ResolvedSampling

    spec = CandidateSpec(name="s", model="m", backend="server", server={"endpoint": "chat"})
    assert spec.server.endpoint == "chat" and spec.engine_spec()["server"]["endpoint"] == "chat"
    # The default is left out of the stored form: fingerprints of existing candidates do not change.
    assert "endpoint" not in CandidateSpec(name="s", model="m", backend="server", server={}).model_dump()["server"]
    backend = VllmServerBackend(spec.engine_spec())
    backend._model_name = "m"

    class NoTemplate:  # regress cannot render it: the server will
        chat_template = None

        def encode(self, text, add_special_tokens=True):
            return [1, 2, 3]

    backend._tokenizer = NoTemplate()
    messages = [{"role": "user", "content": "Hi"}]
    sampling = ResolvedSampling(max_tokens=7, logprobs=5, stop=["\n"]).model_dump()
    chat = backend._payload(GenerationRequest(backend.render({"messages": messages}), sampling))
    assert chat["messages"] == messages and "prompt" not in chat
    assert chat["return_token_ids"] is True and chat["return_tokens_as_token_ids"] is True
    assert chat["logprobs"] is True and chat["top_logprobs"] == 5 and chat["add_generation_prompt"] is True
    sampled = {**sampling, "temperature": 0.8}  # the chosen token may be outside the top-5: one more
    assert backend._payload(GenerationRequest(backend.render({"messages": messages}), sampled))["top_logprobs"] == 6
    assert chat["max_tokens"] == 7 and chat["temperature"] == 0.0 and chat["stop"] == ["\n"] and chat["stream"]
    plain = backend._payload(GenerationRequest(backend.render({"prompt": "Hi"}), sampling))
    assert plain["prompt"] == [1, 2, 3] and "messages" not in plain and plain["logprobs"] == 5
    assert CHAT_ENDPOINT == "/v1/chat/completions"

    def entry(chosen, lp, others):
        return {"token": f"token_id:{chosen}", "logprob": lp,
                "top_logprobs": [{"token": f"token_id:{chosen}", "logprob": lp}]
                + [{"token": f"token_id:{t}", "logprob": v} for t, v in others]}

    rows = chat_rows([7, 2], [entry(7, -3.0, [(1, -0.5), (2, -1.0)]),  # outside the top-2
                              entry(2, -0.25, [(1, -0.5), (3, -9999.0)])], 2)  # ranked first
    assert rows.token_logprobs.tolist() == [-3.0, -0.25]
    assert rows.top_ids.tolist() == [[1, 2], [2, 1]] and rows.top_logprobs.tolist() == [[-0.5, -1.0], [-0.25, -0.5]]


def test_engine_args_become_flags():
    from regress.backends.server_process import engine_arg_flags, server_command

    flags = engine_arg_flags({"enforce_eager": True, "max_model_len": 4096, "enable_prefix_caching": False,
                              "compilation_config": {"mode": 0}, "seed": None},
                             known={"--no-enable-prefix-caching"})
    assert flags == ["--enforce-eager", "--max-model-len", "4096", "--no-enable-prefix-caching",
                     "--compilation-config", '{"mode": 0}']
    assert engine_arg_flags({"trust_remote_code": False}, known=set()) == []
    command = server_command({"model": "/m", "dtype": "bfloat16", "quantization": "fp8", "tokenizer": "/t",
                              "engine_args": {"enforce_eager": True}}, 9000, python="py")
    assert command == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--dtype", "bfloat16",
                       "--quantization", "fp8", "--tokenizer", "/t", "--host", "127.0.0.1", "--port", "9000",
                       "--enforce-eager"]


def test_top_logprobs_rows_put_the_chosen_token_at_its_rank():
    from regress.backends.server_wire import _rows, _top_row, prompt_rows

    # The chosen token outside the top-k: listed first, then the top-k in rank order.
    assert _top_row(7, {"token_id:7": -3.0, "token_id:1": -0.5, "token_id:2": -1.0}, 2) == (-3.0, [1, 2], [-0.5, -1.0])
    # Inside: listed once (first); put back at its place.
    assert _top_row(2, {"token_id:2": -1.0, "token_id:1": -0.5, "token_id:3": -2.0}, 3) == (
        -1.0, [1, 2, 3], [-0.5, -1.0, -2.0])
    # The server clamps -inf to -9999 (JSON has no infinity): read back as -inf.
    chosen, ids, lps = _top_row(1, {"token_id:1": -0.5, "token_id:2": -9999.0}, 2)
    rows = _rows([chosen], [ids], [lps], 2)
    assert rows.top_ids.tolist() == [[1, 2]] and rows.top_logprobs.tolist() == [[-0.5, float("-inf")]]
    rows = prompt_rows([None, {"4": {"logprob": -2.0, "rank": 3}, "8": {"logprob": -0.1, "rank": 1},
                               "9": {"logprob": -1.0, "rank": 2}}], [4], 1, 2)
    assert rows.token_logprobs.tolist() == [-2.0] and rows.top_ids.tolist() == [[8, 9]]


def test_api_key_variable_reaches_only_its_engine(tmp_path, monkeypatch):
    from regress.engine.client import _prepare_shim
    from regress.records import CandidateSpec
    from regress.replay.manifest import _shown_env
    from regress.engine.client import engine_environment

    monkeypatch.setenv(KEY_VARIABLE, KEY_VALUE)
    monkeypatch.setenv("REGRESS_OTHER_TOKEN", "x")
    server = CandidateSpec(name="s", model="m", backend="server", server={"api_key_env": KEY_VARIABLE})
    (tmp_path / "a").mkdir()
    env = _prepare_shim(server, tmp_path / "a", python=tmp_path / "env" / "bin" / "python")
    assert env[KEY_VARIABLE] == KEY_VALUE and "REGRESS_OTHER_TOKEN" not in env
    (tmp_path / "b").mkdir()
    assert KEY_VARIABLE not in _prepare_shim(CandidateSpec(name="o", model="m"), tmp_path / "b", python=tmp_path / "env" / "bin" / "python")
    assert KEY_VALUE not in json.dumps(_shown_env(engine_environment(server)))


def test_diff_files_server_settings():
    from regress.effective import differences
    from regress.records import CandidateSpec

    a = CandidateSpec(name="a", model="m", backend="server")
    b = CandidateSpec(name="b", model="m", backend="server", server={"url": "http://h:8000", "concurrency": 8})
    found = {(d.source, d.name): (d.baseline, d.candidate) for d in differences(a, b)}
    assert found[("scheduling and batching", "server.concurrency")] == ("1", "8")
    assert found[("engine", "server.url")] == ("started by regress", "http://h:8000")


# -- real server --------------------------------------------------------------------------


def _start_server(model: Path, log: Path, *extra: str):
    """vLLM's server from the current environment with the golden's engine settings."""
    from regress.backends.server_process import ServerProcess, free_port, server_command, server_environment

    port = free_port()
    spec = {"model": str(model), "dtype": ENGINE_BASE["dtype"], "engine_args": ENGINE_BASE["engine_args"]}
    env = server_environment({**os.environ, **ENGINE_BASE["env"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    server = ServerProcess(server_command(spec, port) + list(extra), env, sink=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    server.wait_healthy(url, 600)
    return server, url


@pytest.fixture(scope="module")
def served(fixture_model: Path, tmp_path_factory):
    """One real server for the module (API key required), as a url: server."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    server, url = _start_server(fixture_model, log, "--api-key", KEY_VALUE)
    yield url
    server.stop()


@pytest.fixture(scope="module")
def server_workspace(tmp_path_factory, fixture_model: Path, golden_dir: Path, served: str) -> Path:
    """A project of its own (the session's golden copied in), so that the session workspace's
    candidates stay as other modules expect them."""
    import shutil

    from conftest import write_params
    from regress.datasets import FIXTURE_PROMPTS, write_demo_prompts

    root = tmp_path_factory.mktemp("served-workspace")
    write_demo_prompts(root / "datasets" / "prompts", which=FIXTURE_PROMPTS)
    shutil.copytree(golden_dir, root / "golden")
    write_params(root, model=fixture_model, candidates={
        "server-c1": {"backend": "server", "server": {"url": served, "api_key_env": KEY_VARIABLE}},
        "server-c8": {"backend": "server", "server": {"url": served, "api_key_env": KEY_VARIABLE, "concurrency": 8}},
        "server-own": {"backend": "server", "server": {"concurrency": 4}},
    })
    return root


def _check(workspace: Path, name: str) -> tuple[int, Counter, float]:
    from regress.scoring import read_scored_run

    started = time.monotonic()
    result = run_cli("check", name, cwd=workspace, env={KEY_VARIABLE: KEY_VALUE})
    assert result.returncode in (0, 1), result.stderr
    report = read_scored_run(workspace / "scores" / name)
    return result.returncode, Counter(s.prompt_class for s in report.scores), time.monotonic() - started


def _metas(run: Path) -> list[dict]:
    from regress.storage import read_shard_meta

    shards = sorted((run / "shards").glob("*.shard"))
    assert shards
    return [read_shard_meta(p) for p in shards]


def _no_key_in(run: Path) -> None:
    for name in ("manifest.json", "engine.log"):
        assert KEY_VALUE not in (run / name).read_text(encoding="utf-8", errors="replace"), name


@pytest.mark.engine
def test_server_replay_matches_the_offline_golden(server_workspace: Path):
    code, classes, seconds = _check(server_workspace, "server-c1")
    print(f"server-c1: {dict(classes)} in {seconds:.1f} s")
    assert code == 0 and set(classes) <= {"identical", "benign"}, classes
    run = server_workspace / "runs" / "server-c1"
    metas = _metas(run)
    for meta in metas:
        assert meta["concurrency"] == 1
        assert len(meta["ttft_s"]) == len(meta["latency_s"]) == len(meta["prompt_ids"])
        assert all(0 < t <= total for t, total in zip(meta["ttft_s"], meta["latency_s"]))
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["candidate"]["server"]["url"] == served_url(server_workspace)
    assert KEY_VARIABLE not in manifest.get("env_vars", {})
    _no_key_in(run)
    # Latency is a measured output: the server run's percentiles beside the offline golden's throughput.
    latency = json.loads((server_workspace / "scores" / "server-c1" / "metrics.json").read_text())["latency"]
    c = latency["candidate"]
    assert c["requests"] == 40 and c["concurrency"] == 1 and 0 < c["ttft_p50_s"] <= c["ttft_p95_s"] <= c["ttft_p99_s"]
    assert 0 < c["latency_p50_s"] and latency["golden"]["requests"] == 0 and latency["throughput_ratio"] > 0
    page = (server_workspace / "reports" / "server-c1" / "index.html").read_text(encoding="utf-8")
    assert "time to first token" in page.lower() or "ttft" in page.lower()


@pytest.mark.engine
def test_chat_endpoint_matches_the_offline_golden(server_workspace: Path, served: str):
    """``endpoint: chat``: the server renders the chat prompts with its own template (the same one
    regress applies), so nothing drifts, inputs included, and the prompt tokens recorded (the ones
    the server used) are the golden's."""
    from regress.runs import load_run

    params = yaml.safe_load((server_workspace / "params.yaml").read_text())
    params["candidates"]["server-chat"] = {"backend": "server", "server": {
        "url": served, "api_key_env": KEY_VARIABLE, "endpoint": "chat"}}
    (server_workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    code, classes, seconds = _check(server_workspace, "server-chat")
    print(f"server-chat: {dict(classes)} in {seconds:.1f} s (exit {code})")
    assert code == 0 and set(classes) <= {"identical", "benign"}, classes
    run = server_workspace / "runs" / "server-chat"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["candidate"]["server"]["endpoint"] == "chat"
    assert manifest["effective"]["server"]["endpoint"] == "/v1/chat/completions"
    candidate, golden = load_run(run), load_run(server_workspace / "golden")
    chats = [g.prompt_id for g in golden if g.prompt_id.startswith("chat-")]
    assert len(chats) == 10
    for prompt_id in chats:
        assert candidate[prompt_id].prompt_token_ids.tolist() == golden[prompt_id].prompt_token_ids.tolist()
    for meta in _metas(run):  # streamed: TTFT measured for chat prompts too
        assert None not in meta["ttft_s"] and meta["concurrency"] == 1
    _no_key_in(run)


def served_url(workspace: Path) -> str:
    return yaml.safe_load((workspace / "params.yaml").read_text())["candidates"]["server-c1"]["server"]["url"]


@pytest.mark.engine
def test_concurrency_8_is_scored(server_workspace: Path):
    code, classes, seconds = _check(server_workspace, "server-c8")
    print(f"server-c8: {dict(classes)} in {seconds:.1f} s (exit {code})")
    assert sum(classes.values()) == 40
    metas = _metas(server_workspace / "runs" / "server-c8")
    assert all(m["concurrency"] == 8 and None not in m["ttft_s"] for m in metas)
    _no_key_in(server_workspace / "runs" / "server-c8")


@pytest.mark.engine
def test_regress_starts_and_stops_its_own_server(server_workspace: Path):
    started = time.monotonic()
    result = run_cli("replay", "server-own", cwd=server_workspace)
    print(f"server-own replay: {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, result.stderr
    run = server_workspace / "runs" / "server-own"
    log = (run / "engine.log").read_text(encoding="utf-8", errors="replace")
    assert "starting the vLLM server" in log and "Application startup complete" in log
    assert all(m["concurrency"] == 4 and len(m["latency_s"]) == len(m["prompt_ids"]) for m in _metas(run))
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["versions"]["packages"]["server vllm"]
    # Started on a Unix socket in a private directory, never a TCP port another local process
    # could bind first (issue 26); gone with the engine process, its directory too.
    line = next(line for line in log.splitlines() if "starting the vLLM server" in line)
    assert "--port" not in line and "--uds " in line, line
    socket_path = Path(line.split("--uds ")[1].split()[0])
    assert not socket_path.exists() and not socket_path.parent.exists()
    assert manifest["effective"]["server"]["url"] == f"unix:{socket_path}"


@pytest.mark.engine
def test_the_real_servers_text_is_what_its_ids_decode_to(served: str, fixture_model: Path, monkeypatch):
    """The check of text against ids (regress.backends.server_text) passes what the real server
    sends: texts cut before stop strings (English and Chinese ones, one deferred by min_tokens),
    outputs free to stop at EOS, and characters split across tokens, held back at an output's end."""
    from regress.backends.base import GenerationRequest
    from regress.backends.vllm_server import VllmServerBackend
    from regress.datasets import FIXTURE_PROMPTS
    from regress.records import ResolvedSampling

    monkeypatch.setenv(KEY_VARIABLE, KEY_VALUE)
    backend = VllmServerBackend({"model": str(fixture_model), "backend": "server",
                                 "server": {"url": served, "api_key_env": KEY_VARIABLE, "concurrency": 4}})
    backend.load()
    prompts = [p for p in map(json.loads, FIXTURE_PROMPTS.read_text(encoding="utf-8").splitlines()) if "prompt" in p]
    requests = [GenerationRequest(backend.render(p), ResolvedSampling(
        max_tokens=tokens, logprobs=3, stop=stop, min_tokens=least, explicit=["stop", "min_tokens"]).model_dump())
        for stop, least, tokens in ((["e"], 0, 64), (["\n", "的"], 0, 64), (["th", "。"], 5, 64), ([], 0, 160))
        for p in prompts]
    outputs = backend.generate(requests, lambda n: None)  # a text its ids do not hold: ServerReplyError
    decode = backend.get_tokenizer().backend_tokenizer.decode
    kinds = Counter()
    for request, output in zip(requests, outputs):
        prompt = list(request.prompt_token_ids)
        whole = decode(prompt + output.output_token_ids, skip_special_tokens=True)[len(decode(prompt)):]
        kinds[output.finish_reason, "whole" if output.text == whole else "cut" if whole.startswith(output.text)
              else "other"] += 1
    print(f"real server answers, by finish reason and text: {dict(kinds)}")
    assert kinds["stop", "cut"] >= 40 and not kinds["length", "other"] and not kinds["stop", "other"], kinds


# -- pre-run errors -----------------------------------------------------------------------


def _error_workspace(tmp_path: Path, fixture_model: Path, server: dict) -> Path:
    """A project whose baseline is a server candidate (so `regress golden` needs no golden)."""
    from conftest import write_params
    from regress.datasets import FIXTURE_PROMPTS, write_demo_prompts

    write_demo_prompts(tmp_path / "datasets" / "prompts", which=FIXTURE_PROMPTS)
    write_params(tmp_path, model=fixture_model, baseline={"backend": "server", "server": server})
    return tmp_path


def _golden(workspace: Path, env: dict | None = None):
    return run_cli("golden", cwd=workspace, env=env, timeout=600)


@pytest.mark.parametrize("mode, key, expected", [
    ("ok", "wrong", "refused the API key"),
    ("other-model", KEY_VALUE, "some-other-model"),
    ("no-logprobs", KEY_VALUE, "did not return token ids and logprobs"),
])
def test_pre_run_input_errors(tmp_path, fixture_model, mode, key, expected):
    with FakeOpenAIServer(str(fixture_model), mode=mode, key=KEY_VALUE) as fake:
        workspace = _error_workspace(tmp_path, fixture_model, {"url": fake.url, "api_key_env": KEY_VARIABLE})
        result = _golden(workspace, env={KEY_VARIABLE: key})
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    if mode == "other-model":
        assert str(fixture_model) in result.stderr
    assert KEY_VALUE not in result.stderr + result.stdout
    for log in workspace.rglob("engine.log"):
        assert KEY_VALUE not in log.read_text(errors="replace")


def test_unreachable_url_is_a_run_error(tmp_path, fixture_model):
    from regress.backends.server_process import free_port

    url = f"http://127.0.0.1:{free_port()}"
    workspace = _error_workspace(tmp_path, fixture_model, {"url": url})
    result = _golden(workspace)
    assert result.returncode == 3, result.stderr
    assert url in result.stderr and "unreachable" in result.stderr


def test_streamed_rows_vectorized_equal_row_by_row():
    import random

    from regress.backends.server_wire import _rows, _top_row, stream_rows

    rng, k = random.Random(0), 4
    tokens, tops = [], []
    for _ in range(500):
        lps = sorted((-rng.random() * 5 for _ in range(k + 2)), reverse=True)
        ids = rng.sample(range(1000), k + 2)
        chosen = ids[rng.choice([0, 0, 0, 1, k - 1, k + 1])]
        row = {f"token_id:{chosen}": lps[ids.index(chosen)]}
        row.update({f"token_id:{i}": lp for i, lp in zip(ids[:k], lps[:k]) if i != chosen})
        if rng.random() < 0.05:
            row = dict(reversed(list(row.items())))
        tokens.append(f"token_id:{chosen}")
        tops.append(row)
    token_ids, fast = stream_rows(tokens, tops, k)
    slow = [_top_row(t, d, k) for t, d in zip(token_ids, tops)]
    expected = _rows([s[0] for s in slow], [s[1] for s in slow], [s[2] for s in slow], k)
    assert token_ids == [int(t[9:]) for t in tokens]
    for a, b in ((fast.top_ids, expected.top_ids), (fast.top_logprobs, expected.top_logprobs),
                 (fast.token_logprobs, expected.token_logprobs)):
        assert np.array_equal(a, b)


# -- a server that dies mid-run; concurrency as a noise arm ---------------------------------


class _Relay:
    """A TCP relay on loopback in front of the real server: the candidate's ``url`` points at it,
    so "the server dies" is the relay closing (every connection cut, nothing listening) while the
    real server, which computes every token, keeps running for the rerun."""

    def __init__(self, target_port: int, port: int | None = None):
        import socket
        import threading

        from regress.backends.server_process import free_port

        self.target_port = target_port
        self.port = port or free_port()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", self.port))
        self._socket.listen(64)
        self._open: list[socket.socket] = []
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        import socket
        import threading

        while not self._stopped:
            try:
                client, _ = self._socket.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b) -> None:  # type: ignore[no-untyped-def]
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass

    def kill(self) -> None:
        import socket

        self._stopped = True
        self._socket.close()
        for s in self._open:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


@pytest.mark.engine
def test_a_server_that_dies_mid_run_names_the_missing_prompts_and_a_rerun_resumes(server_workspace: Path, served: str):
    import subprocess
    import sys

    relay = _Relay(int(served.rsplit(":", 1)[1]))
    params = yaml.safe_load((server_workspace / "params.yaml").read_text())
    params["candidates"]["server-dying"] = {"backend": "server", "server": {"url": relay.url, "api_key_env": KEY_VARIABLE}}
    (server_workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    partial = server_workspace / "runs" / "server-dying.partial" / "shards"
    proc = subprocess.Popen([sys.executable, "-m", "regress.cli", "replay", "server-dying", "--shard-size", "4"],
                            cwd=server_workspace, env={**os.environ, KEY_VARIABLE: KEY_VALUE},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(partial.glob("*.shard"))) < 2 and proc.poll() is None:
        time.sleep(0.05)
    relay.kill()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 3, stderr
    done = {p.name: p.stat().st_mtime_ns for p in partial.glob("*.shard")}
    assert 2 <= len(done) < 10, done
    assert "prompt(s) not run:" in stderr and "run the command again to resume" in stderr, stderr
    assert relay.url in stderr  # the restarted engine could not reach it: named
    # The server is back at the same address: the rerun runs only the missing shards.
    relay = _Relay(relay.target_port, port=relay.port)
    try:
        again = run_cli("replay", "server-dying", "--shard-size", "4", cwd=server_workspace,
                        env={KEY_VARIABLE: KEY_VALUE})
    finally:
        relay.kill()
    assert again.returncode == 0, again.stderr
    run = server_workspace / "runs" / "server-dying"
    for name, mtime in done.items():
        assert (run / "shards" / name).stat().st_mtime_ns == mtime  # kept, not redone
    from regress.runs import load_run

    assert len(load_run(run)) == 40


@pytest.mark.engine
def test_concurrency_is_a_noise_arm_of_a_server_baseline(tmp_path: Path, fixture_model: Path, served: str):
    """A golden made through the server one request at a time, and the baseline again with 8 in
    flight as its noise arm: golden/noise.json records the arm."""
    from conftest import write_params
    from regress.datasets import FIXTURE_PROMPTS, write_demo_prompts

    write_demo_prompts(tmp_path / "datasets" / "prompts", which=FIXTURE_PROMPTS)
    path = write_params(tmp_path, model=fixture_model,
                        baseline={"backend": "server", "server": {"url": served, "api_key_env": KEY_VARIABLE}},
                        candidates={"offline": {"backend": "vllm", "server": None}})
    data = yaml.safe_load(path.read_text())
    data["noise"] = {"arms": ["concurrency"]}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = run_cli("golden", cwd=tmp_path, env={KEY_VARIABLE: KEY_VALUE})
    assert result.returncode == 0, result.stderr
    noise = json.loads((tmp_path / "golden" / "noise.json").read_text())
    (arm,) = noise["arms"]
    assert arm["name"] == "concurrency" and "requests in flight: 8 instead of 1" in arm["changed"]
    assert arm["prompts"] == 40 and arm["identical"] + arm["diverged"] == 40
    metas = _metas(tmp_path / "golden" / "noise-arms" / "concurrency")
    assert all(m["concurrency"] == 8 for m in metas)
    _no_key_in(tmp_path / "golden")
    # And back: an offline candidate against the server's golden.
    code, classes, _ = _check(tmp_path, "offline")
    assert code == 0 and set(classes) <= {"identical", "benign"}, classes
    latency = json.loads((tmp_path / "scores" / "offline" / "metrics.json").read_text())["latency"]
    assert latency["golden"]["requests"] == 40 and latency["candidate"]["requests"] == 0  # offline: throughput only
    assert latency["candidate"]["throughput_tokens_per_s"] > 0


@pytest.mark.engine
def test_check_your_running_server_as_the_readme_says(served: str, fixture_model: Path, tmp_path: Path) -> None:
    """The README's steps against a real vLLM server: `regress init --url` (the served model's name
    asked of the server), `regress golden`, `regress check served-again`: `package: current`, only
    HTTP requests, and no engine environment is built."""
    from regress.envs.spec import envs_root

    def envs() -> set[str]:
        return {p.name for p in envs_root().iterdir()} if envs_root().is_dir() else set()

    import shlex
    import subprocess
    import sys

    from doc_commands import readme_section_commands

    before = envs()
    project = tmp_path / "served"
    project.mkdir()
    env = {**os.environ, KEY_VARIABLE: KEY_VALUE,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    results = []
    for command in readme_section_commands("Check your running server"):  # as written, our server for theirs
        argv = [{"http://my-vllm:8000": served, "MY_API_KEY": KEY_VARIABLE}.get(w, w) for w in shlex.split(command)]
        results.append(subprocess.run(argv, cwd=project, capture_output=True, text=True, env=env, timeout=1500))
    init, golden, check = results
    assert init.returncode == 0, init.stderr
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert params["baseline"]["package"] == "current" and params["baseline"]["backend"] == "server"
    assert params["baseline"]["model"] == str(fixture_model)  # what the server says it serves
    assert golden.returncode == 0, golden.stderr
    assert check.returncode == 0, check.stderr  # the same server, the same outputs
    metrics = json.loads((project / "scores" / "served-again" / "metrics.json").read_text())
    assert metrics["verdict"] == "pass" and metrics["prompts"] == 13
    # The starter set's multiple-choice question is scored through the server on both sides (each
    # choice teacher-forced with prompt_logprobs): four choices, the same picks and log-likelihoods.
    scores = {s["prompt_id"]: s for s in json.loads((project / "scores" / "served-again" / "scores.json").read_text())["scores"]}
    choice = scores["choice-01"]["metrics"]
    assert choice["choices"] == 4 and choice["choice_golden_pick"] == choice["choice_candidate_pick"]
    assert choice["choice_logprob_shift"] == pytest.approx(0.0, abs=1e-3)
    assert scores["choice-01"]["answer"] is not None
    assert (project / "reports" / "served-again" / "index.html").is_file()
    assert envs() == before
    _no_key_in(project / "runs" / "served-again")
