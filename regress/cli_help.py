"""How ``--help`` names what an option takes.

Typer 0.29's rich help prints each parameter's Python type as its value column: ``<bool>`` beside
every flag (a flag takes no value), ``<list[Path]>``, ``<int range> [x>=1]``. Users read those as
something to type. :func:`install` replaces that column with what the command line takes: nothing
for a flag, ``PATH``, ``INT``, ``TEXT...`` for a repeatable value, ``[a|b]`` for a choice, and a
range in words (``INT, at least 1``). Only the help text changes; parsing is Typer's.

In its "rich" markup mode Typer also keeps a docstring's single line breaks in the command list
of a group's help, so a summary wrapped at 100 columns in the source came out as ragged lines
between the panel's borders; :func:`install` joins them (paragraphs stay paragraphs).
"""

from __future__ import annotations

import re
from typing import Any

_NAMES = {"str": "TEXT", "Path": "PATH", "path": "PATH", "file": "FILE", "directory": "DIR", "int": "INT",
          "float": "FLOAT", "bool": "BOOL", "datetime": "DATETIME", "int range": "INT", "float range": "FLOAT"}


def _shown(label: str) -> str:
    inner = label[1:-1] if label.startswith("<") and label.endswith(">") else label
    listed = re.fullmatch(r"list\[(.*)\]", inner)
    if listed:
        return _shown(f"<{listed.group(1)}>") + "..."
    if "|" in inner:
        return f"[{inner}]"
    return _NAMES.get(inner, inner.upper())


def _range_words(low: Any, high: Any) -> str | None:
    if low is None and high is None:
        return None
    if high is None:
        return f"at least {low}"
    if low is None:
        return f"at most {high}"
    return f"{low} to {high}"


def install() -> None:
    """Patch Typer's parameter classes so that the help shows the value a user types (once)."""
    from typer import core, rich_utils

    if getattr(core, "_regress_help", False):
        return
    option_type, argument_type = core.TyperOption.display_type_rich, core.TyperArgument.display_type_rich

    def option_display(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False) or getattr(self, "count", False):
            return None
        shown = option_type(self, ctx)
        return None if shown is None else _shown(shown.removesuffix("...")) + ("..." if shown.endswith("...") else "")

    def argument_display(self: Any, ctx: Any) -> str | None:
        shown = argument_type(self, ctx)
        return None if shown is None else _shown(shown.removesuffix("..."))

    command_help = rich_utils._make_command_help

    def reflowed_command_help(*, help_text: str, markup_mode: Any) -> Any:
        first, _, rest = help_text.strip().partition("\n\n")
        if not first.startswith("\b"):  # Click's "do not rewrap" marker keeps its line breaks
            first = " ".join(first.split())
        return command_help(help_text=first + ("\n\n" + rest if rest else ""), markup_mode=markup_mode)

    rich_utils._make_command_help = reflowed_command_help
    core.TyperOption.display_type_rich = option_display
    core.TyperArgument.display_type_rich = argument_display
    for cls in (core.TyperOption, core.TyperArgument):
        cls._get_number_range_help_str = lambda self: _range_words(getattr(self, "min", None), getattr(self, "max", None))
    rich_utils.RANGE_STRING = ", {}"
    core._regress_help = True
