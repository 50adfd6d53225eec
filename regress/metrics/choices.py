"""Multiple-choice prompts: which continuation each side finds most likely, and whether it is right.

A prompt with ``choices`` and ``answer`` has every choice scored on each side by its
log-likelihood after the prompt (:mod:`regress.engine.choices`). As lm-evaluation-harness does,
a side *picks* the choice with the highest log-likelihood in two ways:

- by the total log-likelihood (lm-eval's ``acc``);
- by the log-likelihood per character of the choice, leading whitespace left out (lm-eval's
  ``acc_norm``, which divides by the choice string's length without its target delimiter): a
  long choice is not penalised for being long, and, unlike a per-token measure, the
  normalisation does not depend on the tokenizer, so a candidate with another tokenizer is
  normalised the same way.

``choice_pick`` (a ``thresholds:`` setting) says which of the two is the prompt's *answer*:
``choice_golden_correct`` and ``choice_candidate_correct`` follow it, and scoring turns them into
the prompt's answer check (:func:`answer_check`), so choice prompts count in the answer totals,
McNemar and the report like prompts with a free-text ``expected``. The margin is the right
choice's score minus the best wrong choice's (same measure): above 0 the side is right, and its
size says how firmly. Ties go to the lower index (numpy's argmax), as in lm-eval.

A pure function of the two runs' stored scores; prompts without choices get no values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from regress.errors import MeasureError
from regress.metrics.base import Aggregate, Output, Pair, Setting, Values, metric
from regress.records import AnswerCheck
from regress.records.generation import ChoiceScores

CHOICE_PICK = Setting(
    "choice_pick", "total", type=Literal["total", "per_char"],
    doc="Which pick of a multiple-choice prompt is its answer: 'total', the highest log-likelihood (lm-eval's acc), "
        "or 'per_char', the highest log-likelihood per character of the choice (lm-eval's acc_norm).")

_OUTPUTS = [
    Output("choices", "number of choices of a multiple-choice prompt", format="int"),
    Output("choice_golden_pick", "the golden's pick: index of its most likely choice (total log-likelihood)",
           label="golden pick", format="int"),
    Output("choice_candidate_pick", "the candidate's pick: index of its most likely choice (total log-likelihood)",
           label="candidate pick", format="int", headline=30),
    Output("choice_golden_pick_norm", "the golden's pick by log-likelihood per character (lm-eval's acc_norm)",
           label="golden pick/char", format="int"),
    Output("choice_candidate_pick_norm", "the candidate's pick by log-likelihood per character (lm-eval's acc_norm)",
           label="candidate pick/char", format="int"),
    # Shown as shares: their aggregates are the run's acc and acc_norm.
    Output("choice_golden_right", "the golden's pick by total log-likelihood is the right choice (acc)",
           format="pct", aggregate=Aggregate("rate", key="golden_choice_acc", label="golden choice acc", rank=85,
                                             shown_empty=False)),
    Output("choice_candidate_right", "the candidate's pick by total log-likelihood is the right choice (acc)",
           format="pct", better="higher",
           aggregate=Aggregate("rate", key="choice_acc", label="choice acc", rank=86, shown_empty=False)),
    Output("choice_golden_right_norm", "the golden's pick per character is the right choice (acc_norm)",
           format="pct", aggregate=Aggregate("rate", key="golden_choice_acc_norm", label="golden choice acc_norm",
                                             rank=87, shown_empty=False)),
    Output("choice_candidate_right_norm", "the candidate's pick per character is the right choice (acc_norm)",
           format="pct", better="higher",
           aggregate=Aggregate("rate", key="choice_acc_norm", label="choice acc_norm", rank=88, shown_empty=False)),
    Output("choice_golden_correct", "the golden's answer is right, by the pick `choice_pick` names: the prompt's "
           "answer check"),
    Output("choice_candidate_correct", "the candidate's answer is right, by the pick `choice_pick` names: the "
           "prompt's answer check"),
    Output("choice_golden_margin", "the golden's right-choice score minus its best wrong choice's (nat, or nat per "
           "character with choice_pick: per_char); above 0: right", label="golden choice margin"),
    Output("choice_candidate_margin", "the candidate's right-choice score minus its best wrong choice's (as "
           "choice_golden_margin); above 0: right", label="choice margin", better="higher", headline=31,
           aggregate=Aggregate("mean", key="mean_choice_margin", label="choice margin", rank=89,
                               doc="mean over multiple-choice prompts of the candidate's right-minus-best-wrong "
                                   "score", shown_empty=False)),
    Output("choice_logprob_shift", "largest difference, candidate minus golden, of one choice's total "
           "log-likelihood (nat; the sign of the largest in size): how far the candidate moved the scores",
           label="choice logprob shift"),
]
VALUES = tuple(o.name for o in _OUTPUTS)


def per_char(scores: ChoiceScores) -> np.ndarray:
    """Each choice's log-likelihood per character, leading whitespace not counted (lm-eval's
    acc_norm divides by the choice without its delimiter); at least one character (a choice is
    never blank)."""
    lengths = np.array([max(1, len(t.lstrip())) for t in scores.texts], np.float64)
    return np.asarray(scores.logprobs, np.float64) / lengths


def _margin(values: np.ndarray, answer: int) -> float:
    wrong = np.delete(values, answer)
    return float(values[answer] - wrong.max())


def side_values(scores: ChoiceScores, pick: str) -> dict[str, Any]:
    """One side's picks, rightness and margin (the margin by ``pick``'s measure)."""
    total = np.asarray(scores.logprobs, np.float64)
    norm = per_char(scores)
    by_total, by_norm = int(np.argmax(total)), int(np.argmax(norm))
    right, right_norm = by_total == scores.answer, by_norm == scores.answer
    return {
        "pick": by_total, "pick_norm": by_norm, "right": right, "right_norm": right_norm,
        "correct": right if pick == "total" else right_norm,
        "margin": _margin(total if pick == "total" else norm, scores.answer),
    }


def _same_question(pair: Pair) -> tuple[ChoiceScores, ChoiceScores] | None:
    g, c = pair.golden.choices, pair.candidate.choices
    if g is None and c is None:
        return None
    if g is None or c is None or g.texts != c.texts or g.answer != c.answer:
        # The prompt set's hash ties a replay to its golden, so this is a run made by a regress
        # that did not score choices, or an edited run: no verdict from half a question.
        side = "golden" if g is None else "candidate" if c is None else "two sides"
        raise MeasureError(f"prompt '{pair.prompt_id}': the {side} did not score the same choices "
                           "(a run from before choices were scored? re-run it)")
    return g, c


@metric("choices", outputs=_OUTPUTS, options={"pick": CHOICE_PICK})
def choices(pick: str = "total") -> "callable":
    """Picks, rightness and margins of multiple-choice prompts (see the module)."""
    if pick not in ("total", "per_char"):
        raise ValueError(f"choice_pick must be 'total' or 'per_char', got {pick!r}")

    def score(pair: Pair) -> Values:
        both = _same_question(pair)
        if both is None:
            return {}
        g_scores, c_scores = both
        g, c = side_values(g_scores, pick), side_values(c_scores, pick)
        delta = np.asarray(c_scores.logprobs, np.float64) - np.asarray(g_scores.logprobs, np.float64)
        return {
            "choices": len(g_scores.texts),
            "choice_golden_pick": g["pick"], "choice_candidate_pick": c["pick"],
            "choice_golden_pick_norm": g["pick_norm"], "choice_candidate_pick_norm": c["pick_norm"],
            "choice_golden_right": g["right"], "choice_candidate_right": c["right"],
            "choice_golden_right_norm": g["right_norm"], "choice_candidate_right_norm": c["right_norm"],
            "choice_golden_correct": g["correct"], "choice_candidate_correct": c["correct"],
            "choice_golden_margin": g["margin"], "choice_candidate_margin": c["margin"],
            "choice_logprob_shift": float(delta[int(np.argmax(np.abs(delta)))]),
        }

    return score


def answer_check(values: Mapping[str, Any], scores: ChoiceScores) -> AnswerCheck | None:
    """A multiple-choice prompt's answer check, from this metric's values of it (None: the prompt
    has no choice values, e.g. the metric is not in ``thresholds.metrics``). The accepted answer
    is the right choice's text; each side's match is that text when its pick is right."""
    golden, candidate = values.get("choice_golden_correct"), values.get("choice_candidate_correct")
    if golden is None or candidate is None:
        return None
    right = scores.texts[scores.answer]
    return AnswerCheck(expected=[right], golden_correct=bool(golden), candidate_correct=bool(candidate),
                       golden_match=right if golden else None, candidate_match=right if candidate else None)
