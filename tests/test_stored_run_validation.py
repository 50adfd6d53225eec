"""A stored run (golden or replay) read back from disk is untrusted: every value is checked as it
is read (regress.run_values), a manifest without shard hashes is refused, a candidate must hold
the golden's whole prompt set, and a scoring that fails writes none of its outputs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from conftest import run_cli
from regress.errors import ConfigError, IntegrityError, RunError, StorageError
from regress.runs import MANIFEST, load_run, read_manifest, shard_file, write_manifest
from regress.storage import read_shard, write_shard


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A golden (``golden``) and a replay (``runs/candidate``) of 12 prompts in 3 shards, no engine."""
    from report_fixtures import build_scored_project

    return build_scored_project(tmp_path)


def _golden(project: Path) -> Path:
    return project / "golden"


def _run(project: Path) -> Path:
    return project / "runs" / "candidate"


def _edit_shard(run_dir: Path, index: int, change: Callable[[dict[str, Any], dict[str, np.ndarray]], None]) -> Path:
    """Change shard ``index`` and record its new hash (as a tool that rewrites the manifest would)."""
    file = shard_file(run_dir, index)
    meta, arrays = read_shard(file)
    meta = {k: v for k, v in meta.items() if k not in ("arrays", "shard_format_version")}
    arrays = {k: np.array(v) for k, v in arrays.items()}
    change(meta, arrays)
    write_shard(file, meta, arrays)
    write_manifest(run_dir, read_manifest(run_dir))
    return file


