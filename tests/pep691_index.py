"""A tiny package index for the tests: PEP 691 JSON project pages on 127.0.0.1, a free port.

The test changes what it serves between ticks (``add``, ``answer``), and reads which requests
came in. Plus :class:`Recorder`, a loopback HTTP endpoint that records POSTs (webhooks, the
GitHub API), answering with a chosen status.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from contextlib import contextmanager
from typing import Any, Iterator

JSON_SIMPLE = "application/vnd.pypi.simple.v1+json"


class _Server:
    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self  # type: ignore[attr-defined]
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def start(self) -> "_Server":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _IndexHandler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:  # noqa: N802
        index: LocalIndex = self.server.owner  # type: ignore[attr-defined]
        index.requests.append((self.path, self.headers.get("Accept", "")))
        status, content_type, body = index.download(self.path) or index.page(self.path)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class LocalIndex(_Server):
    """Serves ``/simple/<project>/`` as PEP 691 JSON (api-version 1.1, with PEP 700 versions).

    ``answer`` overrides every page: ``(status, content type, body bytes)`` for malformed
    answers and outages.
    """

    def __init__(self) -> None:
        super().__init__(_IndexHandler)
        self.projects: dict[str, list[dict[str, Any]]] = {}
        self.answer: tuple[int, str, bytes] | None = None
        self.requests: list[tuple[str, str]] = []
        self.files: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/simple"

    def add(self, project: str, version: str, *, yanked: bool | str = False, sdist: bool = False) -> None:
        """Publish one file of ``project`` ``version`` (a wheel, or an sdist)."""
        stem = project.replace("-", "_")
        filename = f"{stem}-{version}.tar.gz" if sdist else f"{stem}-{version}-py3-none-any.whl"
        entry = {"filename": filename, "url": f"../../files/{filename}", "hashes": {"sha256": "0" * 64},
                 "yanked": yanked}
        with self._lock:
            self.projects.setdefault(project, []).append(entry)

    def publish(self, project: str, wheel: Path) -> None:
        """Publish a real file (a wheel built by the test): listed with its sha256 and served
        at ``/files/<name>``, so pip can install it from this index."""
        body = wheel.read_bytes()
        entry = {"filename": wheel.name, "url": f"../../files/{wheel.name}",
                 "hashes": {"sha256": hashlib.sha256(body).hexdigest()}, "yanked": False}
        with self._lock:
            self.files[wheel.name] = body
            self.projects.setdefault(project, []).append(entry)

    def download(self, path: str) -> tuple[int, str, bytes] | None:
        """A published file, or None when ``path`` is not under /files/."""
        if not path.startswith("/files/"):
            return None
        with self._lock:
            body = self.files.get(path.removeprefix("/files/"))
        return (200, "application/octet-stream", body) if body is not None else (404, "text/plain", b"not found")

    def page(self, path: str) -> tuple[int, str, bytes]:
        if self.answer is not None:
            return self.answer
        parts = [p for p in path.split("/") if p]
        with self._lock:
            files = self.projects.get(parts[1]) if len(parts) == 2 and parts[0] == "simple" else None
            if files is None:
                return 404, "text/plain", b"not found"
            versions = sorted({f["filename"].split("-")[1].removesuffix(".tar.gz") for f in files})
            body = {"meta": {"api-version": "1.1"}, "name": parts[1], "files": list(files), "versions": versions}
        return 200, JSON_SIMPLE, json.dumps(body).encode()


class _RecordingHandler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        recorder: Recorder = self.server.owner  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"null")
        with recorder.lock:
            recorder.posts.append({"path": self.path, "headers": dict(self.headers), "body": body})
        self.send_response(recorder.status)
        self.send_header("Content-Length", "0")
        self.end_headers()


class Recorder(_Server):
    """Records every POST (path, headers, JSON body); answers ``status`` (default 204)."""

    def __init__(self, status: int = 204):
        super().__init__(_RecordingHandler)
        self.status = status
        self.posts: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def serving(project: str, *versions: str) -> Iterator[LocalIndex]:
    """A started LocalIndex listing ``versions`` of ``project``; stopped on exit."""
    server = LocalIndex().start()
    for version in versions:
        server.add(project, version)
    try:
        yield server
    finally:
        server.stop()

