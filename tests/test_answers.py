"""Expected answers: the correctness rule, the prompt-set field, scoring, the threshold and every output.

Runs are the synthetic ones of report_fixtures (no engine); expected answers are picked from their
texts so that some prompts keep, lose and gain their answer.
"""

from __future__ import annotations

import html
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from report_fixtures import HOSTILE, WORDS, BagOfWordsEncoder, Case, build_case
from regress.datasets import check_prompt_set, load_prompt_set
from regress.errors import ConfigError
from regress.metrics.answers import AnswerKey, contains_answer, is_correct, matching_answer, normalise, rejected_answer
from regress.records import AnswerCheck, PromptRecord, RunMetrics, ScoredRun
from regress.report import JUNIT_FILE, METRICS_FILE, METRICS_SCHEMA, SUMMARY_FILE, write_candidate_report, write_index
from regress.report.junit import junit_xml
from regress.report.payload import build_payload
from regress.report.render import render_candidate
from regress.report.summary import summary_markdown
from regress.scoring import answer_reason, build_metrics, check_answer, expected_answers, score_runs, write_score_outputs
from regress.verdict import Thresholds, run_verdict

# ------------------------------------------------------------------ the rule

CORRECT = [
    ("The answer is 4.", "4"),
    ("4", "4"),
    ("(4)", "4"),
    ("2 + 2 = 4", "4"),
    ("2-4 of them", "4"),  # a range, not a negative number
    ("Paris, of course.", "paris"),
    ("PARIS", "Paris"),
    ("Paris's museums", "Paris"),
    ("ＰＡＲＩＳ", "Paris"),  # full-width letters: NFKC
    ("it is ４", "4"),  # full-width digit: NFKC
    ("cafe\u0301", "café"),  # decomposed vs composed: NFKC
    ("Straße", "STRASSE"),  # case folding, not lower()
    ("New\n  York", "new york"),  # whitespace collapsed on both sides
    ("the city of   New York.", " New  York "),
    ("答案是4。", "4"),  # CJK next to a number is no word boundary
    ("中国的首都是北京。", "北京"),  # CJK: plain containment
    ("東京都に住んでいます", "東京"),
    ("서울은 한국의 수도입니다", "서울"),
    ("首都はParisです", "Paris"),
    ("It costs $5.", "$5"),
    ("about 50%", "50%"),
    ("x = -4", "-4"),
    ("x = −4", "-4"),  # U+2212 minus sign reads as '-'
    ("It is 3.", "3"),
    ("H2O", "h2o"),
    ("İstanbul", "Istanbul"),  # Turkish dotted capital: case folding adds a combining dot, dropped
    ("ISTANBUL", "İstanbul"),
    ("x = –4", "-4"),  # an en dash as a minus reads as '-'
    ("pages 3–4", "4"),  # a range: the dash follows a digit, so it is no sign
    ("3/4 of them", "3/4"),
    ("at 4:30", "4:30"),
    ("Answer: 4", "4"),  # a colon after a word is no number's
]
WRONG = [
    ("It is 14.", "4"),
    ("40 apples", "4"),
    ("about 4.5", "4"),
    ("4,000 people", "4"),
    ("x = -4", "4"),
    ("x = −4", "4"),
    ("the 4th", "4"),
    ("A Parisian café", "Paris"),
    ("Paris_2", "Paris"),
    ("New Yorker", "New York"),
    ("12 apples", "2 apples"),
    ("", "4"),
    ("nothing here", "Paris"),
    ("北京", "上海"),
    ("x = –4", "4"),  # en dash as a minus
    ("about 3/4", "4"),  # a fraction is not its denominator
    ("3/4", "3"),
    ("at 4:30", "4"),  # a time is not its hour
    ("at 4:30", "30"),
]


@pytest.mark.parametrize("output,answer", CORRECT)
def test_output_with_the_answer_is_correct(output: str, answer: str) -> None:
    assert is_correct(output, answer)
    assert is_correct(output, ["nothing-like-it", answer])


