"""Integrity of goldens and runs (every shard checked against the manifest's record of it), and
bounded inputs (YAML alias bombs, a report name that is not a path component)."""

from __future__ import annotations

import json
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import run_cli
from regress.errors import ConfigError, DatasetError, IntegrityError, StorageError
from regress.records import CandidateSpec, DatasetRef, Hardware, Memory, ModelInfo, RunManifest, Timings, Versions
from regress.replay import plan_layout
from regress.runs import MANIFEST, load_run, read_manifest, shard_file, write_manifest
from regress.storage import ragged, read_shard, write_shard


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------ shard hashes, through the CLI


@pytest.fixture
def scored_project(tmp_path: Path) -> Path:
    """A golden and a replay in the real storage format (no engine), and a params.yaml."""
    from report_fixtures import build_scored_project

    return build_scored_project(tmp_path)


def _score(project: Path) -> tuple[int, str]:
    result = run_cli("score", "candidate", "--no-report", cwd=project, env={"REGRESS_HOME": str(project / "home")})
    assert "Traceback" not in result.stderr
    return result.returncode, _one_line(result.stderr)


def test_the_manifest_records_every_shard(scored_project: Path):
    manifest = read_manifest(scored_project / "golden")
    assert manifest.shard_files is not None
    assert [f.index for f in manifest.shard_files] == [s.index for s in manifest.layout.shards]
    first = shard_file(scored_project / "golden", 0)
    assert manifest.shard_files[0].size == first.stat().st_size
    assert load_run(scored_project / "golden").verified


def test_a_flipped_byte_exits_3_naming_the_shard(scored_project: Path):
    shard = shard_file(scored_project / "golden", 2)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code, err = _score(scored_project)
    assert code == 3
    assert "golden/shards/shard-00002.shard: shard 2 is not the file the run recorded" in err
    assert not (scored_project / "scores" / "candidate").exists()


def test_a_shard_of_another_run_copied_in_exits_3_naming_it(scored_project: Path):
    # The golden's shard 1 is a valid shard file, of another run.
    shutil.copy(shard_file(scored_project / "golden", 1), shard_file(scored_project / "runs" / "candidate", 1))
    code, err = _score(scored_project)
    assert code == 3
    assert "runs/candidate/shards/shard-00001.shard: shard 1 is not the file the run recorded" in err


def test_a_missing_shard_exits_3_naming_it(scored_project: Path):
    shard_file(scored_project / "runs" / "candidate", 0).unlink()
    code, err = _score(scored_project)
    assert code == 3
    assert "runs/candidate/shards/shard-00000.shard: shard 0 is missing from a run marked complete" in err


def test_a_manifest_without_shard_hashes_is_refused(scored_project: Path):
    """Removing the hashes must not turn the check off: every manifest of this format records them."""
    manifest_path = scored_project / "golden" / MANIFEST
    data = json.loads(manifest_path.read_text(encoding="utf-8"))
    del data["shard_files"]
    manifest_path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(IntegrityError, match="records no shard hashes"):
        load_run(scored_project / "golden")
    code, err = _score(scored_project)
    assert code == 3 and "golden/manifest.json: records no shard hashes" in err, err


# ------------------------------------------------------------------ stamps: run id and fingerprint


