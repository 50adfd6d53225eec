"""What the commands print: a run's summary, a candidate's scores, a diagnosis, a noise floor.

Plain lines on stdout; progress and errors go to stderr (:mod:`regress.progress`). A score's
reasons and a diagnosis quote model outputs and token texts (a served candidate's answer), so
what these print goes through :func:`regress.untrusted.printable`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from regress.untrusted import printable


def out(message: str) -> None:
    """One line of a command's output on stdout (progress and errors go to stderr). Anything in
    it may come from a remote answer (a model's tokenizer files, a served candidate's outputs), so
    control characters and workflow commands are neutralised; JSON stays JSON."""
    typer.echo(printable(message))


_out = out


def workflow_command(line: str) -> None:
    """A GitHub Actions workflow command regress means to send (``regress gate --annotate``):
    printed as it is; its data must be escaped already (:mod:`regress.report.annotations`)."""
    typer.echo(line)


def summarise_run(manifest, out_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """A finished run in one line: prompts, tokens, speed, engine load and peak memory."""
    t = manifest.timings
    _out(
        f"{manifest.kind} '{manifest.candidate.name}' -> {out_dir}: {manifest.dataset.prompts} prompts, "
        f"{t.output_tokens} tokens in {t.generation_s:.1f} s ({t.tokens_per_s:.0f} tokens/s), "
        f"engine load {t.engine_load_s:.1f} s, peak memory {manifest.memory.peak_rss_mib or 0:.0f} MiB"
    )


def print_scores(report) -> None:  # type: ignore[no-untyped-def]
    """A scored candidate: verdict, classes, measures, speed, latency, reasons and its worst regressions."""
    m = report.metrics

    def fmt(value, pattern="{:.3f}"):  # type: ignore[no-untyped-def]
        return "n/a" if value is None else pattern.format(value)

    from regress.report.overview import load_note, measures

    # The run's measures as the metrics declare them (label, format, order), plugins' included.
    # A quick check generated nothing: what it has is teacher-forced (no exact match of outputs to
    # speak of), and no speed to compare.
    prefill = report.run.prefill_only
    shown = ", ".join(f"{x.label} {x.value}" for x in measures(m)
                      if not (prefill and (x.value == "—" or x.key == "exact_match_rate")))
    decision = "FAIL" if m.gating_failed else "PASS"
    verdicts = f"fidelity {m.verdict.upper()}, quality {(m.quality_verdict or 'n/a').upper()}"
    load_said = load_note(report)
    speed = (f"  prefill only: {report.run.timings.teacher_forcing_s:.1f} s, engine load {m.engine_load_s:.1f} s"
             if prefill else
             f"  speed {m.tokens_per_s:.0f} tokens/s ({fmt(m.tokens_per_s_ratio, '{:.2f}')}x golden), "
             f"engine load {m.engine_load_s:.1f} s (golden {m.golden_engine_load_s:.1f} s)"
             + (f"\n  {m.speed_note}" if m.speed_comparable is False else "")
             + (f"\n  {load_said}" if load_said else ""))
    _out(
        f"{m.candidate}: {decision} (gated on {m.gate}; {verdicts})  {m.prompts} prompts: {m.identical} identical"
        f"{' logprobs' if prefill else ''}, {m.benign} benign, "
        f"{m.drift} drift, {m.regression} regression, {m.input_drift} input drift\n"
        f"  {shown}\n" + speed
    )
    from regress.report.overview import rates

    intervals = ", ".join(f"{x.label} {x.value}" for x in rates(m))
    if intervals:
        _out(f"  {intervals}")
    lat = m.latency
    if lat is not None and lat.candidate.requests:
        g, c = lat.golden, lat.candidate
        ms = lambda v: "n/a" if v is None else f"{v * 1000:.0f} ms"  # noqa: E731
        _out(f"  latency at concurrency {c.concurrency}: TTFT p50 {ms(c.ttft_p50_s)} (golden {ms(g.ttft_p50_s)}), "
             f"p95 {ms(c.ttft_p95_s)} (golden {ms(g.ttft_p95_s)}); total p95 {ms(c.latency_p95_s)} "
             f"(golden {ms(g.latency_p95_s)})")
    if m.latency_verdict is not None:
        gates = "gating" if m.latency_gates else "reported, not gating"
        _out(f"  latency {m.latency_verdict.upper()} ({gates})" + "".join(f"\n  - {r}" for r in m.latency_reasons))
    for reason in report.verdict_reasons:
        _out(f"  - {reason}")
    if m.verdict_basis:
        _out(f"  the verdict rests on {m.verdict_basis}")
    q = m.quality
    gates = {"fidelity": "the fidelity verdict gates", "quality": "the quality verdict gates",
             "both": "both verdicts gate"}[m.gate]
    if q is not None:
        _out(f"  quality: {q.verdict.upper()} ({gates})" + "".join(f"\n  - {r}" for r in q.reasons))
    else:
        _out(f"  quality: no prompt with a checkable answer ({gates})")
    if m.detection_power is not None:
        _out(f"  detection power: {m.detection_power.summary}"
             + ("" if m.detection_power.current else " (measured with other thresholds: run `regress power` again)"))
    worst = [s for s in report.scores if s.prompt_class == "regression"][:5]
    for s in worst:
        _out(f"  regression {s.prompt_id}: {'; '.join(s.reasons)}")


def print_diagnosis(d) -> None:  # type: ignore[no-untyped-def]
    """A diagnosis in a few lines: causes with counts and mitigations, then each prompt's why."""
    from regress.diagnosis.probes import mitigation

    if not d.prompts:
        _out(f"'{d.candidate}': no drifted prompt to diagnose" + (f" ({len(d.left_out)} left out)" if d.left_out else ""))
    else:
        _out(f"'{d.candidate}': {len(d.prompts)} of {d.drifted} drifted prompt(s) diagnosed with "
             f"{sum(1 for r in d.probes if not r.skipped)} probe(s), {d.engine_loads} engine load(s), {d.seconds:.0f} s")
        for cause, n in sorted(d.by_cause.items(), key=lambda kv: -kv[1]):
            _out(f"  {cause}: {n} prompt(s)  (mitigation: {mitigation(cause)})")  # type: ignore[arg-type]
        for pd in d.prompts:
            _out(f"  {pd.prompt_id} [{pd.prompt_class}] {', '.join(pd.causes)}: {pd.why}")
    for r in d.probes:
        if r.skipped:
            _out(f"  probe {r.name}: skipped ({r.skipped})")


def print_noise_floor(floor, golden_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """A measured noise floor: each arm, the floor per measure, the prompts noisy on the baseline itself."""
    from regress.noise.floor import noise_path

    for arm in floor.arms:
        took = f", {arm.seconds:.0f} s" if arm.seconds is not None else ""
        _out(f"noise arm '{arm.name}' ({arm.changed}): {arm.identical} identical, {arm.diverged} diverged{took}")
    shown = ", ".join(f"{k} {'n/a' if v is None else format(v, '.4g')}" for k, v in floor.floor.items())
    _out(f"floor (quantile {floor.quantile:g}, k {floor.k:g}): {shown}")
    noisy = floor.noisy()
    _out(f"{len(noisy)} prompt(s) noisy on the baseline itself" + (":" if noisy else ""))
    for n in noisy:
        margin = n.flipped_margin
        _out(f"  {n.prompt_id}: flipped under {', '.join(n.arms)}"
             + (f", largest flipped margin {margin:.3g}" if margin is not None else ""))
    _out(f"noise floor: {noise_path(golden_dir)}")
