"""The compact per-prompt data the report page ships as JSON and renders on demand.

One entry per prompt, in severity order (``rank`` 0 = worst). Texts are capped so that 10,000
prompts stay a page a browser opens: the shared part of the two outputs is sent once, then each
side's rest after the point where their texts part; only a window of tokens around the first
divergence and the top-k there are sent, never whole logprob tracks. See docs/report.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from regress.metrics import output_specs
from regress.metrics.spec import Output, headline
from regress.records import PromptScore, ScoredRun, sample_id
from regress.runs import RunResult, join_pieces
from regress.verdict import Thresholds, severity

if TYPE_CHECKING:
    from regress.diagnosis.record import Diagnosis

CLASS_ORDER = ("regression", "drift", "input_drift", "benign", "identical")
"""Classes from worst to most harmless: the report's default order."""

TEXT_BUDGET_CHARS = 14_000_000
"""Characters of prompt and output text per page, shared among prompts: each prompt keeps up to
2.5 caps (the prompt 1, the shared output text 0.5, each side's rest 0.5)."""
TEXT_CAP_MIN, TEXT_CAP_MAX = 400, 4000
"""Bounds of the per-text cap (a page with few prompts shows up to 4,000 characters a text)."""
TOKEN_TEXT_CAP = 40
"""Characters of one token's text."""
WINDOW_BEFORE, WINDOW_AFTER = 8, 24
"""Tokens shown before the first divergence (shared) and from it on (each side)."""
MAX_MESSAGES = 20
"""Chat messages shown per prompt (the last ones)."""

WINDOW_MARGIN = "golden_margin"
"""The value the divergence window's note explains (the golden's margin where the outputs part)."""