def _edit_manifest(run_dir: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = run_dir / MANIFEST
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def _set(key: str, value: Any, where: Any = slice(None)) -> Callable[[dict, dict], None]:
    def change(meta: dict, arrays: dict) -> None:
        arrays[key][where] = value
    return change


def _meta(key: str, value: Callable[[list], list]) -> Callable[[dict, dict], None]:
    def change(meta: dict, arrays: dict) -> None:
        meta[key] = value(meta[key])
    return change


def _replace(key: str, make: Callable[[np.ndarray], np.ndarray]) -> Callable[[dict, dict], None]:
    def change(meta: dict, arrays: dict) -> None:
        arrays[key] = make(arrays[key])
    return change


def _narrow(meta: dict, arrays: dict) -> None:
    arrays["tf_top_ids"] = arrays["tf_top_ids"][:, :1].copy()
    arrays["tf_top_logprobs"] = arrays["tf_top_logprobs"][:, :1].copy()


IMPOSSIBLE = {
    # case: (which run, change, the field the error names)
    "nan_tf_logprob": ("run", _set("tf_token_logprobs", np.nan, 3), "'tf_token_logprobs' holds nan"),
    "nan_out_logprobs": ("run", _set("out_top_logprobs", np.nan), "'out_top_logprobs' holds nan"),
    "positive_logprob": ("run", _set("tf_token_logprobs", 5.0), "'tf_token_logprobs' holds 5.0"),
    "inf_in_golden": ("golden", _set("out_top_logprobs", np.inf, (slice(None), slice(1, None))),
                      "'out_top_logprobs' holds inf"),
    "token_id_too_large": ("run", _set("output_tokens", 10 ** 9), "'output_tokens' holds the token id 1000000000"),
    "negative_top_id": ("run", _set("out_top_ids", -7), "'out_top_ids' holds the token id -7"),
    "padding_id_with_a_logprob": ("run", _set("out_top_ids", -1, (0, 1)), "'out_top_ids' holds the padding id -1"),
    "float_token_ids": ("run", _replace("output_tokens", lambda a: a.astype(np.float64) + 0.5),
                        "'output_tokens' is float64"),
    "two_dimensional_tokens": ("run", _replace("output_tokens", lambda a: np.stack([a, a], axis=1)),
                               "'output_tokens' is int32 shaped"),
    "top_k_widths_differ": ("run", _narrow, "'tf_top_ids' has 1 top-k columns, 'out_top_ids' 5"),
    "texts_not_strings": ("run", _meta("texts", lambda v: [1] * len(v)), "'texts'[0] is '1', not a text"),
    "finish_reason_junk": ("run", _meta("finish_reasons", lambda v: [{"x": 1}] * len(v)), "'finish_reasons'[0]"),
    "finish_reason_unknown": ("run", _meta("finish_reasons", lambda v: ["abort"] * len(v)), "'finish_reasons'[0]"),
    "sampling_junk": ("run", _meta("sampling", lambda v: ["hello"] * len(v)), "'sampling'[0]"),
    "sampling_bad_field": ("run", _meta("sampling", lambda v: [{**v[0], "logprobs": "five"}] * len(v)),
                           "'sampling'[0] is not a sampling record"),
    "prompt_id_twice": ("run", _meta("prompt_ids", lambda v: [v[0]] * len(v)), "'prompt_ids'[1] repeats"),
    "golden_prompt_id_twice": ("golden", _meta("prompt_ids", lambda v: [v[0], v[0], *v[2:]]), "'prompt_ids'[1]"),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_an_impossible_value_is_refused_on_load_naming_the_shard_and_field(project: Path, case: str):
    which, change, field = IMPOSSIBLE[case]
    run_dir = _golden(project) if which == "golden" else _run(project)
    file = _edit_shard(run_dir, 0, change)
    with pytest.raises(StorageError) as caught:
        load_run(run_dir)
    assert str(caught.value).startswith(f"{file}: not a consistent shard")
    assert field in str(caught.value)


def test_a_prompt_id_in_two_shards_is_refused(project: Path):
    first = read_shard(shard_file(_run(project), 0))[0]["prompt_ids"][0]
    file = _edit_shard(_run(project), 1, _meta("prompt_ids", lambda v: [first, *v[1:]]))
    with pytest.raises(StorageError, match="a prompt is stored once") as caught:
        load_run(_run(project))
    assert str(caught.value).startswith(str(file))


def test_values_an_engine_writes_still_load(project: Path):
    """-inf logprobs with -1 padding (fewer than k alternatives), a rounding hair above 0."""
    def change(meta: dict, arrays: dict) -> None:
        arrays["out_top_ids"][0, 3:] = -1
        arrays["out_top_logprobs"][0, 3:] = -np.inf
        arrays["tf_token_logprobs"][1] = -np.inf
        arrays["out_top_logprobs"][2, 0] = arrays["out_token_logprobs"][2] = 5e-5

    _edit_shard(_run(project), 0, change)
    assert len(load_run(_run(project))) == 12


def _score_cli(project: Path) -> tuple[int, str]:
    result = run_cli("score", "candidate", cwd=project, env={"REGRESS_HOME": str(project / "home")})
    assert "Traceback" not in result.stderr
    return result.returncode, " ".join(result.stderr.split())


def test_an_impossible_value_exits_2_and_writes_nothing(project: Path):
    _edit_shard(_run(project), 0, _set("out_token_logprobs", np.nan))
    code, err = _score_cli(project)
    assert code == 2, err
    assert "runs/candidate/shards/shard-00000.shard: not a consistent shard: array 'out_token_logprobs'" in err
    assert not (project / "scores" / "candidate").exists() and not (project / "reports").exists()


def test_teacher_forced_tokens_that_are_not_the_goldens_are_refused(project: Path):
    from regress.scoring import score_runs

    file = _edit_shard(_run(project), 1, _set("tf_tokens", 0))
    with pytest.raises(StorageError, match="'tf_tokens' of prompt 'p00004' is not the golden's completion") as caught:
        score_runs(load_run(_golden(project)), load_run(_run(project)))
    assert str(caught.value).startswith(str(file))


def test_a_golden_that_is_a_replay_is_refused(project: Path):
    from regress.scoring import score_runs

    _edit_manifest(_golden(project), lambda m: m.update(kind="replay"))
    with pytest.raises(StorageError, match="'kind' is 'replay': not a golden") as caught:
        score_runs(load_run(_golden(project)), load_run(_run(project)))
    assert str(caught.value).startswith(str(_golden(project) / MANIFEST))


def test_a_run_that_is_not_a_replay_is_not_scored(project: Path):
    _edit_manifest(_run(project), lambda m: m.update(kind="golden", golden=None))
    code, err = _score_cli(project)
    assert code == 2 and "runs/candidate/manifest.json: 'kind' is 'golden'" in err, err


# ------------------------------------------------------------------ the whole prompt set


def test_a_candidate_holding_part_of_the_goldens_prompts_exits_2(project: Path):
    def drop_last_shard(m: dict) -> None:
        m["layout"]["shards"] = m["layout"]["shards"][:2]
        m["shard_files"] = m["shard_files"][:2]
        m["dataset"]["prompts"] = 8

    _edit_manifest(_run(project), drop_last_shard)
    shard_file(_run(project), 2).unlink()
    assert len(load_run(_run(project))) == 8  # a run of its own: loads
    code, err = _score_cli(project)
    assert code == 2, err
    assert "4 prompt(s) of the golden golden are not in runs/candidate (first: p00008)" in err
    assert not (project / "scores" / "candidate").exists()


def test_check_same_entries_is_what_tries_skip(project: Path):
    from regress.run_pairs import check_same_entries

    golden, run = load_run(_golden(project)), load_run(_run(project))
    check_same_entries(golden, run)  # the whole set: fine
    smaller = load_run(_run(project))
    smaller.prompt_ids.pop()
    smaller.__post_init__()
    with pytest.raises(ConfigError, match="1 prompt\\(s\\) of the golden"):
        check_same_entries(golden, smaller)


# ------------------------------------------------------------------ shard hashes


def test_a_manifest_without_shard_hashes_is_refused(project: Path):
    _edit_shard(_run(project), 0, _set("tf_token_logprobs", 0.0))
    _edit_manifest(_run(project), lambda m: m.update(shard_files=None))
    with pytest.raises(IntegrityError, match="records no shard hashes"):
        load_run(_run(project))
    code, err = _score_cli(project)
    assert code == 3 and "runs/candidate/manifest.json: records no shard hashes ('shard_files')" in err, err
    assert not (project / "scores" / "candidate").exists()


# ------------------------------------------------------------------ outputs: all or nothing


def test_a_nan_in_the_manifest_is_refused_and_earlier_scores_stay(project: Path):
    code, err = _score_cli(project)
    assert code in (0, 1), err
    scores = project / "scores" / "candidate"
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in scores.iterdir()}
    text = (_run(project) / MANIFEST).read_text(encoding="utf-8")
    (_run(project) / MANIFEST).write_text(text.replace('"tokens_per_s": 75.0', '"tokens_per_s": NaN'))
    with pytest.raises(StorageError, match="finite number at timings.tokens_per_s"):
        read_manifest(_run(project))
    code, err = _score_cli(project)
    assert code == 2 and "runs/candidate/manifest.json: invalid manifest" in err, err
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in scores.iterdir()} == before


