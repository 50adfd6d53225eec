"""``junit.xml``: what gates a candidate, as failures; everything else it found, as skips and output.

A CI test view counts failures: they are exactly what stops the rollout, so a green view and exit 0
agree, and so do a red view and exit 1.

- ``fidelity`` and ``quality`` cases carry the two run-level verdicts. The one the candidate's
  ``gate`` names fails when its verdict does; the other is ``skipped`` when it did not pass
  ("reported, not gating").
- A prompt fails only when it is what the failed fidelity verdict counted: a regression (with a
  noise floor: a severe one, ``RunMetrics.severe_regression_ids``), or an input drift the candidate
  does not accept. A regression or a lost answer the verdict does not gate on is ``skipped``, with
  the reason; drift and benign prompts pass with their class and reasons in ``system-out``.
- Each prompt's case names its line in the prompt set (``file`` and ``line`` attributes, which
  GitHub annotations and most CI views use to link to it).

Latency (``RunMetrics.latency``) goes into the suite's properties; a failed latency verdict is a
``latency`` test case of its own (``type="latency"``) only when it gates (``thresholds.gate_latency``).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING, Any

from regress.metrics import output_specs
from regress.metrics.spec import headline
from regress.records import PromptScore, RunMetrics, ScoredRun
from regress.untrusted import without_controls

if TYPE_CHECKING:
    from regress.diagnosis.record import Diagnosis, PromptDiagnosis

_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(value: object) -> str:
    """Text XML 1.0 can hold, shown as the CLI shows it: control and bidi characters (a right-to-left
    override that would reorder a CI view's line) and lone surrogates as ``\\uNNNN``
    (:func:`regress.untrusted.without_controls`; tab, newline and CR kept); anything else XML forbids
    (U+FFFE, U+FFFF) becomes U+FFFD."""
    return _NOT_XML.sub("\ufffd", without_controls(str(value), keep="\t\n\r"))


def shown_metrics() -> list[str]:
    """The values on a prompt's line: each registered metric's headline values (its spec says which)."""
    return [spec.name for spec in headline(output_specs())]


def _metrics_line(values: dict, shown: list[str]) -> str:
    return ", ".join(f"{k}={values[k]:.4g}" if isinstance(values.get(k), float) else f"{k}={values.get(k)}"
                     for k in shown if k in values)


def _answer_lost(s: PromptScore) -> bool:
    return s.answer is not None and s.answer.flip == "lost"


def _answer_line(s: PromptScore) -> list[str]:
    if s.answer is None:
        return []
    a = s.answer

    def said(correct: bool) -> str:
        return "correct" if correct else "incorrect"

    return [f"expected: {' | '.join(repr(x) for x in a.expected)}; golden {said(a.golden_correct)}, "
            f"candidate {said(a.candidate_correct)}"]


def _why(dx: "PromptDiagnosis | None") -> str:
    """``why it drifted: causes: why`` of a diagnosed prompt ('' when not diagnosed)."""
    return "" if dx is None else f"why it drifted: {', '.join(dx.causes)}: {dx.why}"


def _quality_properties(props: ET.Element, m: Any) -> None:
    """Which verdict gates, and the quality verdict's figures."""
    ET.SubElement(props, "property", name="gate", value=m.gate)
    q = m.quality
    if q is None:
        return
    for key, value in (("quality_verdict", q.verdict), ("quality_prompts", q.prompts), ("quality_theta", q.theta),
                       ("quality_difference", q.difference), ("quality_low", q.low), ("quality_high", q.high),
                       ("quality_prompts_needed", q.prompts_needed)):
        if value is not None:
            ET.SubElement(props, "property", name=key, value=xml_text(f"{value:.6g}" if isinstance(value, float) else str(value)))


def gating_prompts(score: ScoredRun) -> set[str]:
    """The prompts the failed fidelity verdict stands on (each a failure in junit.xml): with a noise
    floor its severe regressions, else every regression; and input drifts the candidate does not
    accept. Empty when fidelity does not gate or passed."""
    m = score.metrics
    if m.gate not in ("fidelity", "both") or m.verdict != "fail":
        return set()
    accepted = score.run.candidate.allow_input_drift
    counted = set(m.severe_regression_ids) if m.severe_regressions is not None else \
        {s.prompt_id for s in score.scores if s.prompt_class == "regression"}
    return counted | {s.prompt_id for s in score.scores if s.prompt_class == "input_drift" and not accepted}


def _not_gating(s: PromptScore, gate: str) -> str | None:
    """Why a prompt's finding is shown but does not gate (its ``skipped`` message), or None."""
    if s.prompt_class == "input_drift":
        return (s.reasons[0] if s.reasons else "input drift") + (
            "" if gate == "quality" else " (accepted: allow_input_drift)")
    if s.prompt_class == "regression":
        return f"regression, not gating: {s.reasons[0] if s.reasons else 'regression'}"
    if _answer_lost(s):
        return f"expected answer lost, not gating (the quality verdict judges answers as a whole): {_answer_line(s)[0]}"
    return None


def _verdict_case(suite: ET.Element, name: str, which: str, verdict: str, gates: bool, reasons: list[str]) -> bool:
    """A run-level verdict's test case; True when it is a failure."""
    case = ET.SubElement(suite, "testcase", classname=xml_text(name), name=which, time="0")
    head = f"{which} {verdict}: {reasons[0] if reasons else verdict}"
    if verdict == "pass":
        ET.SubElement(case, "system-out").text = xml_text("\n".join(f"- {r}" for r in reasons))
        return False
    if not gates:
        ET.SubElement(case, "skipped", message=xml_text(f"reported, not gating: {head}"))
        return False
    failure = ET.SubElement(case, "failure", message=xml_text(head), type=which)
    failure.text = xml_text("\n".join(f"- {r}" for r in reasons))
    return True


def junit_xml(score: ScoredRun, *, diagnosis: "Diagnosis | None" = None, prompt_set: Any = None) -> str:
    """The JUnit XML document for one candidate. With a ``diagnosis`` of this run (``regress
    diagnose``), a diagnosed prompt's causes and why end its failure message, and its details
    say them with the mitigation. With the ``prompt_set``, each prompt's case names its file and line."""
    from regress.report.payload import diagnosis_of

    diagnosis = diagnosis_of(score, diagnosis)
    diagnosed = {p.prompt_id: p for p in diagnosis.prompts} if diagnosis is not None else {}
    m = score.metrics
    shown = shown_metrics()
    name = f"regress.{m.candidate}"
    gating = gating_prompts(score)
    lines = getattr(prompt_set, "lines", None) or {}
    source = str(prompt_set.path) if prompt_set is not None else None

    fidelity_gates = m.gate in ("fidelity", "both")
    quality_gates = m.gate in ("quality", "both")
    latency_fails = m.latency_verdict == "fail" and m.latency_gates
    has_quality = quality_gates or m.quality is not None
    cases = ET.Element("cases")  # filled first, counted, then put in the suite
    failures = int(_verdict_case(cases, name, "fidelity", m.verdict, fidelity_gates, list(score.verdict_reasons)))
    if has_quality:
        q = m.quality
        reasons = q.reasons if q is not None else ["no prompt with a checkable answer: quality cannot be judged"]
        failures += int(_verdict_case(cases, name, "quality", q.verdict if q is not None else "inconclusive",
                                      quality_gates, reasons))
    if latency_fails:
        case = ET.SubElement(cases, "testcase", classname=xml_text(name), name="latency", time="0")
        message = m.latency_reasons[0] if m.latency_reasons else "latency"
        failure = ET.SubElement(case, "failure", message=xml_text(message), type="latency")
        failure.text = xml_text("\n".join(f"- {r}" for r in m.latency_reasons))
        failures += 1
    for s in score.scores:
        where = {"file": xml_text(source), "line": str(lines[s.prompt_id])} if source and s.prompt_id in lines else {}
        case = ET.SubElement(cases, "testcase", classname=xml_text(name), name=xml_text(s.prompt_id), time="0", **where)
        dx = diagnosed.get(s.prompt_id)
        why = _why(dx)
        detail = "\n".join([f"class: {s.prompt_class}", *[f"- {r}" for r in s.reasons], *_answer_line(s),
                            *([why, f"mitigation: {dx.mitigation}"] if dx is not None else []),
                            f"tags: {', '.join(s.tags)}", _metrics_line(s.metrics, shown)])
        if s.prompt_id in gating:
            kind = s.prompt_class if s.prompt_class in ("regression", "input_drift") else "regression"
            message = s.reasons[0] if s.reasons else kind
            if why:
                message = f"{message}; {why}"
            failure = ET.SubElement(case, "failure", message=xml_text(message), type=kind)
            failure.text = xml_text(detail)
            failures += 1
            continue
        skip = _not_gating(s, m.gate)
        if skip is not None:
            ET.SubElement(case, "skipped", message=xml_text(skip + (f"; {why}" if why else "")))
        if s.prompt_class != "identical" or skip is not None:
            ET.SubElement(case, "system-out").text = xml_text(detail)
    tests = len(cases)
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    suites = ET.Element("testsuites", name="regress", tests=str(tests), failures=str(failures),
                        errors="0", skipped=str(skipped))
    suite = ET.SubElement(suites, "testsuite", name=xml_text(name), tests=str(tests),
                          failures=str(failures), errors="0", skipped=str(skipped), time="0",
                          timestamp=score.created_at.strftime("%Y-%m-%dT%H:%M:%S"))
    props = ET.SubElement(suite, "properties")
    for key, value in (("verdict", m.verdict), ("candidate", m.candidate), ("baseline", score.golden.candidate.name),
                       ("golden_run", score.golden.run_id), ("candidate_run", score.run.run_id),
                       ("verdict_reasons", "; ".join(score.verdict_reasons)),
                       ("gating_failed", "true" if m.gating_failed else "false")):
        ET.SubElement(props, "property", name=key, value=xml_text(value))
    if m.answer_prompts:
        for key, value in (("answer_prompts", m.answer_prompts), ("golden_answers_correct", m.golden_answers_correct),
                           ("answers_correct", m.answers_correct), ("answer_flips_lost", m.answer_flips_lost),
                           ("answer_flips_gained", m.answer_flips_gained)):
            ET.SubElement(props, "property", name=key, value=str(value))
    _quality_properties(props, m)
    _latency_properties(props, m)
    suite.extend(list(cases))
    ET.indent(suites, space=" ")
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


LATENCY_PROPERTIES = ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "tpot_p95_s", "latency_p95_s",
                      "throughput_tokens_per_s", "concurrency")
