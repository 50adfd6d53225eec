"""Text from a remote answer never drives the terminal or the CI log: control characters and workflow
commands are neutralised in everything printed (errors, warnings, status lines, log records, scores,
watch output) and in annotations; ordinary text is left as it is."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from rich.console import Console

from regress.untrusted import printable, without_controls

HOSTILE = ("upstream said: \x1b[2J\x1b]0;owned\x07cleared\rOVERWRITTEN\n::add-mask::hunter2\n"
           "  ::error file=x.py::forged\n\t::stop-commands::abc\n\u00a0::warning::nbsp "
           "##[error]old form \x9b31m c1 \u202eevil\u202c \u2028next\x7f")


def _commands(text: str) -> list[str]:
    """Lines GitHub's runner would take for a workflow command (it splits on CR and LF, trims
    leading whitespace, and reads ``##[`` anywhere)."""
    lines = text.replace("\r", "\n").split("\n")
    return [line for line in lines if line.lstrip().startswith("::") or "##[" in line]


def _clean(text: str) -> None:
    assert not _commands(text), _commands(text)
    assert not any(c in text for c in "\x1b\r\x07\x7f\x9b\u202e\u2028"), repr(text)


def test_printable_neutralises_controls_and_commands_and_keeps_text_readable() -> None:
    shown = printable(HOSTILE)
    _clean(shown)
    assert "\\u001b[2J" in shown and "\\u000d" in shown and "\\u009b" in shown and "\\u202e" in shown
    assert "\n\\::add-mask::hunter2\n" in shown and "\n  \\::error file=x.py::forged" in shown
    assert "\t\\::stop-commands::abc" in shown and "\u00a0\\::warning::" in shown and "##\\u005b" in shown
    assert printable(shown) == shown  # idempotent
    ordinary = "prompt 'zh-3' 天气很好: a::b, std::vector, 0.33.0 passed\n\tsecond line ## [x]"
    assert printable(ordinary) == ordinary
    assert without_controls("a\r\n\x1bb", keep="\t\n\r") == "a\r\n\\u001bb"
    # Printed JSON stays JSON, and decodes to what was sent.
    sent = {"detail": HOSTILE}
    assert json.loads(printable(json.dumps(sent, ensure_ascii=False))) == sent


def test_a_server_error_printed_by_the_command_boundary_is_neutralised_and_redacted(capsys, monkeypatch) -> None:
    from regress.cli_boundary import run_app
    from regress.errors import ServerHTTPError

    app = typer.Typer()

    @app.command()
    def replay() -> None:
        raise ServerHTTPError("http://127.0.0.1:8000/v1/completions", 500, HOSTILE + "\nX-Api-Key: sk-live-1234")

    @app.command()
    def other() -> None:
        pass

    monkeypatch.setattr("sys.argv", ["regress", "replay"])
    with pytest.raises(SystemExit) as exited:
        run_app(app)
    err = capsys.readouterr().err
    assert exited.value.code == 3
    assert err.startswith("error: http://127.0.0.1:8000/v1/completions answered HTTP 500: upstream said:")
    _clean(err)
    assert "\\::add-mask::hunter2" in err and "X-Api-Key: ***" in err and "sk-live-1234" not in err


def test_warnings_and_log_records_are_neutralised(capsys) -> None:
    from regress.progress import _ShownFormatter, guard_log_output, warn

    warn(f"webhook https://hooks.example/...: {HOSTILE}")
    _clean(capsys.readouterr().err)
    guard_log_output()
    assert isinstance(logging.lastResort.formatter, _ShownFormatter)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.lastResort.formatter)
    record = logging.LogRecord("regress.watch", logging.WARNING, __file__, 1, "could not notify: %s", (HOSTILE,), None)
    handler.emit(record)
    _clean(stream.getvalue())


def test_status_lines_are_neutralised() -> None:
    from regress.progress import RichProgress

    buffer = io.StringIO()
    sink = RichProgress("candidate 'x'", console=Console(file=buffer, width=400, force_terminal=False))
    sink.status(f"engine: {HOSTILE}")
    _clean(buffer.getvalue())


def test_scores_printed_to_stdout_are_neutralised(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from regress.cli_output import print_scores
    from report_fixtures import build_case

    case = build_case(tmp_path, prompts=10, tokens=16, semantic=False)
    scores = [s.model_copy(update={"prompt_class": "regression", "reasons": [HOSTILE]}) for s in case.score.scores]
    print_scores(case.score.model_copy(update={"scores": scores, "verdict_reasons": [HOSTILE]}))
    out = capsys.readouterr().out
    assert "upstream said" in out
    _clean(out)


def test_command_output_is_neutralised_but_the_annotations_regress_means_to_send_are_not(capsys) -> None:
    from regress.cli_output import out, workflow_command

    out(f"  bos_token: <s> -> {HOSTILE}")  # `regress diff` of a downloaded tokenizer's special tokens
    _clean(capsys.readouterr().out)
    workflow_command("::error title=regression%3A c / p::reasons%0A::set-env")
    assert capsys.readouterr().out == "::error title=regression%3A c / p::reasons%0A::set-env\n"


def test_watch_output_is_neutralised(capsys) -> None:
    from regress.watch.cli import _print_tick

    package = SimpleNamespace(package="vllm", error=None, skipped_prereleases=[], skipped_yanked=[], releases=1,
                              notes=[HOSTILE], first_watch=False, outcomes=[])
    _print_tick(SimpleNamespace(packages=[package], index="https://pypi.example/simple", dry_run=False, warnings=[]), Path("."))
    _clean(capsys.readouterr().out)


def test_annotations_carry_no_control_characters(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from xml.sax.saxutils import quoteattr

    from regress.report.annotations import junit_annotations

    # XML 1.0 has no ESC, but C1 (CSI is 0x9b, NEL 0x85) and the bidi and line-separator characters pass.
    message = "a\x9b31mred\x9b0m \u202eevil\u202c\u2028done\x85\nnext line"
    junit = tmp_path / "junit.xml"
    junit.write_text(f'<testsuites><testsuite name="s"><testcase classname="regress.c" name="p\x9b8m">'
                     f'<failure message={quoteattr(message)}/></testcase></testsuite></testsuites>', encoding="utf-8")
    [line] = junit_annotations(junit)
    assert line.startswith("::error title=regression%3A regress.c / p\\u009b8m::a\\u009b31mred")
    assert "\\u202eevil" in line and "\\u2028done\\u0085%0Anext line" in line
    assert not any(c in line for c in "\x9b\x85\u202e\u2028\n\r")
