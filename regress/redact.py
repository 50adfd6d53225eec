"""Secrets: redacting them, reading them from the environment, keeping them from child processes.

The module holds the one redaction function, the reading of a secret from the environment, and
the environment a child process gets without the secrets.

Everything regress prints, logs or stores that may hold a URL or a header goes through
:func:`redact`. It works on free text (a pip command line, an error message, a log line), not
only on a lone URL, so one function covers install logs, messages and manifests alike.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

MASK = "***"

# ``scheme://userinfo@``: RFC 3986 allows neither "/", "?", "#" nor whitespace unencoded in
# userinfo, so the userinfo is everything up to the *last* "@" before one of them. The greedy
# match is what keeps a password holding "@" or ":" (``u:p@ss:w@host``) whole.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s'\"<>]*)@")
# A password holding an unencoded "/", "?" or "#" (``https://user:pa/ss@host``): no valid URL,
# but one people write. _USERINFO stops at the "/", so whatever follows ``scheme://user:`` up to
# the word's last "@" is masked here, unless the ":" starts a port (digits, then the path).
_SLASHED_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/?#\s'\"<>:@\[]*):(?!\d*(?:[/?#\s'\"<>]|$))[^\s'\"<>]*@")
# Query (or matrix) parameters whose value is a credential: password, token, access_token,
# api_key, secret, signature (pre-signed URLs), ...
_SECRET_PARAMETER = re.compile(
    r"(?P<name>[?&;](?:[A-Za-z0-9_.-]*?(?:passw(?:or)?d|pwd|token|secret|api[_-]?key|apikey|signature|sig|"
    r"credential|auth)[A-Za-z0-9_.-]*|key|code)=)(?P<value>[^&#\s'\"<>]*)",
    re.IGNORECASE)
# ``name: value`` / ``name=value`` wherever a credential is written under a name: a header line
# (``X-Api-Key: k``, ``Authorization: Bearer k``), JSON or a dict's repr (``"api_key": "k"``,
# ``'token': 'k'``, escaped quotes included), YAML (``password: k``), an environment dump
# (``HF_TOKEN=k``, ``export DB_PASSWORD='k'``), a flag (``--api-key=k``). Which names hold a
# credential is :func:`secret_name`'s; the value is a quoted string or one word (after an auth
# scheme word, the word after it).
_NAME = re.compile(r"""(?<![\w.\-\\])(?P<quote>\\*["'])?(?P<name>-{0,2}[A-Za-z_][\w.\-]*)(?:\\*["'])?[ \t]*(?P<op>[:=])[ \t]*""")
_VALUE = re.compile(
    r"""(?P<quoted>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')|(?P<eq>\\+["']).*?(?P=eq)"""
    r"""|(?:(?:basic|bearer|token|digest|negotiate|apikey)[ \t]+)?(?![=:])[^\s"',;}&<>]+""",
    re.IGNORECASE)
# ``--name value``: a secret flag and the word after it.
_FLAG = re.compile(r"(?<![\w-])(?P<name>--[A-Za-z][\w-]*)(?P<sep>[ \t]+)(?P<value>[^\s\-\"'][^\s\"']*)")
# A bearer token on its own (``Bearer k`` without a header name).
_BEARER = re.compile(r"(?<![\w-])(?P<scheme>bearer)(?P<sep>[ \t]+)(?P<value>[A-Za-z0-9._~+/=\-]+)", re.IGNORECASE)
# Credentials recognisable by their own shape, wherever they stand: GitHub, GitLab, Hugging Face,
# OpenAI-style and Slack tokens, AWS access key ids, JSON Web Tokens.
_SHAPED = re.compile(
    r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_\-]{20,}|hf_[A-Za-z0-9]{20,}"
    r"|sk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}|xox[abposr]-[A-Za-z0-9\-]{10,}|AKIA[0-9A-Z]{16}"
    r"|eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,})")

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# Last words of names that hold a credential, and long words that do inside one (``dbpassword``).
_SECRET_WORDS = frozenset({"password", "passwd", "passphrase", "secret", "secrets", "token", "apikey", "credential",
                           "credentials", "authorization", "auth", "oauth", "cookie", "signature", "privatekey",
                           "accesskey", "secretkey"})
_SECRET_PARTS = ("password", "passwd", "passphrase", "secret", "apikey", "credential")
# ``<word>_token`` and ``<word>_key`` that are no credential: a tokenizer's special tokens, counts
# and positions of tokens; keys of caches, tables, routes and maps, and public keys.
_NOT_TOKEN = frozenset({"bos", "eos", "pad", "unk", "sep", "cls", "mask", "special", "start", "end", "stop", "first",
                        "last", "next", "prev", "max", "min", "num", "per", "added", "decoder", "vocab", "output",
                        "input", "prompt", "sample", "golden", "candidate", "top", "chosen", "image", "audio"})
_NOT_KEY = frozenset({"cache", "sort", "primary", "foreign", "partition", "shard", "group", "lookup", "dict", "hash",
                      "routing", "sample", "prompt", "metric", "row", "column", "index", "map", "join", "unique",
                      "public", "kv", "value", "query", "object", "bucket", "plan", "dedup", "idempotency", "sampling",
                      "dataset", "config", "field", "json", "yaml", "table", "result"})
_BEARER_WORDS = frozenset({"token", "tokens", "auth", "authentication", "authorization", "scheme", "header",
                           "credential", "credentials", "of", "the", "a", "an", "and", "or", "is", "to", "for", "in",
                           "as", "with", "on"})


def secret_name(name: str, *, assigned: bool = False) -> bool:
    """Whether a value written under ``name`` is a credential: its last word is one (``password``,
    ``secret``, ``token``, ``auth``, ``cookie``, ``signature``...), or ``key``/``pass``/``pwd``
    after another word (``X-Api-Key``, ``AWS_SECRET_ACCESS_KEY``, ``DB_PASS``), or it is one of
    regress's secret variables assigned (:func:`is_secret_variable`: ``REGRESS_WEBHOOK_URL=``).
    Not: a tokenizer's ``bos_token``, ``max_tokens``, ``cache_key``, a ``public_key``,
    ``TOKEN_FILE`` or ``api_key_env`` (which name where a secret is, not the secret).
    ``assigned``: written ``name=value``, where a bare ``key`` is a credential too (as in a query
    string)."""
    bare = name.lstrip("-")
    words = [w.lower() for w in _WORD.findall(bare)]
    if not words:
        return False
    last, before = words[-1], (words[-2] if len(words) > 1 else None)
    if assigned and bare.upper() == bare and not bare.upper().endswith("_FILE") and is_secret_variable(bare):
        return True  # an environment dump: REGRESS_WEBHOOK_URL=... (its path is the secret)
    if last == "token":
        return before not in _NOT_TOKEN
    if last in _SECRET_WORDS or any(part in last for part in _SECRET_PARTS):
        return True
    if last == "key":
        return (before is not None and before not in _NOT_KEY) or (before is None and assigned)
    return last in ("pass", "pwd") and before is not None


# Words that make a setting's name a credential's wherever they stand in it (``AUTH_HEADER``,
# ``SECRET_ACCESS``), and the words before ``key`` that do (``AWS_ACCESS_KEY_ID``).
_SETTING_WORDS = frozenset({"password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials",
                            "auth", "authorization", "oauth", "apikey", "privatekey", "accesskey", "secretkey",
                            "cookie"})
_SETTING_KEY_BEFORE = frozenset({"api", "access", "secret", "private", "signing", "encryption", "master", "client",
                                 "account", "service", "license", "subscription", "session"})


def secret_setting(name: str) -> bool:
    """Whether a setting named ``name`` holds a credential: an environment variable (``env``), an
    engine argument or a key of a dict an engine argument takes. :func:`secret_name` (assigned:
    ``WANDB_API_KEY``, ``hf_token``, ``MY_SECRET``, ``AWS_SECRET_ACCESS_KEY``, ``*_CREDENTIALS``),
    regress's own secret variables (:func:`is_secret_variable`), a credential word anywhere in the
    name (``PROXY_AUTH_USER``, ``SECRET_ACCESS``) and ``<api|access|secret|...>_key`` anywhere
    (``AWS_ACCESS_KEY_ID``). Not: names ending in ``env``, which name the variable that holds a
    secret (``api_key_env``), ``max_tokens``, ``bos_token_id``, ``*_TOKEN_THRESHOLD``,
    ``kv_cache_dtype``, ``OMP_NUM_THREADS``."""
    bare = name.lstrip("-")
    words = [w.lower() for w in _WORD.findall(bare)]
    if not words or words[-1] == "env":
        return False
    if is_secret_variable(bare) or secret_name(bare, assigned=True):
        return True
    if any(w in _SETTING_WORDS or any(part in w for part in _SECRET_PARTS) for w in words):
        return True
    for i, word in enumerate(words[1:], 1):
        if word == "key" and words[i - 1] in _SETTING_KEY_BEFORE:
            return True
    return False


def masked_setting(name: str, value: Any) -> Any:
    """``value`` of the setting ``name`` as regress stores and shows it (manifest.json, the report's
    configuration, summary.md): ``***`` when :func:`secret_setting` says the name holds a
    credential (unless the value is None or a bool, which hold none: ``allow_credentials: true``),
    the same within a dict an engine argument takes (by each key's name) and a list, and every
    other string through :func:`redact`. The mask is fixed, not a fingerprint: a short secret's
    hash is as good as the secret. A masked value still shows that it was set; whether it changed
    is for the plan fingerprint (computed from the raw values) and :func:`masked_pair`.
    Idempotent: a stored form masked again is the same."""
    if value is None or isinstance(value, bool):
        return value
    if secret_setting(name):
        return MASK
    if isinstance(value, Mapping):
        return {k: masked_setting(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [masked_setting(name, v) for v in value]
    if isinstance(value, str):
        return redact(value)
    return value


def masked_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting of ``settings`` (an ``env``, ``engine_args``) through :func:`masked_setting`."""
    return {k: masked_setting(str(k), v) for k, v in settings.items()}


CHANGED = " (changed)"
"""What :func:`masked_pair` adds to a masked value that differs from the other side's."""


def masked_pair(name: str, baseline: Any, candidate: Any) -> tuple[Any, Any]:
    """Two runs' values of the setting ``name`` masked (:func:`masked_setting`), the candidate's
    marked ``(changed)`` when the masks hide a difference between two raw values (a manifest
    written before masking). When either side is stored masked already, whether it changed is not
    known from here, and nothing is added (the plan fingerprints, from the raw values, differ)."""
    a, b = masked_setting(name, baseline), masked_setting(name, candidate)
    both_raw = a != baseline and b != candidate and not _holds_mask(baseline) and not _holds_mask(candidate)
    if a == b and baseline != candidate and both_raw:
        return a, (b + CHANGED if isinstance(b, str) else
                   json.dumps(b, ensure_ascii=False, sort_keys=True, default=str) + CHANGED)
    return a, b


def _holds_mask(value: Any) -> bool:
    if isinstance(value, str):
        return MASK in value
    if isinstance(value, Mapping):
        return any(_holds_mask(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_mask(v) for v in value)
    return False


def _named(text: str) -> str:
    """Every value under a credential's name masked (quotes kept). Names are found one by one,
    each match only the name and its ``:``/``=``, so a credential inside another name's value
    (``error: token=k``) is still found."""
    out: list[str] = []
    pos = 0
    for name in _NAME.finditer(text):
        if name.start() < pos or not secret_name(name.group("name"), assigned=name.group("op") == "="):
            continue
        value = _VALUE.match(text, name.end())
        if value is None or value.group().startswith(MASK):  # masked already (a URL's query: ``token=***#frag``)
            continue
        if name.group("quote") and not value.group("quoted") and not value.group("eq") and value.group().isalpha():
            continue  # "field 'api_token': must be ...": a message after a quoted name, no JSON value
        if value.group("quoted"):
            masked = value.group()[0] + MASK + value.group()[0]
        elif value.group("eq"):
            masked = value.group("eq") + MASK + value.group("eq")
        else:
            masked = MASK
        out += [text[pos:name.end()], masked]
        pos = value.end()
    return "".join(out) + text[pos:]


def _flag(match: re.Match[str]) -> str:
    if not secret_name(match.group("name")) or match.group("value") == MASK:
        return match.group()
    return match.group("name") + match.group("sep") + MASK


def _bearer(match: re.Match[str]) -> str:
    value, scheme = match.group("value"), match.group("scheme")
    if value.lower() in _BEARER_WORDS or value == MASK:
        return match.group()
    # "Bearer k" as HTTP writes the scheme; in lower case only what looks like a token, not a word.
    if scheme[0].islower() and not (re.search(r"[\d._~+/=\-]", value) or len(value) >= 16):
        return match.group()
    return scheme + match.group("sep") + MASK


def _userinfo(match: re.Match[str]) -> str:
    user, has_password, _ = match.group("userinfo").partition(":")
    # ``user:secret`` keeps the user (useful in messages); a lone ``token@`` is a credential itself.
    shown = f"{user}:{MASK}" if has_password else MASK
    return f"{match.group('scheme')}{shown}@"


def redact(text: str) -> str:
    """``text`` with every credential replaced by ``***``: the password of ``user:pass@`` in any
    URL (a lone ``token@`` whole), credential query parameters (``?password=``, ``?token=``,
    ``access_token``, ``api_key``, ``sig``...), values written under a credential's name in a
    header, JSON, a dict's repr, YAML, an environment dump or a flag (``X-Api-Key: k``,
    ``"api_key": "k"``, ``HF_TOKEN=k``, ``--password k``: :func:`secret_name`), a bare
    ``Bearer k``, and tokens recognisable by their shape (``ghp_...``, ``hf_...``, ``sk-...``,
    ``AKIA...``, JWTs).

    Idempotent, and safe on text holding no credential at all.
    """
    if not text:
        return text
    text = _USERINFO.sub(_userinfo, text)
    text = _SLASHED_USERINFO.sub(lambda m: f"{m.group('scheme')}{m.group('user')}:{MASK}@", text)
    text = _SECRET_PARAMETER.sub(lambda m: m.group("name") + MASK, text)
    text = _named(text)
    text = _FLAG.sub(_flag, text)
    text = _BEARER.sub(_bearer, text)
    return _SHAPED.sub(MASK, text)


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
