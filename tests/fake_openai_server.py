"""A stand-in for vLLM's OpenAI-compatible server on loopback (or a Unix socket), for the server
backend's boundary: its pre-run checks, and answers that are wrong on purpose. Never used to
measure drift: that is the real server's job.

It answers like vLLM, in the wire format regress asks for (``return_tokens_as_token_ids``,
``logprobs``, ``prompt_logprobs``, ``return_token_ids``), streamed or not, for ``/v1/completions``
and ``/v1/chat/completions``, with made-up but well-formed tokens: output token j of a prompt is
``(sum(prompt) + 7 j + 1) % vocab`` (or what ``outputs(prompt, n)`` chooses), ranked first with
logprob -0.1, the others of its top-k after it. Their text is what vLLM's server sends for them:
where ``model`` is a directory with a ``tokenizer.json``, each chunk's text is what a
``tokenizers`` DecodeStream primed with the prompt emits for its token (special tokens skipped, a
character split across tokens sent with its last byte, the last token left undecoded when
``finish`` is ``stop``, as vLLM does for EOS); for a model that is only a name, ``w<id> ``. Then a
test makes it hostile:

- ``mode``: ``ok``; ``other-model`` (serves another model name); ``no-logprobs`` (answers
  completions without logprobs or token ids);
- ``key``: every ``/v1`` request without ``Authorization: Bearer <key>`` gets 401;
- ``max_model_len``: the context it holds (a whole number: outputs stop there, with ``length``,
  and a prompt that does not fit is answered 400, as vLLM does); ``reported_max_model_len``: what
  ``/v1/models`` says it is, when that is a lie (default: the truth);
- ``tamper(kind, value, body)``: edits an answer to the request ``body`` before it is sent.
  ``kind`` is ``"stream"`` (value: the list of server-sent lines, bytes, ``data: [DONE]`` last)
  or ``"json"`` (value: the answer object; return bytes to send those instead);
- ``routes``: ``{path: handler(request_handler)}`` answers a path by hand (redirects, drips,
  oversized bodies).

Every request is recorded in :attr:`requests` as (method, path, headers). Run as a script
(``python fake_openai_server.py --model M --uds PATH | --port N [--delay S]``) it stands in for a
server process that regress starts.
"""

from __future__ import annotations

import json
import os
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

VOCAB = 1024  # the fixture model's (regress.fixture_model.VOCAB_SIZE)


def output_token(prompt: list[int], j: int, vocab: int = VOCAB) -> int:
    return (sum(prompt) + 7 * j + 1) % vocab


def _top(token: int, k: int, vocab: int) -> list[tuple[int, float]]:
    """The chosen token ranked first (-0.1), then k-1 others."""
    return [(token, -0.1)] + [((token + r) % vocab, -0.1 - r) for r in range(1, k)]


