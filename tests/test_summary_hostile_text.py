"""Untrusted text (prompt ids, tags, configuration values, reasons) in summary.md, junit.xml and the
HTML pages: control and bidi characters shown as ``\\uNNNN`` (never raw), no word GitHub would make
a link outside a code span, ``|`` escaped in table cells only, and lone surrogates written, not fatal.

summary.md is checked as text (GitHub's parser is not a dependency): code spans are taken out the
way CommonMark closes them, and what is left must hold no ``://``, ``www.``, ``@`` or raw control."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from report_fixtures import Case, build_case, build_diagnosis
from regress.report import JUNIT_FILE, METRICS_FILE, SUMMARY_FILE, write_candidate_report
from regress.report.junit import junit_xml, xml_text
from regress.report.render import TEMPLATES, render_candidate, render_index
from regress.report.summary import md_code, md_text, summary_markdown
from regress.untrusted import _CONTROL, printable, without_controls

RLO_ID = "i29\u202e"
CTRL_ID = "i39\x00\x07\x1b[31m\x7f"
PIPE_ID = "i27x|y\\|z`q``"
URL_TAG = "docs https://evil.example/login www.evil.example mail@evil.example @octocat #1"
BIDI = "\u202e\u2066\u200f\u061c"
# What must never be raw in a written file: C0 (but tab and newline), DEL, C1, bidi and line separators.
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("hostile"), 30, semantic=False)


def _hostile(case: Case, ids: list[str], tag: str = URL_TAG):
    """``case``'s score with its regressions renamed to ``ids`` (first ones), every prompt tagged ``tag``,
    a reason and a configuration value holding the same text."""
    regressions = case.ids_of("regression")
    renamed = dict(zip(regressions, ids))
    scores = [s.model_copy(update={"prompt_id": renamed.get(s.prompt_id, s.prompt_id), "tags": [tag],
                                   "reasons": [f"{s.reasons[0] if s.reasons else 'x'} {tag} {BIDI}"]})
              for s in case.score.scores]
    run = case.score.run.model_copy(update={"engine_args": {**case.score.run.engine_args,
                                                            "hostile": f"{RLO_ID} {CTRL_ID} {PIPE_ID} {URL_TAG}"}})
    return case.score.model_copy(update={"scores": scores, "run": run,
                                         "verdict_reasons": [*case.score.verdict_reasons, f"{URL_TAG} {BIDI}"]})


def _diagnosis(case: Case, left_out: list[str]):
    return build_diagnosis(case).model_copy(update={"left_out": left_out})


_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.*?)(?<!`)\1(?!`)")


def _outside_code(md: str) -> str:
    """``md`` without its code spans (a backslash before a backtick does not open one)."""
    return _SPAN.sub(" ", md.replace("\\`", ""))


def _spans(md: str) -> list[str]:
    """The contents of ``md``'s code spans, as CommonMark reads them (one space of padding off each side)."""
    out = []
    for m in _SPAN.finditer(md.replace("\\`", "")):
        text = m.group(2)
        if len(text) > 1 and text.startswith(" ") and text.endswith(" ") and text.strip():
            text = text[1:-1]
        out.append(text)
    return out


# ------------------------------------------------------------------ 1. control and bidi characters


def test_md_text_and_md_code_show_controls_and_bidi_as_escapes() -> None:
    for value in (RLO_ID, CTRL_ID, "tag" + BIDI, "x\u2028y\u0085z"):
        for text in (md_text(value), md_code(value), md_text(value, cell=True), md_code(value, cell=True)):
            assert not RAW.search(text), ascii(text)
    assert md_code(RLO_ID) == "`i29\\u202e`"
    assert md_code(CTRL_ID) == "`i39\\u0000\\u0007\\u001b[31m\\u007f`"
    assert md_text("a\u202eb") == "a\\\\u202eb"  # the backslash escaped: it shows as \u202e


def test_summary_has_no_raw_control_or_bidi_character(case: Case) -> None:
    score = _hostile(case, [RLO_ID, CTRL_ID])
    md = summary_markdown(score, diagnosis=_diagnosis(case, [RLO_ID, CTRL_ID, "t" + BIDI]))
    assert not RAW.search(md), [ascii(line) for line in md.splitlines() if RAW.search(line)]
    not_diagnosed = next(line for line in md.splitlines() if line.startswith("Not diagnosed"))
    assert "`i29\\u202e`" in not_diagnosed and "`i39\\u0000\\u0007\\u001b[31m\\u007f`" in not_diagnosed
    assert "| `i29\\u202e` |" in md  # the worst-prompts table
    assert "\\u202e" in next(line for line in md.splitlines() if line.startswith("| engine arguments: hostile"))


def test_junit_shows_controls_and_bidi_visibly(case: Case) -> None:
    assert xml_text("a\u202eb\x1b[31m\x00\ud800\t\n") == "a\\u202eb\\u001b[31m\\u0000\\ud800\t\n"
    text = junit_xml(_hostile(case, [RLO_ID, CTRL_ID]), diagnosis=build_diagnosis(case))
    assert not RAW.search(text) and "\ufffd" not in text
    names = {c.get("name") for c in ET.fromstring(text.encode()).iter("testcase")}
    assert {"i29\\u202e", "i39\\u0000\\u0007\\u001b[31m\\u007f"} <= names


