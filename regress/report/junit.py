"""``junit.xml``: one test case per prompt, a failure per regression, for CI test views.

input_drift prompts are ``skipped`` (not comparable token by token); drift and benign prompts
pass, with their class and reasons in ``system-out``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from regress.records import ScoreReport

_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
SHOWN_METRICS = ("first_divergence", "golden_margin", "tf_kl_mean", "tf_same_top1_rate", "tf_max_flipped_margin",
                 "semantic_similarity", "edit_distance")


def xml_text(value: object) -> str:
    """Text XML 1.0 can hold: characters it forbids (NUL, most C0 controls, lone surrogates) become U+FFFD."""
    return _NOT_XML.sub("\ufffd", str(value))


def _metrics_line(values: dict) -> str:
    shown = [f"{k}={values[k]:.4g}" if isinstance(values.get(k), float) else f"{k}={values.get(k)}"
             for k in SHOWN_METRICS if k in values]
    return ", ".join(shown)


def junit_xml(score: ScoreReport) -> str:
    """The JUnit XML document for one candidate."""
    m = score.metrics
    name = f"regress.{m.candidate}"
    suites = ET.Element("testsuites", name="regress", tests=str(m.prompts), failures=str(m.regression),
                        errors="0", skipped=str(m.input_drift))
    suite = ET.SubElement(suites, "testsuite", name=xml_text(name), tests=str(m.prompts),
                          failures=str(m.regression), errors="0", skipped=str(m.input_drift), time="0",
                          timestamp=score.created_at.strftime("%Y-%m-%dT%H:%M:%S"))
    props = ET.SubElement(suite, "properties")
    for key, value in (("verdict", m.verdict), ("candidate", m.candidate), ("baseline", score.golden.candidate.name),
                       ("golden_run", score.golden.run_id), ("candidate_run", score.run.run_id),
                       ("verdict_reasons", "; ".join(score.verdict_reasons))):
        ET.SubElement(props, "property", name=key, value=xml_text(value))
    for s in score.scores:
        case = ET.SubElement(suite, "testcase", classname=xml_text(name), name=xml_text(s.prompt_id), time="0")
        detail = "\n".join([f"class: {s.prompt_class}", *[f"- {r}" for r in s.reasons],
                            f"tags: {', '.join(s.tags)}", _metrics_line(s.metrics)])
        if s.prompt_class == "regression":
            failure = ET.SubElement(case, "failure", message=xml_text(s.reasons[0] if s.reasons else "regression"),
                                    type="regression")
            failure.text = xml_text(detail)
        elif s.prompt_class == "input_drift":
            ET.SubElement(case, "skipped", message=xml_text(s.reasons[0] if s.reasons else "input drift"))
        elif s.prompt_class != "identical":
            out = ET.SubElement(case, "system-out")
            out.text = xml_text(detail)
    ET.indent(suites, space=" ")
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
