"""A tiny stand-in for vLLM's OpenAI-compatible server on loopback, for the server backend's
pre-run checks only (a refused key, another model, no logprobs). Never used for a replay: drift
is measured on the real server.

Modes: ``ok`` (answers like vLLM, one token with logprobs), ``other-model`` (serves another
model name), ``no-logprobs`` (answers completions without logprobs or token ids). With ``key``
set, every ``/v1`` request without ``Authorization: Bearer <key>`` gets 401.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeOpenAIServer:
    def __init__(self, model: str, *, mode: str = "ok", key: str | None = None):
        self.model, self.mode, self.key = model, mode, key
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                outer.requests.append((self.command, self.path, dict(self.headers)))
                if outer.key is None or not self.path.startswith("/v1"):
                    return True
                if self.headers.get("Authorization") == f"Bearer {outer.key}":
                    return True
                self._send(401, {"error": {"message": "Unauthorized"}})
                return False

            def do_GET(self) -> None:  # noqa: N802
                if not self._authorized():
                    return
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/version":
                    self._send(200, {"version": "0.0.0-fake"})
                elif self.path == "/v1/models":
                    name = "some-other-model" if outer.mode == "other-model" else outer.model
                    self._send(200, {"object": "list", "data": [{"id": name, "root": name, "max_model_len": 4096}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                if not self._authorized():
                    return
                if self.path != "/v1/completions":
                    self._send(404, {"error": {"message": "not found"}})
                    return
                choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": "length"}
                if outer.mode == "no-logprobs":
                    choice["logprobs"] = None
                else:
                    choice["logprobs"] = {"tokens": ["token_id:5"], "token_logprobs": [-0.1],
                                          "top_logprobs": [{"token_id:5": -0.1}]}
                    choice["prompt_logprobs"] = [None]
                self._send(200, {"object": "text_completion", "choices": [choice]})

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
