"""The webhook: a JSON POST when a check finds a regression (or after every check).

The payload carries a one-line ``text`` too, so a chat webhook that shows ``text`` (Slack,
Mattermost) needs no adapter. A webhook that cannot be reached costs a warning, never the
verdict: the state is recorded before the POST. A webhook that answers with a redirect has not
received the verdict (a POST is never redirected, :mod:`regress.watch.http`): a warning too.
The URL is a secret as a whole (its path is the credential): messages show its origin only,
and ``REGRESS_WEBHOOK_URL`` (or ``_FILE``) keeps it off the command line.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict

from regress.redact import origin
from regress.watch.http import DEFAULT_DEADLINE_S, PostError, post_json
from regress.watch.state import VersionRecord

logger = logging.getLogger("regress.watch")
WEBHOOK_FORMAT_VERSION = 1


class WebhookPayload(BaseModel):
    """The JSON the webhook receives."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = WEBHOOK_FORMAT_VERSION
    """Payload format version."""
    event: Literal["regression", "check"]
    """``regression``: the check failed; ``check``: it passed (sent with ``notify: always``)."""
    package: str
    """Engine package (``vllm``)."""
    version: str
    """The release that was checked."""
    candidate: str | None
    """Candidate name of the check (its scores and report directories)."""
    verdict: Literal["pass", "fail"]
    """The check's verdict."""
    report: str | None
    """The report page."""
    regressions: int | None
    """Prompts classed as regression."""
    prompts: int | None
    """Prompts scored."""
    trigger: str | None
    """Which trigger ran the check."""
    time: str
    """When the verdict was recorded (ISO 8601, UTC)."""
    text: str
    """One line for humans (chat webhooks show it)."""


def payload_for(record: VersionRecord) -> WebhookPayload:
    verdict = "fail" if record.status == "fail" else "pass"
    counted = f" ({record.regressions} of {record.prompts} prompts regressed)" if record.regressions is not None else ""
    text = (f"regress: {record.package} {record.version} {'REGRESSED' if verdict == 'fail' else 'passed'}"
            f"{counted}" + (f"; report: {record.report}" if record.report else ""))
    return WebhookPayload(
        event="regression" if verdict == "fail" else "check", package=record.package, version=record.version,
        candidate=record.candidate, verdict=verdict, report=record.report, regressions=record.regressions,
        prompts=record.prompts, trigger=record.trigger, time=record.iso_time, text=text)


class Notifier:
    """Posts verdicts to one webhook."""

    def __init__(self, url: str, *, on: Literal["regression", "always"] = "regression", timeout_s: float = 30,
                 deadline_s: float = DEFAULT_DEADLINE_S):
        self.url = url
        self.on = on
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s

    def wants(self, record: VersionRecord) -> bool:
        if record.status not in ("pass", "fail"):
            return False
        return self.on == "always" or record.status == "fail"

    def send(self, record: VersionRecord) -> str | None:
        """Post ``record`` if it is one to post. Returns a warning when the POST failed."""
        if not self.wants(record):
            return None
        try:
            post_json(self.url, payload_for(record).model_dump(mode="json"), timeout_s=self.timeout_s,
                      deadline_s=self.deadline_s)
        except PostError as exc:
            warning = f"webhook {origin(self.url)}: could not notify about {record.package} {record.version}: {exc}"
            logger.warning(warning)
            return warning
        return None

