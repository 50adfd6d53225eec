"""Figures measured under the same conditions, or said not to be (issue 30): every run records the
engine's CPU time and the machine's load during generation, and the cores busy beside the engine
during its load; a golden timed while something else
ran (a pip build beside it) makes the page say the speeds are not comparable instead of
colouring a speed-up; the configuration diff leaves out where a cache lives. No engine."""

from __future__ import annotations

from pathlib import Path

import markupsafe

import pytest

from report_fixtures import build_case
from regress.latency import PERF_LOAD_BOUND, load_comparison, speed_comparison
from regress.records import Timings
from regress.replay.manifest import _machine_load


def _timings(load: float | None, cpu_s: float | None, wall: float = 40.0) -> Timings:
    return Timings(engine_load_s=10, generation_s=wall, total_s=60, prompt_tokens=100, output_tokens=200,
                   tokens_per_s=5.0, generation_cpu_s=cpu_s, load_avg=load, cpu_count=2)


def test_the_run_records_cpu_time_and_load_from_its_shards() -> None:
    metas = [{"generation_s": 30.0, "generation_cpu_s": 29.0, "load_avg": 1.0, "cpu_count": 2},
             {"generation_s": 10.0, "generation_cpu_s": 9.5, "load_avg": 3.0, "cpu_count": 2}]
    assert _machine_load(metas) == {"generation_cpu_s": 38.5, "load_avg": 1.5, "cpu_count": 2}
    # A shard without them (an older engine), or with values that are not numbers: left out.
    assert _machine_load([metas[0], {"generation_s": 5.0}]) == {}
    assert _machine_load([{"generation_s": 1.0, "generation_cpu_s": "9", "load_avg": -1, "cpu_count": True}]) == {}
    # The cores busy beside the engine (from /proc/stat), weighted like the load average; they
    # are what other_load() reads where recorded, since the load average lags a minute.
    measured = [{**metas[0], "beside_cores": 0.0}, {**metas[1], "beside_cores": 0.4}]
    assert _machine_load(measured)["generation_beside_cores"] == 0.1
    assert "generation_beside_cores" not in _machine_load([measured[0], metas[1]])  # one shard without it
    lagging = _timings(2.6, 40.0).model_copy(update={"generation_beside_cores": 0.05})
    assert lagging.other_load() == 0.05 and _timings(2.6, 40.0).other_load() == pytest.approx(1.6)


def test_speeds_compare_only_under_the_same_load() -> None:
    quiet, busy = _timings(1.0, 40.0), _timings(3.1, 22.0)  # busy: 2.55 cores beside an engine that got 0.55
    assert quiet.other_load() == pytest.approx(0.0) and busy.other_load() == pytest.approx(2.55)
    ok, note = speed_comparison(quiet, _timings(1.2, 40.0))
    assert ok is True and note.startswith("speeds comparable")
    ok, note = speed_comparison(busy, quiet)
    assert ok is False and "2.5 during the golden's generation and 0.0 during the candidate's" in note
    assert speed_comparison(_timings(None, None), quiet) == (None, None)
    assert PERF_LOAD_BOUND == 0.5


def test_the_page_does_not_colour_a_speed_up_measured_against_a_busy_golden(tmp_path: Path) -> None:
    from regress.report.overview import performance
    from regress.report.render import render_candidate

    case = build_case(tmp_path, 12, tokens=16, semantic=False)
    plain = {row.label: row for row in performance(case.score)}
    assert plain["throughput"].direction == "better"  # the fixture's candidate is faster
    note = "speeds not comparable: beside the engine, the machine's load was 2.5 during the golden's generation"
    busy = case.score.model_copy(update={"metrics": case.score.metrics.model_copy(
        update={"speed_comparable": False, "speed_note": note})})
    rows = {row.label: row for row in performance(busy)}
    for label in ("throughput", "generation time", "engine load"):
        assert rows[label].direction == "incomparable" and rows[label].change.endswith("(not comparable)"), label
    assert rows["peak memory"].direction != "incomparable"  # memory does not depend on the load
    page = render_candidate(busy, case.golden, case.run, case.prompt_set)
    assert str(markupsafe.escape(note)) in page and "perf-incomparable" in page


def test_the_engine_measures_the_cores_busy_beside_it() -> None:
    import subprocess
    import sys
    import time

    from regress.engine.facts import cores_beside, cpu_seconds

    # Another process spinning for 1.5 s is one core beside this one (which sleeps); more may be
    # busy on a shared machine, never less.
    before, started = cpu_seconds(), time.monotonic()
    subprocess.run([sys.executable, "-c", "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass"],
                   check=True)
    beside = cores_beside(before, cpu_seconds(), time.monotonic() - started)
    assert beside is not None and beside >= 0.5, beside
    # This process's own work is not beside it.
    assert cores_beside((100.0, 5.0), (110.0, 15.0), 10.0) == 0.0
    assert cores_beside((100.0, 5.0), (130.0, 15.0), 10.0) == 2.0
    assert cores_beside((None, 5.0), (130.0, 15.0), 10.0) is None and cores_beside((1.0, 0.0), (2.0, 0.0), 0.0) is None


def test_engine_loads_beside_different_work_are_not_compared(tmp_path: Path) -> None:
    """The baseline's engine starting beside a candidate's (to score its samples) is a core of
    work beside that load: its figure against the golden's quiet load is shown, not coloured."""
    from regress.report.overview import performance
    from regress.report.render import render_candidate

    quiet, beside = (_timings(1.0, 40.0).model_copy(update={"engine_load_beside_cores": c}) for c in (0.1, 1.2))
    ok, note = load_comparison(quiet, beside)
    assert ok is False and "0.1 cores were busy during the golden's engine load and 1.2 during the candidate's" in note
    assert load_comparison(quiet, quiet.model_copy(update={"engine_load_beside_cores": 0.5}))[0] is True
    assert load_comparison(_timings(1.0, 40.0), beside) == (None, None)  # an older run: nothing said

    case = build_case(tmp_path, 12, tokens=16, semantic=False)

    def with_loads(golden: float, candidate: float):
        def timed(run, cores):
            return run.model_copy(update={"timings": run.timings.model_copy(update={"engine_load_beside_cores": cores})})
        return case.score.model_copy(update={"golden": timed(case.score.golden, golden), "run": timed(case.score.run, candidate)})

    rows = {row.label: row for row in performance(with_loads(0.0, 1.0))}
    assert rows["engine load"].direction == "incomparable"
    assert rows["throughput"].direction == "better"  # the generations ran alike: still compared
    page = render_candidate(with_loads(0.0, 1.0), case.golden, case.run, case.prompt_set)
    assert "engine loads not comparable" in page
    assert {row.label: row for row in performance(with_loads(0.9, 1.0))}["engine load"].direction != "incomparable"


def test_the_configuration_diff_leaves_out_where_a_cache_lives(tmp_path: Path) -> None:
    from regress.report.configdiff import _flatten

    case = build_case(tmp_path, 6, tokens=8, semantic=False)
    manifest = case.run.manifest.model_copy(update={"environment": "/home/ci/.cache/regress/envs/vllm-0.33.0-abc"})
    assert not any("/.cache/" in str(v) for v in _flatten(manifest).values())
