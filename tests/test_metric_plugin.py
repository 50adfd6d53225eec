"""A metric from another package, installed with pip, gates the verdict and shows everywhere with
no change to regress; and the plugin registry it comes through."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from report_fixtures import NO_SEMANTIC, Case, build_case
from regress.errors import UnknownPluginError
from regress.plugins import Registry

PLUGIN = '''
"""How much longer one output is than the other: a third-party regress metric."""
from regress.metrics.base import Aggregate, Bound, Output, Setting, metric


@metric("length_ratio", outputs=[Output(
    "length_ratio", "longer output's characters / shorter output's (1 = same length)",
    label="length ratio", better="lower", aggregate=Aggregate("max", label="worst length ratio"),
    regression=Bound(Setting("regression_length_ratio", 3.0, ge=1, doc="above this is a regression")))])
def length_ratio():
    def score(pair):
        g, c = len(pair.golden.text), len(pair.candidate.text)
        return {"length_ratio": max(g, c) / max(min(g, c), 1)}
    return score
'''

PYPROJECT = '''
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "regress-length-ratio"
version = "0.1.0"

[project.entry-points."regress.metrics"]
length_ratio = "regress_length_ratio:length_ratio"

[tool.setuptools]
py-modules = ["regress_length_ratio"]
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin package, built and installed by pip into a directory of its own (not regress's venv)."""
    root = tmp_path_factory.mktemp("plugin")
    src = root / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "regress_length_ratio.py").write_text(PLUGIN)
    target = root / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                             "--no-index", "--target", str(target), str(src)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert list(target.glob("regress_length_ratio-*.dist-info/entry_points.txt"))
    return target


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    """Synthetic golden and candidate runs (every class present) in a project with a params.yaml."""
    root = tmp_path_factory.mktemp("project")
    return build_case(root, 20, semantic=False)


def _params(case: Case, **thresholds: object) -> None:
    data = {
        "dataset": "prompts.jsonl",
        "baseline": {"package": "current", "model": "synthetic/model"},
        "candidates": {"candidate": {"dtype": "float16"}},
        # Allow the regressions the built-in metrics find, so that the plugin alone decides the verdict.
        "thresholds": {"metrics": [*NO_SEMANTIC, "length_ratio"], "max_regressions": case.score.metrics.regression,
                       **thresholds},
    }
    (case.root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _cli(case: Case, site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=case.root, env={"PYTHONPATH": str(site)})


def _score(case: Case, site: Path) -> subprocess.CompletedProcess[str]:
    return _cli(case, site, "score", "candidate", "--run", "run")


def _ratio(case: Case, pid: str) -> float:
    g, c = (len(r.texts[r.position(pid)]) for r in (case.golden, case.run))
    return max(g, c) / max(min(g, c), 1)


def _page_data(path: Path) -> dict:
    page = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page, flags=re.S).group(1))


def test_plugin_metric_is_computed_aggregated_and_shown(case: Case, site: Path) -> None:
    _params(case)
    result = _score(case, site)
    assert result.returncode == 0, result.stderr
    scores = json.loads((case.root / "scores" / "candidate" / "scores.json").read_text())
    ratios = {s["prompt_id"]: s["metrics"]["length_ratio"] for s in scores["scores"]}
    assert ratios == pytest.approx({pid: _ratio(case, pid) for pid in case.run.prompt_ids})
    assert scores["thresholds"]["regression_length_ratio"] == 3.0  # the plugin's default
    assert max(ratios.values()) < 3.0

    metrics = json.loads((case.root / "scores" / "candidate" / "metrics.json").read_text())
    assert metrics["extra"] == {"max_length_ratio": pytest.approx(max(ratios.values()))}
    assert metrics["verdict"] == "pass"
    assert _cli(case, site, "gate", "candidate").returncode == 0

    reports = case.root / "reports" / "candidate"
    data = _page_data(reports / "index.html")
    assert "length_ratio" in data["metrics"] and data["specs"]["length_ratio"] == {"label": "length ratio",
                                                                                  "better": "lower"}
    i = data["metrics"].index("length_ratio")
    assert {p["id"]: p["m"][i] for p in data["prompts"]} == pytest.approx(ratios, rel=1e-3)
    assert data["thresholds"]["regression_length_ratio"] == 3.0
    junit = ET.parse(reports / "junit.xml").getroot()
    lines = [tc.findtext("system-out") or "" for tc in junit.iter("testcase")]
    assert any("length_ratio=" in line for line in lines)  # a value that gates is on the prompt's line
    summary = (reports / "summary.md").read_text()
    assert f"| worst length ratio | {max(ratios.values()):.3g} |" in summary
    assert json.loads((case.root / "reports" / "candidates.json").read_text())[0]["max_length_ratio"] > 1


