"""The server backend's one HTTP client: a deadline, a byte limit and no redirect on every request.

Every request regress sends to a vLLM server goes through :class:`ServerClient`: the health poll,
``/version``, ``/v1/models``, the probes, the replay's streamed completions and teacher forcing.
It is aiohttp, over TCP or over the Unix socket of a server regress started, with:

- a whole-request deadline (a server that trickles one byte at a time is cut off at it, not
  given a fresh timeout for every byte);
- a byte limit on every body, answers, error texts and streams alike (a body is read in pieces
  and refused past the limit, whatever its ``Content-Length`` says);
- no redirect followed: the API key goes to ``server.url``'s origin only, so a server that answers
  3xx is an error naming where it pointed (to another origin, another scheme or its own);
- strict JSON: ``NaN``, ``Infinity``, a number too large for a float and a key named twice in
  one object are not JSON, and neither is a body cut short.

Transport failures become ``ConnectionError`` and ``TimeoutError`` naming the URL (never the key),
error statuses :class:`~regress.errors.ServerHTTPError`, and bodies that are too large, not JSON
or a stream that ends before ``[DONE]`` :class:`~regress.errors.ServerReplyError`.

Runs inside the candidate's environment: standard library at import; aiohttp inside the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar
from urllib.parse import urlsplit, urlunsplit

from regress.errors import ServerHTTPError, ServerReplyError

T = TypeVar("T")

SMALL_ANSWER_BYTES = 4 * 1024 * 1024
"""Most bytes of an answer that is small by nature: ``/version``, ``/v1/models``, a probe."""
ERROR_BODY_BYTES = 64 * 1024
"""Most bytes read of an error answer's body (the message shows its start)."""
ANSWER_BASE_BYTES = 1024 * 1024
"""Room in every answer's limit for what does not grow with its tokens (ids, names, usage)."""
BYTES_PER_ENTRY = 1024
"""Room per logprob entry of an answer: one entry is about 90 bytes from vLLM."""


