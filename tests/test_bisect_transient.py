"""A bisect tells an install that failed for a passing reason (the index down, the network, a full
disk) from a release that can never be installed: the first is recorded as transient and tried
again on resume, the second is skipped for good; the state says which, and so does the output.

The environment builds are real (venv and pip from a PEP 691 index on loopback that serves real
wheels and, for a while, answers 503). What runs after the install (replay, scoring) is
stubbed: this is about the installs; tests/test_bisect.py runs the real checks.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import write_params
from regress.bisect.cli import _check_line
from regress.bisect.record import BISECT_FORMAT, load_state, state_path
from regress.errors import CandidateEnvError

PLUGIN = "tiny-plugin"
PLUGIN_VERSIONS = ["1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7"]
FIRST_BAD = "1.5"
NEVER = "1.4"
"""Its wheel requires a package no index has: a permanent failure."""


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The engine stand-in ``tiny-engine`` (with stand-ins of numpy and transformers, which an
    environment must import) and the plugin's releases, served to pip and to the bisect only."""
    from pep691_index import LocalIndex
    from wheels import build_wheel

    wheels = tmp_path / "wheels"
    server = LocalIndex().start()
    server.publish("numpy", build_wheel(wheels, "numpy", "1.0", {"numpy/__init__.py": ""}))
    server.publish("transformers", build_wheel(wheels, "transformers", "1.0", {"transformers/__init__.py": ""}))
    server.publish("tiny-engine", build_wheel(wheels, "tiny-engine", "1.0", {"tiny_engine.py": ""},
                                              requires=["numpy", "transformers"]))
    for version in PLUGIN_VERSIONS:
        requires = ["tiny-missing>=1"] if version == NEVER else []
        server.publish(PLUGIN, build_wheel(wheels, PLUGIN, version, {"tiny_plugin.py": f"VERSION = {version!r}\n"},
                                           requires=requires))
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_INDEX_URL", server.url)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's extra indexes and constraints
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    yield server
    server.stop()


def _checks_that_install(monkeypatch: pytest.MonkeyPatch, index, outage: set[str]) -> list[str]:
    """Replace the check after the install with a stand-in: each version's environment is built
    for real (python_for), during an index outage (HTTP 503) for the versions in ``outage``
    (each once); the version passes below FIRST_BAD. Returns the versions checked, in order."""
    import regress.checks
    from packaging.version import Version

    from regress.envs import python_for

    checked: list[str] = []

    def check(params, spec, **kwargs):  # type: ignore[no-untyped-def]
        version = spec.requirements[-1].split("==")[1]
        checked.append(version)
        if version in outage:
            outage.discard(version)
            index.answer = (503, "text/plain", b"the index is down for maintenance")
        try:
            python_for(spec)
        finally:
            index.answer = None
        failed = Version(version) >= Version(FIRST_BAD)
        metrics = SimpleNamespace(verdict="fail" if failed else "pass", identical=0, prompts=1, mean_teacher_forced_kl=0.0)
        return SimpleNamespace(gating_failed=failed, manifest=SimpleNamespace(run_id=f"run-{version}"),
                               scored=SimpleNamespace(page=None, report=SimpleNamespace(scores=[], metrics=metrics)))

    monkeypatch.setattr(regress.checks, "run_check", check)
    return checked


def _project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from regress.config import load_params

    (tmp_path / "model").mkdir()
    write_params(tmp_path, model=tmp_path / "model", baseline={"package": "tiny-engine==1.0"})
    params = load_params(tmp_path / "params.yaml")

    class Golden:
        class manifest:  # noqa: N801 - a stand-in record
            run_id = "golden"
            candidate = params.baseline

    monkeypatch.setattr("regress.runs.load_run", lambda path: Golden)
    return params


