"""`regress init`: a working minimal project for your model or your running server, as the README's
"check your own model" steps write it (the fixture model stands in for yours: not the demo's model,
not the demo's prompts). The running-server steps are in tests/test_server_backend.py, against a
real vLLM server. Refusals and hostile server answers need no engine."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from fake_openai_server import FakeOpenAIServer

FILES = ("params.yaml", "datasets/prompts/prompts.jsonl", "datasets/prompts/prompts.yaml", "dvc.yaml",
         ".github/workflows/regression.yml")


def _model_dir(root: Path, *, chat: bool = True) -> Path:
    model = root / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"} if chat else {}))
    return model


def _venv_path() -> dict[str, str]:
    # The stages are `regress ...` commands: the interpreter's bin directory on PATH, as after activating it.
    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_init_writes_a_project_that_validates(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    project = tmp_path / "project"
    result = run_cli("init", str(project), "--model", str(model))
    assert result.returncode == 0, result.stderr
    for name in FILES:
        assert (project / name).is_file(), name
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert params["baseline"]["package"] == "current" and params["baseline"]["model"] == str(model.resolve())
    assert list(params["candidates"]) == ["prefix-cache-off"]
    stages = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]
    assert set(stages) == {"golden", "replay", "score", "report"}  # none of the demo's prompts/model/quantize
    workflow = yaml.safe_load((project / ".github/workflows/regression.yml").read_text())
    assert "pull_request" not in workflow[True] and "pull_request_target" not in workflow[True]  # YAML's `on`
    assert any("regress gate --annotate" in str(s.get("run")) for s in workflow["jobs"]["check"]["steps"])
    assert (project / ".dvc").is_dir() and "dvc repro" in result.stdout
    checked = run_cli("validate", "params.yaml", cwd=project)
    assert checked.returncode == 0, checked.stderr
    # A model without a chat template gets only plain prompts (chat prompts would stop the run).
    plain = tmp_path / "plain"
    plain.mkdir()
    assert run_cli("init", str(plain), "--model", str(_model_dir(plain, chat=False))).returncode == 0
    lines = (plain / "datasets/prompts/prompts.jsonl").read_text().splitlines()
    assert lines and not any('"messages"' in line for line in lines)


def test_init_refuses_without_writing(tmp_path: Path) -> None:
    none = run_cli("init", str(tmp_path / "a"))
    assert none.returncode == 2 and "--model DIR" in none.stderr
    not_model = run_cli("init", str(tmp_path / "b"), "--model", str(tmp_path))
    assert not_model.returncode == 2 and "not a model directory" in not_model.stderr
    assert not (tmp_path / "b" / "params.yaml").exists()
    project = tmp_path / "c"
    project.mkdir()
    (project / "dvc.yaml").write_text("mine\n")
    taken = run_cli("init", str(project), "--model", str(_model_dir(tmp_path)))
    assert taken.returncode == 2 and "dvc.yaml" in taken.stderr and "--force" in taken.stderr
    assert (project / "dvc.yaml").read_text() == "mine\n" and not (project / "params.yaml").exists()
    assert run_cli("init", str(project), "--model", str(tmp_path / "my-model"), "--force").returncode == 0
    assert (project / "dvc.yaml").read_text() != "mine\n"
    bad_url = run_cli("init", str(tmp_path / "d"), "--url", "http://user:pw@host:8000")
    assert bad_url.returncode == 2 and "credentials" in bad_url.stderr


def _models_route(body: bytes):
    def answer(handler) -> None:  # type: ignore[no-untyped-def]
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return answer


@pytest.mark.parametrize("body, said", [
    (b'{"data": [{"id": "a"}, {"id": "b"}]}', "exactly one plain model"),
    (b'{"data": [{"id": "m\\n::error::forged"}]}', "exactly one plain model"),
    (b'{"data": [{"id": "../../etc/passwd; rm -rf /"}]}', "exactly one plain model"),
    (b'not json', "pass --model NAME"),
    (b'{"data": "x"}', "exactly one plain model"),
])
def test_the_served_name_is_data_checked_before_use(tmp_path: Path, body: bytes, said: str) -> None:
    with FakeOpenAIServer("m", routes={"/v1/models": _models_route(body)}) as server:
        result = run_cli("init", str(tmp_path / "p"), "--url", server.url)
    assert result.returncode == 2 and said in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "p" / "params.yaml").exists()


def test_init_asks_the_server_which_model_it_serves(tmp_path: Path) -> None:
    with FakeOpenAIServer("served/model-1", key="s3cr3t-value") as server:
        result = run_cli("init", str(tmp_path / "p"), "--url", server.url, "--api-key-env", "MY_KEY",
                         env={"MY_KEY": "s3cr3t-value"})
    assert result.returncode == 0, result.stderr
    params = yaml.safe_load((tmp_path / "p" / "params.yaml").read_text())
    assert params["baseline"]["model"] == "served/model-1" and params["baseline"]["package"] == "current"
    assert params["baseline"]["server"] == {"url": server.url, "api_key_env": "MY_KEY"}
    assert "s3cr3t" not in "".join(p.read_text() for p in (tmp_path / "p").rglob("*") if p.is_file())  # the name only
    assert params["candidates"] == {"served-again": {}}


def test_the_readme_reaches_check_your_own_model_early() -> None:
    from doc_commands import README, readme_section_commands

    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250
    assert "## Check your own model" in lines[:80]
    assert readme_section_commands("Check your own model") == [
        "regress init --model path/to/your-model", "dvc repro", "regress gate"]
    assert readme_section_commands("Check your running server")[0].startswith("regress init --url ")


@pytest.mark.engine
def test_check_your_own_model_as_the_readme_says(fixture_model: Path, tmp_path: Path) -> None:
    """The README's "Check your own model" commands, run as written (the fixture model for
    `path/to/your-model`) in an empty directory, the virtual environment's tools on PATH."""
    import shlex
    import subprocess

    from doc_commands import readme_section_commands

    project = tmp_path / "mine"
    project.mkdir()
    env = {**os.environ, **_venv_path()}
    results = []
    for command in readme_section_commands("Check your own model"):
        argv = [str(fixture_model) if word == "path/to/your-model" else word for word in shlex.split(command)]
        results.append(subprocess.run(argv, cwd=project, capture_output=True, text=True, env=env, timeout=1500))
    init, repro, gate = results
    assert init.returncode == 0, init.stderr
    assert repro.returncode == 0, repro.stdout[-3000:] + repro.stderr[-3000:]
    for name in ("golden/manifest.json", "golden/noise.json", "runs/prefix-cache-off/manifest.json",
                 "scores/prefix-cache-off/metrics.json", "reports/index.html", "reports/prefix-cache-off/junit.xml"):
        assert (project / name).is_file(), name
    assert gate.returncode in (0, 1), gate.stderr
    assert "prefix-cache-off" in gate.stdout and "gate fidelity" in gate.stdout
    metrics = json.loads((project / "scores/prefix-cache-off/metrics.json").read_text())
    assert metrics["prompts"] == 13 and metrics["gate"] == "fidelity"