@pytest.mark.parametrize("output,answer", WRONG)
def test_output_without_the_answer_is_not(output: str, answer: str) -> None:
    assert not is_correct(output, answer)


def test_a_later_occurrence_still_counts() -> None:
    assert is_correct("14 or 40? No: 4", "4")  # the first '4' is inside 14, a later one stands alone
    assert is_correct("Parisian? Paris.", "Paris")


def test_matching_answer_names_the_first_accepted_answer_found() -> None:
    assert matching_answer("The capital is París.", ["Paris", "París"]) == "París"
    assert matching_answer("paris and parís", ["París", "Paris"]) == "París"
    assert matching_answer("Lyon", ["Paris", "París"]) is None
    assert matching_answer("Paris", "Paris") == "Paris"


def test_normalise_and_contains() -> None:
    assert normalise("  Ｈｅｌｌｏ\u3000World\n\t!  ") == "hello world !"
    assert not contains_answer("anything", "")


# ------------------------------------------------------------------ the prompt-set field

BAD_EXPECTED = [
    ("number", 4, "must be a string or a list of strings (accepted answers), got a number (4)"),
    ("boolean", True, "got a boolean"),
    ("object", {"answer": "4"}, "got an object"),
    ("empty-list", [], "must hold at least one accepted answer"),
    ("empty-string", "", "must not be empty"),
    ("blank-string", "  \t", "must not be empty"),
    ("number-in-list", ["4", 4], "answer 2: must be a string, got a number (4)"),
    ("empty-in-list", ["Paris", ""], "answer 2: must not be empty"),
    ("list-in-list", [["Paris"]], "answer 1: must be a string, got a list"),
    ("punctuation", ".", "holds no letter, digit or CJK character"),
    ("punctuation-in-list", ["Paris", "?!"], "answer 2: '?!' holds no letter, digit or CJK character"),
]


