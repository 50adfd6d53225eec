"""The periodic watcher on real Celery: beat (``regress watch --beat``), a real worker, a real
private Redis, the local PEP 691 index. Checks run through ``check_command`` (a real engine
check takes minutes); everything around them is the real path: beat sends ticks, the worker
runs them, ticks enqueue ``check_release`` tasks, the worker runs those and records verdicts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from celery_workers import KEY_ENV, TEST_KEY
from pep691_index import LocalIndex, Recorder

from regress.watch.state import RedisState

PKG = "fakeengine"


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, logs: list[Path]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs if log.exists())
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{tails}")


class Processes:
    """Subprocesses in their own sessions, stopped (whole process group) at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], *, env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
        out = open(log, "wb")
        proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def processes():
    running = Processes()
    yield running
    running.stop()


def test_beat_fires_the_tick_and_the_worker_checks_each_new_version_once(tmp_path, private_redis, processes):
    index = LocalIndex().start()
    hook = Recorder(status=200).start()
    try:
        index.add(PKG, "1.0")
        broker = private_redis.url  # db 0: broker and results
        state_url = private_redis.url.rsplit("/", 1)[0] + "/1"
        queue = f"watch-test-{uuid.uuid4().hex[:8]}"
        marker = tmp_path / "checked.txt"
        # The check: note the version; version 1.2 "regresses" (exit 1).
        script = ("import os, sys; v = os.environ['REGRESS_WATCH_VERSION']; "
                  f"open({str(marker)!r}, 'a').write(v + '\\n'); sys.exit(1 if v == '1.2' else 0)")
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump({
            "dataset": "datasets/prompts/fixture.jsonl",
            "baseline": {"package": f"{PKG}==1.0", "model": "models/fixture"},
            "celery": {"broker_url": broker, "queue": queue},
            "watch": {"index_url": index.url, "trigger": "celery", "state": state_url, "interval_s": 2,
                      "check_command": [sys.executable, "-c", script], "webhook": hook.url + "/hook"},
        }))
        home, cwd = tmp_path / "home", tmp_path / "cwd"
        cwd.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REGRESS_", "CELERY_"))}
        # Beat signs its ticks, the worker checks them; the worker's own params file is where its
        # watch tasks take the check command, state and webhook from.
        env.update({"REGRESS_BROKER_URL": broker, "REGRESS_HOME": str(home), "PYTHONPATH": str(Path.cwd()),
                    **KEY_ENV, "REGRESS_WATCH_PARAMS": str(params)})
        logs = [tmp_path / "worker.log", tmp_path / "beat.log"]
        processes.start([sys.executable, "-m", "celery", "-A", "regress.worker.app", "worker", "--pool", "solo",
                         "-Q", queue, "-n", f"{queue}@localhost", "--without-gossip", "--without-mingle",
                         "--loglevel", "INFO"], env=env, cwd=cwd, log=logs[0])
        processes.start([sys.executable, "-m", "regress.watch.cli", "--beat", "-p", str(params)],
                        env=env, cwd=cwd, log=logs[1])

        state = RedisState(state_url)
        ticks = lambda: sum(1 for path, _ in index.requests if path == f"/simple/{PKG}/")  # noqa: E731
        # The first tick records what is on the index as seen.
        wait_for(lambda: state.known(PKG), 60, "the first tick", logs)
        assert state.get(PKG, "1.0").status == "seen"

        index.add(PKG, "1.1")
        index.add(PKG, "1.2")
        wait_for(lambda: len(state.history()) == 2, 60, "both checks to be recorded", logs)
        after = ticks()
        wait_for(lambda: ticks() >= after + 2, 30, "two more ticks", logs)

        assert sorted(marker.read_text().split()) == ["1.1", "1.2"]  # each checked exactly once
        assert {(r.version, r.status, r.trigger) for r in state.history()} == {
            ("1.1", "pass", "celery"), ("1.2", "fail", "celery")}
        assert state.get(PKG, "1.1").status == "pass"
        # One check task per new version went through the broker (results are kept by task id).
        import redis

        results = redis.Redis.from_url(broker).keys("celery-task-meta-regress-watch-*")
        names = sorted(key.decode().removeprefix("celery-task-meta-regress-watch-").rsplit("-", 1)[0]
                       for key in results)
        assert names == [f"{PKG}-1_1", f"{PKG}-1_2"]
        assert [p["body"]["version"] for p in hook.posts] == ["1.2"]
        assert hook.posts[0]["body"]["event"] == "regression"
        # Beat keeps its schedule in the state directory, not the working directory.
        assert list((home / "watch").glob("celerybeat-schedule*"))
        assert not list(cwd.iterdir())
        state.close()
    finally:
        index.stop()
        hook.stop()


def test_celery_beat_picks_the_schedule_up_from_the_environment(tmp_path):
    """``celery -A regress.worker.app beat`` with REGRESS_WATCH_PARAMS runs the watcher's tick."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "dataset": "d.jsonl", "baseline": {"package": "vllm==0.9.0", "model": "m"},
        "watch": {"interval_s": 90, "queue": "watchq", "state": str(tmp_path / "s.json")}}))
    code = ("import json; from regress.worker.app import app; import regress.watch.tasks; "
            "print(json.dumps(app.conf.beat_schedule))")
    env = {**os.environ, "REGRESS_WATCH_PARAMS": str(params)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"regress-watch-tick": {
        "task": "regress.watch.tick", "schedule": 90.0,
        "kwargs": {"params": str(params.resolve()), "overrides": {}},
        "options": {"expires": 90, "queue": "watchq"}}}


def test_a_broker_that_is_down_leaves_the_version_for_the_next_tick(tmp_path, monkeypatch):
    from redis_process import free_port

    from regress.watch.config import load_watch_config
    from regress.watch.watcher import build_watcher

    index = LocalIndex().start()
    try:
        index.add(PKG, "1.0")
        index.add(PKG, "1.1")
        monkeypatch.setenv("REGRESS_BROKER_URL", f"redis://127.0.0.1:{free_port()}/0")
        monkeypatch.setenv("REGRESS_BROKER_KEY", TEST_KEY)
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump({
            "dataset": "d.jsonl", "baseline": {"package": f"{PKG}==1.0", "model": "m"},
            "watch": {"index_url": index.url, "trigger": "celery", "since": "1.0",
                      "state": str(tmp_path / "state.json")}}))
        report = build_watcher(load_watch_config(params)).tick()
        error = report.packages[0].outcomes[0].error
        assert report.exit_code == 3 and "could not send the check of fakeengine==1.1 to the broker" in str(error)
        assert "Connection refused" in str(error)
        state = json.loads((tmp_path / "state.json").read_text())
        assert set(state["packages"][PKG]["versions"]) == {"1.0"}  # 1.1 not recorded: retried next tick
    finally:
        index.stop()