def test_a_negative_time_is_refused(project: Path):
    _edit_manifest(_run(project), lambda m: m["timings"].update(engine_load_s=-5))
    with pytest.raises(StorageError, match="engine_load_s is -5.0"):
        read_manifest(_run(project))


def test_a_scoring_that_would_not_read_back_is_not_written(project: Path, tmp_path: Path):
    from regress.scoring import score_runs, write_score_outputs

    scored = score_runs(load_run(_golden(project)), load_run(_run(project)))
    broken = scored.model_copy(update={"metrics": scored.metrics.model_copy(update={"tokens_per_s": float("nan")})})
    with pytest.raises(RunError, match="would not read back"):
        write_score_outputs(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_report_that_fails_leaves_the_earlier_scores_and_report(project: Path, monkeypatch: pytest.MonkeyPatch):
    import regress.report
    from regress.checks import score_candidate
    from regress.config import load_params

    monkeypatch.setenv("REGRESS_HOME", str(project / "home"))
    params = load_params(project / "params.yaml")
    score_candidate(params, params.candidate("candidate"))
    outputs = [*(project / "scores").rglob("*"), *(project / "reports").rglob("*")]
    before = {p: p.read_bytes() for p in outputs if p.is_file()}
    assert project / "reports" / "candidate" / "index.html" in before

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the page could not be rendered")

    monkeypatch.setattr(regress.report, "write_candidate_report", fail)
    with pytest.raises(RuntimeError):
        score_candidate(params, params.candidate("candidate"))
    after = [*(project / "scores").rglob("*"), *(project / "reports").rglob("*")]
    assert {p: p.read_bytes() for p in after if p.is_file()} == before