def test_html_pages_show_controls_and_bidi_visibly_and_keep_the_data(case: Case) -> None:
    score = _hostile(case, [RLO_ID, CTRL_ID], tag="t" + BIDI)
    score = score.model_copy(update={"metrics": score.metrics.model_copy(update={"candidate": "cand" + BIDI})})
    page = render_candidate(score, case.golden, case.run, case.prompt_set, diagnosis=_diagnosis(case, [RLO_ID]))
    index = render_index([(score, "candidate/index.html")])
    for html in (page, index):
        assert not RAW.search(html), [ascii(html[max(0, m.start() - 40):m.end() + 40]) for m in RAW.finditer(html)][:3]
        assert "cand\\u202e\\u2066\\u200f\\u061c" in html
    block = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, flags=re.S).group(1)
    data = json.loads(block)  # JSON's own escapes: the script gets the text as it was, and shows it escaped
    assert RLO_ID in [p["id"] for p in data["prompts"]] and "t" + BIDI in data["tags"]


def test_report_js_escapes_what_the_server_escapes() -> None:
    """report.js's CONTROL (its text's escaping) matches regress.untrusted's, character for character."""
    js = (TEMPLATES / "report.js").read_text(encoding="utf-8")
    source = re.search(r"var CONTROL = /(.*)/g;", js).group(1)
    pattern = re.compile(source)  # JS's \uXXXX classes and lookarounds read the same in Python
    differ = [hex(c) for c in range(0x10000) if bool(pattern.fullmatch(chr(c))) != bool(_CONTROL.fullmatch(chr(c)))]
    assert not differ
    assert "e.textContent = escapeControls(text)" in js and "document.createTextNode(" not in js.replace(
        "function txt(text) { return document.createTextNode(escapeControls(text)); }", "")


def test_lone_surrogates_are_escaped_like_controls() -> None:
    assert without_controls("a\ud800b\udfff") == "a\\ud800b\\udfff"
    assert printable("x\udc00") == "x\\udc00"
    assert without_controls("emoji \U0001f600 and ZWJ \u200d") == "emoji \U0001f600 and ZWJ \u200d"


# ------------------------------------------------------------------ 2. autolinks


def test_md_text_puts_every_autolink_in_a_code_span() -> None:
    for value in (URL_TAG, "see HTTPS://Evil.Example/x and Www.evil.example, ftp://x.y (mailto:a@b.c) owner/repo#12",
                  "x(https://evil.example)y"):
        for cell in (False, True):
            md = md_text(value, cell=cell)
            rest = _outside_code(md).lower()
            assert "://" not in rest and "www." not in rest and "@" not in rest and not re.search(r"#\w", rest), md
    md = md_text(URL_TAG)
    assert "`https://evil.example/login`" in md and "`www.evil.example`" in md and "`mail@evil.example`" in md
    assert md.startswith("docs ")
    assert md_text("[a](javascript:b) *x*") == "\\[a\\]\\(javascript:b\\) \\*x\\*"  # the rest as before


def test_summary_has_no_bare_link_outside_code(case: Case) -> None:
    md = summary_markdown(_hostile(case, [RLO_ID]), diagnosis=_diagnosis(case, [URL_TAG]))
    rest = _outside_code(md).lower()
    assert "://" not in rest and "www." not in rest and "@" not in rest, \
        [line for line in _outside_code(md).splitlines() if "://" in line or "www." in line.lower() or "@" in line]


# ------------------------------------------------------------------ 3. | only escaped in table cells


def test_md_code_escapes_pipes_only_in_table_cells() -> None:
    assert _spans(md_code(PIPE_ID)) == [PIPE_ID]
    assert _spans(md_code(PIPE_ID, cell=True))[0].replace("\\|", "|") == PIPE_ID
    assert md_code("a|b") == "`a|b`" and md_code("a|b", cell=True) == "`a\\|b`"


def test_summary_shows_pipe_ids_as_they_are(case: Case) -> None:
    md = summary_markdown(_hostile(case, [PIPE_ID]), diagnosis=_diagnosis(case, [PIPE_ID]))
    not_diagnosed = next(line for line in md.splitlines() if line.startswith("Not diagnosed"))
    assert PIPE_ID in _spans(not_diagnosed)
    row = next(line for line in md.splitlines() if line.startswith("| ```") and "i27x" in line)
    assert _spans(row)[0].replace("\\|", "|") == PIPE_ID
    # a GFM table row: every | of the id escaped, so the row keeps its five cells
    assert len(re.findall(r"(?<!\\)\|", row)) == 6


# ------------------------------------------------------------------ lone surrogates


def test_lone_surrogates_do_not_stop_any_writer(case: Case, tmp_path: Path) -> None:
    bad = "s\ud800x\udfff"
    score = _hostile(case, [bad], tag="t\ud800")
    metrics = score.metrics.model_copy(update={"candidate": "cand\ud800", "severe_regression_ids": [bad]})
    score = score.model_copy(update={"metrics": metrics})
    out = tmp_path / "r"
    write_candidate_report(score, case.golden, case.run, case.prompt_set, out, report_link="r/index.html\udc00")
    summary = (out / SUMMARY_FILE).read_text(encoding="utf-8")
    junit = (out / JUNIT_FILE).read_text(encoding="utf-8")
    assert "`s\\ud800x\\udfff`" in summary and "s\\ud800x\\udfff" in junit
    ET.parse(out / JUNIT_FILE)
    written = json.loads((out / METRICS_FILE).read_text(encoding="utf-8"))
    assert written["candidate"] == "cand?" and written["severe_regression_ids"] == ["s?x?"]
    assert written["prompts"] == score.metrics.prompts
    page = (out / "index.html").read_text(encoding="utf-8")
    assert not RAW.search(page) and "s\\ud800x\\udfff" in page
