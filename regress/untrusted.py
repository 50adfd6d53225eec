"""Text from a remote answer made safe to print: control characters and workflow commands neutralised.

A server's error body, a package index's page, a webhook's answer, an engine's log tail or a
model's output can hold anything. Printed as it is, an ESC starts a terminal escape sequence (a
cleared screen, a rewritten line, a hidden one), a CR or a lone newline starts a line of its
own, and a line that starts with ``::`` (leading whitespace allowed) is a GitHub Actions
workflow command: ``::add-mask::``, ``::error::``, ``::stop-commands::``. The runner also reads
the older ``##[command]`` form anywhere in a line.

:func:`printable` is what every such text goes through before stdout, stderr or a log: control
characters (C0 but tab and newline, DEL, C1, the Unicode format characters that reorder or
break lines, and lone surrogates) are shown as ``\\uNNNN`` (ESC as ``\\u001b``), a ``::`` that would start a line
becomes ``\\::`` and ``##[`` becomes ``##\\u005b``: JSON's escapes, so that printed JSON stays
JSON (where no line can start with ``::``). The text stays readable; no command and no escape sequence survives.
:func:`without_controls` does only the first part, for text whose lines are encoded by its own
format (an annotation's data, where a newline is ``%0A``).
"""

from __future__ import annotations

import re

# Tab and newline are kept: they are what makes a multi-line message readable. Everything else
# below 0x20, DEL and C1 (0x80-0x9f, NEL among them), and the format characters that reorder text
# (bidi embeddings, overrides and isolates: "Trojan Source") or break lines (U+2028, U+2029);
# and lone surrogates (U+D800-DFFF, from a JSON "\\ud800" escape): no UTF-8 writer can encode them.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                      "\ud800-\udfff]")
# A workflow command: "::" first on a line after any whitespace (the runner trims it, Unicode
# spaces included); and the old "##[" form, read anywhere in a line.
_COMMAND = re.compile(r"^([^\S\n]*)::", re.MULTILINE)
_OLD_COMMAND = re.compile(r"##\[")


def escaped_character(char: str) -> str:
    """How a control character is shown: ``\\uNNNN``, JSON's spelling, not Python's \\xNN (printed
    JSON stays JSON, and decodes to the original)."""
    return f"\\u{ord(char):04x}"


def _escaped(match: re.Match[str]) -> str:
    return escaped_character(match.group())


def control_characters(text: str, keep: str = "\t\n") -> set[str]:
    """The distinct characters of ``text`` that :func:`without_controls` would escape."""
    return set(_CONTROL.findall(text)) - set(keep)


def without_controls(text: str, keep: str = "\t\n") -> str:
    """``text`` with every control character but those in ``keep`` shown as ``\\uNNNN``."""
    if not text:
        return text
    return _CONTROL.sub(lambda m: m.group() if m.group() in keep else _escaped(m), text)


def printable(text: str) -> str:
    """``text`` safe to print in a terminal or a CI log: control characters escaped (tab and
    newline kept) and no line able to start a workflow command. Idempotent."""
    if not text:
        return text
    text = without_controls(text)
    text = _COMMAND.sub(lambda m: m.group(1) + "\\::", text)
    return _OLD_COMMAND.sub(r"##\\u005b", text)
