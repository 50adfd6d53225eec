"""Why an environment build failed: transient (a retry may succeed) or permanent (it cannot install).

A bisect goes around a release that cannot be installed, and must not go around one that only
met a bad moment: a package index that was down, a network that dropped, a full disk. The kind
is read from what pip wrote (its log) and from the error regress itself met, in this order:

1. pip killed by a signal (the out-of-memory killer, a job's time-out): transient;
2. a full disk or quota (``ENOSPC``, ``EDQUOT``): transient;
3. pip found no release at all of a package it was asked for by name (``from versions: none``):
   pip says why only at debug level, so regress asks pip once more, verbosely, for just those
   requirements (:func:`unlisted`; the lines it keeps are the ``diagnosis``). An index that could
   not be fetched (HTTP 5xx, refused, timed out): transient; one that answered that it has no such
   project (HTTP 404, a missing directory) or listed nothing installable: permanent; no
   diagnosis: transient;
4. a network error in pip's output (retries, refused or reset connections, time-outs, HTTP 5xx)
   or a download that does not match its hash: transient;
5. what says the requirement cannot be installed here: conflicting requirements, no matching
   release (the index answered with other versions), a dependency that exists nowhere, no wheel
   for this platform or Python, a build that fails: permanent;
6. anything else: transient. Retrying an unknown failure costs one pip run on the next attempt;
   calling it permanent would take a release out of a bisect for good, silently.
"""

from __future__ import annotations

import errno
import re
import signal
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from regress.errors import CandidateEnvError, TransientEnvError, UnresolvableEnvError


@dataclass(frozen=True)
class BuildFailure:
    """What kind of failure an environment build met."""

    transient: bool
    cause: str
    """A few words: ``disk full``, ``the package index gave no release of x``, ..."""

    @property
    def kind(self) -> str:
        return "transient" if self.transient else "permanent"

    def error(self, message: str) -> CandidateEnvError:
        """The error of this kind (:class:`TransientEnvError` or :class:`UnresolvableEnvError`)."""
        cls = TransientEnvError if self.transient else UnresolvableEnvError
        return cls(message, cause=self.cause)


_DISK_FULL = re.compile(r"No space left on device|\[Errno 28\]|Disk quota exceeded|\[Errno 122\]")
_NETWORK = re.compile(
    r"Retrying \(Retry\(|NewConnectionError|ConnectTimeoutError|ReadTimeoutError|Read timed out|"
    r"Connection (?:refused|reset|aborted)|connection broken|ProtocolError|IncompleteRead|RemoteDisconnected|"
    r"Temporary failure in name resolution|Name or service not known|Max retries exceeded|"
    r"\b5\d\d Server Error|HTTP error 5\d\d|too many 5\d\d error responses|SSLError")
_HASH = re.compile(r"DO NOT MATCH THE HASHES")
_NOT_FOUND = re.compile(
    r"Could not find a version that satisfies the requirement (?P<req>\S+)(?P<parent> \(from [^)]*\))?"
    r" \(from versions: (?P<versions>[^)]*)\)")
_CONFLICT = re.compile(r"ResolutionImpossible|conflicting dependencies")
_UNSUPPORTED = re.compile(r"is not a supported wheel on this platform|requires a different Python|Requires-Python")
_FETCH_FAILED = re.compile(r"Could not fetch URL (?P<url>\S+?):? (?P<reason>.*?) - skipping")
_LOCATION_MISSING = re.compile(r"Location '(?P<url>[^']+)' is ignored: it is neither a file nor a directory")
_FETCHED = re.compile(r"Fetched page (?P<url>\S+)")
_BUILD = re.compile(r"Failed building wheel|Failed to build |subprocess-exited-with-error|metadata-generation-failed")


def _name(requirement: str) -> str | None:
    try:
        return canonicalize_name(Requirement(requirement).name)
    except InvalidRequirement:
        return None


def unlisted(log: str, requested: list[str]) -> list[str]:
    """The requirements of ``requested`` that pip found no release of at all (``from versions:
    none``, asked for by name): why is only in pip's verbose output (the module docstring, 3)."""
    names = {n for n in map(_name, requested) if n}
    missing = {_name(m["req"]) for m in _NOT_FOUND.finditer(log)
               if m["parent"] is None and m["versions"].strip() == "none"}
    return [r for r in requested if _name(r) in names & missing]


def diagnosis_lines(output: str) -> str:
    """The lines of pip's verbose ``output`` that say how each index answered for a project."""
    kept = [line for line in output.splitlines()
            if any(p.search(line) for p in (_FETCH_FAILED, _LOCATION_MISSING, _FETCHED))]
    return "\n".join(kept)


def _short(reason: str) -> str:
    """The innermost cause of a pip fetch failure: ``Connection refused``, ``HTTP 503``, ``timed out``."""
    for pattern, form in ((r"\[Errno -?\d+\] ([^'\")]+)", "{0}"), (r"too many (\d{3}) error responses", "HTTP {0}"),
                          (r"\b(\d{3}) (?:Server|Client) Error", "HTTP {0}"), (r"(timed out)", "{0}")):
        found = re.search(pattern, reason)
        if found:
            return form.format(found.group(1).strip())
    return reason[:200]


