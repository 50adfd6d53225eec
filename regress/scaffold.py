"""``regress init``: write a working minimal project for a model directory or a running server.

What a newcomer needs to gate their own model before reading any reference: ``params.yaml`` with
a baseline and one candidate, a starter prompt set with its card, a ``dvc.yaml`` with only the
stages a check needs (golden, replay, score, report: none of the demo's prompt, model and quantize
stages), and the GitHub workflow that runs it. ``dvc repro`` (or ``regress golden`` then
``regress check``) runs in it as written.

- A **model directory**: the baseline runs it with the vLLM regress runs with (``package:
  current``, no environment to build); the candidate is a serving setting (prefix caching off).
  Releases and quantizations are left as commented examples: they need an engine environment.
- A **server URL**: the baseline is that server (``backend: server``, ``package: current``: only
  HTTP requests, no engine environment); the candidate is the same server again (check it after
  an upgrade or redeploy), or ``--candidate-url``. The served model's name is asked of the server
  (``/v1/models``) when not given; its answer is data: one plain name or the command stops.

Nothing is written when any target exists (unless ``force``) or anything is wrong: every file is
composed first, then written.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from regress.errors import ConfigError, InputError
from regress.storage import atomic_write_text

PROMPTS = Path("datasets/prompts/prompts.jsonl")
CARD = PROMPTS.with_suffix(".yaml")
WORKFLOW = Path(".github/workflows/regression.yml")
MODELS_ANSWER_BYTES = 1 << 20
"""The most of a ``/v1/models`` answer read."""
_NAME = re.compile(r"/?[A-Za-z0-9][A-Za-z0-9._/:-]{0,199}")
"""A served model's name as ``/v1/models`` may give it: a hub-style id, or the path vLLM was started
with. Nothing else (no spaces, quotes, newlines, ``..`` segments) is written into params.yaml."""

DVC_YAML = """\
# The regression check as a DVC pipeline (written by `regress init`): `dvc repro` runs it; each
# stage is a regress command, so every step also runs by hand. A threshold change re-runs only
# scoring and the report; a new candidate runs only its own replay and score.
stages:
  golden:
    cmd: regress golden
    deps:
      - datasets/prompts
{model_dep}    params:
      - dataset
      - shard_size
      - baseline
      - noise
    outs:
      - golden
  replay:
    foreach: ${{candidates}}
    do:
      cmd: regress replay ${{key}}
      deps:
        - golden
        - datasets/prompts
      params:
        - baseline
        - candidates.${{key}}
      outs:
        - runs/${{key}}
  score:
    foreach: ${{candidates}}
    do:
      cmd: regress score ${{key}} --no-report
      deps:
        - golden
        - runs/${{key}}
      params:
        - thresholds
      outs:
        - scores/${{key}}/scores.json
        - scores/${{key}}/metrics.json
      metrics:
        - scores/${{key}}/dvc-metrics.json
  report:
    cmd: regress report
    deps:
      - scores
      - runs
      - golden
      - datasets/prompts
    outs:
      - reports
"""

WORKFLOW_YAML = """\
# Regression check on a self-hosted runner (written by `regress init`). Nightly and by hand; never
# on pull requests: code from forks must not run on a self-hosted runner.
name: regression
on:
  schedule:
    - cron: "17 3 * * *"
  workflow_dispatch:
permissions:
  contents: read
