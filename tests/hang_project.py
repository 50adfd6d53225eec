"""A small project on the hanging echo backend (tests/plugins/hanging.py), with its golden.

For the tests of the phase deadlines and the project lock: commands on it start in seconds,
and a candidate that hangs at a chosen step holds a real `regress` process where it hangs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from conftest import REPO, run_cli

TESTS = str(REPO / "tests")
BACKEND = "plugins.hanging:HangingBackend"
NO_SEMANTIC = ["exact_tokens", "divergence_point", "prefix_logprobs", "teacher_forced", "surface"]
"""Metrics that need no embedding model (seconds, not a model load)."""

HANGS = {"hang-load": "load", "hang-generate": "generate", "hang-tf": "teacher_force"}
"""Candidates that hang, by where."""


def write_project(root: Path, *, prompts: int = 6, shard_size: int = 4, thresholds: dict[str, Any] | None = None,
                  extra: dict[str, Any] | None = None, name: str = "params.yaml") -> Path:
    """params.yaml (or ``name``) and a prompt set in ``root``: the echo backend as baseline, a
    candidate per entry of :data:`HANGS`, and ``same`` (the baseline again)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt number {i}"}) + "\n"
                                          for i in range(prompts)))
    data: dict[str, Any] = {
        "dataset": "p.jsonl", "shard_size": shard_size,
        "baseline": {"backend": BACKEND, "model": "none", "env": {"PYTHONPATH": TESTS}},
        "candidates": {"same": {}, **{name: {"env": {"FAKE_HANG_IN": step}} for name, step in HANGS.items()}},
        "thresholds": {"metrics": NO_SEMANTIC, **(thresholds or {})},
        **(extra or {}),
    }
    path = root / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def with_golden(root: Path, env: dict[str, str] | None = None) -> Path:
    """The project's golden, made by the real `regress golden`."""
    result = run_cli("golden", cwd=root, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return root


def wait_for_file(path: Path, timeout_s: float = 120, proc: Any = None) -> str:
    """The contents of ``path`` once it exists (a hanging plugin writes its pid there)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the command exited {proc.returncode} before {path} appeared:\n"
                                 f"{proc.stderr.read()[-3000:] if proc.stderr else ''}")
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear within {timeout_s} s")


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_alive(pid):
            return True
        time.sleep(0.05)
    return False


def leftovers(root: Path) -> list[str]:
    """Temporary files of unfinished atomic writes under ``root`` (there must be none)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))


def pids_with(variable: str, value: str) -> list[int]:
    """Live processes (other than this one) whose environment sets ``variable`` to ``value``: the
    processes a command started for one test, found whether or not they got far enough to say."""
    import os

    wanted = f"{variable}={value}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in environ and is_alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def wait_none_with(variable: str, value: str, timeout_s: float = 10) -> list[int]:
    """:func:`pids_with` once it is empty, or what is still there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = pids_with(variable, value)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