def shown_url(url: str) -> str:
    """A URL without userinfo, query or fragment (what is recorded and printed)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # Python reads 1e400 as inf: a number JSON cannot mean
        raise ValueError(f"the number {text[:40]} is too large for a float")
    return value


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):  # Python keeps the last; another reader may keep the first
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"an object names the key {key[:60]!r} twice")
            seen.add(key)
    return found


def strict_json(data: bytes | str) -> Any:
    """JSON as the standard defines it: ``NaN``, ``Infinity`` and ``-Infinity`` are refused
    (Python's reader takes them), as are a number too large for a float (Python's reader makes it
    infinite), an object that names a key twice (Python's reader keeps the last value, silently),
    text that is not UTF-8, anything cut short and anything nested past the reader's depth.
    Raises ``ValueError``."""
    # UTF-8, as JSON between systems must be (RFC 8259); the reader would also take UTF-16 and 32.
    text = bytes(data).decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    # The hooks cost a Python call per float and per object (a chunk of 21 logprobs takes half as
    # long again, some 6 us more): less than a regex scan of the text for what could overflow.
    try:
        return json.loads(text, parse_constant=_refuse, parse_float=_finite, object_pairs_hook=_unique)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def stream_limit(prompt_tokens: int, max_tokens: int, entries_per_token: int) -> int:
    """The byte limit of one streamed answer: its chunks' text, ids and logprob entries."""
    return ANSWER_BASE_BYTES + 16 * prompt_tokens + max_tokens * (2 + entries_per_token) * BYTES_PER_ENTRY


def positions_limit(positions: int, entries_per_position: int) -> int:
    """The byte limit of a teacher-forcing answer: its ``prompt_logprobs`` positions and entries."""
    return ANSWER_BASE_BYTES + positions * (1 + entries_per_position) * BYTES_PER_ENTRY


def run_to_end(main: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run(main())``, also from a thread whose event loop is already running (a
    notebook, a caller that drives its own loop, Playwright's sync API): there ``asyncio.run``
    refuses, so the coroutine runs on a loop of its own in a short-lived thread instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="regress-http") as pool:
        return pool.submit(lambda: asyncio.run(main())).result()


class ServerClient:
    """One server's requests, through one aiohttp session per ``async with``.

    ``base_url`` is what requests go to (``http://localhost`` over a Unix socket); ``shown`` is
    how the server is named in messages and records (default: ``base_url`` without userinfo)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, unix_socket: str | None = None,
                 concurrency: int = 1, timeout_s: float = 600.0, shown: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.unix_socket = unix_socket
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.shown = shown or shown_url(base_url)
        self._api_key = api_key
        self._session: Any = None

    async def __aenter__(self) -> "ServerClient":
        import aiohttp

        connector = (aiohttp.UnixConnector(path=self.unix_socket, limit=self.concurrency) if self.unix_socket
                     else aiohttp.TCPConnector(limit=self.concurrency))
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        # trust_env off: no proxy from the environment sees the key or the prompts.
        self._session = aiohttp.ClientSession(connector=connector, headers=headers, raise_for_status=False,
                                              timeout=aiohttp.ClientTimeout(total=self.timeout_s), trust_env=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def where(self, path: str) -> str:
        """The URL of ``path`` as messages show it."""
        return self.shown + path

    def run(self, work: Callable[["ServerClient"], Awaitable[T]]) -> T:
        """Run ``work(client)`` to its end in a session of its own (the synchronous callers)."""

        async def main() -> T:
            async with self:
                return await work(self)

        return run_to_end(main)

    # -- requests ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _mapped(self, path: str, timeout_s: float | None) -> AsyncIterator[None]:
        """Transport failures of one request as ``ConnectionError`` and ``TimeoutError``."""
        import aiohttp

        try:
            yield
        except asyncio.TimeoutError:
            raise TimeoutError(f"the server at {self.where(path)} did not finish answering within its deadline "
                               f"({timeout_s or self.timeout_s:g} s)") from None
        except aiohttp.ClientError as exc:
            raise ConnectionError(f"the server at {self.shown} is unreachable or broke off ({path}: {exc})") from None

    @contextlib.asynccontextmanager
    async def _open(self, path: str, payload: Any, timeout_s: float | None) -> AsyncIterator[Any]:
        """One request, its answer open: 200 only (a redirect or another status raises)."""
        import aiohttp

        options: dict[str, Any] = {"allow_redirects": False}
        if timeout_s is not None:
            options["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
        if payload is not None:
            options["json"] = payload
        method = self._session.get if payload is None else self._session.post
        async with method(self.base_url + path, **options) as response:
            if 300 <= response.status < 400:
                location = response.headers.get("Location") or "nowhere"
                raise ServerHTTPError(self.where(path), response.status, (
                    f"a redirect to {shown_url(location)}, not followed: regress sends requests and the API key "
                    "to server.url's origin only (set server.url to the address that answers)"))
            if response.status != 200:
                body = await _read(response, ERROR_BODY_BYTES, self.where(path), cut=True)
                raise ServerHTTPError(self.where(path), response.status, body.decode("utf-8", "replace"))
            yield response

    async def status(self, path: str, *, timeout_s: float) -> int:
        """The status of ``GET path`` (its body read up to the error limit), redirects included."""
        async with self._mapped(path, timeout_s):
            try:
                async with self._open(path, None, timeout_s) as response:
                    await _read(response, ERROR_BODY_BYTES, self.where(path), cut=True)
                    return int(response.status)
            except ServerHTTPError as exc:
                return exc.status

    async def json(self, path: str, payload: Any = None, *, limit: int, timeout_s: float | None = None) -> Any:
        """The JSON answer to ``GET path`` (``payload`` None) or ``POST path`` with ``payload``."""
        async with self._mapped(path, timeout_s):
            async with self._open(path, payload, timeout_s) as response:
                body = await _read(response, limit, self.where(path))
        try:
            return strict_json(body)
        except ValueError as exc:
            raise ServerReplyError(f"an answer that is not JSON ({exc})", url=self.where(path)) from None

    async def events(self, path: str, payload: Any, *, limit: int) -> AsyncIterator[dict[str, Any]]:
        """The JSON chunks of one streamed answer (server-sent ``data:`` lines) up to ``[DONE]``.
        A stream that ends before ``[DONE]``, a chunk that is not a JSON object, an error chunk or
        more than ``limit`` bytes in all raise."""
        where = self.where(path)
        async with self._mapped(path, None):
            async with self._open(path, payload, None) as response:
                pending, size = b"", 0
                async for data in response.content.iter_any():
                    size += len(data)
                    if size > limit:
                        raise ServerReplyError(f"a stream of more than {limit} bytes (the limit for this request)",
                                               url=where)
                    lines = (pending + data).split(b"\n")
                    pending = lines.pop()
                    for line in lines:
                        chunk = _event(line, where)
                        if chunk is _DONE:
                            return
                        if chunk is not None:
                            yield chunk
                if pending.strip() and _event(pending, where) is _DONE:
                    return
        raise ServerReplyError("the stream ended before 'data: [DONE]' (cut short)", url=where)


_DONE: dict[str, Any] = {}


def _event(line: bytes, where: str) -> dict[str, Any] | None:
    """One line of a server-sent stream: a JSON chunk, :data:`_DONE`, or None (not a data line)."""
    line = line.rstrip(b"\r")
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return _DONE
    try:
        chunk = strict_json(data)
    except ValueError as exc:
        raise ServerReplyError(f"a stream chunk that is not JSON ({exc})", url=where) from None
    if not isinstance(chunk, dict):
        raise ServerReplyError(f"a stream chunk that is not a JSON object ({type(chunk).__name__})", url=where)
    if "error" in chunk:
        raise ServerReplyError(f"an error in the stream: {str(chunk['error'])[:500]}", url=where)
    return chunk


async def _read(response: Any, limit: int, where: str, *, cut: bool = False) -> bytes:
    """A body, at most ``limit`` bytes: past it, refused (or, ``cut``, its first ``limit`` bytes)."""
    declared = response.content_length
    if declared is not None and declared > limit and not cut:
        raise ServerReplyError(f"an answer of {declared} bytes, over the limit of {limit} for this request", url=where)
    parts: list[bytes] = []
    size = 0
    async for data in response.content.iter_any():
        if size + len(data) > limit:
            if cut:
                parts.append(data[: limit - size])
                break
            raise ServerReplyError(f"an answer of more than {limit} bytes (the limit for this request)", url=where)
        size += len(data)
        parts.append(data)
    return b"".join(parts)
