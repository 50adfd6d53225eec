"""The HTML report, junit.xml, summary.md and metrics.json, without a browser (see test_report_browser.py)."""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from markupsafe import escape

from report_fixtures import HOSTILE, Case, build_case
from regress.records import PromptScore
from regress.report import (JUNIT_FILE, METRICS_FILE, METRICS_SCHEMA, SUMMARY_FILE, refresh_index,
                            write_candidate_report, write_index)
from regress.report.configdiff import config_diff
from regress.report.junit import junit_xml, xml_text
from regress.report.payload import (CLASS_ORDER, TEXT_CAP_MAX, TEXT_CAP_MIN, build_payload, common_prefix_len,
                                    text_cap)
from regress.report.render import TEMPLATES, environment, json_for_script, render_candidate
from regress.report.schema import schema_text
from regress.report.summary import md_code, md_text, summary_markdown


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("report"), 40)


@pytest.fixture(scope="module")
def written(case: Case) -> Path:
    out = case.root / "reports" / "candidate"
    write_candidate_report(case.score, case.golden, case.run, case.prompt_set, out)
    write_index([(case.score, "candidate/index.html")], case.root / "reports")
    return out


@pytest.fixture(scope="module")
def page(written: Path) -> str:
    return (written / "index.html").read_text(encoding="utf-8")


def _inline(page: str, tag: str) -> list[str]:
    return re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.S)


def _data(page: str) -> dict:
    block = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, flags=re.S)
    assert block, "no data block"
    return json.loads(block.group(1))


# ------------------------------------------------------------------ files


def test_writes_every_file(case: Case, written: Path) -> None:
    assert sorted(p.name for p in written.iterdir()) == sorted(["index.html", METRICS_FILE, JUNIT_FILE, SUMMARY_FILE])
    assert (case.root / "reports" / "index.html").is_file()
    assert json.loads((written / METRICS_FILE).read_text()) == json.loads(case.score.metrics.model_dump_json())


def test_fixture_covers_every_class(case: Case) -> None:
    assert all(getattr(case.score.metrics, k) > 0 for k in CLASS_ORDER)
    assert case.score.metrics.verdict == "fail"


# ------------------------------------------------------------------ escaping and CSP


def test_environment_autoescapes_every_template_name() -> None:
    env = environment()
    assert env.autoescape is True  # not select_autoescape: every name, .j2, .js, .txt alike
    assert env.from_string("{{ x }}").render(x="<b>&'\"") == "&lt;b&gt;&amp;&#39;&#34;"


def test_templates_never_bypass_escaping() -> None:
    for path in TEMPLATES.iterdir():
        text = path.read_text(encoding="utf-8")
        for banned in ("|safe", "| safe", "Markup", "autoescape false", "autoescape False"):
            assert banned not in text, f"{path.name} uses {banned}"
    script = (TEMPLATES / "report.js").read_text(encoding="utf-8")
    for banned in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                   "setAttribute(\"href\"", ".href =", "</script"):
        assert banned not in script, banned
    for asset in ("report.js", "report.css"):  # included as templates: must hold no Jinja syntax
        text = (TEMPLATES / asset).read_text(encoding="utf-8")
        assert not re.search(r"\{[{%#]", text), asset


def test_hostile_text_never_reaches_the_markup(page: str, case: Case) -> None:
    rendered_outputs = "".join(case.run.texts) + "".join(case.golden.texts)
    assert all(h in rendered_outputs or h in json.dumps([p.model_dump() for p in case.prompt_set.prompts]) for h in HOSTILE)
    for hostile in HOSTILE:
        if "<" in hostile or ">" in hostile:
            assert hostile not in page
    assert "<img" not in page
    assert len(re.findall(r"<script", page)) == 2  # the data block and the report's own script
    assert 'href="javascript' not in page.lower()


def test_data_block_cannot_close_its_script_tag(page: str, case: Case) -> None:
    block = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, flags=re.S).group(1)
    assert "<" not in block and ">" not in block and "&" not in block
    data = json.loads(block)
    texts = json.dumps(data, ensure_ascii=False)
    assert "</script><script>alert(2)</script>" in texts  # the text survives, escaped
    assert json_for_script({"x": "</script><!--&'"}) == '{"x":"\\u003c/script\\u003e\\u003c!--\\u0026\\u0027"}'


