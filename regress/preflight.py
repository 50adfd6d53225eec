"""``regress validate``: check files without running anything, every problem with file, line and field.

A path is a prompt set (``.jsonl``, with its card ``<name>.yaml`` beside it) or a params file
(``.yaml``/``.yml`` holding ``baseline``, ``candidates`` or ``dataset``). A params file is
loaded whole (every problem at once, as every command loads it) and then its prompt set is
planned for the baseline and each candidate, so what only the run would refuse is said now: a
prompt that asks for samples but gets temperature 0 from the candidate, choices that would be
sampled. A prompt set alone says what it cannot know (a sampled prompt whose temperature comes
from the candidate) as a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regress.errors import ConfigError, ConfigProblems, InputError

PARAMS_KEYS = ("baseline", "candidates", "dataset")


@dataclass
class Checked:
    """What checking one path found."""

    path: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: str | None = None
    """The one line said when there is no problem."""
    prompts: int = 0
    """A prompt set's prompts."""


def is_params_file(path: Path) -> bool:
    """A YAML file that is not a mapping, or a mapping with one of params.yaml's top-level keys (a
    prompt set's card has none)."""
    if path.suffix not in (".yaml", ".yml"):
        return False
    from regress.validation import load_yaml

    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except Exception:  # not readable or not YAML: the params loader says so, with the line
        return True
    # An empty file, a list or a scalar is no card either: the params loader says what is wrong.
    return not isinstance(data, dict) or any(key in data for key in PARAMS_KEYS)


def check_path(path: Path) -> Checked:
    """Check a prompt set or a params file."""
    return _check_params(path) if is_params_file(path) else _check_prompt_set(path)


def _check_prompt_set(path: Path) -> Checked:
    from regress.datasets import check_prompt_set

    checked = Checked(path)
    prompt_set, problems = check_prompt_set(path)
    if problems:
        checked.problems = [str(p) for p in problems]
        return checked
    assert prompt_set is not None
    chats = sum(1 for p in prompt_set.prompts if p.messages is not None)
    checked.prompts = len(prompt_set)
    checked.summary = f"{path}: ok, {len(prompt_set)} prompts ({chats} chat), sha256 {prompt_set.sha256[:12]}"
    card_temperature = prompt_set.card.defaults.temperature
    for prompt in prompt_set.prompts:
        samples = prompt.samples if prompt.samples is not None else None
        if samples and samples > 1 and prompt.sampling.temperature is None and card_temperature is None:
            line = prompt_set.lines.get(prompt.id)
            checked.notes.append(
                f"{path}:{line}: field 'samples': prompt '{prompt.id}' asks for {samples} samples and neither it nor the "
                "card sets a temperature: the candidate's decides, and a run refuses samples at temperature 0 "
                "(`regress validate params.yaml` checks it against the candidates)")
    return checked


def _check_params(path: Path) -> Checked:
    from regress.config import load_params

    checked = Checked(path)
    try:
        params = load_params(path)
    except ConfigProblems as exc:
        checked.problems = [str(p) for p in exc.problems]
        return checked
    except InputError as exc:
        checked.problems = [str(exc)]
        return checked
    names = ["baseline", *params.candidates]
    dataset = _check_prompt_set(params.dataset) if params.dataset.exists() else None
    if dataset is None:
        checked.notes.append(f"{path}: field 'dataset': {params.dataset} does not exist yet (a pipeline stage may "
                             "write it); its prompts were not checked against the candidates")
    elif dataset.problems:
        checked.problems += dataset.problems
        return checked
    else:
        checked.problems += _plan_problems(params, params.dataset)
    if not checked.problems:
        checked.summary = (f"{path}: ok, baseline '{params.baseline.name}' and {len(params.candidates)} candidate(s)"
                           + (f" ({', '.join(names[1:])})" if len(names) > 1 else "")
                           + (f"; {dataset.prompts} prompts in {params.dataset}" if dataset else ""))
    return checked


def _plan_problems(params: Any, dataset: Path) -> list[str]:
    """Plan the prompt set for the baseline and every candidate, as a run would, without running."""
    from regress.datasets import load_prompt_set
    from regress.replay.plan import plan_entries

    prompt_set = load_prompt_set(dataset)
    problems = []
    for spec in [params.baseline, *params.candidates.values()]:
        try:
            defaults = _generation_defaults(spec)
            plan_entries(prompt_set, spec, defaults)
        except ConfigError as exc:
            line = None
            pid = _prompt_named(str(exc), prompt_set)
            if pid is not None:
                line = prompt_set.lines.get(pid)
            where = f"{dataset}:{line}" if line else str(dataset)
            problems.append(f"{where}: for candidate '{spec.name}': {exc.message}")
    return problems


def _generation_defaults(spec: Any) -> dict[str, Any]:
    """The candidate's generation_config defaults when its model directory is here; {} otherwise
    (the run reads them; a model not built yet cannot be read now)."""
    from regress.effective import generation_defaults

    try:
        return generation_defaults(spec) or {}
    except Exception:
        return {}


def _prompt_named(message: str, prompt_set: Any) -> str | None:
    import re

    found = re.search(r"prompt '([^']+)'", message)
    return found.group(1) if found and found.group(1) in prompt_set.lines else None