@pytest.mark.envs  # real venvs and pip
def test_an_index_outage_is_transient_retried_on_resume_and_a_broken_release_is_skipped_for_good(
        tmp_path, monkeypatch, index):
    from regress.bisect.plan import releases_between
    from regress.bisect.run import bisect
    from regress.watch.index import IndexClient, configured_index

    params = _project(tmp_path, monkeypatch)
    client = IndexClient(configured_index(index.url))
    rng = releases_between(PLUGIN, "1.0", "1.7", client.releases(PLUGIN), index=client.describe())
    checked = _checks_that_install(monkeypatch, index, outage={"1.3"})
    lines: list[str] = []

    def run():  # type: ignore[no-untyped-def]
        return bisect(params, rng, params.baseline, index=client.describe(),
                      on_check=lambda state, check: lines.append(_check_line(check)))

    # 1. --bad installs and fails; 1.3's install meets the outage: the bisect stops, exit 3.
    with pytest.raises(CandidateEnvError) as stopped:
        run()
    from regress.errors import TransientEnvError

    assert isinstance(stopped.value, TransientEnvError)
    message = str(stopped.value)
    assert "tiny-plugin 1.3 could not be installed, a transient failure" in message
    assert "the package index could not be fetched for tiny-plugin" in message and "run the command again" in message
    assert stopped.value.exit_code == 3
    path = state_path(params.root, PLUGIN, "1.0", "1.7")
    state = load_state(path)
    assert state.format_version == BISECT_FORMAT == 2
    assert [(c.version, c.outcome) for c in state.checks] == [("1.7", "fail"), ("1.3", "transient")]
    assert state.status == "running" and state.outcomes == {"1.7": "fail"}
    assert state.checks[1].cause == "the package index could not be fetched for tiny-plugin (HTTP 503)"
    assert lines[-1].split()[:3] == ["1.3", "RETRY", "transient:"]

    # 2. The index is back: resumed, 1.3 is tried again, and the search ends; 1.4 can never be
    #    installed (a dependency no index has): skipped, permanent.
    result = run()
    assert checked == ["1.7", "1.3", "1.3", "1.5", NEVER]
    assert any("trying 1.3 again: its install failed transiently" in note for note in result.notes)
    state = result.state
    assert (state.status, state.first_bad, state.last_good, state.untested_before) == ("found", "1.5", "1.3", [NEVER])
    assert [(c.version, c.outcome) for c in state.checks] == [
        ("1.7", "fail"), ("1.3", "transient"), ("1.3", "pass"), ("1.5", "fail"), (NEVER, "skipped")]
    never = state.outcome(NEVER)
    assert never.cause == "its dependency tiny-missing>=1 is not available"
    assert state.outcome("1.3").outcome == "pass" and state.checked == 4
    assert lines[-1].split()[:3] == [NEVER, "SKIP", "permanent:"] and "tiny-missing" in lines[-1]

    # 3. Again: nothing is installed; the permanent failure is not retried.
    again = run()
    assert again.ran_now == [] and checked == ["1.7", "1.3", "1.3", "1.5", NEVER]
    assert again.state.first_bad == "1.5"

    # 4. What pip alone cannot tell apart ("from versions: none"): a project the index does not
    #    have is permanent, an index that cannot be reached is transient.
    from regress.envs import EnvSpec, ensure_env
    from regress.errors import UnresolvableEnvError

    with pytest.raises(UnresolvableEnvError, match="the package index has no project tiny-nothere"):
        ensure_env(EnvSpec("tiny-engine==1.0", ("tiny-nothere==1.0",), layered=True))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    with pytest.raises(TransientEnvError, match=r"could not be fetched for tiny-plugin \(Connection refused\)"):
        ensure_env(EnvSpec("tiny-engine==1.0", ("tiny-plugin==1.2",), layered=True))


def test_a_state_written_before_the_kinds_were_told_apart_loads_and_retries_its_skips(tmp_path):
    """Format 1 recorded every install failure as ``skipped``: it loads, and those versions are
    tried again once (a resume)."""
    from regress.bisect.run import _resumable

    path = tmp_path / "bisect" / "pkg-1.0-1.7.json"
    path.parent.mkdir()
    old = {"format_version": 1, "package": "pkg", "good": "1.0", "bad": "1.7", "template": "baseline",
           "template_sha256": "t", "golden_run_id": "g", "index": "http://127.0.0.1/simple",
           "versions": ["1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7"],
           "checks": [{"version": "1.7", "candidate": "pkg-1_7", "outcome": "fail"},
                      {"version": "1.3", "candidate": "pkg-1_3", "outcome": "skipped",
                       "detail": "creating the environment for 'pkg==1.3' failed: pip install failed"}],
           "status": "running"}
    path.write_text(json.dumps(old))
    state = load_state(path)
    assert state.format_version == 2
    assert [(c.version, c.outcome) for c in state.checks] == [("1.7", "fail"), ("1.3", "transient")]
    assert "state format 1" in state.checks[1].cause
    notes: list[str] = []
    resumed = _resumable(state, state.model_copy(update={"checks": []}), notes)
    assert resumed.outcomes == {"1.7": "fail"} and [c.version for c in resumed.transient] == ["1.3"]
    from regress.bisect.plan import next_version

    assert next_version(resumed.versions, resumed.outcomes)[0] == "1.3"


# --------------------------------------------------------------------------------------
# Which failures are which (pip's own words)
# --------------------------------------------------------------------------------------

