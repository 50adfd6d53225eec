"""``regress watch``: check every new release of the engine packages.

One tick by default (for cron and scheduled CI), ``--loop`` to tick every ``interval_s`` in
this process, ``--beat`` to run Celery beat (workers run the ticks), ``--history`` to print
what has been checked. Exit codes of a tick: 0 nothing regressed, 1 a check found a
regression, 2 bad configuration, 3 the index (or the state, or a check) could not be reached.

Kept light: Celery is imported only by ``--beat`` and the celery trigger.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer

from regress.errors import EXIT_INPUT, RegressError


def _echo(message: str) -> None:
    # Index notes, versions and reports come from remote answers: no escape sequence, no workflow command.
    from regress.untrusted import printable

    typer.echo(printable(message))


def _shown_report(project: Path, report: str) -> str:
    """A record's report (relative to the params directory, ``project``) as a path that opens
    from where the command ran."""
    return str(project / report)


def _print_tick(tick: Any, project: Path) -> None:
    from regress.progress import print_error, warn

    for package in tick.packages:
        if package.error is not None:
            print_error(f"{package.package}: {package.error} (state unchanged; the next tick retries)")
            continue
        skipped = []
        if package.skipped_prereleases:
            skipped.append(f"{len(package.skipped_prereleases)} pre-release(s)")
        if package.skipped_yanked:
            skipped.append(f"{len(package.skipped_yanked)} yanked")
        line = f"{package.package}: {package.releases} release(s) on {tick.index}"
        if skipped:
            line += f" ({', '.join(skipped)} skipped)"
        _echo(line)
        for note in package.notes:
            _echo(f"  note: {note}")
        if package.first_watch:
            recorded = "would be recorded" if tick.dry_run else "recorded"
            _echo(f"  first watch: {package.recorded_seen} release(s) {recorded} as seen, not checked"
                  + ("" if package.outcomes else " (--check-existing or --since VERSION checks them)"))
        if not package.outcomes:
            _echo("  no new release")
        for outcome in package.outcomes:
            text = f"  {outcome.version}: {'REGRESSION' if outcome.status == 'fail' else outcome.status}"
            if outcome.candidate:
                text += f" (candidate {outcome.candidate})"
            if outcome.report:
                text += f"  report: {_shown_report(project, outcome.report)}"
            elif outcome.detail:
                text += f"  {outcome.detail}"
            _echo(text)
            if outcome.error is not None:
                print_error(f"{package.package} {outcome.version}: {outcome.error} "
                            "(not recorded; the next tick retries)")
    for warning in tick.warnings:
        warn(warning)


def _print_history(records: list[Any], project: Path) -> None:
    """One line per checked version. A record's report is relative to the params directory
    (``project``): shown joined to it, so the path opens from where the command ran."""
    if not records:
        _echo("no release checked yet")
    for record in records:
        where = _shown_report(project, record.report) if record.report else record.detail or ""
        _echo(f"{record.iso_time}  {record.package} {record.version}  {record.status}"
              + (f"  {where}" if where else ""))


def watch(
    params: Path = typer.Option(Path("params.yaml"), "--params", "-p", help="The params file (baseline and its watch: section)."),
    package: Optional[list[str]] = typer.Option(None, "--package", help="Package to watch (repeatable; default: watch.packages, else the baseline's package)."),
    index_url: Optional[str] = typer.Option(None, "--index-url", help="Package index (simple API root; default: REGRESS_INDEX_URL, else the one pip is configured to use). Visible in ps: put credentials in REGRESS_INDEX_URL(_FILE)."),
    trigger: Optional[str] = typer.Option(None, "--trigger", "-t", help="How checks start: local, celery or github (default: watch.trigger, else local)."),
    state: Optional[str] = typer.Option(None, "--state", help="State file path or redis:// URL (default: REGRESS_WATCH_STATE_URL, else watch.state, else $REGRESS_HOME/watch/state.json). Visible in ps: put a password in REGRESS_WATCH_STATE_URL(_FILE)."),
    webhook: Optional[str] = typer.Option(None, "--webhook", help="URL that gets a JSON POST on a regression (default: REGRESS_WEBHOOK_URL, else watch.webhook). Visible in ps: prefer REGRESS_WEBHOOK_URL(_FILE)."),
    include_prereleases: Optional[bool] = typer.Option(None, "--include-prereleases", "--pre", help="Check pre-releases too (`--pre` for short, as pip says it).", show_default=False),
    include_yanked: Optional[bool] = typer.Option(None, "--include-yanked", help="Check yanked releases too.", show_default=False),
    check_existing: bool = typer.Option(False, "--check-existing", help="First watch of a package: check every release already there (default: record them as seen)."),
    since: Optional[str] = typer.Option(None, "--since", help="First watch of a package: check the releases newer than this version."),
    interval: Optional[float] = typer.Option(None, "--interval", min=1, help="Seconds between ticks for --loop and --beat (default: watch.interval_s)."),
    loop: bool = typer.Option(False, "--loop", help="Tick every interval in this process until stopped (no broker needed)."),
    beat: bool = typer.Option(False, "--beat", help="Run Celery beat: it sends a tick task every interval to the workers."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be checked; change nothing, start nothing."),
    history: bool = typer.Option(False, "--history", help="Print every checked version (version, verdict, report) and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print the tick's result as JSON."),
) -> None:
    """Watch the package index for new engine releases and run one regression check per new version.

    One tick by default (cron, scheduled CI): exit 0 no regression, 1 a check regressed,
    2 bad configuration, 3 the index or a check could not be reached (state unchanged; the next
    tick retries)."""
    if sum((loop, beat, history)) > 1:
        raise _fail_usage("use one of --loop, --beat and --history")
    overrides: dict[str, Any] = {
        "packages": package or None, "index_url": index_url, "trigger": trigger, "state": state,
        "webhook": webhook, "include_prereleases": include_prereleases, "include_yanked": include_yanked,
        "since": since, "interval_s": interval, "first_run": "all" if check_existing else None,
    }
    overrides = {key: value for key, value in overrides.items() if value is not None}
    try:
        code = _run(params, overrides, loop=loop, beat=beat, dry_run=dry_run, history=history, as_json=as_json)
    except RegressError as exc:
        from regress.progress import print_error

        print_error(str(exc))
        raise typer.Exit(exc.exit_code) from None
    raise typer.Exit(code)


def _fail_usage(message: str) -> typer.Exit:
    from regress.progress import print_error

    print_error(message)
    return typer.Exit(EXIT_INPUT)


def _run(params: Path, overrides: dict[str, Any], *, loop: bool, beat: bool, dry_run: bool, history: bool,
         as_json: bool) -> int:
    from regress.watch.config import load_watch_config

    config = load_watch_config(params, overrides)
    if history:
        from regress.watch.state import open_state

        records = open_state(config.settings.state).history()
        if as_json:
            _echo(json.dumps([r.model_dump(mode="json") for r in records], indent=1))
        else:
            _print_history(records, params.parent)
        return 0
    if beat:
        return _run_beat(config, overrides)
    from regress.watch.watcher import build_watcher

    watcher = build_watcher(config, dry_run=dry_run)
    _attach_progress(watcher)
    try:
        while True:
            tick = watcher.tick()
            if as_json:
                _echo(json.dumps(tick.summary(), indent=1))
            else:
                _print_tick(tick, params.parent)
            if not loop:
                return tick.exit_code
            time.sleep(config.settings.interval_s)
    except KeyboardInterrupt:
        # Stopping a loop is its normal end; a check that was starting released its claim.
        if loop:
            return 0
        raise


def _attach_progress(watcher: Any) -> None:
    """Progress bars on stderr for checks run here."""
    from regress.watch.triggers import LocalTrigger

    if isinstance(watcher.trigger, LocalTrigger) and watcher.trigger.progress_factory is None:
        from regress.progress import RichProgress

        watcher.trigger.progress_factory = RichProgress


def _run_beat(config: Any, overrides: dict[str, Any]) -> int:
    from regress.watch.triggers import require_celery

    require_celery()
    _refuse_secrets_in_schedule(overrides)
    from regress.watch.state import default_state_path
    from regress.watch.tasks import install_beat_schedule
    from regress.worker.app import app, configure

    settings = config.params.celery.with_environment()
    configure(app, settings)
    schedule = install_beat_schedule(app, str(config.params_path), overrides)
    entry = next(iter(schedule.values()))
    # Beat keeps the last run times in a file: the state directory, never the cwd.
    schedule_file = default_state_path().parent / "celerybeat-schedule"
    schedule_file.parent.mkdir(parents=True, exist_ok=True)
    _echo(f"beat: a watch tick every {entry['schedule']:g} s to queue '{entry['options'].get('queue')}' "
          f"on {settings.describe()}; schedule file {schedule_file}")
    app.Beat(schedule=str(schedule_file), loglevel="INFO", max_interval=min(60.0, entry["schedule"])).run()
    return 0


def _refuse_secrets_in_schedule(overrides: dict[str, Any]) -> None:
    """Beat puts its overrides in every tick message and in its schedule file: a secret given
    as a flag would be copied to the broker and to disk. The workers read it from their own
    environment instead (the tick task loads the configuration there)."""
    from regress.errors import ConfigError
    from regress.redact import has_credentials
    from regress.watch.config import SECRET_SETTINGS

    for field, variable in SECRET_SETTINGS.items():
        value = overrides.get(field)
        # A webhook URL is a secret as a whole (its path); the others when they hold credentials.
        if value is not None and (field == "webhook" or has_credentials(str(value))):
            option = "--" + field.replace("_", "-")
            raise ConfigError(f"{option} would be written into every tick message and beat's schedule file; "
                              f"set {variable} (or {variable}_FILE) in the workers' environment instead",
                              field=option)


def register(app: typer.Typer) -> None:
    """Add the ``watch`` command to the ``regress`` app."""
    app.command("watch")(watch)


def standalone_app() -> typer.Typer:
    """``python -m regress.watch.cli``: the command on its own."""
    single = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                         context_settings={"help_option_names": ["-h", "--help"]})
    single.command()(watch)
    return single


if __name__ == "__main__":
    from regress.cli_boundary import run_app

    # The same exit codes as `regress watch`: a crash is 3 with a crash log, never Python's 1.
    run_app(standalone_app())
