"""``junit.xml``: one test case per prompt, a failure per regression, for CI test views.

input_drift prompts fail (``type="input_drift"``: they fail the run) unless the candidate
accepts input drift (``allow_input_drift: true``), then they are ``skipped`` (not comparable
token by token); drift and benign prompts
pass, with their class and reasons in ``system-out``. A prompt that lost its expected answer
(golden correct, candidate not) fails too, like a regression: ``type="answer_lost"`` (or
``regression`` when it is one as well), the lost answer as the message.

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

if TYPE_CHECKING:
    from regress.diagnosis.record import Diagnosis, PromptDiagnosis

_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(value: object) -> str:
    """Text XML 1.0 can hold: characters it forbids (NUL, most C0 controls, lone surrogates) become U+FFFD."""
    return _NOT_XML.sub("\ufffd", str(value))


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


def junit_xml(score: ScoredRun, *, diagnosis: "Diagnosis | None" = None) -> str:
    """The JUnit XML document for one candidate. With a ``diagnosis`` of this run (``regress
    diagnose``), a diagnosed prompt's causes and why end its failure message, and its details
    say them with the mitigation."""
    from regress.report.payload import diagnosis_of

    diagnosis = diagnosis_of(score, diagnosis)
    diagnosed = {p.prompt_id: p for p in diagnosis.prompts} if diagnosis is not None else {}
    m = score.metrics
    shown = shown_metrics()
    name = f"regress.{m.candidate}"
    accepted = score.run.candidate.allow_input_drift

    fidelity_gates = m.gate in ("fidelity", "both")
    quality_gates = m.gate in ("quality", "both")

    def fails(s: PromptScore) -> bool:
        # A candidate gated on quality alone is judged on its answers as a whole (the "quality" case):
        # a prompt's drift, or one answer lost among others gained, is no failure of it.
        if not fidelity_gates:
            return s.prompt_class == "input_drift" and not accepted
        return s.prompt_class == "regression" or _answer_lost(s) or (s.prompt_class == "input_drift" and not accepted)

    failures = sum(1 for s in score.scores if fails(s))
    skipped = sum(1 for s in score.scores if s.prompt_class == "input_drift" and not fails(s))
    latency_fails = m.latency_verdict == "fail" and m.latency_gates
    quality_fails = quality_gates and (m.quality is None or m.quality.verdict != "pass")
    tests = m.prompts + (1 if latency_fails else 0) + (1 if quality_gates else 0)
    failures += (1 if latency_fails else 0) + (1 if quality_fails else 0)
    suites = ET.Element("testsuites", name="regress", tests=str(tests), failures=str(failures),
                        errors="0", skipped=str(skipped))
    suite = ET.SubElement(suites, "testsuite", name=xml_text(name), tests=str(tests),
                          failures=str(failures), errors="0", skipped=str(skipped), time="0",
                          timestamp=score.created_at.strftime("%Y-%m-%dT%H:%M:%S"))
    props = ET.SubElement(suite, "properties")
    for key, value in (("verdict", m.verdict), ("candidate", m.candidate), ("baseline", score.golden.candidate.name),
                       ("golden_run", score.golden.run_id), ("candidate_run", score.run.run_id),
                       ("verdict_reasons", "; ".join(score.verdict_reasons))):
        ET.SubElement(props, "property", name=key, value=xml_text(value))
    if m.answer_prompts:
        for key, value in (("answer_prompts", m.answer_prompts), ("golden_answers_correct", m.golden_answers_correct),
                           ("answers_correct", m.answers_correct), ("answer_flips_lost", m.answer_flips_lost),
                           ("answer_flips_gained", m.answer_flips_gained)):
            ET.SubElement(props, "property", name=key, value=str(value))
    _quality_properties(props, m)
    _latency_properties(props, m)
    if quality_gates:
        case = ET.SubElement(suite, "testcase", classname=xml_text(name), name="quality", time="0")
        reasons = m.quality.reasons if m.quality is not None else ["no prompt with a checkable answer: quality cannot be judged"]
        if quality_fails:
            verdict = m.quality.verdict if m.quality is not None else "inconclusive"
            failure = ET.SubElement(case, "failure", message=xml_text(f"quality {verdict}: {reasons[0]}"), type="quality")
            failure.text = xml_text("\n".join(f"- {r}" for r in reasons))
        else:
            ET.SubElement(case, "system-out").text = xml_text("\n".join(f"- {r}" for r in reasons))
    if latency_fails:
        case = ET.SubElement(suite, "testcase", classname=xml_text(name), name="latency", time="0")
        message = m.latency_reasons[0] if m.latency_reasons else "latency"
        failure = ET.SubElement(case, "failure", message=xml_text(message), type="latency")
        failure.text = xml_text("\n".join(f"- {r}" for r in m.latency_reasons))
    for s in score.scores:
        case = ET.SubElement(suite, "testcase", classname=xml_text(name), name=xml_text(s.prompt_id), time="0")
        dx = diagnosed.get(s.prompt_id)
        why = _why(dx)
        detail = "\n".join([f"class: {s.prompt_class}", *[f"- {r}" for r in s.reasons], *_answer_line(s),
                            *([why, f"mitigation: {dx.mitigation}"] if dx is not None else []),
                            f"tags: {', '.join(s.tags)}", _metrics_line(s.metrics, shown)])
        if fails(s):
            kind = s.prompt_class if s.prompt_class in ("regression", "input_drift") else "answer_lost"
            message = s.reasons[0] if s.reasons else kind
            if why:
                message = f"{message}; {why}"
            failure = ET.SubElement(case, "failure", message=xml_text(message), type=kind)
            failure.text = xml_text(detail)
        elif s.prompt_class == "input_drift":
            ET.SubElement(case, "skipped", message=xml_text(s.reasons[0] if s.reasons else "input drift"))
        elif s.prompt_class != "identical":
            out = ET.SubElement(case, "system-out")
            out.text = xml_text(detail)
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
