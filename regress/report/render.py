"""HTML rendering: one Jinja environment, autoescaped for every template, and the page's CSP.

Every page is self-contained: the stylesheet and the one script are inlined from
``templates/report.css`` and ``templates/report.js`` (included as templates, so they are written
byte for byte as the hashes in the Content-Security-Policy were computed). Data for the script
goes in with Jinja's ``tojson`` filter, which escapes ``<``, ``>``, ``&`` and ``'`` as ``\\u003c``
and friends, so no output text can close the ``<script type="application/json">`` element.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

from regress.records import ScoredRun
from regress.report import overview
from regress.report.configdiff import config_diff
from regress.report.payload import build_payload, cause_mitigation, causes_by_count, diagnosis_of
from regress.runs import RunResult
from regress.untrusted import control_characters, escaped_character, without_controls

if TYPE_CHECKING:
    from regress.diagnosis.record import Diagnosis
    from regress.trend import HistoryLine

TEMPLATES = Path(__file__).parent / "templates"
SCRIPT, STYLE = "report.js", "report.css"


def shown(value: Any) -> Any:
    """What a template writes for ``value`` (Jinja's ``finalize``, before autoescaping): text with its
    control and bidi characters shown as ``\\uNNNN``, as the CLI, summary.md and junit.xml show them.

    Escaped visibly rather than isolated (``<bdi>``, ``unicode-bidi: isolate``): isolation would
    keep a right-to-left override in a prompt id from reordering what follows it, but the id itself
    would still read reversed, and would not match the same id in the CLI's output or summary.md.
    Markup too (``join`` and ``replace`` return it): the escapes hold no markup character, and in
    the data block (``tojson``) they are JSON's own escapes, so the script reads the text as it was
    and shows it the same way (report.js's ``escapeControls``)."""
    if isinstance(value, Markup):
        # Markup's own replace (it escapes its arguments), never a new Markup around edited text.
        for char in control_characters(value):
            value = value.replace(char, escaped_character(char))
        return value
    if isinstance(value, str):
        return without_controls(value)
    return value


@functools.lru_cache(maxsize=1)
def environment() -> Environment:
    """The report's Jinja environment: autoescape on for every template name, undefined is an error,
    control and bidi characters shown (:func:`shown`)."""
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True, finalize=shown)
    env.policies["json.dumps_kwargs"] = {"ensure_ascii": False, "separators": (",", ":"), "allow_nan": False}
    env.filters["fmt"] = overview.fmt
    return env


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def asset_hash(name: str) -> str:
    """CSP source of an inlined asset: the hash of exactly the text the page will hold."""
    return _sha256(environment().get_template(name).render())


def csp(*, script: bool) -> str:
    """Nothing remote, nothing inline but the report's own stylesheet and (if any) script."""
    scripts = asset_hash(SCRIPT) if script else "'none'"
    return (f"default-src 'none'; script-src {scripts}; style-src {asset_hash(STYLE)}; img-src data:; "
            "base-uri 'none'; form-action 'none'")


def valid_text(text: str) -> str:
    """``text`` as it can be written in UTF-8: lone surrogates (from JSON escapes) become '?'."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _stamp(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def render_candidate(score: ScoredRun, golden: RunResult, run: RunResult, prompt_set: Any = None, *,
                     index_link: str | None = None, diagnosis: "Diagnosis | None" = None) -> str:
    """The candidate page as one HTML string. ``diagnosis`` (``regress diagnose``'s record, or
    None) adds the "Why it drifted" card and the prompt table's cause column; one made for
    another run than ``score``'s is not shown."""
    m = score.metrics
    diagnosis = diagnosis_of(score, diagnosis)
    settings = config_diff(score.golden, score.run)
    context = {
        "csp": csp(script=True),
        "index_link": _safe_link(index_link) if index_link else None,
        "score": score,
        "m": m,
        "created": _stamp(score.created_at),
        "counts": overview.counts(m),
        "measures": overview.measures(m),
        "noise_measures": overview.noise_measures(m),
        "severity_help": overview.SEVERITY_HELP,
        "divergence_help": overview.DIVERGENCE_HELP,
        "rates": overview.rates(m),
        # What stopped the run, in the verdict's own words (the first failure reason: a count, a
        # rate at its interval's lower bound, lost answers, a sampled shift).
        "verdict_says": score.verdict_reasons[0] if score.verdict_reasons else "the run failed",
        "performance": overview.performance(score),
        "load_note": overview.load_note(score),
        "worst": overview.worst(score),
        "changed": [s for s in settings if s.changed],
        "settings": settings,
        "data": build_payload(score, golden, run, prompt_set, diagnosis=diagnosis),
        "diagnosis": diagnosis,
        "diagnosis_created": _stamp(diagnosis.created_at) if diagnosis is not None else None,
        "diagnosis_causes": [] if diagnosis is None else [
            {"cause": c, "count": n, "mitigation": cause_mitigation(diagnosis, c)} for c, n in causes_by_count(diagnosis)],
        "script": SCRIPT,
        "style": STYLE,
    }
    return valid_text(environment().get_template("candidate.html.j2").render(context))


def _safe_link(link: str) -> str:
    """Only relative links into the reports directory (no scheme, no protocol-relative URL)."""
    head = link.split("/", 1)[0]
    if ":" in head or link.startswith(("/", "\\")) or "\\" in link:
        raise ValueError(f"report link must be a relative path, got {link!r}")
    return link


def render_index(reports: list[tuple[ScoredRun, str]], history: "list[HistoryLine] | None" = None) -> str:
    """The page listing every candidate checked, and (when ``history`` has release lines) the
    trend across releases (:mod:`regress.report.trendchart`)."""
    from regress.report.trendchart import trend_context
    from regress.trend import trend_series

    rows = []
    for score, link in reports:
        m = score.metrics
        rows.append({"m": m, "link": _safe_link(link), "baseline": score.golden.candidate.name,
                     "created": _stamp(score.created_at), "counts": overview.counts(m),
                     "package": score.run.candidate.package, "reasons": score.verdict_reasons})
    failed = sum(1 for r in rows if r["m"].gating_failed)
    context = {"csp": csp(script=False), "rows": rows, "failed": failed,
               "classes": [(k, overview.CLASS_LABELS[k]) for k in overview.CLASS_ORDER],
               "created": _stamp(datetime.now(timezone.utc)), "style": STYLE,
               "trend": trend_context(trend_series(history or []))}
    return valid_text(environment().get_template("index.html.j2").render(context))


def json_for_script(data: Any) -> str:
    """What ``tojson`` writes into the page for ``data`` (for tests and tools)."""
    return environment().from_string("{{ data|tojson }}").render(data=data)

