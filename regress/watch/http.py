"""The watcher's HTTP: the index's GETs and the JSON POSTs (webhooks, GitHub's API).

Every request is bounded three ways, because the answers come from servers regress does not
control:

- **size**: at most ``max_bytes`` of body are read (a ``Content-Length`` above it is refused
  before reading); one byte more is an error, never a truncated answer;
- **time**: ``timeout_s`` per socket operation *and* ``deadline_s`` for the whole exchange,
  redirects and name lookups included. A watchdog shuts the socket down at the deadline, so a
  server that trickles a byte a second (each read well inside the timeout) cannot hold a tick
  forever; a name is looked up in a thread waited on until the deadline only (:func:`resolve`:
  the C resolver has no timeout of its own to give, and a DNS server that never answers costs
  its retries, tens of seconds, per lookup);
- **where credentials go**: credentials (``Authorization``) are sent to the origin (scheme,
  host, port) they were given for and nowhere else. A GET may follow a redirect within that
  origin with them, and to another origin without them (what pip does), but never from https
  to http. A POST never follows a redirect: urllib would re-send it as a GET, or re-send the
  token to wherever the server points; a 3xx answer to a POST is a failure;
- **where it connects**: an exchange that begins at a public host never reaches an address
  outside the public internet (loopback, private, link-local: the cloud's metadata service), by
  a redirect or by a name that resolves there when connected (:func:`non_global_host`,
  :func:`_connect`). An index on such an address itself (a local mirror) is asked as configured.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urljoin, urlsplit

from regress.errors import PostError, RegressError
from regress.redact import origin as shown_origin
from regress.redact import redact
from regress.untrusted import escaped_character, printable, without_controls

MAX_REDIRECTS = 5
POST_ANSWER_BYTES = 64 * 1024
"""A webhook's or GitHub's answer is only shown in messages: more is never needed."""
DEFAULT_DEADLINE_S = 120.0

def remote_text(text: str) -> str:
    """A server's words (a reason phrase, an error body) as they may go into a message: any
    credentials redacted, every control character escaped, newlines and tabs included (the text
    stays on the message's one line, so no line of it can start a workflow command), and no
    ``::`` or ``##[`` that a log could read as one (:func:`regress.untrusted.printable`)."""
    text = without_controls(redact(text)).replace("\n", escaped_character("\n")).replace("\t", escaped_character("\t"))
    return printable(text)


Failure = Callable[[str], RegressError]
"""Builds the caller's error from a message (PackageIndexError for the index, PostError for POSTs)."""


@dataclass(frozen=True)
class Answer:
    """What the server said."""

    status: int
    body: str


@dataclass(frozen=True)
class Response:
    """A whole, bounded answer."""

    status: int
    reason: str
    """The status line's reason phrase, escaped (:func:`remote_text`): a server's words."""
    content_type: str
    body: bytes
    url: str
    """The URL that answered (after redirects)."""


# --------------------------------------------------------------------------------------
# The deadline: a watchdog that shuts the sockets of one exchange down
# --------------------------------------------------------------------------------------


class _Watchdog:
    """Shuts every socket of one exchange down when ``deadline_s`` has passed; the blocked read
    then returns at once and the exchange fails as too slow."""

    def __init__(self, deadline_s: float):
        self.deadline = time.monotonic() + deadline_s
        self.expired = False
        self.public_only: str | None = None
        """The host of the hop now asked, when the exchange began at a public host: a direct
        connection to it must then reach a public address (:func:`_connect`)."""
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(deadline_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            self._shut(sock)
        return sock

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        # The plain socket's shutdown, even on an SSL socket: it acts on the file descriptor
        # without touching the TLS state another thread is reading through. A socket closed
        # already has no descriptor (-1), so this never reaches a reused one.
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def stop(self) -> None:
        self._timer.cancel()


def _open_socket(watchdog: _Watchdog, address: tuple[str, int], timeout: Any = socket._GLOBAL_DEFAULT_TIMEOUT,
                 source_address: tuple[str, int] | None = None) -> socket.socket:
    """What :func:`socket.create_connection` does, with the name looked up within the
    exchange's deadline (:func:`resolve`) and every socket watched before it connects."""
    host, port = address
    failure: OSError | None = None
    for family, kind, proto, _, sockaddr in resolve(host, port, within_s=watchdog.remaining()):
        sock = watchdog.track(socket.socket(family, kind, proto))
        try:
            if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            failure = exc
            sock.close()
    raise failure or OSError(f"{host} has no address to connect to")


def _connect(connection: http.client.HTTPConnection, watchdog: _Watchdog, *args: Any, **kwargs: Any) -> socket.socket:
    """The connection's socket, watched; refused when an exchange that began at a public host
    reaches an address outside the public internet directly (a name that resolved to a public
    address when the redirect was checked, and to 127.0.0.1 or 169.254.169.254 now: DNS
    rebinding). Through a proxy (another host connected, or a CONNECT tunnel) the proxy's
    address is not the index's, and is not judged."""
    sock = _open_socket(watchdog, *args, **kwargs)
    host = watchdog.public_only
    if host is not None and connection._tunnel_host is None and connection.host.strip("[]").lower() == host:
        try:
            peer = str(sock.getpeername()[0])
        except OSError:
            peer = ""
        if peer and non_global_address(peer):
            sock.close()
            raise OSError(f"{host} resolved to {peer}, an address outside the public internet, "
                          "for an index on the internet; not asked")
    return sock


class _TrackedHTTP(http.client.HTTPConnection):
    def __init__(self, *args: Any, watchdog: _Watchdog, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._create_connection = functools.partial(_connect, self, watchdog)


class _TrackedHTTPS(http.client.HTTPSConnection):
    def __init__(self, *args: Any, watchdog: _Watchdog, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._watchdog = watchdog
        self._create_connection = functools.partial(_connect, self, watchdog)

    def connect(self) -> None:
        # HTTPSConnection.connect, with the TLS socket watched *before* its handshake: a
        # handshake trickled byte by byte is bounded by the deadline too.
        http.client.HTTPConnection.connect(self)
        server_hostname = self._tunnel_host or self.host
        self.sock = self._context.wrap_socket(self.sock, server_hostname=server_hostname,
                                              do_handshake_on_connect=False)
        self._watchdog.track(self.sock)
        self.sock.do_handshake()


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, watchdog: _Watchdog):
        super().__init__()
        self._factory = functools.partial(_TrackedHTTP, watchdog=watchdog)

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._factory, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, watchdog: _Watchdog, context: ssl.SSLContext | None):
        super().__init__(context=context)
        self._factory = functools.partial(_TrackedHTTPS, watchdog=watchdog)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._factory, req, context=self._context)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Hands every 3xx back to :func:`fetch` (as an HTTPError), which decides."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


# --------------------------------------------------------------------------------------
# One exchange
# --------------------------------------------------------------------------------------


def _origin_key(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


def same_origin(a: str, b: str) -> bool:
    """Same scheme, host and port (default ports spelled or not)."""
    return _origin_key(a) == _origin_key(b)


def _read_bounded(answer: Any, max_bytes: int, fail: Failure) -> bytes:
    length = answer.headers.get("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        raise fail(f"answer of {int(length):,} bytes is larger than {max_bytes:,} bytes (the limit)")
    chunks: list[bytes] = []
    total = 0
    # read1: one socket read per call, so a trickle cannot keep one call (and the deadline
    # check of the watchdog's caller) waiting for a whole 64 KiB.
    read = getattr(answer, "read1", answer.read)
    while True:
        chunk = read(65536)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise fail(f"answer larger than {max_bytes:,} bytes (the limit)")
        chunks.append(chunk)


def fetch(url: str, *, fail: Failure, method: str = "GET", headers: dict[str, str] | None = None,
          credentials: dict[str, str] | None = None, data: bytes | None = None, max_bytes: int,
          timeout_s: float = 30, deadline_s: float = DEFAULT_DEADLINE_S,
          context: ssl.SSLContext | None = None) -> Response:
    """One bounded exchange (see the module's docstring). ``credentials`` are headers sent
    only to ``url``'s origin. Any final status is returned (the caller judges it); transport
    failures, limits, the deadline and refused redirects raise ``fail(message)``.
    """
    watchdog = _Watchdog(deadline_s)
    opener = urllib.request.build_opener(_NoRedirects(), _HTTPHandler(watchdog), _HTTPSHandler(watchdog, context))
    first = url
    public = not non_global_host(urlsplit(first).hostname or "", within_s=watchdog.remaining())
    try:
        for _ in range(MAX_REDIRECTS + 1):
            watchdog.public_only = (urlsplit(url).hostname or "").lower() if public else None
            sent = dict(headers or {})
            if credentials and same_origin(url, first):
                sent.update(credentials)
            request = urllib.request.Request(url, data=data, method=method, headers=sent)
            try:
                try:
                    answer = opener.open(request, timeout=min(timeout_s, max(watchdog.remaining(), 0.001)))
                except urllib.error.HTTPError as exc:
                    if exc.fp is None:
                        raise fail(f"HTTP {exc.code} {remote_text(str(exc.reason))}") from exc
                    answer = exc
                with answer:
                    status = answer.status if hasattr(answer, "status") else answer.code
                    location = answer.headers.get("Location")
                    if 300 <= status < 400 and location and status != 304:
                        url = _next_hop(url, first, location, status, method, fail, first_public=public,
                                        within_s=watchdog.remaining())
                        continue
                    body = _read_bounded(answer, max_bytes, fail)
                    if watchdog.expired:
                        # The shut-down socket reads as a clean end: never take it for the whole answer.
                        raise fail(f"no complete answer within the deadline of {deadline_s:g} s")
                    return Response(status, remote_text(str(getattr(answer, "reason", ""))),
                                    answer.headers.get_content_type(),
                                    body, url)
            except RegressError:
                raise
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
                if watchdog.expired:
                    raise fail(f"no complete answer within the deadline of {deadline_s:g} s") from exc
                reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
                raise fail(f"unreachable ({remote_text(str(reason))})") from exc
        raise fail(f"more than {MAX_REDIRECTS} redirects")
    finally:
        watchdog.stop()


def _next_hop(url: str, first: str, location: str, status: int, method: str, fail: Failure,
              first_public: bool | None = None, within_s: float = DEFAULT_DEADLINE_S) -> str:
    """Where a redirect from ``url`` goes, or ``fail``: see the module's docstring.
    ``first_public``: whether ``first``'s host is public, when the caller knows (else resolved);
    ``within_s``: the time its names may take to resolve (what is left of the deadline)."""
    target = urljoin(url, location.strip())
    if method != "GET":
        # urllib would turn a 301/302/303 POST into a GET without the body and follow a
        # 307/308 to any host with the token: neither is a delivery.
        raise fail(f"answered HTTP {status} (a redirect to {shown_origin(target)}); "
                   f"a {method} is never redirected: fix the URL")
    scheme = urlsplit(target).scheme
    if scheme not in ("http", "https"):
        raise fail(f"redirected to a {scheme or 'schemeless'} URL ({redact(target)}), which is not followed")
    if urlsplit(first).scheme == "https" and scheme == "http":
        raise fail(f"redirected from https to plain http ({redact(target)}), which is not followed")
    if not same_origin(target, first):
        host = urlsplit(target).hostname or ""
        if first_public is None:
            first_public = not non_global_host(urlsplit(first).hostname or "", within_s=within_s)
        if first_public and non_global_host(host, within_s=within_s):
            # An index on the internet may send the watcher to a CDN, never into the watcher's
            # own network: the cloud's metadata service (169.254.169.254), a Redis on localhost,
            # a service behind the firewall. An index that is itself local may redirect anywhere.
            raise fail(f"redirected from {shown_origin(first)} to {shown_origin(target)}, an address "
                       "outside the public internet (loopback, private, link-local), which is not followed")
    return target


def resolve(host: str, port: int | None, *, within_s: float) -> list[tuple[Any, ...]]:
    """``socket.getaddrinfo(host, port)`` for TCP, given at most ``within_s`` seconds: the
    lookup runs in a daemon thread, left to finish on its own when the time is up (the C
    resolver cannot be interrupted). Raises OSError when it fails or takes longer."""
    found: dict[str, Any] = {}
    done = threading.Event()

    def look_up() -> None:
        try:
            found["infos"] = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError) as exc:
            found["error"] = exc
        finally:
            done.set()

    threading.Thread(target=look_up, name="regress-resolve", daemon=True).start()
    if not done.wait(max(within_s, 0.0)):
        raise OSError(f"the name {host!r} was not resolved within the deadline")
    if "error" in found:
        error = found["error"]
        raise error if isinstance(error, OSError) else OSError(f"{host!r}: {error}")
    return list(found["infos"])


def non_global_host(host: str, *, within_s: float = DEFAULT_DEADLINE_S) -> bool:
    """Whether ``host`` is, or resolves (within ``within_s``) to, an address outside the public
    internet: loopback, private, link-local, unique-local, shared, multicast, reserved or
    unspecified (an IPv4 address mapped into IPv6 counts as itself). A host that does not
    resolve is not: its connection fails anyway. What a name resolves to can change between
    this check and the connection (DNS rebinding): :func:`_connect` judges the address the
    socket reached as well."""
    if not host:
        return False
    try:
        infos = resolve(host, None, within_s=within_s)
    except OSError:
        return False
    return any(non_global_address(str(info[4][0])) for info in infos)


def non_global_address(address: str) -> bool:
    """Whether an IP address (``10.0.0.5``, ``::ffff:127.0.0.1``, ``fe80::1%eth0``) is outside
    the public internet; not an IP address at all: False."""
    try:
        parsed = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(parsed, "ipv4_mapped", None)
    return not (mapped or parsed).is_global


# --------------------------------------------------------------------------------------
# JSON POST
# --------------------------------------------------------------------------------------


def post_json(url: str, payload: Any, *, headers: dict[str, str] | None = None, credentials: dict[str, str] | None = None,
              timeout_s: float = 30, deadline_s: float = DEFAULT_DEADLINE_S,
              context: ssl.SSLContext | None = None, statuses: frozenset[int] | None = None) -> Answer:
    """POST ``payload`` as JSON; raise :class:`PostError` unless the answer is 2xx (a redirect
    is not: see the module's docstring), or, when ``statuses`` is given, unless its status is one
    of them (GitHub's dispatches answer 204 only: a 200 login page of a proxy is no dispatch).
    ``credentials`` (an Authorization header) go to ``url``'s origin only."""
    answer = fetch(
        url, fail=PostError, method="POST", data=json.dumps(payload).encode("utf-8"),
        headers={"Content-Type": "application/json", "User-Agent": "regress-watch", **(headers or {})},
        credentials=credentials, max_bytes=POST_ANSWER_BYTES, timeout_s=timeout_s, deadline_s=deadline_s,
        context=context)
    text = answer.body.decode("utf-8", "replace")
    if not 200 <= answer.status < 300 or (statuses is not None and answer.status not in statuses):
        # The reason (escaped in Response) and the body are the server's words: escaped here, once,
        # so every message, warning and log line built from a PostError is safe to print.
        raise PostError(f"HTTP {answer.status} {answer.reason}".rstrip(), answer.status, remote_text(text[:2000]))
    return Answer(answer.status, text)
