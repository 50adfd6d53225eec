"""The command line's process boundary: run a typer app and turn whatever ends it into the exit code.

Exit codes: 0 no regression, 1 regression found, 2 usage / configuration / input error,
3 the check could not run (environment or engine failure; retrying may help), 130 interrupted.
An exception that is not a regress error (a bug, or a failure nobody mapped) also exits 3, never
1: one line on stderr names it and the crash log (``$REGRESS_HOME/logs/crash-*.log``) holding its
traceback. ``regress`` (:func:`regress.cli.main`), ``python -m regress.watch.cli`` and any other
entry point go through :func:`run_app`, so they all exit the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from regress.errors import EXIT_INPUT, RegressError
from regress.progress import guard_log_output, print_error, stderr_console


def _usage_errors() -> tuple[type[Exception], ...]:
    """The classes of usage errors (unknown command or option, missing argument, bad value):
    typer's own base class where typer bundles click, else click's."""
    found: list[type[Exception]] = []
    bundled = getattr(typer, "TyperException", None)
    if isinstance(bundled, type):
        found.append(bundled)
    try:
        import click
    except ImportError:
        pass
    else:
        found.append(click.ClickException)
    return tuple(found)


def write_crash_log(exc: BaseException) -> Path | None:
    """Write the full traceback of an unexpected exception (with the command line and versions)
    to ``$REGRESS_HOME/logs/crash-<UTC time>-<pid>.log``, else under the temporary directory;
    its path, or None if neither is writable."""
    import os
    import platform
    import tempfile
    import traceback
    from datetime import datetime, timezone
    from importlib.metadata import PackageNotFoundError, version

    from regress.home import regress_home

    now = datetime.now(timezone.utc)
    name = f"crash-{now.strftime('%Y%m%dT%H%M%SZ')}-{os.getpid()}.log"
    try:
        regress_version = version("regress")
    except PackageNotFoundError:  # run from a checkout that was never installed
        regress_version = "(not installed)"
    text = (
        f"regress {regress_version} crashed at {now.isoformat(timespec='seconds')}\n"
        f"command: {' '.join(sys.argv)}\n"
        f"cwd: {os.getcwd()}\n"
        f"python: {sys.version.split()[0]} on {platform.platform()}\n\n"
        + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    )
    for directory in (regress_home() / "logs", Path(tempfile.gettempdir()) / "regress-logs"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / name
            path.write_text(text, encoding="utf-8")
            return path
        except OSError:
            continue
    return None


def report_crash(exc: BaseException) -> int:
    """Say in one line that ``exc`` (not a regress error: a bug in regress or a plugin, or a
    failure nobody mapped) stopped the command, with where its traceback went; returns exit 3.
    Never 1: CI must not read a crash as "regression found"."""
    from regress.errors import EXIT_RUN_FAILED

    log = write_crash_log(exc)
    first_line = (str(exc).strip().splitlines() or [""])[0][:500]
    where = f"full traceback in {log}" if log else "no crash log could be written"
    print_error(f"unexpected {type(exc).__module__}.{type(exc).__qualname__}"
                + (f": {first_line}" if first_line else "")
                + f" (the check could not run; {where})")
    return EXIT_RUN_FAILED


EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT), as shells report it."""


def run_app(typer_app: typer.Typer) -> None:
    """Run ``typer_app`` and exit with the code the project's conventions give: the regress
    error's own, 2 for usage errors, 130 when interrupted, 3 with a crash log for anything else."""
    guard_log_output()
    try:
        code = typer_app(standalone_mode=False)
    except RegressError as exc:
        print_error(str(exc))
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        # click turns Ctrl-C into Abort; a KeyboardInterrupt outside its main loop arrives as is.
        _interrupted()
    except _usage_errors() as exc:
        show = getattr(exc, "show", None)
        if callable(show):
            show()
        else:
            print_error(str(exc))
        # A usage error's own code is 2; a file argument that cannot be opened says 1, which is
        # the verdict "regression found": it is an input error too.
        sys.exit(EXIT_INPUT)
    except Exception as exc:  # noqa: BLE001 - the last boundary: whatever no one mapped
        sys.exit(report_crash(exc))
    if code == EXIT_INTERRUPTED:
        # This click returns 130 for Ctrl-C in standalone_mode=False instead of raising Abort.
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)


def _interrupted() -> None:
    stderr_console.print("[red]interrupted[/red]; finished shards are kept, run the command again to resume")
    sys.exit(EXIT_INTERRUPTED)
