"""Whose model scores a candidate's samples (regress.metrics.sample_scorer): the candidate's own
logprobs stand in for the baseline's only when they match the golden's on every entry both sides
scored; anything else (one entry beyond the tolerance, a NaN, too little to compare) keeps the
baseline's engine."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from regress.metrics.sample_scorer import GOLDEN_SCORING_MODES, MIN_COMPARED, OWN_SCORING_TOLERANCE, logprob_agreement

pytestmark = pytest.mark.fast


@dataclass
class Track:
    token_ids: np.ndarray
    token_logprobs: np.ndarray


@dataclass
class Entry:
    prompt_token_ids: np.ndarray
    output_token_ids: np.ndarray
    free_run: Track
    teacher_forced: Track | None = None


class Run:
    """The part of a RunResult the agreement reads: ids in order, lookup by id."""

    def __init__(self, entries: dict[str, Entry]):
        self.entries = entries
        self.prompt_ids = list(entries)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self.entries

    def __getitem__(self, entry_id: str) -> Entry:
        return self.entries[entry_id]


def _entry(tokens: list[int], logprobs: list[float], *, prompt: tuple[int, ...] = (1, 2, 3),
           forced: list[float] | None = None, forced_tokens: list[int] | None = None) -> Entry:
    ids = np.asarray(tokens, dtype=np.int32)
    tf = None
    if forced is not None:
        tf = Track(np.asarray(forced_tokens if forced_tokens is not None else tokens, dtype=np.int32),
                   np.asarray(forced, dtype=np.float32))
    return Entry(np.asarray(prompt, dtype=np.int32), ids, Track(ids, np.asarray(logprobs, dtype=np.float32)), tf)


def _pair(n: int = 10, shift: float = 0.0, *, seed: int = 0) -> tuple[Run, Run]:
    """A golden of n entries and a candidate with the same outputs, its logprobs moved by ``shift``."""
    rng = np.random.default_rng(seed)
    golden, candidate = {}, {}
    for i in range(n):
        tokens = rng.integers(5, 100, 12).tolist()
        lp = (-rng.exponential(1.0, 12)).tolist()
        golden[f"p{i}"] = _entry(tokens, lp)
        candidate[f"p{i}"] = _entry(tokens, [v + shift for v in lp])
    return Run(candidate), Run(golden)


def test_identical_logprobs_agree() -> None:
    run, golden = _pair()
    a = logprob_agreement(run, golden)
    assert a.holds and a.compared == 10 and a.tokens == 120 and a.worst_mean_abs == 0.0
    assert "within" in a.describe()


def test_a_shift_inside_the_tolerance_agrees_and_one_beyond_it_does_not() -> None:
    assert logprob_agreement(*_pair(shift=OWN_SCORING_TOLERANCE / 2)).holds
    beyond = logprob_agreement(*_pair(shift=OWN_SCORING_TOLERANCE * 2))
    assert not beyond.holds and "beyond" in beyond.describe()


def test_one_entry_beyond_the_tolerance_is_enough_to_keep_the_baseline() -> None:
    run, golden = _pair(n=40)
    e = run["p17"]
    e.free_run = Track(e.free_run.token_ids, e.free_run.token_logprobs - 0.5)
    a = logprob_agreement(run, golden)
    assert not a.holds and a.worst_entry == "p17" and a.worst_mean_abs == pytest.approx(0.5, abs=1e-5)
    assert a.mean_abs < OWN_SCORING_TOLERANCE  # the average alone would have agreed


def test_a_diverged_entry_is_compared_through_its_teacher_forced_track() -> None:
    run, golden = _pair()
    g = golden["p3"]
    # The candidate said something else; its prefill of the golden's tokens is what it thinks of them.
    run.entries["p3"] = _entry([7, 7, 7], [-0.1, -0.2, -0.3], forced=(g.free_run.token_logprobs + 0.3).tolist(),
                               forced_tokens=g.output_token_ids.tolist())
    a = logprob_agreement(run, golden)
    assert not a.holds and a.worst_entry == "p3" and a.compared == 10
    run.entries["p3"].teacher_forced.token_logprobs = g.free_run.token_logprobs.copy()
    assert logprob_agreement(run, golden).holds


def test_a_diverged_entry_without_its_teacher_forced_track_is_not_compared() -> None:
    run, golden = _pair(n=MIN_COMPARED)
    run.entries["p0"] = _entry([7, 7], [-0.1, -0.2])  # diverged, never prefilled
    a = logprob_agreement(run, golden)
    assert a.compared == MIN_COMPARED - 1 and not a.holds  # too few compared entries
    assert f"at least {MIN_COMPARED}" in a.describe()


def test_a_teacher_forced_track_of_other_tokens_is_not_compared() -> None:
    run, golden = _pair()
    run.entries["p1"] = _entry([7, 7], [-0.1, -0.2], forced=[-5.0, -5.0], forced_tokens=[8, 8])
    a = logprob_agreement(run, golden)
    assert a.compared == 9 and a.holds


def test_a_nan_logprob_on_either_side_never_agrees() -> None:
    for side in ("candidate", "golden"):
        run, golden = _pair()
        target = (run if side == "candidate" else golden)["p4"]
        lp = target.free_run.token_logprobs.copy()
        lp[2] = np.nan
        target.free_run = Track(target.free_run.token_ids, lp)
        a = logprob_agreement(run, golden)
        assert not a.holds and math.isnan(a.worst_mean_abs) and a.worst_entry == "p4", side
        assert "not finite" in a.describe()


def test_minus_infinity_agrees_only_with_minus_infinity() -> None:
    run, golden = _pair()
    for r in (run, golden):
        lp = r["p5"].free_run.token_logprobs.copy()
        lp[0] = -np.inf
        r["p5"].free_run = Track(r["p5"].free_run.token_ids, lp)
    assert logprob_agreement(run, golden).holds
    lp = golden["p5"].free_run.token_logprobs.copy()
    lp[0] = -1.0
    golden["p5"].free_run = Track(golden["p5"].free_run.token_ids, lp)
    assert not logprob_agreement(run, golden).holds


def test_nothing_to_compare_never_agrees() -> None:
    a = logprob_agreement(Run({}), Run({}))
    assert a.compared == 0 and not a.holds and math.isnan(a.worst_mean_abs)


def test_the_cli_offers_the_same_modes() -> None:
    from regress.cli_options import GoldenScoring

    assert tuple(m.value for m in GoldenScoring) == GOLDEN_SCORING_MODES


def test_replay_refuses_an_unknown_mode(tmp_path) -> None:
    from regress.replay import replay

    with pytest.raises(ValueError, match="golden_scoring"):
        replay(None, None, tmp_path, golden_scoring=True)  # type: ignore[arg-type]