@pytest.mark.parametrize("name,value,words", BAD_EXPECTED, ids=[b[0] for b in BAD_EXPECTED])
def test_bad_expected_is_reported_with_file_line_and_field(tmp_path: Path, name: str, value, words: str) -> None:
    path = tmp_path / f"{name}.jsonl"
    lines = [{"id": "a", "prompt": "Hello", "expected": "hi"}, {"id": "b", "prompt": "2 + 2?", "expected": value}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    prompt_set, problems = check_prompt_set(path)
    assert prompt_set is None
    assert len(problems) == 1
    problem = problems[0]
    assert (problem.line, problem.field) == (2, "expected")
    assert words in problem.message
    assert str(problem).startswith(f"{path}:2: field 'expected': ")


def test_expected_is_optional_and_stored_as_a_list(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    lines = [{"id": "a", "prompt": "Capital of France?", "expected": "Paris"},
             {"id": "b", "messages": [{"role": "user", "content": "2 + 2?"}], "expected": ["4", "four"]},
             {"id": "c", "prompt": "Say something"},
             {"id": "d", "prompt": "Anything", "expected": None}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    prompt_set = load_prompt_set(path)
    assert [p.expected for p in prompt_set.prompts] == [["Paris"], ["4", "four"], None, None]
    assert expected_answers(prompt_set) == {"a": AnswerKey(("Paris",)), "b": AnswerKey(("4", "four"))}
    assert expected_answers(None) == {}
    assert "expected" not in prompt_set.get("a").payload()  # never sent to the engine
    assert PromptRecord.model_validate(prompt_set.get("b").model_dump()) == prompt_set.get("b")


# ------------------------------------------------------------------ rejected answers (hedges)

HEDGES = [
    # (output, accepted, rejected, the accepted answer found or None)
    ("Paris, London or Rome?", "Paris", ["London", "Rome"], None),  # names every option
    ("Paris.", "Paris", ["London", "Rome"], "Paris"),
    ("A B C D", "B", ["A", "C", "D"], None),
    ("The answer is (B).", "B", ["A", "C", "D"], "B"),
    ("Answer: B, not a", "B", ["A", "C", "D"], None),  # case-folded like the accepted ones
    ("Paris, Texas", "Paris", ["Paris, Texas"], None),  # a rejected answer may hold the accepted one
    ("It is Paris; Texas has another.", "Paris", ["Paris, Texas"], "Paris"),
    ("4 or 40", "4", ["40"], None),
    ("4.5 is close, 4 is it", "4", ["5"], "4"),  # 5 only inside 4.5: not found, as any answer
]


@pytest.mark.parametrize("output,accepted,rejected,found", HEDGES)
def test_an_output_that_names_a_rejected_answer_is_wrong(output, accepted, rejected, found) -> None:
    key = AnswerKey((accepted,), tuple(rejected))
    assert matching_answer(output, key) == found
    assert is_correct(output, key) is (found is not None)
    assert is_correct(output, accepted) is (contains_answer(normalise(output), normalise(accepted)))  # no key: as before
    assert (rejected_answer(output, rejected) is None) is (found is not None or not is_correct(output, accepted))


def test_a_hedging_candidate_loses_the_answer_and_the_reason_names_the_rejected_one() -> None:
    key = AnswerKey(("Paris",), ("London", "Rome"))
    check = check_answer("The capital of France is Paris.", "It is Paris, or maybe London.", key)
    assert (check.golden_correct, check.candidate_correct, check.flip) == (True, False, "lost")
    assert (check.golden_rejected, check.candidate_rejected) == (None, "London")
    assert answer_reason(check) == "expected answer lost: golden had 'Paris', the candidate names the rejected answer 'London'"
    plain = check_answer("Paris", "Berlin", key)
    assert answer_reason(plain) == "expected answer lost: golden had 'Paris', candidate does not"


def test_reject_is_read_from_the_prompt_set_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    lines = [{"id": "a", "prompt": "Capital of France?", "expected": "Paris", "reject": ["London", "Paris, Texas"]},
             {"id": "b", "prompt": "Which letter?", "expected": "B", "reject": "A"},
             {"id": "c", "prompt": "2 + 2?", "expected": "4"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    prompt_set = load_prompt_set(path)
    assert [p.reject for p in prompt_set.prompts] == [["London", "Paris, Texas"], ["A"], None]
    assert expected_answers(prompt_set) == {"a": AnswerKey(("Paris",), ("London", "Paris, Texas")),
                                            "b": AnswerKey(("B",), ("A",)), "c": AnswerKey(("4",))}
    assert "reject" not in prompt_set.get("a").payload()  # never sent to the engine


BAD_REJECT = [
    ("without-expected", {"reject": ["London"]}, "needs 'expected'"),
    ("part-of-accepted", {"expected": "New York", "reject": "York"}, "is part of the accepted answer 'New York'"),
    ("same-as-accepted", {"expected": ["Paris", "París"], "reject": ["PARIS"]}, "is part of the accepted answer 'Paris'"),
    ("punctuation", {"expected": "Paris", "reject": ["?"]}, "holds no letter, digit or CJK character"),
    ("number", {"expected": "Paris", "reject": 4}, "(rejected answers), got a number (4)"),
    ("empty-list", {"expected": "Paris", "reject": []}, "must hold at least one rejected answer"),
]


@pytest.mark.parametrize("name,fields,words", BAD_REJECT, ids=[b[0] for b in BAD_REJECT])
def test_bad_reject_is_reported_with_file_line_and_field(tmp_path: Path, name: str, fields, words: str) -> None:
    path = tmp_path / f"{name}.jsonl"
    lines = [{"id": "a", "prompt": "Hello", "expected": "hi"}, {"id": "b", "prompt": "Capital?", **fields}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    prompt_set, problems = check_prompt_set(path)
    assert prompt_set is None and len(problems) == 1
    assert (problems[0].line, problems[0].field) == (2, "reject")
    assert words in problems[0].message


def test_score_runs_counts_an_output_with_a_rejected_answer_as_wrong(base: Case, plan, answered) -> None:
    # The prompt whose answer both sides keep: a rejected word both outputs also hold makes both wrong.
    score, _ = answered
    kept = next(s for s in score.scores if s.answer is not None and s.answer.golden_correct and s.answer.candidate_correct)
    g = base.golden.texts[base.golden.position(kept.prompt_id)]
    c = base.run.texts[base.run.position(kept.prompt_id)]
    accepted = kept.answer.golden_match
    wrong = next(w for w in WORDS if w != accepted and is_correct(g, w) and is_correct(c, w)
                 and not contains_answer(normalise(accepted), normalise(w)))
    keys = {pid: AnswerKey(tuple(v)) for pid, v in plan.items()}
    keys[kept.prompt_id] = AnswerKey(tuple(plan[kept.prompt_id]), (wrong,))
    rescored = {s.prompt_id: s for s in _score(base, keys).scores}[kept.prompt_id]
    assert not rescored.answer.golden_correct and not rescored.answer.candidate_correct
    assert rescored.answer.golden_rejected == rescored.answer.candidate_rejected == wrong
    assert _score(base, keys).metrics.golden_answers_correct == score.metrics.golden_answers_correct - 1


# ------------------------------------------------------------------ scoring


def _absent(word: str, text: str) -> bool:
    return not is_correct(text, word)


def _word(present_in: str, absent_from: str) -> str:
    """A fixture word the first text holds and the second does not."""
    for word in WORDS:
        if is_correct(present_in, word) and _absent(word, absent_from):
            return word
    raise AssertionError("no such word in the fixture texts")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("answers"), 40)


@pytest.fixture(scope="module")
def plan(base: Case) -> dict[str, list[str]]:
    return answer_plan(base)


def answer_plan(base: Case) -> dict[str, list[str]]:
    """Prompt id -> accepted answers: two drift prompts and a regression lose their answer, a
    regression gains one, an identical prompt keeps it, another never had it, a benign one keeps
    its second accepted answer."""

    def texts(pid: str) -> tuple[str, str]:
        return base.golden.texts[base.golden.position(pid)], base.run.texts[base.run.position(pid)]

    drift, regression = base.ids_of("drift"), base.ids_of("regression")
    identical, benign = base.ids_of("identical"), base.ids_of("benign")
    out = {}
    for pid in (drift[0], drift[1], regression[0]):
        out[pid] = [_word(*texts(pid))]
    g, c = texts(regression[1])
    out[regression[1]] = [_word(c, g)]
    g, _ = texts(identical[0])
    out[identical[0]] = [next(w for w in WORDS if is_correct(g, w))]
    out[identical[1]] = ["xylophone"]
    g, c = texts(benign[0])
    out[benign[0]] = ["xylophone", next(w for w in WORDS if is_correct(g, w) and is_correct(c, w))]
    return out


def _answered_prompt_set(base: Case, plan: dict[str, list[str]], path: Path):
    lines = []
    for p in base.prompt_set.prompts:
        record = p.model_dump(exclude_none=True, exclude={"sampling"})
        if p.id in plan:
            record["expected"] = plan[p.id] if len(plan[p.id]) > 1 else plan[p.id][0]
        lines.append(json.dumps(record, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return load_prompt_set(path)


def _score(base: Case, expected: dict[str, list[str]] | None, t: Thresholds | None = None) -> ScoredRun:
    t = t or Thresholds()
    tags = {p.id: p.tags for p in base.prompt_set.prompts}
    return score_runs(base.golden, base.run, t, tags=tags, expected=expected,
                      metrics=build_metrics(t, encoder=BagOfWordsEncoder()))


@pytest.fixture(scope="module")
def answered(base: Case, plan: dict[str, list[str]]) -> tuple[ScoredRun, object]:
    prompt_set = _answered_prompt_set(base, plan, base.root / "answered.jsonl")
    return _score(base, expected_answers(prompt_set)), prompt_set


def test_scores_count_correct_answers_and_flips(base: Case, plan: dict[str, list[str]], answered) -> None:
    score, _ = answered
    m = score.metrics
    drift, regression = base.ids_of("drift"), base.ids_of("regression")
    identical, benign = base.ids_of("identical"), base.ids_of("benign")
    order = [s.prompt_id for s in score.scores]
    lost = sorted([drift[0], drift[1], regression[0]], key=order.index)
    assert m.answer_prompts == len(plan) == 7
    assert m.golden_answers_correct == 5  # the three lost, the identical one and the benign one
    assert m.answers_correct == 3  # the gained one, the identical one and the benign one
    assert (m.answer_flips_lost, m.answer_flips_gained) == (3, 1)
    assert m.answer_flips_lost_ids == lost
    assert m.answer_flips_gained_ids == [regression[1]]
    by_id = {s.prompt_id: s for s in score.scores}
    kept = by_id[benign[0]].answer
    assert kept.golden_correct and kept.candidate_correct and kept.flip is None
    assert kept.golden_match == kept.candidate_match == plan[benign[0]][1]
    never = by_id[identical[1]].answer
    assert not never.golden_correct and not never.candidate_correct and never.flip is None
    assert all(by_id[pid].answer is None for pid in order if pid not in plan)


def test_lost_and_gained_answers_are_reasons_classes_unchanged(base: Case, plan, answered) -> None:
    score, _ = answered
    by_id = {s.prompt_id: s for s in score.scores}
    before = {s.prompt_id: s for s in base.score.scores}
    for pid in score.metrics.answer_flips_lost_ids:
        s = by_id[pid]
        assert s.prompt_class == before[pid].prompt_class
        assert s.reasons[0] == f"expected answer lost: golden had '{plan[pid][0]}', candidate does not"
        assert s.reasons[1:] == before[pid].reasons
    (gained,) = score.metrics.answer_flips_gained_ids
    assert by_id[gained].reasons[-1] == f"expected answer gained: candidate has '{plan[gained][0]}', golden did not"
    assert by_id[gained].reasons[:-1] == before[gained].reasons
    for pid in plan:
        if pid not in score.metrics.answer_flips_lost_ids + score.metrics.answer_flips_gained_ids:
            assert by_id[pid].reasons == before[pid].reasons


def test_without_expected_answers_nothing_changes(base: Case) -> None:
    for expected in (None, {}):
        score = _score(base, expected)
        old_fields = {k: v for k, v in score.metrics.model_dump().items() if not k.startswith("answer")
                      and k not in ("golden_answers_correct", "answers_correct")}
        assert old_fields == {k: v for k, v in base.score.metrics.model_dump().items() if k in old_fields}
        m = score.metrics
        assert (m.answer_prompts, m.golden_answers_correct, m.answers_correct, m.answer_flips_lost,
                m.answer_flips_gained, m.answer_flips_lost_ids, m.answer_flips_gained_ids) == (0, 0, 0, 0, 0, [], [])
        assert score.verdict_reasons == base.score.verdict_reasons == \
            [f"{base.score.metrics.regression} prompt(s) regressed (allowed: 0)"]
        assert [s.reasons for s in score.scores] == [s.reasons for s in base.score.scores]
        assert all(s.answer is None for s in score.scores)


def test_old_metrics_and_scores_files_still_read(answered) -> None:
    score, _ = answered
    old = {k: v for k, v in json.loads(score.metrics.model_dump_json()).items() if "answer" not in k}
    assert RunMetrics.model_validate(old).answer_prompts == 0
    data = json.loads(score.model_dump_json())
    for s in data["scores"]:
        del s["answer"]
    assert ScoredRun.model_validate(data).scores[0].answer is None


# ------------------------------------------------------------------ the threshold


def test_threshold_is_optional_and_validated() -> None:
    assert Thresholds().max_answer_flips_lost is None
    assert Thresholds.from_params({"max_answer_flips_lost": 2}).max_answer_flips_lost == 2
    for bad in (-1, "two"):
        with pytest.raises(ConfigError) as info:
            Thresholds.from_params({"max_answer_flips_lost": bad}, file="params.yaml")
        assert info.value.field == "thresholds.max_answer_flips_lost"
        assert "params.yaml: field 'thresholds.max_answer_flips_lost'" in str(info.value)


ANSWERS = {"answer_prompts": 10, "golden_answers_correct": 9, "answers_correct": 8, "answer_flips_lost": 2,
           "answer_flips_gained": 1}


def test_run_verdict_with_answers() -> None:
    clean = {"regression": 0, "input_drift": 0}
    none = {**ANSWERS, "answer_prompts": 0}
    assert run_verdict(clean, Thresholds()) == run_verdict(clean, Thresholds(), answers=none)
    verdict, reasons = run_verdict(clean, Thresholds(), answers=ANSWERS)
    assert verdict == "pass"
    assert reasons == ["0 regression(s), allowed 0",
                       "expected answers: golden 9/10 correct, candidate 8/10; 2 lost, 1 gained "
                       "(reported, not gating: thresholds.max_answer_flips_lost is not set)"]
    verdict, reasons = run_verdict(clean, Thresholds(max_answer_flips_lost=1), answers=ANSWERS)
    assert verdict == "fail"
    assert reasons == ["2 prompt(s) lost their expected answer (allowed: 1)",
                       "expected answers: golden 9/10 correct, candidate 8/10; 2 lost, 1 gained"]
    verdict, reasons = run_verdict(clean, Thresholds(max_answer_flips_lost=2), answers=ANSWERS)
    assert verdict == "pass" and reasons[-1].endswith("(allowed lost: 2)")
    verdict, reasons = run_verdict({"regression": 3}, Thresholds(max_answer_flips_lost=0), answers=ANSWERS)
    assert verdict == "fail"
    assert reasons[:2] == ["3 prompt(s) regressed (allowed: 0)", "2 prompt(s) lost their expected answer (allowed: 0)"]
    kept = {**ANSWERS, "answer_flips_lost": 0}
    assert run_verdict(clean, Thresholds(max_answer_flips_lost=0), answers=kept)[0] == "pass"


def test_threshold_gates_a_scored_run(base: Case, plan) -> None:
    lenient = {"max_regressions": 100}
    assert _score(base, plan, Thresholds(**lenient)).metrics.verdict == "pass"
    failing = _score(base, plan, Thresholds(**lenient, max_answer_flips_lost=2))
    assert failing.metrics.verdict == "fail"
    assert failing.verdict_reasons[0] == "3 prompt(s) lost their expected answer (allowed: 2)"
    assert _score(base, plan, Thresholds(**lenient, max_answer_flips_lost=3)).metrics.verdict == "pass"
    assert failing.thresholds["max_answer_flips_lost"] == 2


# ------------------------------------------------------------------ outputs


@pytest.fixture(scope="module")
def written(base: Case, answered, tmp_path_factory: pytest.TempPathFactory) -> Path:
    score, prompt_set = answered
    root = tmp_path_factory.mktemp("answers-report")
    write_score_outputs(score, root / "scores")
    write_candidate_report(score, base.golden, base.run, prompt_set, root / "reports" / "candidate")
    write_index([(score, "candidate/index.html"), (base.score, "plain/index.html")], root / "reports")
    return root


def test_metrics_json_carries_answers_and_matches_its_schema(answered, written: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    score, _ = answered
    schema = json.loads(METRICS_SCHEMA.read_text(encoding="utf-8"))
    for path in (written / "scores" / "metrics.json", written / "reports" / "candidate" / METRICS_FILE):
        metrics = json.loads(path.read_text(encoding="utf-8"))
        jsonschema.validate(metrics, schema)
        assert metrics["answer_flips_lost_ids"] == score.metrics.answer_flips_lost_ids
        assert (metrics["answer_prompts"], metrics["answer_flips_lost"], metrics["answer_flips_gained"]) == (7, 3, 1)
    for broken in ({**metrics, "answer_flips_lost": "3"}, {**metrics, "answer_flips_lost_ids": [1]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)
    old = {k: v for k, v in metrics.items() if "answer" not in k}  # metrics.json of earlier releases
    jsonschema.validate(old, schema)


def test_summary_lists_answers(answered, written: Path, base: Case) -> None:
    score, _ = answered
    text = (written / "reports" / "candidate" / SUMMARY_FILE).read_text(encoding="utf-8")
    assert ("**Expected answers** (7 prompts have one): golden 5 correct (71.4%), candidate 3 (42.9%); "
            "**3 lost**, 1 gained.") in text
    lost = ", ".join(f"`{pid}`" for pid in score.metrics.answer_flips_lost_ids)
    assert f"Lost: {lost}" in text
    assert f"Gained: `{score.metrics.answer_flips_gained_ids[0]}`" in text
    assert "Expected answers" not in summary_markdown(base.score)


def test_junit_fails_what_gates_and_skips_lost_answers(answered, written: Path, base: Case) -> None:
    """junit.xml's failures are what the verdict gates on: the failed fidelity verdict and the
    regressions it counts. A lost answer on a prompt that did not regress is reported (skipped,
    with the answer) and does not fail: the quality verdict judges answers as a whole."""
    score, _ = answered
    assert score.metrics.gate == "fidelity" and score.metrics.verdict == "fail"
    suite = ET.parse(written / "reports" / "candidate" / JUNIT_FILE).getroot().find("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    regressions = set(base.ids_of("regression"))
    failed = {name for name, c in cases.items() if c.find("failure") is not None}
    assert failed == {"fidelity"} | regressions
    assert suite.get("failures") == str(len(failed))
    assert cases["fidelity"].find("failure").get("message").startswith("fidelity fail: ")
    lost_only = set(score.metrics.answer_flips_lost_ids) - regressions
    assert lost_only
    for pid in score.metrics.answer_flips_lost_ids:
        if pid in regressions:
            failure = cases[pid].find("failure")
            assert failure.get("type") == "regression"
            assert failure.get("message").startswith("expected answer lost: golden had '")
            assert "golden correct, candidate incorrect" in failure.text
        else:
            skipped = cases[pid].find("skipped")
            assert skipped.get("message").startswith("expected answer lost, not gating")
            assert "golden correct, candidate incorrect" in skipped.get("message")
    assert int(suite.get("skipped")) >= len(lost_only)
    gained = score.metrics.answer_flips_gained_ids[0]
    assert cases[gained].find("failure").get("type") == "regression"  # it regressed, answer or not
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert (props["answer_prompts"], props["answer_flips_lost"], props["answer_flips_gained"]) == ("7", "3", "1")
    assert props["gating_failed"] == "true"
    plain = ET.fromstring(junit_xml(base.score).encode()).find("testsuite")
    assert "answer_prompts" not in {p.get("name") for p in plain.find("properties")}
    assert plain.get("failures") == str(len(regressions) + 1)


def _data(page: str) -> dict:
    block = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, flags=re.S)
    return json.loads(block.group(1))


def test_page_has_an_answers_section_linking_to_prompts(answered, written: Path, plan) -> None:
    score, _ = answered
    page = (written / "reports" / "candidate" / "index.html").read_text(encoding="utf-8")
    section = page[page.index('<section class="card answers" id="answers">'):]
    section = section[:section.index("</section>")]
    assert "7 of 40 prompts have an expected answer" in section
    assert "5 / 7" in section and "3 / 7" in section
    assert "Lost answers are reported, not gating" in section
    lost, gained = section.index("Lost: 3"), section.index("Gained: 1")
    for pid in score.metrics.answer_flips_lost_ids:
        at = section.index(f'<a class="open-prompt" href="#prompt={pid}" data-id="{pid}"')
        assert lost < at < gained
        assert f">{html.escape(plan[pid][0])}</td>" in section
    pid = score.metrics.answer_flips_gained_ids[0]
    assert section.index(f'href="#prompt={pid}" data-id="{pid}"') > gained
    data = _data(page)
    answers = {p["id"]: p["a"] for p in data["prompts"] if "a" in p}
    assert set(answers) == set(plan)
    for pid in score.metrics.answer_flips_lost_ids:
        assert answers[pid][:3] == [plan[pid], True, False] and answers[pid][3] == plan[pid][0]
    script = (Path(__file__).resolve().parent.parent / "regress/report/templates/report.js").read_text(encoding="utf-8")
    assert "#answers a.open-prompt" in script and "answerBlock(p.a)" in script


def test_page_without_expected_answers_has_no_answers_section(base: Case) -> None:
    page = render_candidate(base.score, base.golden, base.run, base.prompt_set)
    assert 'id="answers"' not in page
    assert not any("a" in p for p in _data(page)["prompts"])


def test_threshold_shows_on_the_page(base: Case, plan) -> None:
    score = _score(base, plan, Thresholds(max_regressions=100, max_answer_flips_lost=1))
    page = render_candidate(score, base.golden, base.run, None)
    assert "The run fails when more than 1 prompt lose their answer" in page
    # The page says what stopped the run, in the verdict's own words.
    assert "3 prompt(s) lost their expected answer (allowed: 1): stop the rollout" in page


def test_index_lists_answers_per_candidate(written: Path) -> None:
    index = (written / "reports" / "index.html").read_text(encoding="utf-8")
    assert ">answers</th>" in index
    assert "5 → 3 / 7" in index
    assert '<td class="num lost">3 / 1</td>' in index
    assert '<td class="num zero">—</td><td class="num zero">—</td>' in index  # the candidate without answers


def test_hostile_answers_and_ids_are_escaped_everywhere(answered, base: Case, tmp_path: Path) -> None:
    score, _ = answered
    bad_id = HOSTILE[1]
    first = score.scores[0]
    hostile = first.model_copy(update={
        "prompt_id": bad_id,
        "answer": AnswerCheck(expected=[HOSTILE[0], HOSTILE[4]], golden_correct=True, candidate_correct=False,
                              golden_match=HOSTILE[0]),
        "reasons": [f"expected answer lost: golden had {HOSTILE[0]!r}, candidate does not"]})
    metrics = score.metrics.model_copy(update={"answer_flips_lost_ids": [bad_id], "answer_flips_lost": 1})
    bad = score.model_copy(update={"scores": [hostile, *score.scores[1:]], "metrics": metrics})
    page = render_candidate(bad, base.golden, base.run, None)
    for h in (HOSTILE[0], HOSTILE[1], HOSTILE[4]):
        assert h not in page
    assert "<img" not in page and len(re.findall(r"<script", page)) == 2
    assert f'href="#prompt=%22%3E%3Cimg%20src%3Dx%20onerror%3Dalert%281%29%3E"' in page
    assert _data(page)["prompts"][[p["id"] for p in _data(page)["prompts"]].index(bad_id)]["a"][0] == \
        [HOSTILE[0], HOSTILE[4]]
    summary = summary_markdown(bad)
    assert "<img" not in summary.replace(f"`{bad_id}`", "")
    junit = ET.fromstring(junit_xml(bad).encode())
    case = next(c for c in junit.findall("testsuite/testcase") if c.get("name") not in ("fidelity", "quality"))
    assert case.get("name") == bad_id
    assert case.find("failure") is not None or case.find("skipped") is not None


def test_payload_answer_entries_are_capped(answered, base: Case) -> None:
    score, _ = answered
    long = "x" * 1000
    s = score.scores[0].model_copy(update={"answer": AnswerCheck(expected=[long] * 30, golden_correct=True,
                                                                 candidate_correct=True, golden_match=long,
                                                                 candidate_match=long)})
    data = build_payload(score.model_copy(update={"scores": [s]}), base.golden, base.run, None)
    a = data["prompts"][0]["a"]
    assert len(a[0]) == 20 and all(len(x) == 201 and x.endswith("…") for x in a[0])
    assert len(a[3]) == len(a[4]) == 201