OUTAGE = """Looking in indexes: http://127.0.0.1:35941/simple
ERROR: Could not find a version that satisfies the requirement tiny-plug==1.1 (from versions: none)
ERROR: No matching distribution found for tiny-plug==1.1
"""
NO_SUCH_RELEASE = """ERROR: Could not find a version that satisfies the requirement tiny-plug==9.9 (from versions: 1.0, 1.1)
ERROR: No matching distribution found for tiny-plug==9.9
"""
MISSING_DEPENDENCY = """Collecting tiny-plug==1.0
  Downloading http://127.0.0.1:35941/files/tiny_plug-1.0-py3-none-any.whl (887 bytes)
ERROR: Could not find a version that satisfies the requirement tiny-missing>=1 (from tiny-plug) (from versions: none)
ERROR: No matching distribution found for tiny-missing>=1
"""
RETRIES = """WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object at 0x7f>: Failed to establish a new connection: [Errno 111] Connection refused')': /simple/vllm/
ERROR: Could not find a version that satisfies the requirement vllm==0.9.1 (from versions: 0.9.0)
"""
TIMEOUT = """pip._vendor.urllib3.exceptions.ReadTimeoutError: HTTPSConnectionPool(host='files.example.org', port=443): Read timed out.
"""
DISK_FULL = """Installing collected packages: torch
ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device
"""
CONFLICT = """ERROR: Cannot install a==1.0 and b==2.0 because these package versions have conflicting dependencies.
ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/
"""
PLATFORM = "ERROR: vllm-0.9-cp312-cp312-manylinux1_x86_64.whl is not a supported wheel on this platform.\n"
BUILD = "error: subprocess-exited-with-error\n  Failed building wheel for tiny-native\n"


FETCH_503 = ("Could not fetch URL http://127.0.0.1:38023/simple/tiny-plug/: HTTPConnectionPool(host='127.0.0.1', "
             "port=38023): Max retries exceeded with url: /simple/tiny-plug/ (Caused by ResponseError('too many 503 "
             "error responses')) - skipping")
FETCH_404 = ("Could not fetch URL http://127.0.0.1:38023/simple/tiny-plug/: 404 Client Error: Not Found for url: "
             "http://127.0.0.1:38023/simple/tiny-plug/ - skipping")
MISSING_DIRECTORY = "WARNING: Location 'file:///opt/pypi/simple/tiny-plug/' is ignored: it is neither a file nor a directory."
FETCHED = "Fetched page http://127.0.0.1:38023/simple/tiny-plug/ as application/vnd.pypi.simple.v1+json"


@pytest.mark.parametrize(("diagnosis", "transient", "words"), [
    ("", True, "gave pip no release of tiny-plug"),
    (FETCH_503, True, "could not be fetched for tiny-plug (HTTP 503)"),
    (f"{FETCH_404}\n{FETCH_503}", True, "(HTTP 503)"),
    (FETCH_404, False, "has no project tiny-plug"),
    (MISSING_DIRECTORY, False, "has no project tiny-plug"),
    (FETCHED, False, "lists no installable release of tiny-plug"),
])
def test_no_release_at_all_is_told_apart_by_how_the_index_answered(diagnosis, transient, words):
    from regress.envs.failures import classify_pip, diagnosis_lines, unlisted

    assert unlisted(OUTAGE, ["tiny-plug==1.1", "other==2"]) == ["tiny-plug==1.1"]
    assert unlisted(MISSING_DEPENDENCY, ["tiny-plug==1.0"]) == []  # a dependency: pip said enough
    failure = classify_pip(OUTAGE, 1, ["tiny-plug==1.1"], diagnosis_lines(f"noise\n{diagnosis}\nmore noise"))
    assert failure.transient is transient and words in failure.cause, failure


@pytest.mark.parametrize(("log", "returncode", "transient", "words"), [
    (RETRIES, 1, True, "network"),
    (TIMEOUT, 2, True, "network"),
    (DISK_FULL, 1, True, "disk full"),
    ("", -9, True, "killed by SIGKILL"),
    ("ERROR: something new\n", 1, True, "does not recognise"),
    (NO_SUCH_RELEASE, 1, False, "no release matches tiny-plug==9.9"),
    (MISSING_DEPENDENCY, 1, False, "its dependency tiny-missing>=1 is not available"),
    (CONFLICT, 1, False, "conflict"),
    (PLATFORM, 1, False, "platform"),
    (BUILD, 1, False, "building it failed"),
])
def test_pip_failures_are_told_apart(log, returncode, transient, words):
    from regress.envs.failures import classify_pip

    failure = classify_pip(log, returncode, ["tiny-plug==1.1", "vllm==0.9.1"])
    assert failure.transient is transient and words in failure.cause, failure


def test_a_full_disk_met_by_regress_itself_is_transient():
    from regress.envs.failures import classify_os_error

    assert classify_os_error(OSError(errno.ENOSPC, "No space left on device")).cause == "disk full"
    assert classify_os_error(OSError(errno.EDQUOT, "Disk quota exceeded")).transient


def test_the_output_says_which_kind_each_failure_was():
    from regress.bisect.record import BisectCheck

    skipped = BisectCheck(version="1.4", candidate="c", outcome="skipped", cause="its requirements conflict", detail="x")
    transient = BisectCheck(version="1.3", candidate="c", outcome="transient", cause="disk full", detail="y")
    assert "SKIP  permanent: cannot be installed (its requirements conflict)" in _check_line(skipped)
    assert "RETRY transient: could not be installed this time (disk full), tried again on the next run" in _check_line(transient)