def test_plugin_threshold_gates_the_verdict(case: Case, site: Path) -> None:
    _params(case, regression_length_ratio=1.0)
    result = _score(case, site)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((case.root / "scores" / "candidate" / "metrics.json").read_text())
    assert metrics["verdict"] == "fail" and metrics["regression"] > case.score.metrics.regression
    gate = _cli(case, site, "gate", "candidate")
    assert gate.returncode == 1, gate.stdout + gate.stderr
    scores = json.loads((case.root / "scores" / "candidate" / "scores.json").read_text())
    caught = [s for s in scores["scores"] if any(r.startswith("length ratio ") and r.endswith(" > 1.0")
                                                 for r in s["reasons"])]
    assert caught and all(s["prompt_class"] == "regression" for s in caught)
    failures = [f.get("message") for f in ET.parse(case.root / "reports" / "candidate" / "junit.xml").iter("failure")]
    assert any(m.startswith("length ratio ") for m in failures)


def test_plugin_thresholds_are_validated_and_unknown_keys_still_rejected(case: Case, site: Path) -> None:
    _params(case, regression_length_ratio=0.5)
    result = _score(case, site)
    assert result.returncode == 2 and "thresholds.regression_length_ratio" in result.stderr
    assert "Traceback" not in result.stderr
    _params(case, length_ratio_bogus=1)
    result = _score(case, site)
    assert result.returncode == 2 and "thresholds.length_ratio_bogus" in result.stderr
    assert "regression_length_ratio" in result.stderr  # listed among the allowed keys
    _params(case)
    result = run_cli("score", "candidate", "--run", "run", cwd=case.root)  # the plugin not installed here
    # Refused when params.yaml is read (validate says it too), naming the line and field.
    assert result.returncode == 2 and "no metric named 'length_ratio' is registered" in result.stderr
    assert "field 'thresholds.metrics[" in result.stderr


# ------------------------------------------------------------------ the registry


def _installed(site: Path, group: str, entries: dict[str, str], dist: str = "some-plugins") -> None:
    """What pip leaves for a distribution that declares entry points: a .dist-info directory."""
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")


def test_registry_lists_and_loads_builtins_and_rejects_unknown_names() -> None:
    things = Registry("thing", "regress.test-things", {"dumps": "json:dumps", "join": "os.path:join"})
    assert things.names() == ["dumps", "join"] and "dumps" in things and "nope" not in things
    assert things.get("dumps") is json.dumps and things.distribution("dumps") is None
    with pytest.raises(UnknownPluginError, match=r"unknown thing 'nope'; known things: dumps, join"):
        things.get("nope")


def test_registry_finds_entry_points_once_and_builtins_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(tmp_path, "regress.test-things", {"dumps": "os:getcwd", "loads": "json:loads", "abs": "os.path:abspath"})
    monkeypatch.syspath_prepend(str(tmp_path))
    things = Registry("thing", "regress.test-things", {"dumps": "json:dumps"})
    assert things.names() == ["dumps", "abs", "loads"]  # built-ins first, then entry points by name
    assert things.get("loads") is json.loads and things.distribution("loads") == "some-plugins"
    # A built-in name wins over an entry point of the same name: an installed package cannot
    # silently replace how regress measures.
    assert things.get("dumps") is json.dumps
    _installed(tmp_path / "later", "regress.test-things", {"late": "json:dumps"}, dist="later")
    monkeypatch.syspath_prepend(str(tmp_path / "later"))
    assert "late" not in things.names()  # entry points are read once per registry
    things.register("late", len)  # code may still add (or replace) one in this process
    assert things.get("late") is len


def test_metrics_backends_and_triggers_share_the_registry() -> None:
    from regress.backends import REGISTRY as BACKENDS, backend_names, check_backend_name
    from regress.metrics import REGISTRY as METRICS, metric_names
    from regress.watch.triggers import TRIGGERS, known_triggers

    assert METRICS.names()[:6] == ["exact_tokens", "divergence_point", "prefix_logprobs", "teacher_forced", "surface",
                                   "semantic"]  # the order they run, check and show in
    assert metric_names() == sorted(METRICS.names())
    assert (METRICS.group, BACKENDS.group, TRIGGERS.group) == ("regress.metrics", "regress.backends", "regress.triggers")
    assert {"vllm", "hf"} <= set(backend_names()) and {"local", "celery", "github"} <= set(known_triggers())
    with pytest.raises(UnknownPluginError, match="known backends: hf, server, vllm"):
        check_backend_name("tgi")
    check_backend_name("my_pkg.backend:MyBackend")  # the direct module:Class form


def test_plugin_registry_is_stdlib_only() -> None:
    # regress.backends imports it inside candidate environments, where pydantic may be missing.
    code = ("import sys; import regress.plugins, regress.backends; "
            "heavy = {'pydantic', 'numpy', 'yaml'} & set(sys.modules); assert not heavy, heavy")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
