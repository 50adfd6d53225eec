"""The quick check's screening sample (`--quick-prompts N`, `quick: {prompts: N}`): which prompts it
prefills, that it is the same every time, and that its verdict says what it left out. No engine:
the engine side (the sample's prefill against the baseline's prefill of the same sample) is in
tests/test_power.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from report_fixtures import build_case
from test_config_strictness import _problems
from test_error_boundaries import _params, cli

from regress.quick_sample import QuickSample, choose, quick_sample


def _lengths(n: int) -> dict[str, int]:
    return {f"q{i:04d}": (i * 37) % n + 1 for i in range(n)}  # every length 1..n once, in shuffled order


def test_every_prompt_when_the_size_is_zero_or_not_below_the_set():
    lengths = _lengths(50)
    assert choose(lengths, {}, 0) == set(lengths)
    assert choose(lengths, {}, 50) == set(lengths) == choose(lengths, {}, 10_000)


@pytest.mark.parametrize("size", [1, 7, 25, 49])
def test_exactly_the_size_asked_for(size):
    assert len(choose(_lengths(50), {}, size)) == size


def test_the_same_sample_every_time_whatever_the_order_it_is_given_in():
    lengths = _lengths(300)
    tags = {pid: ["a" if i % 2 else "b"] for i, pid in enumerate(lengths)}
    first = choose(lengths, tags, 40)
    backwards = choose(dict(reversed(list(lengths.items()))), dict(reversed(list(tags.items()))), 40)
    assert first == backwards == choose(lengths, tags, 40)


def test_the_longest_sequence_and_every_length_stratum_are_in_it():
    lengths = _lengths(1000)
    chosen = sorted(lengths[pid] for pid in choose(lengths, {}, 20))
    assert chosen[-1] == 1000  # the longest: kernels change with shapes
    # One per stratum of the rest: no two chosen lengths further apart than two strata (2 x 1000/19).
    assert all(b - a <= 2 * 1000 / 19 + 1 for a, b in zip([0, *chosen], chosen)), chosen


def test_every_tag_is_covered_even_a_rare_one():
    lengths = _lengths(400)
    tags = {pid: ["common"] for pid in lengths}
    rare = sorted(lengths)[123]
    tags[rare] = ["common", "zh"]
    tags[sorted(lengths)[7]] = ["code"]
    chosen = choose(lengths, tags, 10)
    assert rare in chosen and sorted(lengths)[7] in chosen and len(chosen) == 10


def test_more_tags_than_places_fills_the_places_with_tags():
    lengths = _lengths(30)
    tags = {pid: [f"t{i}"] for i, pid in enumerate(lengths)}
    assert len(choose(lengths, tags, 5)) == 5


def test_a_sample_of_a_prompt_set_keeps_its_version_and_its_order(tmp_path):
    case = build_case(tmp_path, prompts=30, semantic=False)
    sample = quick_sample(case.prompt_set, case.golden, 10)
    assert (sample.chosen, sample.eligible, sample.whole) == (10, 30, False)
    ids = [p.id for p in sample.prompts.prompts]
    assert len(ids) == 10 and ids == [p.id for p in case.prompt_set.prompts if p.id in set(ids)]
    assert sample.prompts.sha256 == case.prompt_set.sha256 and sample.prompts.get(ids[0]).id == ids[0]
    tags = {tag for p in case.prompt_set.prompts for tag in p.tags}
    assert tags == {tag for p in sample.prompts.prompts for tag in p.tags}
    assert "10 of the 30" in sample.describe() and "20 left out" in sample.describe()
    assert "--quick-prompts 0" in sample.describe()
    whole = quick_sample(case.prompt_set, case.golden, 0)
    assert whole.whole and whole.prompts is case.prompt_set and "every one of the 30" in whole.describe()


def test_the_verdict_says_it_rests_on_a_sample(tmp_path):
    from regress.quick import score_quick
    from regress.verdict import Thresholds

    case = build_case(tmp_path, prompts=30, semantic=False)
    t = Thresholds(metrics=["exact_tokens", "teacher_forced"])
    sampled = score_quick(case.run, case.golden, case.run, t, sample=QuickSample(case.prompt_set, 10, 30))
    assert "a stratified sample of 10 of the 30" in sampled.metrics.verdict_basis
    whole = score_quick(case.run, case.golden, case.run, t, sample=QuickSample(case.prompt_set, 30, 30))
    assert "sample" not in (whole.metrics.verdict_basis or "")


def test_the_quick_section_of_params(tmp_path):
    from regress.config import load_params

    assert load_params(_params(tmp_path, {})).quick.prompts == 0
    assert load_params(_params(tmp_path, {"quick": {"prompts": 128}})).quick.prompts == 128
    for bad, field in (({"prompts": -1}, "quick.prompts"), ({"prompts": True}, "quick.prompts"),
                       ({"prompts": "128"}, "quick.prompts"), ({"sample": 5}, "quick.sample")):
        [problem] = _problems(_params(tmp_path, {"quick": bad}))
        assert problem.field == field and problem.line is not None, (bad, problem)


def test_quick_prompts_without_quick_is_an_input_error(tmp_path):
    _params(tmp_path, {})
    for args in (["check", "next", "--quick-prompts", "5"], ["power", "--quick-prompts", "5"]):
        result = cli(*args, cwd=tmp_path, home=tmp_path / "home")
        assert result.returncode == 2 and "--quick-prompts" in result.stderr and "--quick" in result.stderr, result
    result = cli("check", "next", "--quick", "--quick-prompts", "-1", cwd=tmp_path, home=tmp_path / "home")
    assert result.returncode == 2 and "--quick-prompts" in result.stderr, result
