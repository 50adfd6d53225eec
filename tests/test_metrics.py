"""Metric unit tests against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from regress.metrics import get_metric, metric_names
from regress.metrics.base import Pair, first_divergence
from regress.records import Generation, LogprobTrack, ResolvedSampling
from regress.verdict import Thresholds, classify


def track(tokens, token_lp, top_ids, top_lp) -> LogprobTrack:
    return LogprobTrack(token_ids=np.asarray(tokens, np.int32), token_logprobs=np.asarray(token_lp, np.float32),
                        top_ids=np.asarray(top_ids, np.int32), top_logprobs=np.asarray(top_lp, np.float32))


def gen(tokens, token_lp, top_ids, top_lp, *, prompt=(1, 2, 3), text=None, tf=None) -> Generation:
    return Generation(prompt_id="p", prompt_token_ids=np.asarray(prompt, np.int32),
                      output_token_ids=np.asarray(tokens, np.int32), text=text if text is not None else " ".join(map(str, tokens)),
                      finish_reason="length", free_run=track(tokens, token_lp, top_ids, top_lp), teacher_forced=tf)


LN = math.log
# Golden: 3 tokens. Position 1 is a near-tie (0.5 vs 0.45), positions 0 and 2 confident.
GOLDEN = gen(
    [10, 20, 30],
    [LN(0.9), LN(0.5), LN(0.8)],
    [[10, 11], [20, 21], [30, 31]],
    [[LN(0.9), LN(0.05)], [LN(0.5), LN(0.45)], [LN(0.8), LN(0.1)]],
)


def score(name, golden, candidate, **options):
    info = get_metric(name)
    fn = info.factory(**options)
    return fn([Pair(golden, candidate)])[0] if info.batched else fn(Pair(golden, candidate))


def test_registry_lists_metrics_and_rejects_unknown():
    assert {"exact_tokens", "teacher_forced", "surface", "semantic"} <= set(metric_names())
    from regress.errors import UnknownPluginError

    with pytest.raises(UnknownPluginError, match="known metrics: .*exact_tokens"):
        get_metric("bleu")


def test_first_divergence():
    a = np.array([1, 2, 3])
    assert first_divergence(a, np.array([1, 2, 3])) is None
    assert first_divergence(a, np.array([1, 5, 3])) == 1
    assert first_divergence(a, np.array([1, 2])) == 2
    assert first_divergence(np.array([], np.int32), np.array([7])) == 0


def test_exact_and_divergence_point_at_a_near_tie():
    cand = gen([10, 21, 99], [LN(0.9), LN(0.48), LN(0.7)], [[10, 11], [21, 20], [99, 30]],
               [[LN(0.9), LN(0.05)], [LN(0.48), LN(0.47)], [LN(0.7), LN(0.2)]])
    v = score("exact_tokens", GOLDEN, cand)
    assert v == {"input_drift": False, "identical": False, "first_divergence": 1, "golden_tokens": 3, "candidate_tokens": 3}
    v = score("divergence_point", GOLDEN, cand)
    assert v["golden_margin"] == pytest.approx(LN(0.5) - LN(0.45), abs=1e-6)  # 0.105 nat
    assert v["candidate_margin"] == pytest.approx(LN(0.48) - LN(0.47), abs=1e-6)
    assert v["golden_token_in_candidate_topk"] is True and v["candidate_token_in_golden_topk"] is True
    v = score("prefix_logprobs", GOLDEN, cand)
    assert v["prefix_max_abs_delta"] == pytest.approx(0.0, abs=1e-7)


def test_divergence_outside_topk_and_input_drift():
    cand = gen([10, 77, 30], [LN(0.9), LN(0.6), LN(0.8)], [[10, 11], [77, 78], [30, 31]],
               [[LN(0.9), LN(0.05)], [LN(0.6), LN(0.3)], [LN(0.8), LN(0.1)]], prompt=(1, 2, 4))
    v = score("divergence_point", GOLDEN, cand)
    assert v["candidate_token_in_golden_topk"] is False and v["golden_token_in_candidate_topk"] is False
    assert score("exact_tokens", GOLDEN, cand)["input_drift"] is True


def test_prefix_logprob_deltas():
    cand = gen([10, 20, 30], [LN(0.8), LN(0.5), LN(0.8)], GOLDEN.free_run.top_ids, GOLDEN.free_run.top_logprobs)
    v = score("prefix_logprobs", GOLDEN, cand)
    assert v["prefix_max_abs_delta"] == pytest.approx(abs(LN(0.9) - LN(0.8)), abs=1e-6)
    assert v["prefix_mean_abs_delta"] == pytest.approx(abs(LN(0.9) - LN(0.8)) / 3, abs=1e-6)


def test_teacher_forced_by_hand():
    # Candidate scored on the golden's tokens [10, 20, 30]:
    # pos 0: same distribution; pos 1: flips the near-tie (21 now top-1); pos 2: less sure of 30.
    tf = track([10, 20, 30], [LN(0.9), LN(0.45), LN(0.6)], [[10, 11], [21, 20], [30, 31]],
               [[LN(0.9), LN(0.05)], [LN(0.5), LN(0.45)], [LN(0.6), LN(0.3)]])
    cand = gen([10, 21, 30], [LN(0.9), LN(0.5), LN(0.6)], [[10, 11], [21, 20], [30, 31]],
               [[LN(0.9), LN(0.05)], [LN(0.5), LN(0.45)], [LN(0.6), LN(0.3)]], tf=tf)
    v = score("teacher_forced", GOLDEN, cand)
    d = [0.0, abs(LN(0.45) - LN(0.5)), abs(LN(0.6) - LN(0.8))]
    assert v["tf_positions"] == 3
    assert v["tf_mean_abs_delta"] == pytest.approx(sum(d) / 3, abs=1e-6)
    assert v["tf_max_abs_delta"] == pytest.approx(max(d), abs=1e-6)
    # KL over the golden's top-2 + rest bucket, by hand.
    def kl(p, q):
        p_rest, q_rest = 1 - sum(p), 1 - sum(q)
        return sum(pi * LN(pi / qi) for pi, qi in zip(p, q)) + p_rest * LN(p_rest / q_rest)
    expected = [kl([0.9, 0.05], [0.9, 0.05]), kl([0.5, 0.45], [0.45, 0.5]), kl([0.8, 0.1], [0.6, 0.3])]
    assert v["tf_kl_mean"] == pytest.approx(sum(expected) / 3, abs=1e-5)
    assert v["tf_kl_max"] == pytest.approx(max(expected), abs=1e-5)
    assert v["tf_same_top1_rate"] == pytest.approx(2 / 3)
    assert v["tf_flips"] == 1
    assert v["tf_max_flipped_margin"] == pytest.approx(LN(0.5) - LN(0.45), abs=1e-6)
    dp = [0.0, 0.45 - 0.5, 0.6 - 0.8]
    assert v["tf_delta_p_mean"] == pytest.approx(sum(dp) / 3, abs=1e-6)
    assert v["tf_delta_p_rms"] == pytest.approx(math.sqrt(sum(x * x for x in dp) / 3), abs=1e-6)


def test_teacher_forced_missing_token_gets_the_kth_logprob_and_ties_are_not_flips():
    golden = gen([5], [LN(0.4)], [[5, 6]], [[LN(0.4), LN(0.4)]])  # exact tie in the golden
    tf = track([5], [LN(0.3)], [[6, 7]], [[LN(0.4), LN(0.3)]])  # candidate prefers 6 (tied in golden)
    v = score("teacher_forced", golden, gen([6], [LN(0.4)], [[6, 7]], [[LN(0.4), LN(0.3)]], tf=tf))
    assert v["tf_same_top1_rate"] == 1.0 and v["tf_flips"] == 0
    # golden top-2 = {5: 0.4, 6: 0.4}; candidate has 6: 0.4, 5 not in its top-k -> its k-th logprob 0.3.
    p, q = [0.4, 0.4], [0.3, 0.4]
    expected = sum(pi * LN(pi / qi) for pi, qi in zip(p, q)) + 0.2 * LN(0.2 / 0.3)
    assert v["tf_kl_mean"] == pytest.approx(expected, abs=1e-5)


def test_surface_by_hand():
    golden = gen([1, 2, 3, 4], [0] * 4, [[1]] * 4, [[0]] * 4)
    cand = gen([1, 3, 4, 5, 6], [0] * 5, [[1]] * 5, [[0]] * 5)
    v = score("surface", golden, cand)
    # Levenshtein: delete 2, insert 5, insert 6 = 3 edits over max length 5.
    assert v["edit_distance"] == pytest.approx(3 / 5)
    # LCS = [1, 3, 4] = 3; ROUGE-L F1 = 2*3 / (4 + 5).
    assert v["rouge_l"] == pytest.approx(6 / 9)
    assert score("surface", golden, golden) == {"edit_distance": 0.0, "rouge_l": 1.0}


@pytest.fixture(scope="module")
def semantic_metric():
    return get_metric("semantic").factory()


def test_semantic_similarity_orders_meaning(semantic_metric):
    g = gen([1], [0], [[1]], [[0]], text="The cat sat on the warm windowsill in the sun.")
    close = gen([2], [0], [[2]], [[0]], text="A cat was sitting on the sunny, warm window sill.")
    far = gen([3], [0], [[3]], [[0]], text="Quarterly revenue rose because of strong bond sales.")
    same = gen([1], [0], [[1]], [[0]], text=g.text)
    out = semantic_metric([Pair(g, close), Pair(g, far), Pair(g, same)])
    sims = [o["semantic_similarity"] for o in out]
    assert sims[2] == 1.0
    assert sims[0] > 0.7 > 0.3 > sims[1]


def test_classes_from_values():
    t = Thresholds()
    assert classify({"input_drift": True, "identical": False}, t)[0] == "input_drift"
    assert classify({"input_drift": False, "identical": True}, t)[0] == "identical"
    noise = {"identical": False, "first_divergence": 7, "golden_margin": 0.02, "golden_token_in_candidate_topk": True,
             "candidate_token_in_golden_topk": True, "tf_kl_mean": 0.001, "tf_same_top1_rate": 0.99,
             "tf_max_flipped_margin": 0.03, "semantic_similarity": 0.95}
    assert classify(noise, t)[0] == "benign"
    assert classify({**noise, "semantic_similarity": 0.6}, t)[0] == "drift"
    assert classify({**noise, "tf_kl_mean": 0.05}, t)[0] == "drift"
    cls, reasons = classify({**noise, "golden_margin": 2.0}, t)
    assert cls == "regression" and "confident" in reasons[0]
    assert classify({**noise, "tf_kl_mean": 0.5}, t)[0] == "regression"
    assert classify({**noise, "tf_same_top1_rate": 0.5}, t)[0] == "regression"
    assert classify({**noise, "candidate_token_in_golden_topk": False}, t)[0] == "regression"
    assert classify({**noise, "candidate_token_in_golden_topk": False}, Thresholds(require_topk_agreement=False))[0] == "benign"