def _unlisted_kind(name: str, diagnosis: str) -> BuildFailure:
    """Why no index gave pip a release of ``name``, from the verbose lines in ``diagnosis``."""
    failed = [m["reason"] for m in _FETCH_FAILED.finditer(diagnosis)]
    unreachable = [reason for reason in failed if not reason.startswith("404")]
    if unreachable:
        return BuildFailure(True, f"the package index could not be fetched for {name} ({_short(unreachable[0])})")
    if failed or _LOCATION_MISSING.search(diagnosis):
        return BuildFailure(False, f"the package index has no project {name}")
    if _FETCHED.search(diagnosis):
        return BuildFailure(False, f"the package index lists no installable release of {name}")
    return BuildFailure(True, f"the package index gave pip no release of {name} (unreachable or failing)")


def classify_pip(log: str, returncode: int, requested: list[str], diagnosis: str = "") -> BuildFailure:
    """The kind of a failed ``pip install`` of ``requested`` (requirement strings), from its
    output ``log``, its exit status (negative: killed by that signal) and, when pip found no
    release at all of a requirement (:func:`unlisted`), the verbose lines of pip asked again."""
    if returncode < 0:
        try:
            how = signal.Signals(-returncode).name
        except ValueError:
            how = f"signal {-returncode}"
        return BuildFailure(True, f"pip was killed by {how}")
    if _DISK_FULL.search(log):
        return BuildFailure(True, "disk full")
    not_found = list(_NOT_FOUND.finditer(log))
    missing = unlisted(log, requested)
    if missing:
        return _unlisted_kind(_name(missing[0]) or missing[0], diagnosis)
    if _NETWORK.search(log):
        return BuildFailure(True, "network error reaching the package index")
    if _HASH.search(log):
        return BuildFailure(True, "a download did not match its hash")
    if _CONFLICT.search(log):
        return BuildFailure(False, "its requirements conflict")
    if not_found:
        first = not_found[0]
        if first["parent"] is not None:
            return BuildFailure(False, f"its dependency {first['req']} is not available")
        return BuildFailure(False, f"no release matches {first['req']} (the index has {first['versions'].strip()})")
    if _UNSUPPORTED.search(log):
        return BuildFailure(False, "no distribution for this platform or Python")
    if _BUILD.search(log):
        return BuildFailure(False, "building it failed")
    return BuildFailure(True, f"pip exited with status {returncode} for a reason regress does not recognise")


def classify_os_error(exc: OSError) -> BuildFailure:
    """The kind of a filesystem or process error met while building (always transient: a full
    disk, a quota, a machine out of processes)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return BuildFailure(True, "disk full")
    return BuildFailure(True, f"{exc.strerror or exc}")


def classify_probe(stderr: str) -> BuildFailure:
    """The kind of a finished install whose interpreter cannot import numpy and transformers:
    permanent (no engine runs in it), unless the machine was out of disk or memory."""
    if _DISK_FULL.search(stderr):
        return BuildFailure(True, "disk full")
    if "MemoryError" in stderr:
        return BuildFailure(True, "out of memory")
    return BuildFailure(False, "installed, but it cannot import numpy and transformers")


def classify_venv(log: str) -> BuildFailure:
    """The kind of a failed ``python -m venv`` (never the requirement's fault)."""
    if _DISK_FULL.search(log):
        return BuildFailure(True, "disk full")
    return BuildFailure(True, "python -m venv failed")


def pinned_version_problem(requirement: str, installed: dict[str, str]) -> str | None:
    """What is wrong with the version pip installed for an exact pin (``name==X``, no local
    label): PEP 440 has ``==X`` match ``X+anything``, and pip then takes the highest, so an index
    that also lists ``X+evil`` (a local build, a mirror's own) would be installed and checked as
    if it were X. None when it is X, or when ``requirement`` is not such a pin. ``installed``:
    distribution name -> version, as the environment's metadata says."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    try:
        req = Requirement(requirement)
    except InvalidRequirement:
        return None
    pins = [s for s in req.specifier if s.operator == "==" and "*" not in s.version and "+" not in s.version]
    if len(pins) != 1 or req.url:
        return None
    wanted = Version(pins[0].version)
    found = {canonicalize_name(name): version for name, version in installed.items()}.get(canonicalize_name(req.name))
    if found is None:
        return f"{req.name} is not installed although it was asked for ({requirement})"
    try:
        got = Version(found)
    except InvalidVersion:
        return f"{req.name} {found!r} was installed for {requirement}, which is not a version"
    if got != wanted:  # a local label makes the versions unequal
        return (f"{req.name} {found} was installed for {requirement}: the index offered another build under that "
                f"version (PEP 440's == matches local labels), which would be checked as {wanted}; to check "
                f"that build, pin it by its whole version ({req.name}=={found})")
    return None
