"""The watcher on Celery: a periodic tick (beat) and the check of one release (a worker).

- ``regress.watch.tick`` runs one tick with the params file (and command-line overrides) the
  schedule names. With ``trigger: celery`` it sends one ``check_release`` per new version;
  with ``trigger: local`` it runs the checks itself, in the worker.
- ``regress.watch.check_release`` runs the local check of one release (the built-in check,
  or ``check_command``), records the verdict in the shared state (use a Redis state, or a
  state file on storage every worker sees), writes the history line and posts the webhook.
  A redelivered message whose verdict is already recorded is not checked again.

Nothing a message says is trusted with code, commands or where verdicts go: a worker runs
watch tasks only for its own params file (``REGRESS_WATCH_PARAMS``, which ``regress worker
--params`` sets), and takes the check command, the state, the webhook and the template from
it. A tick may carry only harmless command-line overrides (:data:`MESSAGE_OVERRIDES`); a check
request whose fields differ from what the worker's own configuration gives for that package and
version is refused (:class:`~regress.errors.MessageRefused`) before anything runs.

The schedule: :func:`beat_schedule` builds it; ``regress watch --beat`` installs it and runs
beat with its schedule file under ``$REGRESS_HOME/watch/``. ``celery -A regress.worker.app
beat`` installs it too when ``REGRESS_WATCH_PARAMS`` names the params file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery.utils.log import get_task_logger

from regress.errors import CheckFailed, MessageRefused, RegressError
from regress.worker.app import TASK_CHECK, TASK_TICK, app

if TYPE_CHECKING:
    from regress.watch.config import WatchConfig
    from regress.watch.triggers import CheckRequest

logger = get_task_logger(__name__)

BEAT_ENTRY = "regress-watch-tick"
PARAMS_VARIABLE = "REGRESS_WATCH_PARAMS"
MESSAGE_OVERRIDES = frozenset({"interval_s", "since", "include_prereleases", "include_yanked", "first_run"})
"""Overrides a tick message may carry (``regress watch --beat`` options): none of them chooses a
command, a state, a webhook, an index or a trigger."""


def _own_params(given: str | None, what: str) -> Path:
    """This worker's params file; :class:`MessageRefused` when it has none or ``given`` is another."""
    own = os.environ.get(PARAMS_VARIABLE)
    if not own:
        raise MessageRefused(f"{what} refused: this worker has no watch configuration ({PARAMS_VARIABLE}, or "
                             "`regress worker --params`); it never takes one from a message")
    path = Path(own).expanduser().resolve()
    if given is not None and Path(str(given)).expanduser().resolve() != path:
        raise MessageRefused(f"{what} refused: the message names params {given!r}, this worker's is {path}")
    return path


def trusted_request(req: "CheckRequest", config: "WatchConfig") -> "CheckRequest":
    """The check request this worker's own configuration gives for ``req``'s package and version;
    :class:`MessageRefused` naming the first field where the message differs."""
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    from regress.watch.state import open_state
    from regress.watch.triggers import CheckRequest, wire_form
    from regress.watch.watcher import candidate_name, requirement_for

    what = f"check of {req.package} {req.version}"
    if canonicalize_name(req.package) != req.package or req.package not in config.packages:
        raise MessageRefused(f"{what} refused: package {req.package!r} is not watched by this worker "
                             f"({', '.join(config.packages)})")
    try:
        Version(req.version)
    except InvalidVersion:
        raise MessageRefused(f"{what} refused: {req.version!r} is not a version") from None
    settings = config.settings
    state = open_state(settings.state)
    try:
        state_spec = state.spec()
    finally:
        state.close()
    own = CheckRequest(
        package=req.package, version=req.version,
        requirement=requirement_for(req.package, req.version, config.template_requirement),
        candidate=candidate_name(req.package, req.version), template=settings.template,
        params=str(config.params_path), state=state_spec, webhook=settings.webhook, notify=settings.notify,
        check_command=settings.check_command, timeout_s=settings.timeout_s, check_timeout_s=settings.check_timeout_s)
    # Messages carry the state URL and webhook in their wire form (no password, no webhook
    # path): compare like with like, then use this worker's own values.
    wire = wire_form(own)
    for field in CheckRequest.model_fields:
        if getattr(req, field) != getattr(wire, field):
            raise MessageRefused(f"{what} refused: field '{field}' differs from this worker's configuration "
                                 f"({config.params_path}); a message never chooses it")
    return own