def test_csp_allows_only_the_reports_own_script_and_style(page: str) -> None:
    meta = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', page)
    assert meta
    policy = dict(part.strip().split(" ", 1) for part in html.unescape(meta.group(1)).split(";"))
    assert policy["default-src"] == "'none'"
    assert policy["img-src"] == "data:"
    assert "unsafe" not in meta.group(1) and "http" not in meta.group(1)
    scripts = [s for s in _inline(page, "script")]
    assert len(scripts) == 1

    def sha(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    assert policy["script-src"] == sha(scripts[0])
    assert policy["style-src"] == sha(_inline(page, "style")[0])
    assert page.index("Content-Security-Policy") < page.index("<style>")


def test_page_is_self_contained(page: str) -> None:
    assert "<link" not in page
    assert not re.search(r'\s(src|href)="(https?:)?//', page)
    assert "@import" not in page and "url(" not in page


def test_index_page(case: Case, written: Path) -> None:
    index = (case.root / "reports" / "index.html").read_text(encoding="utf-8")
    assert 'href="candidate/index.html"' in index
    assert "script-src 'none'" in html.unescape(index)
    assert "<script" not in index
    assert "FAIL" in index and "candidate" in index
    with pytest.raises(ValueError):
        write_index([(case.score, "javascript:alert(1)")], case.root / "elsewhere")
    with pytest.raises(ValueError):
        write_index([(case.score, "//evil.example/x")], case.root / "elsewhere")


# ------------------------------------------------------------------ content


def test_page_shows_verdict_counts_worst_and_config(page: str, case: Case) -> None:
    m = case.score.metrics
    assert "FAIL" in page and "stop the rollout" in page
    for reason in case.score.verdict_reasons:
        assert html.escape(reason) in page
    worst = re.findall(r'<tr class="open" data-id="([^"]+)"', page)
    regressions = case.ids_of("regression")
    assert worst[: len(regressions)] and set(worst[: len(regressions)]) == set(regressions)
    assert f'<span class="count-n">{m.regression}</span>' in page
    assert "0.32.0" in page and "0.33.0" in page and "float16" in page
    assert str(escape(HOSTILE[1])) in page  # the hostile env var value, escaped


def test_payload_orders_worst_first_and_carries_the_divergence(case: Case) -> None:
    data = build_payload(case.score, case.golden, case.run, case.prompt_set)
    classes = [p["k"] for p in data["prompts"]]
    assert classes == sorted(classes, key=CLASS_ORDER.index)
    assert [p["r"] for p in data["prompts"]] == list(range(len(classes)))
    regs = [p for p in data["prompts"] if p["k"] == "regression"]
    assert regs == sorted(regs, key=lambda p: -p["v"])
    p = regs[0]
    w = p["w"]
    d = case.score.scores[[s.prompt_id for s in case.score.scores].index(p["id"])].metrics["first_divergence"]
    assert w["at"] == d and w["g"][0] != w["c"][0]
    assert [row[2] for row in w["gk"]].count(1) == 1  # the golden's own choice is marked
    assert any(row[2] == 2 for row in w["gk"])  # so is the candidate's, in the golden's top-k
    g_text = case.golden.texts[case.golden.position(p["id"])]
    assert g_text.startswith(p.get("s", "")) or p.get("s0")
    identical = next(x for x in data["prompts"] if x["k"] == "identical")
    assert "g" not in identical and "w" not in identical and identical["s"]
    assert all(name in data["metrics"] for name in data["key"])


def test_long_texts_are_capped_and_say_so(case: Case) -> None:
    assert text_cap(10) == TEXT_CAP_MAX and text_cap(10**7) == TEXT_CAP_MIN
    assert TEXT_CAP_MIN <= text_cap(10_000) <= TEXT_CAP_MAX
    long_score = case.score.model_copy(update={"scores": case.score.scores[:3]})
    run = case.run
    original = list(run.texts)
    try:
        run.texts[0] = original[0] + "x" * 50_000
        run.texts[1] = "y" * 50_000
        data = build_payload(long_score, case.golden, run, None)
    finally:
        run.texts[:] = original
    by_id = {p["id"]: p for p in data["prompts"]}
    cap = data["caps"]["text"]
    first, second = by_id[case.score.scores[0].prompt_id], by_id[case.score.scores[1].prompt_id]
    assert len(first["c"]) <= cap and first["c1"] > 0
    assert len(second["c"]) <= cap and second["c1"] > 0
    assert "pm" not in first  # no prompt set given


def test_common_prefix() -> None:
    assert common_prefix_len("abcdef", "abcxyz") == 3
    assert common_prefix_len("abc", "abc") == 3
    assert common_prefix_len("", "abc") == 0
    assert common_prefix_len("天气很好", "天气不好") == 2


def test_config_diff_lists_changes(case: Case) -> None:
    rows = {(r.section, r.name): r for r in config_diff(case.score.golden, case.score.run)}
    assert rows[("engine", "vllm")].changed
    assert rows[("model", "dtype used")].baseline == "bfloat16" and rows[("model", "dtype used")].candidate == "float16"
    assert not rows[("hardware", "platform")].changed
    assert rows[("engine arguments", "dtype")].changed
    assert ("environment variables", "VLLM_CPU_KVCACHE_SPACE") in rows


def test_renders_without_prompt_set_or_vocabulary(case: Case, tmp_path: Path) -> None:
    import shutil

    from regress.runs import load_run

    run_dir = tmp_path / "run"
    shutil.copytree(case.run.path, run_dir)
    (run_dir / "tokens.json").unlink()
    run = load_run(run_dir)
    page = render_candidate(case.score, case.golden, run, None)
    data = _data(page)
    regression = next(p for p in data["prompts"] if p["k"] == "regression")
    assert regression["w"]["c"][0].startswith("<") and "pm" not in regression


# ------------------------------------------------------------------ junit.xml


def test_junit_has_a_case_per_prompt_and_a_failure_per_regression(case: Case, written: Path) -> None:
    root = ET.parse(written / JUNIT_FILE).getroot()
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    cases = suites[0].findall("testcase")
    # The run-level fidelity verdict (it gates this candidate and failed), then one case per prompt.
    assert [c.get("name") for c in cases[:1]] == ["fidelity"] and len(cases) == case.score.metrics.prompts + 1
    assert cases[0].find("failure").get("type") == "fidelity"
    prompts = cases[1:]
    failed = [c.get("name") for c in prompts if c.find("failure") is not None]
    assert sorted(failed) == sorted(case.ids_of("regression"))
    assert all(c.find("failure").get("type") == "regression" for c in prompts if c.find("failure") is not None)
    skipped = [c.get("name") for c in prompts if c.find("skipped") is not None]
    assert sorted(skipped) == sorted(case.ids_of("input_drift"))
    assert suites[0].get("failures") == str(case.score.metrics.regression + 1)
    assert suites[0].get("tests") == str(case.score.metrics.prompts + 1)
    props = {p.get("name"): p.get("value") for p in suites[0].find("properties")}
    assert props["verdict"] == "fail" and props["gating_failed"] == "true"
    # Each prompt's case points at its line of the prompt set, for CI views and annotations.
    lines = {c.get("name"): int(c.get("line")) for c in prompts}
    assert {c.get("file") for c in prompts} == {str(case.prompt_set.path)}
    assert lines == case.prompt_set.lines and sorted(lines.values()) == list(range(1, len(prompts) + 1))


def test_junit_survives_hostile_ids(case: Case) -> None:
    bad = "\x00<&>\"'\x1b]]>" + HOSTILE[0]
    s = case.score.scores[0]
    scores = [PromptScore(prompt_id=bad, tags=[bad], prompt_class="regression", reasons=[bad], metrics=s.metrics)]
    text = junit_xml(case.score.model_copy(update={"scores": scores}))
    root = ET.fromstring(text.encode())
    tc = root.findall("testsuite/testcase")[1]  # after the run-level fidelity case
    assert tc.get("name") == xml_text(bad) and "\\u0000<&>" in tc.get("name")  # controls shown, as the CLI does
    assert tc.find("failure").get("message") == xml_text(bad)


# ------------------------------------------------------------------ summary.md


def test_summary(case: Case, written: Path) -> None:
    text = (written / SUMMARY_FILE).read_text(encoding="utf-8")
    assert text.startswith("## ❌ regress: `candidate` fails against `baseline`")
    m = case.score.metrics
    assert f"| {m.prompts:,} | {m.regression} | {m.drift} | {m.input_drift} | {m.benign} | {m.identical} |" in text
    for pid in case.ids_of("regression"):
        assert f"`{pid}`" in text
    assert "<img" not in text.replace("`\"><img src=x onerror=alert(1)>`", "")
    assert summary_markdown(case.score, "reports/candidate/index.html").rstrip().endswith("`reports/candidate/index.html`")


def test_markdown_escaping() -> None:
    assert md_code("a|b") == "`a|b`" and md_code("a|b", cell=True) == "`a\\|b`"
    assert md_code("x `y` z") == "``x `y` z``"
    assert md_code("`") == "`` ` ``"
    assert md_text("<img src=x> [a](javascript:b) @team *x*") == \
        "\\<img src=x\\> \\[a\\]\\(javascript:b\\) `@team` \\*x\\*"
    assert "\n" not in md_text("a\nb") and "\n" not in md_code("a\nb")


# ------------------------------------------------------------------ metrics.json


def test_metrics_schema_is_current() -> None:
    assert METRICS_SCHEMA.read_text(encoding="utf-8") == schema_text(), \
        "RunMetrics changed: run `python -m regress.report.schema` and document the change in docs/report.md"


def test_metrics_json_matches_its_schema(written: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(METRICS_SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    metrics = json.loads((written / METRICS_FILE).read_text(encoding="utf-8"))
    jsonschema.validate(metrics, schema)
    for broken in ({**metrics, "verdict": "maybe"}, {**metrics, "surprise": 1},
                   {k: v for k, v in metrics.items() if k != "regression"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


def test_docs_list_every_metrics_field() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "report.md").read_text(encoding="utf-8")
    for name in json.loads(METRICS_SCHEMA.read_text(encoding="utf-8"))["properties"]:
        assert f"`{name}`" in doc, name


def test_passing_and_empty_reports_render(case: Case) -> None:
    benign = [s for s in case.score.scores if s.prompt_class in ("identical", "benign")]
    passing = case.score.model_copy(update={
        "scores": benign, "verdict_reasons": ["0 regression(s), allowed 0"],
        "metrics": case.score.metrics.model_copy(update={"verdict": "pass", "regression": 0, "drift": 0,
                                                         "input_drift": 0, "prompts": len(benign)})})
    page = render_candidate(passing, case.golden, case.run, case.prompt_set)
    assert "PASS" in page and "No regression, drift or input drift" in page
    empty = passing.model_copy(update={"scores": []})
    assert len(_data(render_candidate(empty, case.golden, case.run, None))["prompts"]) == 0


def test_refresh_index_lists_every_scored_candidate(case: Case, tmp_path: Path) -> None:
    import shutil

    for name in ("b-cand", "a-cand"):
        shutil.copytree(case.root / "scores", tmp_path / name)
    (tmp_path / "not-a-report").mkdir()
    index = refresh_index(tmp_path).read_text(encoding="utf-8")
    assert index.index('href="a-cand/index.html"') < index.index('href="b-cand/index.html"')
    assert "not-a-report" not in index


def test_lone_surrogates_do_not_break_writing(case: Case, tmp_path: Path) -> None:
    scores = [s.model_copy(update={"tags": ["bad\ud800tag"], "reasons": ["why \udfff"]}) for s in case.score.scores]
    score = case.score.model_copy(update={"scores": scores})
    page = write_candidate_report(score, case.golden, case.run, None, tmp_path / "r")
    assert "bad\\ud800tag" in page.read_text(encoding="utf-8")
    ET.parse(tmp_path / "r" / JUNIT_FILE)
