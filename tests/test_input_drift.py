"""Input drift fails the run unless the candidate accepts it (``allow_input_drift: true``), and
its prompts are still scored by their outputs."""

from __future__ import annotations

import dataclasses

import pytest

from report_fixtures import BagOfWordsEncoder, Case, build_case
from regress.scoring import build_metrics, score_runs
from regress.verdict import Thresholds, classify, run_verdict


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("input-drift"), 20)


def _score(case: Case, *, allow: bool):  # type: ignore[no-untyped-def]
    manifest = case.run.manifest
    candidate = manifest.candidate.model_copy(update={"allow_input_drift": allow})
    run = dataclasses.replace(case.run, manifest=manifest.model_copy(update={"candidate": candidate}))
    t = Thresholds(max_regressions=100)  # only input drift can fail the run here
    return score_runs(case.golden, run, t, metrics=build_metrics(t, encoder=BagOfWordsEncoder()))


def test_input_drift_fails_unless_the_candidate_accepts_it(case: Case) -> None:
    refused = _score(case, allow=False)
    n = refused.metrics.input_drift
    assert n >= 1
    assert refused.metrics.verdict == "fail"
    assert refused.verdict_reasons[0].startswith(f"{n} prompt(s) changed their input tokens")
    assert "allow_input_drift: true" in refused.verdict_reasons[0] and "regress diff" in refused.verdict_reasons[0]
    accepted = _score(case, allow=True)
    assert accepted.metrics.verdict == "pass"
    assert f"{n} prompt(s) changed their input tokens, accepted (allow_input_drift: true)" in accepted.verdict_reasons


def test_input_drift_prompts_are_scored_by_their_outputs(case: Case) -> None:
    scored = _score(case, allow=True)
    drifted = [s for s in scored.scores if s.prompt_class == "input_drift"]
    assert drifted
    for s in drifted:
        assert s.reasons[0].startswith("prompt token ids differ")
        assert s.reasons[1].startswith("outputs: semantic similarity ") and "ROUGE-L" in s.reasons[1]
    # The class itself: the outputs do not turn it into another class.
    klass, reasons = classify({"input_drift": True, "semantic_similarity": 0.25}, Thresholds())
    assert klass == "input_drift" and reasons[1] == "outputs: semantic similarity 0.25"


def test_the_count_of_input_drift_alone_decides() -> None:
    t = Thresholds()
    assert run_verdict({"regression": 0, "input_drift": 2}, t)[0] == "fail"
    assert run_verdict({"regression": 0, "input_drift": 2}, t, allow_input_drift=True)[0] == "pass"
    assert run_verdict({"regression": 0, "input_drift": 0}, t)[0] == "pass"


def test_junit_fails_input_drift_prompts_unless_accepted(case: Case) -> None:
    import xml.etree.ElementTree as ET

    from regress.report.junit import junit_xml

    for allow, tag in ((False, "failure"), (True, "skipped")):
        scored = _score(case, allow=allow)
        root = ET.fromstring(junit_xml(scored))
        drifted = {s.prompt_id for s in scored.scores if s.prompt_class == "input_drift"}
        for tc in root.iter("testcase"):
            if tc.get("name") in drifted:
                assert tc.find(tag) is not None, (allow, tc.get("name"))
                if tag == "failure":
                    assert tc.find(tag).get("type") == "input_drift"