def _tokenizer(model: str) -> Any:
    """The model's tokenizer where ``model`` is a directory holding one (else None: a name)."""
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class FakeOpenAIServer:
    def __init__(self, model: str, *, mode: str = "ok", key: str | None = None, vocab: int = VOCAB,
                 max_model_len: Any = 4096, reported_max_model_len: Any = "the truth", tamper: Callable[[str, Any, dict[str, Any]], Any] | None = None,
                 routes: dict[str, Callable[[BaseHTTPRequestHandler], None]] | None = None,
                 unix_socket: str | None = None, port: int = 0, log: str | None = None,
                 outputs: Callable[[list[int], int], list[int]] | None = None, finish: str = "length"):
        self.model, self.mode, self.key, self.vocab = model, mode, key, vocab
        self.outputs, self.finish = outputs, finish
        self._tokenizer = _tokenizer(model)
        self.max_model_len, self.tamper, self.routes = max_model_len, tamper, dict(routes or {})
        self.reported = max_model_len if reported_max_model_len == "the truth" else reported_max_model_len
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def address_string(self) -> str:  # a Unix socket's peer has no host
                return "local"

            def _send(self, status: int, body: Any) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                outer.requests.append((self.command, self.path, dict(self.headers)))
                if log is not None:  # at once: the process may be killed at any moment
                    with open(log, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps({"method": self.command, "path": self.path,
                                             "authorization": self.headers.get("Authorization")}) + "\n")
                if outer.key is None or not self.path.startswith("/v1"):
                    return True
                if self.headers.get("Authorization") == f"Bearer {outer.key}":
                    return True
                self._send(401, {"error": {"message": "Unauthorized"}})
                return False

            def _routed(self) -> bool:
                route = outer.routes.get(self.path)
                if route is None:
                    return False
                try:
                    route(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on purpose (a limit or the deadline)
                return True

            def do_GET(self) -> None:  # noqa: N802
                if not self._authorized() or self._routed():
                    return
                if self.path == "/health":
                    self._send(200, b"")
                elif self.path == "/version":
                    self._send(200, {"version": "0.0.0-fake"})
                elif self.path == "/v1/models":
                    name = "some-other-model" if outer.mode == "other-model" else outer.model
                    self._send(200, {"object": "list", "data": [
                        {"id": name, "root": name, "max_model_len": outer.reported}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if not self._authorized() or self._routed():
                    return
                body = json.loads(raw or b"{}")
                room = outer._room(body)
                if room is not None and room < 1:
                    self._send(400, {"error": {"message": "This model's maximum context length is exceeded"}})
                    return
                if self.path == "/v1/completions":
                    answer = outer._completion(body)
                elif self.path == "/v1/chat/completions":
                    answer = outer._chat(body)
                else:
                    self._send(404, {"error": {"message": "not found"}})
                    return
                try:
                    if isinstance(answer, list):
                        self._stream(answer)
                    else:
                        self._send(200, answer)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _stream(self, lines: list[bytes]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for line in lines:
                    self.wfile.write(line + b"\n\n")
                    self.wfile.flush()
                self.close_connection = True

        if unix_socket is not None:
            self._httpd: Any = _UnixHTTPServer(unix_socket, Handler)
            self.port = 0
            self.url = "http://localhost"
        else:
            self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
            self._httpd.daemon_threads = True
            self.port = self._httpd.server_address[1]
            self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    # -- answers ------------------------------------------------------------------------

    def _tokens(self, prompt: list[int], n: int) -> list[int]:
        if self.outputs is not None:
            return list(self.outputs(prompt, n))[:n]
        return [output_token(prompt, j, self.vocab) for j in range(n)]

    def _pieces(self, prompt: list[int], tokens: list[int]) -> list[str]:
        """The text each output token adds, as vLLM's server streams it (module docstring)."""
        if self._tokenizer is None:
            return [f"w{t} " for t in tokens]
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)
        decoded = tokens[:-1] if self.finish == "stop" else tokens
        return [stream.step(self._tokenizer, t) or "" for t in decoded] + [""] * (len(tokens) - len(decoded))

    def _tampered(self, kind: str, value: Any, body: dict[str, Any]) -> Any:
        return self.tamper(kind, value, body) if self.tamper is not None else value

    def _room(self, body: dict[str, Any]) -> int | None:
        """How many tokens may follow the prompt (None: no limit)."""
        if type(self.max_model_len) is not int:
            return None
        prompt = body.get("prompt") if "prompt" in body else [1, 2, 3, 4]
        return self.max_model_len - len(prompt or [])

    def _completion(self, body: dict[str, Any]) -> Any:
        prompt = list(body.get("prompt") or [])
        k = int(body.get("logprobs") or 1)
        n = int(body.get("max_tokens") or 1)
        room = self._room(body)
        n = min(n, room) if room is not None else n
        if self.mode == "no-logprobs":
            return {"object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                                                              "logprobs": None}]}
        tokens = self._tokens(prompt, n)
        pieces = self._pieces(prompt, tokens)
        last = self.finish if n else "length"

        def logprobs(some: list[int]) -> dict[str, Any]:
            return {"tokens": [f"token_id:{t}" for t in some], "token_logprobs": [-0.1 for _ in some],
                    "top_logprobs": [{f"token_id:{i}": lp for i, lp in _top(t, k, self.vocab)} for t in some]}

        if body.get("stream"):
            lines = []
            for j, token in enumerate(tokens):
                choice = {"index": 0, "text": pieces[j], "logprobs": logprobs([token]),
                          "finish_reason": last if j == len(tokens) - 1 else None}
                lines.append(b"data: " + json.dumps({"object": "text_completion", "choices": [choice]}).encode())
            return self._tampered("stream", lines + [b"data: [DONE]"], body)
        choice: dict[str, Any] = {"index": 0, "text": "".join(pieces), "finish_reason": last,
                                  "logprobs": logprobs(tokens)}
        if body.get("prompt_logprobs") is not None:
            pk = int(body["prompt_logprobs"])
            choice["prompt_logprobs"] = [None] + [
                {str(i): {"logprob": lp, "rank": r + 1, "decoded_token": f"token_id:{i}"}
                 for r, (i, lp) in enumerate(_top(t, pk, self.vocab))} for t in prompt[1:]]
        return self._tampered("json", {"object": "text_completion", "choices": [choice]}, body)

    def _chat(self, body: dict[str, Any]) -> Any:
        prompt = [1, 2, 3, len(body.get("messages") or [])]  # "the server's own rendering"
        n = int(body.get("max_tokens") or 1)
        top_n = int(body.get("top_logprobs") or 1)
        tokens = self._tokens(prompt, n)
        pieces = self._pieces(prompt, tokens)
        last = self.finish if n else "length"

        def content(token: int) -> dict[str, Any]:
            return {"token": f"token_id:{token}", "logprob": -0.1,
                    "top_logprobs": [{"token": f"token_id:{i}", "logprob": lp} for i, lp in _top(token, top_n, self.vocab)]}

        if body.get("stream"):
            lines = [b"data: " + json.dumps({"prompt_token_ids": prompt, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]}).encode()]
            for j, token in enumerate(tokens):
                choice = {"index": 0, "delta": {"content": pieces[j]}, "logprobs": {"content": [content(token)]},
                          "token_ids": [token], "finish_reason": last if j == len(tokens) - 1 else None}
                lines.append(b"data: " + json.dumps({"choices": [choice]}).encode())
            return self._tampered("stream", lines + [b"data: [DONE]"], body)
        return self._tampered("json", {"prompt_token_ids": prompt, "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "".join(pieces)},
            "logprobs": {"content": [content(t) for t in tokens]}, "token_ids": tokens, "finish_reason": last}]},
            body)

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def main(argv: list[str]) -> None:
    """Stand in for vLLM's server process: ``--model``, ``--uds`` or ``--port`` (after ``--delay``
    seconds, as vLLM binds only after its slow import); other flags are taken and ignored.
    Requests are appended to ``--log`` as JSON lines."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--uds")
    parser.add_argument("--port", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--log")
    args, _ = parser.parse_known_args(argv)
    time.sleep(args.delay)
    server = FakeOpenAIServer(args.model, unix_socket=args.uds, port=args.port or 0, log=args.log)
    print(f"fake server listening on {args.uds or server.url}", flush=True)
    with server:
        while True:
            time.sleep(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
