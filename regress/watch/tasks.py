"""The watcher on Celery: a periodic tick (beat) and the check of one release (a worker).

- ``regress.watch.tick`` runs one tick with the params file (and command-line overrides) the
  schedule names. With ``trigger: celery`` it sends one ``check_release`` per new version;
  with ``trigger: local`` it runs the checks itself, in the worker.
- ``regress.watch.check_release`` runs the local check of one release (the built-in check,
  or ``check_command``), records the verdict in the shared state (use a Redis state, or a
  state file on storage every worker sees), writes the history line and posts the webhook.
  A redelivered message whose verdict is already recorded is not checked again.

The schedule: :func:`beat_schedule` builds it; ``regress watch --beat`` installs it and runs
beat with its schedule file under ``$REGRESS_HOME/watch/``. ``celery -A regress.worker.app
beat`` installs it too when ``REGRESS_WATCH_PARAMS`` names the params file.
"""

from __future__ import annotations

import os
from typing import Any

from celery.utils.log import get_task_logger

from regress.errors import CheckFailed, RegressError
from regress.worker.app import app

logger = get_task_logger(__name__)

TASK_TICK = "regress.watch.tick"
TASK_CHECK = "regress.watch.check_release"
BEAT_ENTRY = "regress-watch-tick"
PARAMS_VARIABLE = "REGRESS_WATCH_PARAMS"


@app.task(name=TASK_TICK)
def tick(params: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """One tick of the watcher. Errors are logged and returned, never raised: the next tick is
    the retry."""
    from regress.watch.config import load_watch_config
    from regress.watch.triggers import LocalTrigger
    from regress.watch.watcher import build_watcher

    try:
        config = load_watch_config(params, overrides)
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

    req = CheckRequest.model_validate(request)
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
