"""Read and validate prompt sets.

A prompt set is ``datasets/prompts/<name>.jsonl`` (one :class:`~regress.records.PromptRecord`
per line) with an optional card ``<name>.yaml`` beside it holding a description and the
dataset-level sampling defaults. Every problem is reported with file, line and field.
"""

from __future__ import annotations

import dataclasses

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from regress.errors import DatasetError, DuplicateKeyError, InputError
from regress.records import DatasetCard, DatasetRef, PromptRecord
from regress.records.prompts import FIELD_PROBLEM
from regress.validation import (all_errors, load_yaml, utf8_error_line, value_problems, yaml_error_field,
                                yaml_error_line, yaml_key_lines)

MAX_REPORTED_PROBLEMS = 50
DEMO_PROMPTS = Path(__file__).parent / "data" / "prompts" / "demo.jsonl"
"""The demo prompt set for a real instruct model (questions with checkable answers, multi-turn
chats, code, Chinese, format instructions, long context): the main job's data."""
FIXTURE_PROMPTS = Path(__file__).parent / "data" / "prompts" / "fixture.jsonl"
"""The prompt set written for the fixture model (its corpus' domains): the fast tests' data."""


@dataclass(frozen=True)
class PromptSet:
    """A validated prompt set."""

    name: str
    path: Path
    sha256: str
    card: DatasetCard
    prompts: list[PromptRecord]
    card_path: Path | None = None
    lines: dict[str, int] = field(default_factory=dict, compare=False)
    """Each prompt's line in the file (from 1), for messages and CI annotations that point at it."""
    _by_id: dict[str, PromptRecord] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_id.update({p.id: p for p in self.prompts})

    def __len__(self) -> int:
        return len(self.prompts)

    def get(self, prompt_id: str) -> PromptRecord:
        """The prompt with this id."""
        return self._by_id[prompt_id]

    def subset(self, tags: list[str] | None = None, limit: int | None = None) -> "PromptSet":
        """The prompts with any of ``tags`` (all when None), the first ``limit`` of them: the same
        version of the set (its sha256 stays, each prompt is the golden's), fewer prompts. An
        unknown tag is an error naming the tags there are."""
        from regress.errors import ConfigError

        wanted = set(tags or [])
        known = {tag for p in self.prompts for tag in p.tags}
        unknown = sorted(wanted - known)
        if unknown:
            raise ConfigError(f"no prompt of {self.path} has the tag '{unknown[0]}' (its tags: "
                              f"{', '.join(sorted(known)) or 'none'})", field="--tags")
        chosen = [p for p in self.prompts if not wanted or wanted & set(p.tags)]
        return dataclasses.replace(self, prompts=chosen[:limit] if limit is not None else chosen, _by_id={})

    def ref(self) -> DatasetRef:
        """What a manifest records about this prompt set."""
        return DatasetRef(name=self.name, path=str(self.path), sha256=self.sha256, prompts=len(self.prompts))


def card_path_for(path: Path) -> Path:
    """Where the card of a prompt set lives: same stem, ``.yaml``."""
    return path.with_suffix(".yaml")


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKeyError(key)
        seen[key] = value
    return seen


def _load_card(path: Path) -> tuple[DatasetCard, bytes, list[DatasetError]]:
    if not os.path.lexists(path):
        return DatasetCard(), b"", []
    if path.is_symlink() and not path.exists():  # dangling: not "no card", its defaults would be lost
        return DatasetCard(), b"", [DatasetError(f"a link to {os.readlink(path)}, which does not exist", file=path)]
    if not path.is_file():
        return DatasetCard(), b"", [DatasetError("not a file (the card beside a prompt set is a YAML file)", file=path)]
    try:
        raw = path.read_bytes()
    except OSError as exc:  # no permission, a link loop
        return DatasetCard(), b"", [DatasetError(f"cannot read it ({exc.strerror or exc})", file=path)]
    try:
        data = load_yaml(raw.decode("utf-8")) or {}
    except UnicodeDecodeError as exc:
        return DatasetCard(), raw, [DatasetError(f"not valid UTF-8: byte 0x{raw[exc.start]:02x} ({exc.reason})",
                                                 file=path, line=utf8_error_line(raw, exc))]
    except yaml.YAMLError as exc:
        return DatasetCard(), raw, [DatasetError(f"invalid YAML: {getattr(exc, 'problem', exc)}", file=path,
                                                 line=yaml_error_line(exc),
                                                 field=yaml_error_field(exc))]
    if not isinstance(data, dict):
        return DatasetCard(), raw, [DatasetError("must be a mapping with 'description' and 'defaults'", file=path, line=1)]
    lines = yaml_key_lines(raw.decode("utf-8"))
    values = value_problems(data)
    if values:
        return DatasetCard(), raw, [DatasetError(message, file=path, line=_card_line(lines, where), field=where)
                                    for where, message in values]
    try:
        return DatasetCard.model_validate(data), raw, []
    except ValidationError as exc:
        problems = []
        for where, message in all_errors(exc, DatasetCard):
            problems.append(DatasetError(message, file=path, line=lines.get(where or ""), field=where))
        return DatasetCard(), raw, problems


def _card_line(lines: dict[str, int], where: str) -> int | None:
    from regress.validation import line_for

    return line_for(lines, where.split("[", 1)[0])