"""Of each side's latency, what the suite's properties carry (``golden_<name>``, ``candidate_<name>``)."""


def _latency_properties(props: ET.Element, m: RunMetrics) -> None:
    """The latency as suite properties: the latency verdict and its reasons when there is one, and
    for runs with per-request times (server runs) both sides' percentiles, throughput and
    concurrency. A failed latency verdict is a ``latency`` test case only when it gates
    (``thresholds.gate_latency``); otherwise these properties are all JUnit says of it."""
    from regress.latency import timed

    if m.latency_verdict is not None:
        ET.SubElement(props, "property", name="latency_verdict", value=m.latency_verdict)
        ET.SubElement(props, "property", name="latency_gates", value="true" if m.latency_gates else "false")
        ET.SubElement(props, "property", name="latency_reasons", value=xml_text("; ".join(m.latency_reasons)))
    lat = m.latency
    if lat is None or not timed(lat):
        return
    for side, stats in (("golden", lat.golden), ("candidate", lat.candidate)):
        ET.SubElement(props, "property", name=f"{side}_timed_requests", value=str(stats.requests))
        for key in LATENCY_PROPERTIES:
            value = getattr(stats, key)
            if value is not None:
                ET.SubElement(props, "property", name=f"{side}_{key}",
                              value=f"{value:.6g}" if isinstance(value, float) else str(value))