jobs:
  check:
    runs-on: [self-hosted, linux]
    timeout-minutes: 240
    env:
      REGRESS_HOME: ${{{{ github.workspace }}}}/../regress-cache
    steps:
      - uses: actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2
        with:
          persist-credentials: false
      - name: Install regress and DVC
        # The requirement of regress for this runner (a wheel, a path or a git URL), as a repository variable.
        env:
          REGRESS_REQUIREMENT: ${{{{ vars.REGRESS_REQUIREMENT }}}}
        run: |
          python3 -m venv .venv
          .venv/bin/python -m pip install "${{REGRESS_REQUIREMENT:-regress[pipeline]}}"
          echo "$PWD/.venv/bin" >> "$GITHUB_PATH"
      - name: Run the check
        run: dvc repro
      - name: Job summary
        if: always()
        run: |
          for summary in reports/*/summary.md; do
            [ -f "$summary" ] && cat "$summary" >> "$GITHUB_STEP_SUMMARY"
          done
      - name: Gate on the verdicts
        run: regress gate --annotate
"""


@dataclass(frozen=True)
class Scaffold:
    """The files of a new project, relative to its directory, and what to say after writing them."""

    files: dict[Path, str]
    next_steps: list[str]


def _has_chat_template(model_dir: Path) -> bool:
    for name in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        if name != "tokenizer_config.json":
            return True
        try:
            return bool(json.loads(path.read_text(encoding="utf-8")).get("chat_template"))
        except (OSError, ValueError, AttributeError):
            return False
    return False


def _starter_prompts(chat: bool) -> tuple[str, str]:
    """The starter set's lines (chat prompts left out for a model without a chat template) and card."""
    data = resources.files("regress") / "data" / "scaffold"
    lines = [line for line in (data / "starter.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    if not chat:
        lines = [line for line in lines if '"messages"' not in line]
    return "\n".join(lines) + "\n", (data / "starter.yaml").read_text(encoding="utf-8")


def _shown_path(path: Path, directory: Path) -> str:
    """``path`` relative to the project when inside it (the project moves with it), else absolute."""
    path = path.resolve()
    try:
        return path.relative_to(directory.resolve()).as_posix()
    except ValueError:
        return str(path)


def _params_text(header: str, params: dict) -> str:
    return header + yaml.safe_dump(params, sort_keys=False, allow_unicode=True)


def model_scaffold(directory: Path, model: Path) -> Scaffold:
    """A project checking ``model`` (a local model directory) on this machine's vLLM."""
    if not (model / "config.json").is_file():
        raise InputError(f"{model}: not a model directory (no config.json); pass the directory of a Hugging Face "
                         "checkpoint, or --url for a running server")
    chat = _has_chat_template(model)
    prompts, card = _starter_prompts(chat)
    shown = _shown_path(model, directory)
    params = {
        "dataset": PROMPTS.as_posix(),
        "shard_size": 16,
        "baseline": {"name": "baseline", "package": "current", "model": shown, "dtype": "bfloat16",
                     "engine_args": {"enforce_eager": True, "max_model_len": 4096},
                     "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        "candidates": {"prefix-cache-off": {"engine_args": {"enable_prefix_caching": False}}},
        "thresholds": {"max_regressions": 0},
        "noise": {"arms": ["batch"], "k": 2, "quantile": 0.95},
    }
    header = (
        "# regress parameters (written by `regress init`; also DVC's params file). Candidates list only how\n"
        "# they differ from the baseline. More candidates, e.g.:\n"
        "#   next:   {package: vllm==0.34.0}                  # an engine release: its own cached environment\n"
        "#   fp8-kv: {engine_args: {kv_cache_dtype: fp8}}     # a change made on purpose: quality gates it\n"
        "#   awq:    {model: path/to/awq-checkpoint, quantization: awq}\n"
        "# VLLM_CPU_KVCACHE_SPACE applies to vLLM for CPUs (GiB of KV cache); drop it on GPUs.\n")
    model_dep = f"      - {shown}\n" if not Path(shown).is_absolute() else ""
    files = {Path("params.yaml"): _params_text(header, params), PROMPTS: prompts, CARD: card,
             Path("dvc.yaml"): DVC_YAML.format(model_dep=model_dep), WORKFLOW: WORKFLOW_YAML.format()}
    return Scaffold(files, ["dvc repro                # golden, replay, score, report",
                            "regress gate             # the verdicts; exit 1 when one fails",
                            "open reports/index.html"])


def served_model_name(url: str, api_key_env: str | None) -> str:
    """The one model a server serves, by its own ``/v1/models`` (one plain name, or an error)."""
    import os

    from regress.backends.server_http import ServerClient
    from regress.errors import ServerHTTPError, ServerReplyError

    key = os.environ.get(api_key_env) if api_key_env else None

    async def ask(client: ServerClient) -> object:
        return await client.json("/v1/models", limit=MODELS_ANSWER_BYTES, timeout_s=30.0)

    try:
        answer = ServerClient(url, api_key=key, timeout_s=30.0).run(ask)
    except (ServerHTTPError, ServerReplyError, OSError) as exc:
        raise InputError(f"{url}: cannot ask the server which model it serves ({exc}); pass --model NAME") from exc
    data = answer.get("data") if isinstance(answer, dict) else None
    names = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    names = [n for n in names if isinstance(n, str)]
    if len(names) != 1 or not _NAME.fullmatch(names[0]) or ".." in names[0].split("/"):
        raise InputError(f"{url}: the server's /v1/models does not name exactly one plain model "
                         f"({len(names)} named); pass --model NAME")
    return names[0]


def server_scaffold(directory: Path, url: str, *, model: str | None, tokenizer: Path | None,
                    api_key_env: str | None, candidate_url: str | None) -> Scaffold:
    """A project checking the server at ``url``: HTTP requests only, no engine environment."""
    from pydantic import ValidationError

    from regress.records.candidate import ServerSettings

    try:
        ServerSettings(url=url, api_key_env=api_key_env)
        if candidate_url:
            ServerSettings(url=candidate_url, api_key_env=api_key_env)
    except ValidationError as exc:
        raise ConfigError(exc.errors()[0]["msg"].removeprefix("Value error, "), field="--url") from None
    name = model or served_model_name(url, api_key_env)
    local = Path(name)
    chat = _has_chat_template(tokenizer or local) if (tokenizer or local.is_dir()) else True
    prompts, card = _starter_prompts(chat)
    server: dict = {"url": url, **({"api_key_env": api_key_env} if api_key_env else {})}
    baseline: dict = {"name": "served", "package": "current", "backend": "server", "model": name, "server": server}
    if tokenizer is not None:
        baseline["tokenizer"] = _shown_path(tokenizer, directory)
    candidate = {"server": {**server, "url": candidate_url}} if candidate_url else {}
    params = {"dataset": PROMPTS.as_posix(), "shard_size": 16, "baseline": baseline,
              "candidates": {"candidate" if candidate_url else "served-again": candidate},
              "thresholds": {"max_regressions": 0}}
    header = ("# regress parameters (written by `regress init --url`): the baseline is the running server, its\n"
              "# golden recorded now; the candidate is " + ("the server at --candidate-url" if candidate_url else
              "the same server later (after an upgrade or a redeploy)") + ".\n"
              "# `package: current`: regress only sends HTTP requests, no engine environment is built.\n")
    files = {Path("params.yaml"): _params_text(header, params), PROMPTS: prompts, CARD: card,
             Path("dvc.yaml"): DVC_YAML.format(model_dep=""), WORKFLOW: WORKFLOW_YAML.format()}
    steps = ["regress golden           # record the server's outputs now",
             f"regress check {next(iter(params['candidates']))}" + ("" if candidate_url else
             "   # after the upgrade: exit 1 when outputs regressed"),
             "open reports/index.html"]
    return Scaffold(files, steps)


def write_scaffold(directory: Path, scaffold: Scaffold, *, force: bool = False) -> list[Path]:
    """Write every file of ``scaffold`` under ``directory``; refuse (nothing written) when one exists."""
    existing = [directory / rel for rel in scaffold.files if (directory / rel).exists()]
    if existing and not force:
        raise ConfigError(f"exists ({len(existing)} of the files `regress init` writes do); "
                          "--force overwrites them", file=existing[0])
    written = []
    for rel, text in scaffold.files.items():
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, text)
        written.append(target)
    return written


def dvc_init(directory: Path) -> str | None:
    """``dvc init`` in ``directory`` when it is not a DVC project yet (``--no-scm`` outside git);
    what was done, or None when nothing was needed or DVC is not installed."""
    if (directory / ".dvc").exists():
        return None
    # Beside this interpreter first: a virtual environment's tools need not be on PATH.
    beside = Path(sys.executable).parent / "dvc"
    dvc = str(beside) if beside.is_file() else shutil.which("dvc")
    if dvc is None:
        return "DVC is not installed: `pip install dvc`, then `dvc init` here (or run the stages by hand)"
    in_git = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=directory, capture_output=True,
                            text=True).returncode == 0 if shutil.which("git") else False
    result = subprocess.run([dvc, "init", *([] if in_git else ["--no-scm"]), "-q"], cwd=directory,
                            capture_output=True, text=True)
    if result.returncode != 0:
        return f"`dvc init` failed ({result.stderr.strip()[:200]}): run it yourself"
    return "initialised DVC" + ("" if in_git else " (--no-scm: not in a git repository)")