def _stamped_run(path: Path, run_id: str, *, prompts: int = 6, shard_size: int = 2) -> RunManifest:
    """A run whose shards carry the engine's stamps (run id, shard fingerprint)."""
    ids = [f"p{i}" for i in range(prompts)]
    layout = plan_layout(ids, shard_size)
    for s in layout.shards:
        tokens, offsets = ragged([[1, 2]] * s.count, np.int32)
        arrays = {"prompt_tokens": tokens, "prompt_offsets": offsets, "output_tokens": tokens,
                  "output_offsets": offsets, "out_token_logprobs": np.zeros(len(tokens), np.float32),
                  "out_top_ids": np.zeros((len(tokens), 1), np.int32),
                  "out_top_logprobs": np.zeros((len(tokens), 1), np.float32)}
        meta = {"fingerprint": f"{run_id}-shard-{s.index}", "run_id": run_id,
                "prompt_ids": ids[s.start:s.start + s.count], "texts": ["t"] * s.count,
                "finish_reasons": ["length"] * s.count, "sampling": [{}] * s.count, "generation_s": 0.1,
                "teacher_forcing_s": 0.0, "prompt_tokens": len(tokens), "output_tokens": len(tokens)}
        write_shard(shard_file(path, s.index), meta, arrays)
    manifest = RunManifest(
        run_id=run_id, kind="golden", candidate=CandidateSpec(name="c", model="m"),
        dataset=DatasetRef(name="d", path="-", sha256="0", prompts=prompts), layout=layout,
        versions=Versions(python="3", regress="0"), model=ModelInfo(model="m"), hardware=Hardware(platform="x"),
        env_vars={}, engine_args={}, teacher_forced=False,
        timings=Timings(engine_load_s=1, generation_s=1, total_s=2, prompt_tokens=1, output_tokens=1, tokens_per_s=1),
        memory=Memory())
    return write_manifest(path, manifest)


def test_the_manifest_records_each_shards_stamps(tmp_path: Path):
    manifest = _stamped_run(tmp_path / "a", "run-a")
    assert [(f.run_id, f.fingerprint) for f in manifest.shard_files or []] == [
        ("run-a", f"run-a-shard-{i}") for i in range(3)]


def test_a_manifest_without_hashes_is_refused_before_any_shard_is_read(tmp_path: Path):
    """Removing the recorded hashes does not turn the check off, whatever the shards hold."""
    _stamped_run(tmp_path / "a", "run-a")
    _stamped_run(tmp_path / "b", "run-b")
    manifest_path = tmp_path / "a" / MANIFEST
    data = json.loads(manifest_path.read_text(encoding="utf-8"))
    del data["shard_files"]
    manifest_path.write_text(json.dumps(data), encoding="utf-8")
    shutil.copy(shard_file(tmp_path / "b", 1), shard_file(tmp_path / "a", 1))
    with pytest.raises(IntegrityError, match=r"records no shard hashes \('shard_files'\)"):
        load_run(tmp_path / "a")


def test_a_shard_restamped_for_another_plan_is_caught(tmp_path: Path):
    """A shard edited to another fingerprint and its recorded hash edited to match: the stamp
    the manifest recorded still differs."""
    manifest = _stamped_run(tmp_path / "a", "run-a")
    shard = shard_file(tmp_path / "a", 0)
    meta, arrays = read_shard(shard)
    meta["fingerprint"] = "another-plan"
    for key in ("shard_format_version", "arrays"):
        meta.pop(key)
    write_shard(shard, meta, arrays)
    from regress.storage import sha256_file

    sha, size = sha256_file(shard)
    files = [f.model_copy(update={"sha256": sha, "size": size}) if f.index == 0 else f for f in manifest.shard_files or []]
    (tmp_path / "a" / MANIFEST).write_text(manifest.model_copy(update={"shard_files": files}).model_dump_json(),
                                           encoding="utf-8")
    with pytest.raises(IntegrityError, match=r"shard-00000.shard: shard 0 was made for another plan"):
        load_run(tmp_path / "a")


def test_a_manifest_is_never_written_over_a_shard_of_another_run(tmp_path: Path):
    _stamped_run(tmp_path / "b", "run-b")
    manifest = _stamped_run(tmp_path / "a", "run-a")
    shutil.copy(shard_file(tmp_path / "b", 2), shard_file(tmp_path / "a", 2))
    with pytest.raises(IntegrityError, match=r"shard-00002.shard: shard 2 belongs to run run-b"):
        write_manifest(tmp_path / "a", manifest)


def test_integrity_errors_exit_3_and_storage_errors_2():
    assert IntegrityError("x").exit_code == 3 and StorageError("x").exit_code == 2


# ------------------------------------------------------------------ YAML alias bombs

