"""Secrets: redacting them, reading them from the environment, keeping them from child processes.

The module holds the one redaction function, the reading of a secret from the environment, and
the environment a child process gets without the secrets.

Everything regress prints, logs or stores that may hold a URL or a header goes through
:func:`redact`. It works on free text (a pip command line, an error message, a log line), not
only on a lone URL, so one function covers install logs, messages and manifests alike.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

MASK = "***"

# ``scheme://userinfo@``: RFC 3986 allows neither "/", "?", "#" nor whitespace unencoded in
# userinfo, so the userinfo is everything up to the *last* "@" before one of them. The greedy
# match is what keeps a password holding "@" or ":" (``u:p@ss:w@host``) whole.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s'\"<>]*)@")
# Query (or matrix) parameters whose value is a credential: password, token, access_token,
# api_key, secret, signature (pre-signed URLs), ...
_SECRET_PARAMETER = re.compile(
    r"(?P<name>[?&;](?:[A-Za-z0-9_.-]*?(?:passw(?:or)?d|pwd|token|secret|api[_-]?key|apikey|signature|sig|"
    r"credential|auth)[A-Za-z0-9_.-]*|key|code)=)(?P<value>[^&#\s'\"<>]*)",
    re.IGNORECASE)
# An Authorization header as a line (``Authorization: Bearer x``), a dict repr
# (``'Authorization': 'Basic x'``) or a curl-like ``-H``: the scheme word and the credential.
_AUTH_HEADER = re.compile(
    r"(?P<name>\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?)"
    r"(?P<value>(?:(?:basic|bearer|token|digest|negotiate)\s+)?[^\s\"',}]+)",
    re.IGNORECASE)


def _userinfo(match: re.Match[str]) -> str:
    user, has_password, _ = match.group("userinfo").partition(":")
    # ``user:secret`` keeps the user (useful in messages); a lone ``token@`` is a credential itself.
    shown = f"{user}:{MASK}" if has_password else MASK
    return f"{match.group('scheme')}{shown}@"


def redact(text: str) -> str:
    """``text`` with every credential replaced by ``***``: the password of ``user:pass@`` in any
    URL (a lone ``token@`` whole), credential query parameters (``?password=``, ``?token=``,
    ``access_token``, ``api_key``, ``sig``...) and ``Authorization`` header values.

    Idempotent, and safe on text holding no URL at all.
    """
    if not text:
        return text
    text = _USERINFO.sub(_userinfo, text)
    text = _SECRET_PARAMETER.sub(lambda m: m.group("name") + MASK, text)
    return _AUTH_HEADER.sub(lambda m: m.group("name") + MASK, text)


def has_credentials(text: str) -> bool:
    """Whether :func:`redact` would hide anything in ``text``."""
    return redact(text) != text


def origin(url: str) -> str:
    """``scheme://host[:port]/...``: how a URL that is a secret as a whole (a webhook: its path
    is the credential) is shown."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or "?"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}/..."


# --------------------------------------------------------------------------------------
# secrets from the environment
# --------------------------------------------------------------------------------------


def secret_from_environment(variable: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of ``variable``, else the content of the file ``variable_FILE`` names (one
    line, surrounding whitespace stripped), else None. A file keeps the secret out of the
    process table and of shell history (a flag is visible in ``ps``).

    Raises :class:`regress.errors.ConfigError` (naming the variable, never the content) when
    the file cannot be read or is empty.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(variable)
    if value:
        return value.strip()
    path = environ.get(f"{variable}_FILE")
    if not path:
        return None
    from regress.errors import ConfigError

    try:
        content = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the secret file {path}: {exc.__class__.__name__}",
                          field=f"{variable}_FILE") from exc
    if not content:
        raise ConfigError(f"the secret file {path} is empty", field=f"{variable}_FILE")
    return content


# Names a child process (an engine, pip) must not inherit: the broker and its signing key, the
# watcher's state, webhook and index URLs, tokens regress uses, and passwords by convention.
# HF_TOKEN is deliberately kept: the engine needs it for gated models.
SECRET_VARIABLES = frozenset({
    "REGRESS_BROKER_URL", "REGRESS_RESULT_BACKEND", "REGRESS_BROKER_KEY",
    "REGRESS_WATCH_STATE_URL", "REGRESS_WEBHOOK_URL", "REGRESS_INDEX_URL",
    "REGRESS_GITHUB_TOKEN", "REGRESS_DISPATCH_TOKEN", "GITHUB_TOKEN", "GH_TOKEN",
    "ACTIONS_RUNTIME_TOKEN", "ACTIONS_ID_TOKEN_REQUEST_TOKEN", "ACTIONS_ID_TOKEN_REQUEST_URL",
})
_SECRET_NAME = re.compile(
    r"^(REGRESS_\w*(_URL|_TOKEN|_KEY|_SECRET|_PASSWORD)|\w*_PASSWORD|\w*_PASSWD)(_FILE)?$", re.IGNORECASE)


def is_secret_variable(name: str) -> bool:
    """Whether environment variable ``name`` holds (or names the file of) a secret of regress."""
    base = name[:-5] if name.upper().endswith("_FILE") else name
    return base.upper() in SECRET_VARIABLES or bool(_SECRET_NAME.match(name))


def without_secrets(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default: this process's) without the variables
    :func:`is_secret_variable` names: the environment of engines and pip."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items() if not is_secret_variable(name)}
