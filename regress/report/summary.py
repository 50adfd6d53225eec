"""``summary.md``: the verdict in Markdown, for a CI job summary or a pull-request comment.

Prompt ids, tags and configuration values come from users' files: they go into code spans
(nothing inside is a link, an @-mention or HTML), with ``|`` escaped in table cells only (a table
cell unescapes ``\\|``; anywhere else it would show as written); other text is backslash-escaped,
and a word of it that GitHub would make a link (a bare URL, ``www.``, an e-mail address or an
@-mention: GFM's autolinks, which backslashes cannot stop) goes into a code span of its own. Both
show control and bidi characters (and lone surrogates) as ``\\uNNNN``, as the CLI does
(:func:`regress.untrusted.without_controls`): a right-to-left override in a prompt id cannot
reorder the rest of its line. Model outputs are never included.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from regress.records import ScoredRun
from regress.records.quality import gate_fails
from regress.report import overview
from regress.report.configdiff import config_diff
from regress.report.payload import cause_mitigation, causes_by_count, diagnosis_of
from regress.report.render import valid_text
from regress.untrusted import without_controls

if TYPE_CHECKING:
    from regress.diagnosis.record import Diagnosis

WORST_LISTED = 10
CHANGES_LISTED = 20
ANSWER_IDS_LISTED = 20
CELL_CAP = 80
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]<>()#!|~&@])")


# A word GitHub would turn into a link although every character Markdown acts on is escaped: GFM's
# extended autolinks (``https://``, ``ftp://``, ``www.``, an e-mail address, ``mailto:``/``xmpp:``
# with one), found in the rendered text, and GitHub's @-mentions and ``#1``/``owner/repo#1`` references.
_LINKISH = re.compile(r"://|www\.|@|#\w", re.IGNORECASE)


def _one_line(value: object, cap: int) -> str:
    """``value`` on one line (whitespace runs as one space), capped, controls shown as ``\\uNNNN``."""
    text = " ".join(str(value).split())
    if len(text) > cap:
        text = text[:cap] + "…"
    return without_controls(text, keep="")


def md_text(value: object, cap: int = 300, *, cell: bool = False) -> str:
    """Plain text for Markdown: one line, every character Markdown could act on escaped, and each
    word GitHub would make a link in a code span (``cell``: the text is in a table cell)."""
    words = _one_line(value, cap).split(" ")
    return " ".join(_code_span(w, cell) if _LINKISH.search(w) else _MD_SPECIAL.sub(r"\\\1", w) for w in words)


def md_code(value: object, cap: int = CELL_CAP, *, cell: bool = False) -> str:
    """A code span; ``cell``: in a table cell (whose ``|`` must be escaped, and is unescaped there)."""
    return _code_span(_one_line(value, cap), cell)


def _code_span(text: str, cell: bool) -> str:
    if cell:
        text = text.replace("|", "\\|")
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _answers_markdown(score: ScoredRun) -> list[str]:
    """Expected answers: golden and candidate correct, then the prompts that lost or gained theirs."""
    a = overview.answers(score.metrics)
    if a is None:
        return []
    lines = ["", f"**Expected answers** ({a.prompts:,} prompts have one): golden {a.golden_correct:,} correct "
                 f"({md_text(a.golden_share)}), candidate {a.candidate_correct:,} ({md_text(a.candidate_share)}); "
                 f"**{a.lost:,} lost**, {a.gained:,} gained."]
    for label, ids, total in (("Lost", a.lost_ids, a.lost), ("Gained", a.gained_ids, a.gained)):
        if ids:
            listed = ", ".join(md_code(pid) for pid in ids[:ANSWER_IDS_LISTED])
            more = f" and {total - ANSWER_IDS_LISTED:,} more" if total > ANSWER_IDS_LISTED else ""
            lines += ["", f"{label}: {listed}{more}"]
    return lines


def _latency_markdown(score: ScoredRun) -> list[str]:
    """A latency line for runs with per-request times (server runs): TTFT, TPOT and total p95 and
    concurrency against the golden; and the latency verdict with its reasons when one was given
    (thresholds ``max_latency_ratio`` / ``min_throughput_ratio``). Nothing for offline runs
    without a latency verdict (their throughput is in the table above)."""
    from regress.report.payload import latency_view

    view = latency_view(score.metrics)
    if view is None:
        return []
    lines: list[str] = []
    if view["timed"]:
        parts = [f"{md_text(label)} {md_text(c)} (golden {md_text(g)}, {md_text(r)})"
                 for label, g, c, r, _, _ in view["rows"] if label != "TTFT p99"]
        g_conc, c_conc = view["concurrency"]
        parts.append(f"concurrency {overview.fmt(c_conc, 'int')} (golden {overview.fmt(g_conc, 'int')})")
        lines += ["", "**Latency** (per request, candidate vs golden): " + "; ".join(parts) + "."]
    if view["verdict"]:
        icon = "✅" if view["verdict"] == "pass" else "❌"
        gates = "gates the check" if view["gates"] else "reported, not gating"
        lines += ["", f"{icon} **Latency {view['verdict']}** ({gates}):"]
        lines += [f"- {md_text(r)}" for r in view["reasons"]]
    elif view["reasons"]:
        lines += ["", *[f"- {md_text(r)}" for r in view["reasons"]]]
    return lines


def _diagnosis_markdown(score: ScoredRun, diagnosis: "Diagnosis | None") -> list[str]:
    """"Why it drifted": diagnosed prompts per cause with its mitigation (``regress diagnose``);
    without a diagnosis, for a failed candidate, how to get one."""
    if diagnosis is None:
        if score.metrics.verdict != "fail":
            return []
        return ["", f"Run {md_code('regress diagnose ' + score.metrics.candidate, 300)} to see why."]
    explained = sum(1 for p in diagnosis.prompts if p.explained)
    lines = ["", f"**Why it drifted** ({md_code('regress diagnose')}: {len(diagnosis.prompts):,} of "
                 f"{diagnosis.drifted:,} drifted prompt(s) diagnosed, {explained:,} explained by a probe, the rest "
                 f"by elimination):"]
    causes = causes_by_count(diagnosis)
    if causes:
        lines += ["", "| cause | prompts | mitigation |", "|---|---:|---|"]
        lines += [f"| {md_text(c, cell=True)} | {n:,} | {md_text(cause_mitigation(diagnosis, c), 200, cell=True)} |"
                  for c, n in causes]
    else:
        lines += ["", "No prompt was diagnosed."]
    if diagnosis.left_out:
        listed = ", ".join(md_code(pid) for pid in diagnosis.left_out[:ANSWER_IDS_LISTED])
        more = f" and {len(diagnosis.left_out) - ANSWER_IDS_LISTED:,} more" if len(diagnosis.left_out) > ANSWER_IDS_LISTED else ""
        lines += ["", f"Not diagnosed ({len(diagnosis.left_out):,}): {listed}{more}"]
    return lines


GATE_WORDS = {"fidelity": "did outputs move beyond the baseline's noise", "quality": "did answers hold",
              "both": "both verdicts"}


def quality_markdown(m: Any) -> list[str]:
    """The quality verdict: accuracies, the paired difference against theta, the slices."""
    q = m.quality
    if q is None:
        return ["**Quality:** no prompt with a checkable answer (`expected` or `choices`)."]
    lines = [f"**Quality: {q.verdict.upper()}**", ""] + [f"- {md_text(r)}" for r in q.reasons]
    if q.slices:
        lines += ["", "| slice | prompts | golden | candidate | difference (points) | interval | p, corrected |",
                  "|---|---:|---:|---:|---:|---|---:|"]
        lines += [f"| {md_text(s.tag, cell=True)}{' ❌' if s.worse else ''} | {s.prompts:,} | {s.golden_correct:,g} | "
                  f"{s.candidate_correct:,g} | {s.difference * 100:+.1f} | {s.low * 100:+.1f} to {s.high * 100:+.1f} | "
                  f"{f'{s.p_adjusted:.2g}' if s.tested else 'not tested'} |" for s in q.slices]
    return lines


def summary_markdown(score: ScoredRun, report_link: str | None = None, *,
                     diagnosis: "Diagnosis | None" = None) -> str:
    """The Markdown summary of one candidate (with ``regress diagnose``'s causes when
    ``diagnosis`` is one of this run)."""
    m = score.metrics
    icon, word = ("❌", "fails") if m.gating_failed else ("✅", "passes")
    gate_failed = gate_fails(m.gate, m.verdict, m.quality)
    if m.gating_failed and not gate_failed:  # the gating verdicts pass, a gating latency verdict failed
        word = "fails on latency"
    lines = [f"## {icon} regress: {md_code(m.candidate)} {word} against {md_code(score.golden.candidate.name)}", ""]
    lines += [f"Gated on **{m.gate}** ({GATE_WORDS[m.gate]}).", ""]
    lines += [f"**Fidelity: {m.verdict.upper()}**", ""]
    lines += [f"- {md_text(r)}" for r in score.verdict_reasons]
    lines += [""] + quality_markdown(m)
    lines += ["", "| prompts | " + " | ".join(c.label for c in overview.counts(m)) + " |",
              "|---:|" + "---:|" * len(overview.counts(m)),
              f"| {m.prompts:,} | " + " | ".join(f"{c.count:,}" for c in overview.counts(m)) + " |", ""]
    lines += ["| measure | value |", "|---|---:|"]
    lines += [f"| {x.label} | {md_text(x.value, cell=True)} |" for x in overview.measures(m) + overview.rates(m)]
    for p in overview.performance(score):
        lines.append(f"| {p.label} | {md_text(p.candidate, cell=True)} (golden {md_text(p.golden, cell=True)}, "
                     f"{md_text(p.change, cell=True)}) |")
    lines += _latency_markdown(score)
    lines += _answers_markdown(score)
    nf = m.noise_floor
    if nf is not None:
        noisy = ", ".join(md_code(pid) for pid in nf.noisy_ids[:ANSWER_IDS_LISTED])
        lines += ["", f"**Noise floor** (the baseline under {md_text(', '.join(nf.arms))}, golden/noise.json): "
                      f"{nf.noisy_prompts:,} prompt(s) noisy on the baseline itself{': ' + noisy if noisy else ''}"
                      f"{' …' if nf.noisy_prompts > ANSWER_IDS_LISTED else ''}; "
                      f"{len(nf.made_benign):,} benign within their envelope; bounds in force: "
                      + ", ".join(f"{md_text(k)} {v:.4g}" for k, v in nf.bounds.items()) + "."]
    if m.noise_test is not None:
        lines += ["", f"**Run-level test:** {md_text(m.noise_test.summary)}."]
    if m.verdict_basis:
        lines += ["", f"**The verdict rests on** {md_text(m.verdict_basis)}."]
    if m.sample_scoring:
        lines += ["", f"**Sampled prompts:** {md_text(m.sample_scoring)}."]
    if m.detection_power is not None:
        stale = "" if m.detection_power.current else " (measured with other thresholds: run `regress power` again)"
        lines += ["", f"**Detection power:** {md_text(m.detection_power.summary)}{stale}"]
    changed = [s for s in config_diff(score.golden, score.run) if s.changed]
    lines += ["", f"**Configuration:** {len(changed)} setting(s) differ from the baseline."]
    if changed:
        lines += ["", "| setting | baseline | candidate |", "|---|---|---|"]
        lines += [f"| {s.section}: {md_text(s.name, cell=True)} | {md_code(s.baseline, cell=True)} | "
                  f"{md_code(s.candidate, cell=True)} |"
                  for s in changed[:CHANGES_LISTED]]
        if len(changed) > CHANGES_LISTED:
            lines.append(f"| … {len(changed) - CHANGES_LISTED} more | | |")
    worst = overview.worst(score, WORST_LISTED)
    if worst:
        total = m.regression + m.drift + m.input_drift
        lines += ["", f"**Worst prompts** ({len(worst)} of {total:,} regressions, drifts and input drifts):", "",
                  "| prompt | class | severity | first div. | why |", "|---|---|---:|---:|---|"]
        lines += [f"| {md_code(w.prompt_id, cell=True)} | {w.label} | {w.severity} | {w.divergence} | "
                  f"{md_text(w.reason, 160, cell=True)} |"
                  for w in worst]
    lines += _diagnosis_markdown(score, diagnosis_of(score, diagnosis))
    if report_link:
        lines += ["", f"Full report: {md_code(report_link, 300)}"]
    return valid_text("\n".join(lines) + "\n")
