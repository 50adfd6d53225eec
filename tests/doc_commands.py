"""The new-release commands the documentation gives, extracted from where users copy them, so
the tests run them exactly as written:

- README.md: the ``dvc exp run ...`` line of its fenced ``bash`` block ("Checking a new release
  is one command");
- .github/workflows/regression.yml: the ``run:`` script of the step that calls ``dvc exp run``
  (its input check takes the package and version from the environment: DISPATCH_PACKAGE,
  DISPATCH_VERSION, and hands the validated requirement to the step as REQUIREMENT);
- docs/watch.md: the example ``watch.check_command``.

``run_readme_command`` and ``run_workflow_command`` run them in a DVC project with another
engine release substituted for the documented one, as a user (or the runner) would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
WORKFLOW = REPO / ".github" / "workflows" / "regression.yml"
WATCH_DOC = REPO / "docs" / "watch.md"

# An engine requirement as the README spells its example (``vllm==0.34.0``), quotes excluded.
_REQUIREMENT = re.compile(r"vllm(?:-cpu)?==[0-9][0-9A-Za-z.+!]*")


def _fenced_blocks(text: str, language: str) -> list[str]:
    """The bodies of the ```<language> fenced blocks of a Markdown text (indented ones too)."""
    blocks = re.findall(rf"^[ \t]*```{language}[ \t]*\n(.*?)^[ \t]*```", text, flags=re.M | re.S)
    return [textwrap.dedent(block) for block in blocks]


def _the_one(found: list, what: str) -> str:
    if len(found) != 1:
        raise AssertionError(f"expected exactly one {what}, found {len(found)}: {found!r}")
    return found[0]


def readme_command() -> str:
    """README.md's new-release command: the ``dvc exp run`` line of its bash blocks."""
    lines = [line.strip() for block in _fenced_blocks(README.read_text(encoding="utf-8"), "bash")
             for line in block.splitlines() if line.strip().startswith("dvc exp run")]
    return _the_one(lines, "`dvc exp run` line in README.md's bash blocks")


def workflow_step() -> dict:
    """The step of regression.yml's jobs whose ``run:`` script calls ``dvc exp run``."""
    data = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    steps = [step for job in data["jobs"].values() for step in job.get("steps", [])
             if "dvc exp run" in str(step.get("run", ""))]
    return _the_one(steps, "step running `dvc exp run` in regression.yml")


def workflow_script() -> str:
    """The whole ``run:`` script of that step (input validation included)."""
    return workflow_step()["run"]


def workflow_command() -> str:
    """The ``dvc exp run`` line of that script."""
    lines = [line.strip() for line in workflow_script().splitlines() if line.strip().startswith("dvc exp run")]
    return _the_one(lines, "`dvc exp run` line in regression.yml's step")


def watch_check_command() -> list[str]:
    """docs/watch.md's example ``watch.check_command`` (the one that runs ``dvc exp run``)."""
    found = []
    for block in _fenced_blocks(WATCH_DOC.read_text(encoding="utf-8"), "yaml"):
        data = yaml.safe_load(block)
        command = (data.get("watch") or {}).get("check_command") if isinstance(data, dict) else None
        if command and "dvc exp run" in " ".join(command):
            found.append(command)
    return _the_one(found, "check_command running `dvc exp run` in docs/watch.md")


def readme_command_for(package: str, version: str) -> str:
    """README.md's command with ``package==version`` in place of its example requirement."""
    command = readme_command()
    matches = list(_REQUIREMENT.finditer(command))
    match = _the_one(matches, f"engine requirement in README.md's command {command!r}")
    return command[:match.start()] + f"{package}=={version}" + command[match.end():]


def command_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with the test interpreter's bin directory (dvc, regress) first on PATH,
    as the workflow's install step puts .venv/bin on GITHUB_PATH."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", **(extra or {})}


def run_readme_command(cwd: Path, package: str, version: str, *, env: dict[str, str] | None = None,
                       timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run README.md's command (its block is bash) for ``package==version`` in ``cwd``."""
    return subprocess.run(["bash", "-c", readme_command_for(package, version)], cwd=cwd, env=command_env(env),
                          capture_output=True, text=True, timeout=timeout)


def validation_step() -> dict:
    """The step of regression.yml that checks the dispatch inputs (id ``inputs``)."""
    data = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    steps = [step for job in data["jobs"].values() for step in job.get("steps", []) if step.get("id") == "inputs"]
    return _the_one(steps, "step with id 'inputs' in regression.yml")


def run_workflow_command(cwd: Path, package: str, version: str, *, env: dict[str, str] | None = None,
                         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run regression.yml's two steps as the runner does (``shell: bash``): the input check with
    only what the workflow takes from its inputs (DISPATCH_PACKAGE, DISPATCH_VERSION), then the
    ``dvc exp run`` step with the check's output where the workflow maps it (REQUIREMENT)."""
    check, step = validation_step(), workflow_step()
    assert step.get("shell", "bash") == "bash" and check.get("shell", "bash") == "bash"
    assert step["env"]["REQUIREMENT"] == "${{ steps.inputs.outputs.requirement }}", step["env"]
    inputs = {"DISPATCH_PACKAGE": package, "DISPATCH_VERSION": version}
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "github_output"
        output.write_text("")
        checked = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", check["run"]], cwd=cwd,
                                 env=command_env({**(env or {}), **inputs, "GITHUB_OUTPUT": str(output)}),
                                 capture_output=True, text=True, timeout=timeout)
        if checked.returncode != 0:
            return checked
        outputs = dict(line.split("=", 1) for line in output.read_text().splitlines() if "=" in line)
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=cwd,
                          env=command_env({**(env or {}), "REQUIREMENT": outputs.get("requirement", "")}),
                          capture_output=True, text=True, timeout=timeout)


def readme_section_commands(heading: str) -> list[str]:
    """The commands of the first ``bash`` block under README.md's ``## <heading>``, as a user copies
    them: one per line, the trailing ``# comment`` dropped."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    block = _fenced_blocks(text[start:end if end != -1 else None], "bash")[0]
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines() if line.strip()]