@app.task(name=TASK_TICK)
def tick(params: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """One tick of the watcher. Errors are logged and returned, never raised: the next tick is
    the retry."""
    from regress.watch.config import load_watch_config
    from regress.watch.triggers import LocalTrigger
    from regress.watch.watcher import build_watcher

    extra = sorted(set(overrides or {}) - MESSAGE_OVERRIDES)
    if extra:
        raise MessageRefused(f"watch tick refused: a message may not override {', '.join(extra)}")
    own = _own_params(params, "watch tick")
    try:
        config = load_watch_config(own, overrides)
        # A check run inside this worker replays its shards here too: sending them to the queue
        # would leave them waiting for the one worker that is busy waiting for them.
        local = LocalTrigger(use_params_executor=False) if config.settings.trigger == "local" else None
        watcher = build_watcher(config, trigger=local)
        result = watcher.tick()
    except RegressError as exc:
        logger.error("watch tick: %s", exc)
        return {"error": str(exc), "exit_code": exc.exit_code}
    for warning in result.warnings:
        logger.warning("watch tick: %s", warning)
    for error in result.errors():
        logger.error("watch tick: %s", error)
    for package in result.packages:
        for outcome in package.outcomes:
            logger.info("watch tick: %s %s: %s", package.package, outcome.version, outcome.status)
    return result.summary()


@app.task(name=TASK_CHECK)
def check_release(request: dict[str, Any]) -> dict[str, Any]:
    """Check one release here and record its verdict."""
    from regress.watch.state import FINISHED, VersionRecord, open_state
    from regress.watch.triggers import CheckRequest, LocalTrigger
    from regress.watch.watcher import finish_check, notifier_for

    from pydantic import ValidationError

    from regress.watch.config import load_watch_config

    try:
        req = CheckRequest.model_validate(request)
    except ValidationError as exc:
        raise MessageRefused(f"check request refused: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None
    own = _own_params(req.params, f"check of {req.package} {req.version}")
    try:
        config = load_watch_config(own)
    except RegressError as exc:
        raise CheckFailed(f"{req.requirement}: this worker's watch configuration: {exc}") from None
    req = trusted_request(req, config)
    state = open_state(req.state)
    try:
        current = state.get(req.package, req.version)
        if current is not None and current.status in FINISHED:
            logger.info("%s %s already has a verdict (%s): not checked again", req.package, req.version, current.status)
            return {"package": req.package, "version": req.version, "status": current.status, "repeated": True}
        try:
            outcome = LocalTrigger(use_params_executor=False).start(req)
        except RegressError as exc:
            state.release(req.package, req.version)
            raise CheckFailed(f"{req.requirement}: {exc} (released: the next tick retries it)") from None
        record = VersionRecord(package=req.package, version=req.version, status=outcome.status,
                               candidate=req.candidate, trigger="celery", report=outcome.report,
                               regressions=outcome.regressions, prompts=outcome.prompts, detail=outcome.detail)
        # ``None`` when the state has no entry (it was not shared with the watcher): record anyway.
        expected = None if current is None else frozenset({"claimed", "queued"})
        recorded, warning = finish_check(state, record, notifier_for(req.webhook, req.notify, req.timeout_s), expected)
        if warning:
            logger.warning(warning)
        return {"package": req.package, "version": req.version, "status": outcome.status,
                "report": outcome.report, "recorded": recorded}
    finally:
        state.close()


def beat_schedule(interval_s: float, params: str, *, overrides: dict[str, Any] | None = None,
                  queue: str | None = None) -> dict[str, Any]:
    """The beat schedule: one tick every ``interval_s`` seconds for ``params``.

    A tick expires after one interval: ticks that piled up while no worker listened are
    dropped, not run back to back (the next one does the same work).
    """
    options: dict[str, Any] = {"expires": interval_s}
    if queue:
        options["queue"] = queue
    return {BEAT_ENTRY: {"task": TASK_TICK, "schedule": float(interval_s),
                         "kwargs": {"params": str(params), "overrides": overrides or {}},
                         "options": options}}


def install_beat_schedule(celery_app: Any, params: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Validate the watch configuration and put its tick into ``celery_app``'s beat schedule."""
    from regress.watch.config import load_watch_config

    config = load_watch_config(params, overrides)
    queue = config.settings.queue or config.params.celery.with_environment().queue
    schedule = beat_schedule(config.settings.interval_s, str(config.params_path), overrides=overrides, queue=queue)
    celery_app.conf.beat_schedule = {**(celery_app.conf.beat_schedule or {}), **schedule}
    return schedule


def _install_from_environment() -> None:
    params = os.environ.get(PARAMS_VARIABLE)
    if not params:
        return
    try:
        install_beat_schedule(app, params)
    except RegressError as exc:
        logger.error("%s=%s: no watch schedule: %s", PARAMS_VARIABLE, params, exc)


# Beat imports this module (the app's ``include``) before it reads the schedule.
_install_from_environment()
