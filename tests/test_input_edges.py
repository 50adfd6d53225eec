"""Bad input at the edges is exit 2 naming the file, line, field or option, with nothing written
or deleted: params' ``paths`` that would make regress replace the prompt set, the project or
another output; a bisect's package and versions (checked before the index is asked or the project
locked) and its --index-url; a prompt set's card that is a directory or a dangling link;
``demo-prompts --out`` and ``init`` at a file; a failed ``init`` leaves no directory behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from regress.errors import ConfigError, ConfigProblems

PLUGIN_PATH = str(REPO / "tests")
BASELINE = ("baseline:\n  backend: plugins.fake_backends:EchoBackend\n  model: none\n"
            f"  env: {json.dumps({'PYTHONPATH': PLUGIN_PATH})}\n")


def _project(root: Path, *, dataset: str = "p.jsonl", paths: str = "") -> Path:
    prompts = root / dataset
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt number {i}"}) + "\n" for i in range(3)))
    params = root / "params.yaml"
    params.write_text(f"dataset: {dataset}\nshard_size: 4\n" + BASELINE + paths, encoding="utf-8")
    return params


def _problems(path: Path) -> list[ConfigError]:
    from regress.config import load_params

    with pytest.raises(ConfigError) as caught:
        load_params(path)
    return list(caught.value.problems) if isinstance(caught.value, ConfigProblems) else [caught.value]


# -- params' paths ---------------------------------------------------------------------------

@pytest.mark.parametrize(("paths", "field", "words"), [
    ("paths:\n  golden: ''\n", "paths.golden", "must not be empty"),
    ("paths:\n  runs: .\n", "paths.runs", "is the project directory"),
    ("paths:\n  scores: ./sub/..\n", "paths.scores", "is the project directory"),
    ("paths:\n  reports: ..\n", "paths.reports", "or above it"),
    ("paths:\n  power: golden\n", "paths.power", "is the same directory as paths.golden"),
    ("paths:\n  runs: golden/runs\n", "paths.runs", "is inside paths.golden"),
    ("paths:\n  reports: golden/../out/reports\n  scores: out\n", "paths.scores", "holds paths.reports"),
])
def test_paths_that_overlap_the_project_or_each_other_are_refused(tmp_path, paths, field, words):
    [problem] = _problems(_project(tmp_path, paths=paths))
    key = field.split(".")[1] + ":"
    line = 6 + next(i for i, text in enumerate(paths.splitlines(), 1) if text.strip().startswith(key))
    assert problem.field == field and problem.line == line, problem
    assert words in problem.message


def test_an_absolute_path_to_the_project_is_refused(tmp_path):
    [problem] = _problems(_project(tmp_path, paths=f"paths:\n  golden: {tmp_path}\n"))
    assert problem.field == "paths.golden" and "is the project directory" in problem.message


@pytest.mark.parametrize(("dataset", "paths", "field", "line"), [
    ("data/p.jsonl", "paths:\n  golden: data\n", "paths.golden", 8),
    ("runs/sets/p.jsonl", "", "dataset", 1),  # the default runs/ written nowhere: said at the dataset
    ("out/p.jsonl", "paths: {reports: out}\n", "paths.reports", 7),
])
def test_a_path_holding_the_prompt_set_is_refused(tmp_path, dataset, paths, field, line):
    [problem] = _problems(_project(tmp_path, dataset=dataset, paths=paths))
    assert problem.field == field and problem.line == line, problem
    assert "prompt set" in problem.message


def test_separate_paths_beside_each_other_and_beside_the_prompt_set_load(tmp_path):
    from regress.config import load_params

    paths = "paths:\n  golden: out/golden\n  runs: out/runs\n  scores: out/scores\n  reports: out/reports\n"
    params = load_params(_project(tmp_path, dataset="data/p.jsonl", paths=paths + "  power: data/power\n"))
    assert params.golden_dir() == tmp_path / "out" / "golden"


def test_validate_reports_a_bad_path_and_golden_deletes_nothing(tmp_path):
    params = _project(tmp_path, dataset="data/p.jsonl", paths="paths: {golden: data}\n")
    (tmp_path / "data" / "README").write_text("precious\n")
    checked = run_cli("validate", "params.yaml", cwd=tmp_path)
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "params.yaml:7: field 'paths.golden'" in checked.stderr
    golden = run_cli("golden", cwd=tmp_path)
    assert golden.returncode == 2, golden.stdout + golden.stderr
    assert "field 'paths.golden'" in golden.stderr and "Traceback" not in golden.stderr
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["README", "p.jsonl"]
    assert params.is_file()


def test_an_empty_golden_path_is_exit_2_not_a_crash(tmp_path):
    _project(tmp_path, paths="paths:\n  golden: ''\n")
    done = run_cli("golden", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "params.yaml:8: field 'paths.golden'" in done.stderr


# -- bisect ----------------------------------------------------------------------------------

DEAD_INDEX = "http://127.0.0.1:9/simple"  # nothing listens: asking it is exit 3


@pytest.mark.parametrize(("args", "named"), [
    (["vllm", "--good", "0.2", "--bad", "0.1"], "'--good'"),
    (["vllm", "--good", "0.2", "--bad", "0.2"], "'--good'"),
    (["vllm", "--good", "notaversion", "--bad", "0.1"], "'--good'"),
    (["vllm", "--good", "0.1", "--bad", "latest"], "'--bad'"),
    (["vllm>=1", "--good", "0.1", "--bad", "0.2"], "'PACKAGE'"),
    (["../../etc", "--good", "0.1", "--bad", "0.2"], "'PACKAGE'"),
    (["", "--good", "0.1", "--bad", "0.2"], "'PACKAGE'"),
])
def test_bisect_refuses_bad_input_before_the_index_or_the_lock(tmp_path, monkeypatch, args, named):
    from regress.project_lock import project_lock

    _project(tmp_path)
    home = tmp_path / "home"
    monkeypatch.setenv("REGRESS_HOME", str(home))
    # Another command holds the project: bad input must be said first, not "locked" nor "unreachable".
    with project_lock(tmp_path, "regress check elsewhere"):
        done = run_cli("bisect", *args, "--index-url", DEAD_INDEX, cwd=tmp_path, env={"REGRESS_HOME": str(home)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"field {named}" in done.stderr, done.stderr
    assert "unreachable" not in done.stderr and "elsewhere" not in done.stderr


@pytest.mark.parametrize(("how", "named"), [
    ({"args": ["--index-url", "notaurl"]}, "--index-url"),
    ({"env": {"REGRESS_INDEX_URL": "ftp://mirror/simple"}}, "REGRESS_INDEX_URL"),
])
def test_a_bad_index_url_names_where_it_came_from(tmp_path, how, named):
    _project(tmp_path)
    done = run_cli("bisect", "vllm", "--good", "0.1", "--bad", "0.2", *how.get("args", []), cwd=tmp_path,
                   env={"REGRESS_HOME": str(tmp_path / "home"), **how.get("env", {})})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"field '{named}'" in done.stderr and "watch.index_url" not in done.stderr, done.stderr


def test_an_index_password_with_an_unencoded_slash_is_refused_and_never_printed(tmp_path):
    # urlsplit reads https://ci:pa/ss@mirror as host "ci" and path "/ss@mirror": asked as it is,
    # the request would go to another host, and a message would print the password.
    _project(tmp_path)
    for how in ({"args": ["--index-url", "https://ci:s3cr/et@mirror.example/simple"]},
                {"env": {"REGRESS_INDEX_URL": "https://ci:s3cr/et?x#y@mirror.example/simple"}}):
        done = run_cli("bisect", "vllm", "--good", "0.1", "--bad", "0.2", *how.get("args", []), cwd=tmp_path,
                       env={"REGRESS_HOME": str(tmp_path / "home"), **how.get("env", {})})
        assert done.returncode == 2, done.stdout + done.stderr
        assert "s3cr" not in done.stdout + done.stderr and "percent-encoded" in done.stderr, done.stderr


def test_bisect_keeps_the_watch_sections_bounds_on_the_index(tmp_path):
    from pep691_index import LocalIndex

    params = _project(tmp_path)
    params.write_text(params.read_text() + "watch:\n  max_index_mib: 0.0001\n")  # about 100 bytes
    index = LocalIndex().start()
    try:
        for version in ("0.1", "0.2", "0.3"):
            index.add("vllm", version)
        done = run_cli("bisect", "vllm", "--good", "0.1", "--bad", "0.3", "--index-url", index.url, cwd=tmp_path,
                       env={"REGRESS_HOME": str(tmp_path / "home")})
    finally:
        index.stop()
    assert done.returncode == 3, done.stdout + done.stderr
    assert "larger than" in done.stderr and "(the limit)" in done.stderr, done.stderr


# -- a prompt set's card ---------------------------------------------------------------------

def _prompt_set(root: Path, name: str) -> Path:
    path = root / f"{name}.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    return path


def test_a_card_that_is_a_directory_is_exit_2_naming_it(tmp_path):
    _prompt_set(tmp_path, "carddir")
    (tmp_path / "carddir.yaml").mkdir()
    done = run_cli("validate", "carddir.jsonl", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "carddir.yaml: not a file" in done.stderr and "unexpected" not in done.stderr


def test_a_dangling_card_link_is_exit_2_not_no_card(tmp_path):
    _prompt_set(tmp_path, "dangle")
    (tmp_path / "dangle.yaml").symlink_to("/nonexistent/card.yaml")
    done = run_cli("validate", "dangle.jsonl", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "dangle.yaml: a link to /nonexistent/card.yaml, which does not exist" in done.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_an_unreadable_card_is_a_dataset_error(tmp_path):
    from regress.datasets import check_prompt_set

    path = _prompt_set(tmp_path, "locked")
    card = tmp_path / "locked.yaml"
    card.write_text("description: x\n")
    card.chmod(0)
    try:
        prompt_set, [problem] = check_prompt_set(path)
    finally:
        card.chmod(0o644)
    assert prompt_set is None and problem.file == str(card) and "cannot read it" in problem.message


# -- demo-prompts and init -------------------------------------------------------------------

@pytest.mark.parametrize("out", ["afile", "afile/sub"])
def test_demo_prompts_into_a_file_is_exit_2_naming_it(tmp_path, out):
    (tmp_path / "afile").write_text("mine\n")
    done = run_cli("demo-prompts", "--out", out, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{out}:" in done.stderr and "unexpected" not in done.stderr
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_demo_prompts_writes_nothing_when_the_card_cannot_be_written(tmp_path):
    from regress.datasets import FIXTURE_PROMPTS, card_path_for

    (tmp_path / "out" / card_path_for(FIXTURE_PROMPTS).name).mkdir(parents=True)
    done = run_cli("demo-prompts", "--set", "fixture", "--out", "out", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert not (tmp_path / "out" / FIXTURE_PROMPTS.name).exists()


def _model(root: Path) -> Path:
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


@pytest.mark.parametrize("target", ["afile", "afile/sub"])
def test_init_at_a_file_is_exit_2_naming_it(tmp_path, target):
    model = _model(tmp_path)
    (tmp_path / "afile").write_text("mine\n")
    done = run_cli("init", target, "--model", str(model), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{target}: cannot write the project there" in done.stderr and "unexpected" not in done.stderr
    assert (tmp_path / "afile").read_text() == "mine\n"


@pytest.mark.parametrize("args", [
    ["--url", "notaurl"],
    ["--url", "http://127.0.0.1:9"],
    ["--model", "/nonexistent/model"],
    [],
])
def test_a_failed_init_leaves_no_directory(tmp_path, args):
    done = run_cli("init", "newproj", *args, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert not (tmp_path / "newproj").exists()
