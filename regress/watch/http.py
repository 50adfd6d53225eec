"""One JSON POST with a timeout (webhooks, GitHub's API): the only HTTP the watcher sends."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from regress.errors import PostError


@dataclass(frozen=True)
class Answer:
    """What the server said."""

    status: int
    body: str


def post_json(url: str, payload: Any, *, headers: dict[str, str] | None = None, timeout_s: float = 30) -> Answer:
    """POST ``payload`` as JSON; raise :class:`PostError` unless the answer is 2xx."""
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode("utf-8"), method="POST",
        headers={"Content-Type": "application/json", "User-Agent": "regress-watch", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return Answer(answer.status, answer.read(65536).decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        body = exc.read(2000).decode("utf-8", "replace") if exc.fp else ""
        raise PostError(f"HTTP {exc.code} {exc.reason}", exc.code, body) from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise PostError(f"unreachable ({getattr(exc, 'reason', exc)})") from exc