def check_prompt_set(path: str | Path) -> tuple[PromptSet | None, list[DatasetError]]:
    """Validate a prompt set. Returns the set (None if anything is wrong) and every problem found."""
    path = Path(path)
    if not path.is_file():
        return None, [DatasetError("no such file", file=path)]
    try:
        raw = path.read_bytes()
    except OSError as exc:  # no permission
        return None, [DatasetError(f"cannot read it ({exc.strerror or exc})", file=path)]
    card_file = card_path_for(path)
    card, card_raw, problems = _load_card(card_file)
    prompts: list[PromptRecord] = []
    first_line_of: dict[str, int] = {}
    for number, line_bytes in enumerate(raw.split(b"\n"), start=1):
        if len(problems) >= MAX_REPORTED_PROBLEMS:
            break
        if not line_bytes.strip():
            continue
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(
                DatasetError(f"not valid UTF-8: byte 0x{line_bytes[exc.start]:02x} at column {exc.start + 1}",
                             file=path, line=number)
            )
            continue
        try:
            data = json.loads(line, object_pairs_hook=_reject_duplicate_keys)
        except DuplicateKeyError as exc:
            problems.append(DatasetError("key appears twice in the same object", file=path, line=number, field=exc.key))
            continue
        except json.JSONDecodeError as exc:
            problems.append(DatasetError(f"invalid JSON: {exc.msg} (column {exc.colno})", file=path, line=number))
            continue
        except RecursionError:
            problems.append(DatasetError("invalid JSON: nested too deeply (brackets inside brackets beyond what "
                                         "Python's parser can follow)", file=path, line=number))
            continue
        except ValueError as exc:  # e.g. an integer of more digits than Python converts (4300)
            problems.append(DatasetError(f"invalid JSON: {str(exc).split(';')[0]}", file=path, line=number))
            continue
        if not isinstance(data, dict):
            problems.append(DatasetError(f"each line must be a JSON object, got {type(data).__name__}", file=path, line=number))
            continue
        surrogates = value_problems(data, finite=False)
        if surrogates:
            problems += [DatasetError(message, file=path, line=number, field=where) for where, message in surrogates]
            continue
        try:
            record = PromptRecord.model_validate(data)
        except ValidationError as exc:
            for error, (where, message) in zip(exc.errors(), all_errors(exc, PromptRecord)):
                problems.append(DatasetError(message, file=path, line=number, field=where or _field_of(error)))
            continue
        if record.id in first_line_of:
            problems.append(
                DatasetError(f"duplicate id '{record.id}' (first on line {first_line_of[record.id]})",
                             file=path, line=number, field="id")
            )
            continue
        first_line_of[record.id] = number
        greedy = record.sampling.over(card.defaults).temperature == 0
        if record.samples is not None and record.samples > 1 and greedy:
            problems.append(DatasetError(f"{record.samples} samples at temperature 0 would all be the same output: "
                                         "set sampling.temperature above 0 or drop samples",
                                         file=path, line=number, field="samples"))
            continue
        temperature = record.sampling.over(card.defaults).temperature  # None: the candidate's, checked by the plan
        if (record.choices is not None and record.samples is None and temperature is not None and temperature > 0
                and card.samples is not None and card.samples > 1):
            # The card's samples reach every prompt that samples: this one would run several times.
            problems.append(DatasetError(f"the card's samples: {card.samples} would sample this prompt (its temperature "
                                         "is above 0), and a prompt with 'choices' is not sampled: give it "
                                         "\"samples\": 1 or temperature 0, or drop the card's samples",
                                         file=path, line=number, field="choices"))
            continue
        prompts.append(record)
    if not prompts and not problems:
        problems.append(DatasetError("the prompt set holds no prompts", file=path))
    if problems:
        return None, problems
    digest = hashlib.sha256(raw)
    digest.update(b"\0card\0" + card_raw)
    prompt_set = PromptSet(
        name=path.stem, path=path, sha256=digest.hexdigest(), card=card, prompts=prompts,
        card_path=card_file if card_raw else None, lines=first_line_of,
    )
    return prompt_set, []


def _field_of(error: Any) -> str:
    """The field a cross-field problem names (:data:`~regress.records.prompts.FIELD_PROBLEM`),
    else the input fields: a problem pydantic locates nowhere is about the record as a whole."""
    if error.get("type") == FIELD_PROBLEM:
        return str((error.get("ctx") or {}).get("field"))
    return "prompt|messages"


def write_demo_prompts(out_dir: str | Path, *, which: Path = DEMO_PROMPTS) -> Path:
    """Copy a prompt set shipped with regress (the demo set by default) and its card into
    ``out_dir`` (atomically); returns the .jsonl path."""
    from regress.storage import atomic_write_bytes

    out_dir = Path(out_dir)
    sources = (which, card_path_for(which))
    for target in [out_dir, *(out_dir / source.name for source in sources)]:
        if target.exists() and not (target.is_dir() if target == out_dir else target.is_file()):
            raise InputError(f"{target}: exists and is not a {'directory' if target == out_dir else 'file'}; "
                             "nothing was written")
    try:
        for source in sources:
            atomic_write_bytes(out_dir / source.name, source.read_bytes())
    except OSError as exc:  # under a file, no permission, a full disk
        raise InputError(f"{out_dir}: cannot write the prompt set there ({exc.strerror or exc})") from exc
    return out_dir / which.name


def load_prompt_set(path: str | Path) -> PromptSet:
    """Load a prompt set or raise the first :class:`DatasetError` (noting how many more there are)."""
    prompt_set, problems = check_prompt_set(path)
    if problems:
        first = problems[0]
        if len(problems) > 1:
            more = f" (and {len(problems) - 1} more problem(s); `regress validate {path}` lists them)"
            raise DatasetError(first.message + more, file=first.file, line=first.line, field=first.field)
        raise first
    assert prompt_set is not None
    return prompt_set

