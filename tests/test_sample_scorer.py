"""Whose model scores a candidate's samples (regress.metrics.sample_scorer): the candidate's own
logprobs stand in for the baseline's only when its decode logprobs match the golden's on every
entry, wherever both had the same context; anything else (one entry beyond the tolerance, a NaN,
another prompt, too little to compare) keeps the baseline's engine. A teacher-forced prefill is
never compared with a decode: that difference is the engine's own."""

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
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def _track(tokens: list[int], logprobs: list[float], top: list[list[tuple[int, float]]] | None = None) -> Track:
    """A track with a top-2 per position: ``top`` when given, else the token itself and a filler
    token 1 (a padding -1 where the token is 1)."""
    ids = np.asarray(tokens, dtype=np.int32)
    lps = np.asarray(logprobs, dtype=np.float32)
    if top is None:
        top = [[(t, lp), (1, lp - 2.0)] if t != 1 else [(t, lp), (-1, -np.inf)] for t, lp in zip(tokens, logprobs)]
    width = len(top[0]) if top else 2
    return Track(ids, lps, np.asarray([[t for t, _ in row] for row in top], dtype=np.int32).reshape(len(ids), width),
                 np.asarray([[v for _, v in row] for row in top], dtype=np.float32).reshape(len(ids), width))


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


def _entry(tokens: list[int], logprobs: list[float], *, prompt: tuple[int, ...] = (1, 2, 3)) -> Entry:
    return Entry(np.asarray(prompt, dtype=np.int32), np.asarray(tokens, dtype=np.int32), _track(tokens, logprobs))


def _shifted(track: Track, shift: float, positions: slice = slice(None)) -> Track:
    """The same track with its logprobs (its own and its top-k's) moved by ``shift`` at ``positions``."""
    lp, top = track.token_logprobs.copy(), track.top_logprobs.copy()
    lp[positions] += shift
    top[positions] += shift
    return Track(track.token_ids, lp, track.top_ids, top)


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
    e.free_run = _shifted(e.free_run, -0.5)
    a = logprob_agreement(run, golden)
    assert not a.holds and a.worst_entry == "p17" and a.worst_mean_abs == pytest.approx(0.5, abs=1e-5)
    assert a.mean_abs < OWN_SCORING_TOLERANCE  # the average alone would have agreed


def test_a_diverged_entry_is_compared_decode_against_decode_up_to_where_it_diverged() -> None:
    run, golden = _pair()
    g = golden["p3"]
    tokens = g.output_token_ids.tolist()
    diverged = tokens[:4] + [3, 3, 3]  # the golden's first 4 tokens, then another answer (ids 5-99)
    logprobs = g.free_run.token_logprobs[:4].tolist() + [-0.1, -0.2, -0.3]
    top = [list(zip(r.tolist(), v.tolist())) for r, v in zip(g.free_run.top_ids[:5], g.free_run.top_logprobs[:5])]
    top[4] = [(3, -0.1), (tokens[4], float(g.free_run.token_logprobs[4]))]  # its choice, then the golden's
    top += [[(3, -0.2)], [(3, -0.3)]]
    top = [row + [(-1, -np.inf)] * (2 - len(row)) for row in top]
    run.entries["p3"] = Entry(g.prompt_token_ids, np.asarray(diverged, np.int32), _track(diverged, logprobs, top),
                              _track(tokens, (g.free_run.token_logprobs + 0.3).tolist()))
    a = logprob_agreement(run, golden)
    # Positions 0-4 share their context: compared (the golden's token 4 is in the candidate's top-k
    # there, at the golden's logprob); what follows is another context, and the prefill (+0.3) is
    # the engine's other kernels: neither is compared.
    assert a.holds and a.compared == 10 and a.worst_mean_abs == 0.0, a.describe()
    assert a.tokens == 9 * 12 + 5 and "to the bit" in a.describe()
    moved = run.entries["p3"]
    moved.free_run = _shifted(moved.free_run, 0.3, slice(0, 2))  # the shared context's logprobs moved
    a = logprob_agreement(run, golden)
    assert not a.holds and a.worst_entry == "p3"


def test_the_first_differing_position_is_compared_through_the_top_k_both_report() -> None:
    """Samples drawn with another seed often differ at their first token; the distribution both
    computed there, after the same prompt, is still comparable through the tokens both list."""
    run, golden = _pair()
    g = golden["p2"]
    first = int(g.output_token_ids[0])
    top = [[(4, -0.5), (first, float(g.free_run.token_logprobs[0]) + 0.4)]]
    run.entries["p2"] = Entry(g.prompt_token_ids, np.asarray([4], np.int32), _track([4], [-0.5], top))
    a = logprob_agreement(run, golden)
    assert not a.holds and a.worst_entry == "p2" and a.worst_mean_abs == pytest.approx(0.4, abs=1e-5)


def test_an_entry_with_another_prompt_never_agrees() -> None:
    run, golden = _pair()
    e = run["p6"]
    run.entries["p6"] = Entry(np.asarray([1, 2, 4], np.int32), e.output_token_ids, e.free_run)
    a = logprob_agreement(run, golden)
    assert not a.holds and a.prompt_differs == 1 and a.worst_entry == "p6"
    assert "another prompt" in a.describe()


def test_an_empty_output_is_not_compared() -> None:
    run, golden = _pair(n=MIN_COMPARED)
    run.entries["p0"] = _entry([], [])
    a = logprob_agreement(run, golden)
    assert a.compared == MIN_COMPARED - 1 and not a.holds  # too few compared entries
    assert f"at least {MIN_COMPARED}" in a.describe()


def test_a_nan_logprob_on_either_side_never_agrees() -> None:
    for side in ("candidate", "golden"):
        run, golden = _pair()
        target = (run if side == "candidate" else golden)["p4"]
        lp = target.free_run.token_logprobs.copy()
        lp[2] = np.nan
        target.free_run = Track(target.free_run.token_ids, lp, target.free_run.top_ids, target.free_run.top_logprobs)
        a = logprob_agreement(run, golden)
        assert not a.holds and math.isnan(a.worst_mean_abs) and a.worst_entry == "p4", side
        assert "not finite" in a.describe()


def test_minus_infinity_agrees_only_with_minus_infinity() -> None:
    run, golden = _pair()
    for r in (run, golden):
        t = r["p5"].free_run
        lp, top = t.token_logprobs.copy(), t.top_logprobs.copy()
        lp[0] = top[0, 0] = -np.inf
        r["p5"].free_run = Track(t.token_ids, lp, t.top_ids, top)
    assert logprob_agreement(run, golden).holds
    t = golden["p5"].free_run
    lp, top = t.token_logprobs.copy(), t.top_logprobs.copy()
    lp[0] = top[0, 0] = -1.0
    golden["p5"].free_run = Track(t.token_ids, lp, t.top_ids, top)
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