# 19 lines: each list holds its predecessor nine times; constructed, 9**9 values (~390 million)
# and far more memory than any machine has. Composing it is cheap (aliases share the node).
BOMB = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"] + [
    f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [" + ", ".join([f"*{chr(ord('a') + i - 1)}"] * 9) + "]"
    for i in range(1, 9)] + [f"# padding {i}" for i in range(10)]) + "\n"


def _bounded_memory_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_the_bomb_is_19_lines():
    assert len(BOMB.splitlines()) == 19


def test_a_params_yaml_alias_bomb_is_refused_fast(tmp_path: Path):
    from regress.config import load_params

    path = tmp_path / "params.yaml"
    path.write_text(BOMB + "baseline: {package: current, model: m}\n", encoding="utf-8")
    before = _bounded_memory_mib()
    started = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        load_params(path)
    assert time.perf_counter() - started < 1.0
    assert _bounded_memory_mib() - before < 50
    assert caught.value.file == str(path) and caught.value.line is not None and caught.value.line <= 9
    assert "alias" in str(caught.value)


def test_too_many_aliases_are_refused_at_the_first_one_too_many(tmp_path: Path):
    from regress.config import load_params

    path = tmp_path / "params.yaml"
    path.write_text("x: &x 1\n" + "".join(f"k{i}: *x\n" for i in range(150)), encoding="utf-8")
    with pytest.raises(ConfigError, match="more than 100 aliases") as caught:
        load_params(path)
    assert caught.value.line == 102  # the 101st alias


def test_a_recursive_alias_is_refused(tmp_path: Path):
    from regress.config import load_params

    path = tmp_path / "params.yaml"
    path.write_text("a: &a [1, *a]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="refers to a collection that contains it"):
        load_params(path)


def test_a_dataset_card_alias_bomb_is_refused_fast(tmp_path: Path):
    from regress.datasets import load_prompt_set

    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n", encoding="utf-8")
    (tmp_path / "p.yaml").write_text(BOMB, encoding="utf-8")
    started = time.perf_counter()
    with pytest.raises(DatasetError) as caught:
        load_prompt_set(tmp_path / "p.jsonl")
    assert time.perf_counter() - started < 1.0
    assert "p.yaml" in str(caught.value) and "alias" in str(caught.value)


def test_anchors_and_aliases_of_normal_size_keep_working(tmp_path: Path):
    """A params.yaml sharing engine arguments between candidates through an anchor, and a merge key."""
    from regress.config import load_params

    path = tmp_path / "params.yaml"
    path.write_text(
        "dataset: p.jsonl\n"
        "baseline:\n  package: current\n  model: m\n  engine_args: &args {enforce_eager: true, max_model_len: 512}\n"
        "candidates:\n"
        "  a: {dtype: float16, engine_args: *args}\n"
        "  b:\n    <<: {dtype: float16}\n    engine_args: *args\n", encoding="utf-8")
    params = load_params(path)
    assert params.candidate("a").engine_args == {"enforce_eager": True, "max_model_len": 512}
    assert params.candidate("b").dtype == "float16"
    assert params.key_lines["candidates.b.engine_args"] == 10


def test_the_repos_own_params_and_pipeline_load():
    from conftest import REPO
    from regress.config import load_params
    from regress.validation import load_yaml

    load_params(REPO / "params.yaml")
    assert load_yaml((REPO / "dvc.yaml").read_text(encoding="utf-8")) == yaml.safe_load(
        (REPO / "dvc.yaml").read_text(encoding="utf-8"))


# ------------------------------------------------------------------ `regress report NAME`


@pytest.mark.parametrize("name", ["../../etc", "..", "a/b", ".hidden", "", "x" * 101])
def test_report_refuses_a_name_that_is_not_a_candidate_name(tmp_path: Path, name: str):
    result = run_cli("report", name, cwd=tmp_path, env={"REGRESS_HOME": str(tmp_path / "home")})
    assert result.returncode == 2, result.stderr
    assert "is not a candidate name" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "reports").exists()