def text_cap(prompts: int) -> int:
    """Characters kept of each text for a page of ``prompts`` prompts."""
    per_text = TEXT_BUDGET_CHARS * 2 // 5 // max(prompts, 1)
    return max(TEXT_CAP_MIN, min(TEXT_CAP_MAX, per_text))


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-level slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _round(value: Any) -> Any:
    """JSON-ready metric value: floats to 4 significant digits, non-finite as None."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.4g}")
    return None


def thresholds_of(score: ScoredRun) -> Any:
    """The thresholds a run was scored with (defaults for anything missing or unreadable)."""
    try:
        return Thresholds.model_validate(score.thresholds)
    except ValidationError:  # a run scored by another version or with a plugin not installed here still renders
        known = {k: v for k, v in score.thresholds.items() if k in Thresholds.model_fields}
        try:
            return Thresholds.model_validate(known)
        except ValidationError:
            return Thresholds()


def ranked(score: ScoredRun) -> list[tuple[PromptScore, float]]:
    """Scores from worst to most harmless: class order, then severity, then prompt order."""
    t = thresholds_of(score)
    order = {k: i for i, k in enumerate(CLASS_ORDER)}
    rows = [(s, severity(s.metrics, t), i) for i, s in enumerate(score.scores)]
    rows.sort(key=lambda r: (order.get(r[0].prompt_class, len(order)), -r[1], r[2]))
    return [(s, sev) for s, sev, _ in rows]


def metric_names(score: ScoredRun) -> list[str]:
    """Every metric output present, documented ones first in their documented order."""
    names = list(score.metric_descriptions)
    seen = set(names)
    for s in score.scores:
        for name in s.metrics:
            if name not in seen:
                seen.add(name)
                names.append(name)
    return names


def _cap_end(text: str, cap: int) -> tuple[str, int]:
    """Keep the first ``cap`` characters; return them and how many were dropped."""
    return (text, 0) if len(text) <= cap else (text[:cap], len(text) - cap)


def _cap_start(text: str, cap: int) -> tuple[str, int]:
    """Keep the last ``cap`` characters; return them and how many were dropped."""
    return (text, 0) if len(text) <= cap else (text[len(text) - cap:], len(text) - cap)


def _texts(golden: str, candidate: str, cap: int) -> dict[str, Any]:
    """Shared part once, then each side's rest, each capped."""
    cp = common_prefix_len(golden, candidate)
    out: dict[str, Any] = {}
    if cp == len(golden) == len(candidate):
        out["s"], dropped = _cap_end(golden, cap)
        if dropped:
            out["s1"] = dropped
        return out
    half = max(cap // 2, 1)
    out["s"], dropped = _cap_start(golden[:cp], half)
    if dropped:
        out["s0"] = dropped
    for key, rest in (("g", golden[cp:]), ("c", candidate[cp:])):
        out[key], dropped = _cap_end(rest, half)
        if dropped:
            out[key + "1"] = dropped
    return out


class _Vocab:
    def __init__(self, run: RunResult):
        self.texts = run.display_texts()  # byte pieces as <0xE5><0x90>
        self.pieces = run.piece_bytes()
        self.bytes = run.token_bytes

    def __call__(self, token_id: int) -> str:
        t = self.texts[token_id] if 0 <= token_id < len(self.texts) else f"<{token_id}>"
        return _cap_token(t)


def _cap_token(t: str) -> str:
    return t if len(t) <= TOKEN_TEXT_CAP else t[:TOKEN_TEXT_CAP] + "…"


class _Tracks:
    """Direct access to a run's output tokens and free-run top-k (no per-prompt objects)."""

    def __init__(self, run: RunResult):
        a = run.arrays
        self.run = run
        self.offsets = a.get("output_offsets")
        self.tokens = a.get("output_tokens")
        self.top_ids = a.get("out_top_ids")
        self.top_lp = a.get("out_top_logprobs")
        self.token_lp = a.get("out_token_logprobs")
        self.vocab = _Vocab(run)

    def span(self, row: int) -> tuple[int, int]:
        return int(self.offsets[row]), int(self.offsets[row + 1])

    def topk(self, start: int, d: int, own: int | None, other: int | None) -> list[list[Any]]:
        """[token text, logprob, 1 if this side chose it / 2 if the other side did / 0] per top-k entry,
        plus the text it completes for a byte piece that ends characters begun by the pieces before it."""
        ids, lps = self.top_ids[start + d], self.top_lp[start + d]
        rows = [[self.vocab(int(i)), _round(float(lp)), 1 if i == own else 2 if i == other else 0]
                for i, lp in zip(ids, lps) if i >= 0 and np.isfinite(lp)]
        if self.vocab.pieces and d > 0:
            before = self._boundary(start, d - 1)
            lead = [self.vocab.bytes(int(t)) for t in self.tokens[start + before:start + d]]
            kept = [int(i) for i, lp in zip(ids, lps) if i >= 0 and np.isfinite(lp)]
            for row, token_id in zip(rows, kept):
                if token_id in self.vocab.pieces:
                    runs = join_pieces(lead + [self.vocab.pieces[token_id]])
                    if runs and runs[-1][1] == len(lead) + 1:
                        row.append(_cap_token(runs[-1][2]))
        return rows

    def _boundary(self, start: int, i: int) -> int:
        """Position <= i where the output's bytes start a character: at most 3 byte pieces back
        from i, past pieces that begin with a UTF-8 continuation byte."""
        b = i
        while b > 0 and i - b < 3:
            raw = self.vocab.pieces.get(int(self.tokens[start + b]))
            if not raw or raw[0] & 0xC0 != 0x80:
                break
            b -= 1
        return b

    def joined(self, start: int, n: int, lo: int, hi: int) -> list[list[Any]]:
        """[first, end, text] per run of byte pieces among output tokens lo..hi-1 (indices from lo)
        that completes characters: what the pieces read as together."""
        if not self.vocab.pieces:
            return []
        b, e = self._boundary(start, lo) if lo < n else lo, min(n, hi + 8)
        out = []
        for first, end, text in join_pieces([self.vocab.bytes(int(t)) for t in self.tokens[start + b:start + e]]):
            first, end = first + b - lo, end + b - lo
            if end > 0 and first < hi - lo:
                out.append([max(first, 0), min(end, hi - lo), _cap_token(text)])
        return out


def _window(g: _Tracks, g_row: int, c: _Tracks, c_row: int, d: int) -> dict[str, Any]:
    """Tokens around the first divergence ``d`` and the top-k of both sides there."""
    gs, ge = g.span(g_row)
    cs, ce = c.span(c_row)
    g_tok, c_tok = g.tokens[gs:ge], c.tokens[cs:ce]
    lo = max(0, d - WINDOW_BEFORE)
    w: dict[str, Any] = {
        "at": d,
        "pre": [g.vocab(int(t)) for t in g_tok[lo:d]],
        "g": [g.vocab(int(t)) for t in g_tok[d:d + WINDOW_AFTER]],
        "c": [c.vocab(int(t)) for t in c_tok[d:d + WINDOW_AFTER]],
        "gn": len(g_tok), "cn": len(c_tok),
    }
    if lo:
        w["pre0"] = lo
    for side, tracks, start, n in (("g", g, gs, len(g_tok)), ("c", c, cs, len(c_tok))):
        joined = tracks.joined(start, n, lo, min(n, d + WINDOW_AFTER))
        if joined:  # runs of byte pieces in the row pre + side, and the text they complete
            w[side + "j"] = joined
    g_choice = int(g_tok[d]) if d < len(g_tok) else None
    c_choice = int(c_tok[d]) if d < len(c_tok) else None
    if g_choice is not None:
        w["gk"] = g.topk(gs, d, g_choice, c_choice)
        w["gl"] = _round(float(g.token_lp[gs + d]))
    if c_choice is not None:
        w["ck"] = c.topk(cs, d, c_choice, g_choice)
        w["cl"] = _round(float(c.token_lp[cs + d]))
    return w


def _prompt(record: Any, cap: int) -> dict[str, Any]:
    """The prompt as [[role, text], ...] ('' role for a plain prompt), capped."""
    if record is None:
        return {}
    if record.messages is not None:
        messages = [(m.role, m.content) for m in record.messages]
    else:
        messages = [("", record.prompt or "")]
    out: dict[str, Any] = {}
    if len(messages) > MAX_MESSAGES:
        out["pm0"] = len(messages) - MAX_MESSAGES
        messages = messages[-MAX_MESSAGES:]
    per = max(cap // len(messages), 100)
    out["pm"] = [[role, *_cap_start_pair(text, per)] for role, text in messages]
    return out


def _cap_start_pair(text: str, cap: int) -> list[Any]:
    kept, dropped = _cap_start(text, cap)
    return [kept, dropped] if dropped else [kept]


ANSWERS_SHOWN = 20
"""Accepted answers of one prompt shown in its details (each cut to TOKEN_TEXT_CAP * 5 characters)."""


def _answer(s: PromptScore) -> dict[str, Any]:
    """``a``: [accepted answers, golden correct, candidate correct, found in golden, found in candidate]
    for a prompt with an expected answer (nothing otherwise)."""
    a = s.answer
    if a is None:
        return {}
    cap = TOKEN_TEXT_CAP * 5

    def cut(text: str | None) -> str | None:
        return text if text is None or len(text) <= cap else text[:cap] + "…"

    return {"a": [[cut(x) for x in a.expected[:ANSWERS_SHOWN]], a.golden_correct, a.candidate_correct,
                  cut(a.golden_match), cut(a.candidate_match)]}


SAMPLES_SHOWN = 16
"""Samples of one sampled prompt shown side by side in its details."""


def _samples(s: PromptScore, golden: RunResult, run: RunResult, cap: int) -> dict[str, Any]:
    """``sm``: [[golden text, candidate text], ...] of a sampled prompt's samples (each capped), and
    ``sm0``, how many more there are."""
    n = int(s.metrics.get("samples") or 0)
    per = max(cap // 4, TOKEN_TEXT_CAP * 4)
    rows = []
    for k in range(min(n, SAMPLES_SHOWN)):
        sid = sample_id(s.prompt_id, k)
        if sid not in golden or sid not in run:
            break
        texts = [golden.texts[golden.position(sid)], run.texts[run.position(sid)]]
        rows.append([t if len(t) <= per else t[:per] + "…" for t in texts])
    out: dict[str, Any] = {"sm": rows}
    if n > len(rows):
        out["sm0"] = n - len(rows)
    return out


def diagnosis_of(score: ScoredRun, diagnosis: "Diagnosis | None") -> "Diagnosis | None":
    """``diagnosis`` when it was made for this scoring's candidate run, else None: a stale
    diagnosis (of another run) is never shown."""
    if diagnosis is None or diagnosis.run_id != score.run.run_id:
        return None
    return diagnosis


def cause_mitigation(diagnosis: "Diagnosis", cause: str) -> str:
    """What would have prevented drift from ``cause``: the field guide's mitigation for a source
    (:data:`regress.effective.MITIGATION`), else the one the diagnosis gives most often for it."""
    from regress.effective import MITIGATION

    if cause in MITIGATION:
        return MITIGATION[cause]  # type: ignore[index]
    said: dict[str, int] = {}
    for p in diagnosis.prompts:
        if cause in p.causes and p.mitigation:
            said[p.mitigation] = said.get(p.mitigation, 0) + 1
    return max(said, key=lambda k: said[k]) if said else ""


def causes_by_count(diagnosis: "Diagnosis") -> list[tuple[str, int]]:
    """(cause, prompts) from the most prompts to the fewest; ties in the field guide's order."""
    from regress.effective import SOURCES

    order = {c: i for i, c in enumerate(SOURCES)}
    return sorted(((c, n) for c, n in diagnosis.by_cause.items() if n),
                  key=lambda cn: (-cn[1], order.get(cn[0], len(order)), cn[0]))


def _prompt_diagnosis(p: Any) -> dict[str, Any]:
    """``dx`` of a diagnosed prompt: causes, why, mitigation, explained, batch variant, and per
    probe [name, same, first divergence]."""
    out: dict[str, Any] = {"c": list(p.causes), "y": p.why, "mi": p.mitigation, "e": p.explained,
                           "o": [[o.probe, o.same, o.first_divergence] for o in p.observations]}
    if p.batch_variant:
        out["b"] = True
    return out


def build_payload(score: ScoredRun, golden: RunResult, run: RunResult, prompt_set: Any = None, *,
                  diagnosis: "Diagnosis | None" = None) -> dict[str, Any]:
    """Everything the page's script needs, JSON-ready. With a ``diagnosis`` of this run, each
    diagnosed prompt gets ``dx`` (see :func:`_prompt_diagnosis`) and the payload ``diagnosis``
    (the causes present, for the table's filter); without one ``diagnosis`` is None."""
    diagnosis = diagnosis_of(score, diagnosis)
    diagnosed = {p.prompt_id: p for p in diagnosis.prompts} if diagnosis is not None else {}
    names = metric_names(score)
    tags: dict[str, int] = {}
    cap = text_cap(len(score.scores))
    g_tracks, c_tracks = _Tracks(golden), _Tracks(run)
    prompts = []
    for rank, (s, sev) in enumerate(ranked(score)):
        entry: dict[str, Any] = {
            "id": s.prompt_id,
            "k": s.prompt_class,
            "t": [tags.setdefault(tag, len(tags)) for tag in s.tags],
            "r": rank,
            "v": _round(sev),
            "m": [_round(s.metrics.get(n)) for n in names],
            "why": s.reasons,
        }
        record = None
        if prompt_set is not None:
            try:
                record = prompt_set.get(s.prompt_id)
            except KeyError:
                record = None
        entry.update(_prompt(record, cap))
        if s.prompt_id in diagnosed:
            entry["dx"] = _prompt_diagnosis(diagnosed[s.prompt_id])
        entry.update(_answer(s))
        if s.metrics.get("samples"):
            entry.update(_samples(s, golden, run, cap))
        elif s.prompt_id in run and s.prompt_id in golden:
            g_row, c_row = golden.position(s.prompt_id), run.position(s.prompt_id)
            entry.update(_texts(golden.texts[g_row], run.texts[c_row], cap))
            entry["f"] = [golden.finish_reasons[g_row], run.finish_reasons[c_row]]
            d = s.metrics.get("first_divergence")
            if isinstance(d, int) and not isinstance(d, bool) and g_tracks.offsets is not None:
                entry["w"] = _window(g_tracks, g_row, c_tracks, c_row, d)
        prompts.append(entry)
    t = thresholds_of(score)
    specs = {spec.name: spec for spec in output_specs()}
    present = [specs[n] for n in names if n in specs]
    bounds = [b.setting.name for spec in output_specs() for b in (spec.benign, spec.regression) if b is not None]
    return {
        "candidate": score.run.candidate.name,
        "baseline": score.golden.candidate.name,
        "classes": list(CLASS_ORDER),
        "tags": list(tags),
        "metrics": names,
        "descriptions": score.metric_descriptions,
        "specs": {spec.name: _spec(spec) for spec in present if _spec(spec)},
        "key": [spec.name for spec in headline(present) if spec.column],
        "charts": [_chart(spec, t) for spec in present if spec.chart is not None],
        "window": {"margin": WINDOW_MARGIN},
        "thresholds": t.model_dump(include=set(bounds)),
        "caps": {"text": cap, "token_text": TOKEN_TEXT_CAP, "before": WINDOW_BEFORE, "after": WINDOW_AFTER},
        "prompts": prompts,
        "diagnosis": None if diagnosis is None else {
            "causes": [c for c, _ in causes_by_count(diagnosis)],
            "mitigations": {c: cause_mitigation(diagnosis, c) for c, _ in causes_by_count(diagnosis)},
        },
        "latency": latency_view(score.metrics),
    }


LATENCY_ROWS = (
    # (label, LatencyStats field, LatencyComparison ratio field or None, help)
    ("TTFT p50", "ttft_p50_s", "ttft_p50_ratio", "median time to first token of a request"),
    ("TTFT p95", "ttft_p95_s", "ttft_p95_ratio", "95th percentile time to first token (max_latency_ratio)"),
    ("TTFT p99", "ttft_p99_s", None, "99th percentile time to first token"),
    ("TPOT p95", "tpot_p95_s", "tpot_p95_ratio",
     "95th percentile time per output token after the first: (total - TTFT) / (output tokens - 1) (max_latency_ratio)"),
    ("total p95", "latency_p95_s", "latency_p95_ratio", "95th percentile total time of a request (max_latency_ratio)"),
)
"""The latency rows of the performance card (server runs: per-request times)."""
LATENCY_SAME_WITHIN = 0.05
"""Ratios within 5 % of 1 are not coloured (as the performance card's other changes)."""


def seconds_text(value: float | None) -> str:
    """A time for people: milliseconds below a second ('—' when missing)."""
    if value is None:
        return "—"
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


def latency_view(m: Any) -> dict[str, Any] | None:
    """What the page shows of the latency (``RunMetrics.latency``): ``rows`` of [label, golden,
    candidate, candidate / golden, direction (better, worse, same), help] for runs with per-request
    times (server runs; offline runs have only throughput, already a performance row), the
    concurrency, the latency verdict, its reasons and whether it gates. None when the metrics have
    no latency (scored before it) and no latency verdict."""
    from regress.latency import ratio, timed

    lat = getattr(m, "latency", None)
    if lat is None and getattr(m, "latency_verdict", None) is None:
        return None
    rows: list[list[Any]] = []
    if timed(lat):
        for label, stat, ratio_field, help in LATENCY_ROWS:
            g, c = getattr(lat.golden, stat), getattr(lat.candidate, stat)
            r = getattr(lat, ratio_field) if ratio_field else ratio(c, g)
            direction = "same" if r is None or abs(r - 1) <= LATENCY_SAME_WITHIN else ("worse" if r > 1 else "better")
            shown = "—" if r is None else f"{r:.2f}×"
            rows.append([label, seconds_text(g), seconds_text(c), shown, direction, help])
    return {
        "timed": timed(lat),
        "rows": rows,
        "requests": [lat.golden.requests, lat.candidate.requests] if lat is not None else [0, 0],
        "concurrency": [lat.golden.concurrency, lat.candidate.concurrency] if lat is not None else [None, None],
        "throughput_ratio": None if lat is None or lat.throughput_ratio is None else _round(lat.throughput_ratio),
        "verdict": m.latency_verdict,
        "reasons": list(m.latency_reasons),
        "gates": bool(getattr(m, "latency_gates", False)),
    }


def _spec(spec: Output) -> dict[str, Any]:
    """What the page's script needs of a value, where it is not the default: column label (the
    name), number format (``num``), which way is better (neither)."""
    out: dict[str, Any] = {"label": spec.label, "format": spec.format if spec.format != "num" else None,
                           "better": spec.better}
    return {k: v for k, v in out.items() if v is not None}


def _chart(spec: Output, t: Any) -> dict[str, Any]:
    c = spec.chart
    assert c is not None

    def limit(bound: Any) -> Any:
        return None if bound is None else getattr(t, bound.setting.name)

    return {"metric": spec.name, "title": c.title, "sub": c.sub, "scale": c.scale, "noun": c.noun, "empty": c.empty,
            "diverged": c.diverged_only, "benign": limit(spec.benign), "regression": limit(spec.regression)}
