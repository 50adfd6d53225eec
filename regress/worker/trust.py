"""What a broker message may choose on a worker, and what it may not.

params.yaml is trusted: whoever writes it runs the check on their own machine. A message is
not, even a signed one (a leaked key, a compromised sender). A worker validates every candidate
it receives with params.yaml's own rules (:class:`~regress.records.CandidateSpec`), then refuses
(:func:`untrusted_candidate`) what would let a message choose code, commands or where files go:

- engine ``env`` keys that steer loaders and interpreters (``LD_PRELOAD``, ``PYTHONPATH``, ...)
  or name directories (``*_HOME``, ``*_DIR``, ...): set those in the worker's own environment;
- requirements that are not plain ``name[extras] <specifier>`` (direct URLs ``x @ URL``, pip
  options such as ``--index-url`` or ``-e``, local paths);
- backends given as ``module:Class`` (registered names only);
- engine arguments that load code (``trust_remote_code``, ``worker_cls``, ...), and any name that
  abbreviates one (``trust_remote``, ``compilation_confi``: vLLM's server parser expands a
  unique prefix of an option, so ``--trust-remote`` is ``--trust-remote-code``), whatever the
  backend (:func:`abbreviated_denied_arg`);
- any path to write outside the worker's results directory (``celery.results_dir``).

Then an allow-list (:func:`from_own_configuration`): a message chooses no network destination,
secret or file. Everything that names one must come from the worker's own params.yaml
(``REGRESS_WATCH_PARAMS``, which ``regress worker --params`` sets): the model with its revision,
the tokenizer, the chat template, the generation config, the server's URL and the variable
holding its key (as a pair, so no key goes to another candidate's server). Engine arguments and
``env`` values must either be set the same way by one of the worker's candidates or be plain
settings: numbers and booleans (no ports), the listed word-valued knobs (:data:`WORD_ENGINE_ARGS`).
For the ``server`` backend (its engine arguments become flags of vLLM's argparse) each name must
also be exactly one of vLLM's engine arguments (``regress/data/vllm_engine_args.json``) or a name
the worker's own candidates set: no abbreviation or unknown option reaches vLLM's parser. The
offline engine takes keyword arguments: nothing is expanded, and an unknown name fails its start.
``env`` keys are an allow-list, not a deny-pattern: a message may set a key only when one of the
worker's own candidates sets that key, or the key is one of the few performance knobs in
:data:`MESSAGE_ENV_KEYS` (``OMP_NUM_THREADS``, ``VLLM_CPU_KVCACHE_SPACE``, ...), with a value
without ``/``. So ``VLLM_USE_MODELSCOPE`` (the model fetched from another registry),
``VLLM_NO_USAGE_STATS=0`` / ``DO_NOT_TRACK=0`` (usage reporting back on) and
``VLLM_TEST_FORCE_LOAD_FORMAT=dummy`` (random weights) are refused; the keys of
:data:`PINNED_ENV` pass only with the very value one of the worker's candidates gives them.
The deny rules above (loader, interpreter, path, network and secret variables) still apply on top.
A candidate equal to one of the worker's own passes as it is. So the watcher's and bisect's
candidates (a template with another package), noise arms (another concurrency) and tuning
candidates replay; one that points elsewhere is refused before pip or an engine starts.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import ValidationError

from regress.errors import MessageRefused, RegressError
from regress.records import CURRENT_ENVIRONMENT, CandidateSpec

DENIED_ENV = frozenset({
    "PATH", "BASH_ENV", "ENV", "SHELL", "SHELLOPTS", "BASHOPTS", "PS4", "IFS", "CDPATH", "HOME",
    "GCONV_PATH", "PERL5OPT", "PERL5LIB", "PERLLIB", "RUBYOPT", "RUBYLIB", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS",
    "TMPDIR", "OPENSSL_CONF", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONFIG_FILE", "UV_INDEX_URL",
    "HF_ENDPOINT", "HF_TOKEN", "VLLM_PLUGINS",
})
"""Environment variables a message may never set for an engine."""
DENIED_ENV_PREFIXES = ("LD_", "DYLD_", "PYTHON", "MALLOC_", "GLIBC_", "REGRESS_", "PIP_", "UV_", "CELERY_")
"""Whole families: the dynamic loader, the interpreter (``PYTHONWARNINGS`` imports modules too)."""
DENIED_ENV_SUFFIXES = ("PATH", "_HOME", "_DIR", "_ROOT", "_CACHE", "_FILE", "_CONFIG")
"""Variables that name files or directories (caches, configs): a message must not choose them."""
DENIED_ENGINE_ARGS = frozenset({
    "trust_remote_code", "worker_cls", "worker_extension_cls", "distributed_executor_backend",
    "logits_processors", "download_dir", "model_loader_extra_config", "hf_overrides", "code_revision",
    "allowed_local_media_path", "compilation_config",
})
"""Engine arguments that import or download code, or write where they like."""

_PLAIN_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,\s-]*\])?\s*([<>=!~]=?[^;@\s,]+(\s*,\s*[<>=!~]=?[^;@\s,]+)*)?$")


def denied_env_key(key: str) -> bool:
    """Whether a message may not set ``key`` in an engine's environment."""
    upper = key.upper()
    return (upper in DENIED_ENV or upper.startswith(DENIED_ENV_PREFIXES) or upper.endswith(DENIED_ENV_SUFFIXES)
            or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key))


def _arg_stem(key: str) -> str:
    """``key`` as vLLM's server parser would see the option's name: ``--`` and what follows ``=``
    dropped, dashes as underscores, lower case."""
    return key.split("=", 1)[0].strip().lstrip("-").replace("-", "_").lower()


def abbreviated_denied_arg(key: str) -> str | None:
    """The refused engine argument (:data:`DENIED_ENGINE_ARGS`) that ``key`` names or abbreviates
    (``None``: none). argparse, as vLLM's server uses it (``allow_abbrev`` on), reads a unique
    prefix of an option as the option, so ``trust_remote`` is ``trust_remote_code`` there. An
    exact name of vLLM's own (``model``, a prefix of ``model_loader_extra_config``) is itself."""
    from regress.engine_args import known_engine_args

    stem = _arg_stem(key)
    if stem in DENIED_ENGINE_ARGS:
        return stem
    if stem and stem in known_engine_args()[1]:
        return None
    for denied in sorted(DENIED_ENGINE_ARGS):
        if denied.startswith(stem):
            return denied
    return None


def requirement_problem(text: str) -> str | None:
    """Why ``text`` is not a plain requirement a message may ask pip for (``None``: it is)."""
    stripped = text.strip()
    if stripped.startswith("-"):
        return f"pip option {stripped.split()[0]!r}"
    try:
        parsed = Requirement(stripped)
    except InvalidRequirement:
        return "not a requirement (a path or URL?)"
    if parsed.url:
        return "a direct URL (name @ URL)"
    if parsed.marker is not None or not _PLAIN_REQUIREMENT.match(stripped):
        return "not a plain 'name[extras] specifier' requirement"
    return None


def untrusted_candidate(data: Any, where: str) -> CandidateSpec:
    """A candidate from a broker message: params.yaml's validation, then the message's limits."""
    if not isinstance(data, dict):
        raise MessageRefused(f"{where}: the candidate is not an object")
    try:
        candidate = CandidateSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise MessageRefused(f"{where}: invalid candidate: field '{field}': {first['msg']}") from None
    problems: list[str] = []
    for key in candidate.env:
        if denied_env_key(key):
            problems.append(f"env '{key}' (loader, interpreter or path variables come from the worker's own "
                            "environment, never from a message)")
    for requirement in ([candidate.package] if candidate.package != CURRENT_ENVIRONMENT else []) + candidate.requirements:
        problem = requirement_problem(requirement)
        if problem:
            problems.append(f"requirement {requirement!r}: {problem}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", candidate.backend):
        problems.append(f"backend {candidate.backend!r} (registered backend names only, not module:Class)")
    for arg in candidate.engine_args:
        denied = abbreviated_denied_arg(arg)
        if denied == arg:
            problems.append(f"engine argument '{arg}' (loads code or chooses where files go)")
        elif denied is not None:
            problems.append(f"engine argument '{arg}' (vLLM's parser would read it as '{denied}', which "
                            "loads code or chooses where files go)")
    if problems:
        raise MessageRefused(f"{where}: candidate '{candidate.name}' refused: " + "; ".join(problems))
    return candidate


def inside(root: Path, path: str | Path, what: str, where: str) -> Path:
    """``path`` resolved (symlinks included); :class:`MessageRefused` unless it lies below ``root``."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise MessageRefused(f"{where}: {what} is missing")
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root):
        raise MessageRefused(f"{where}: {what} {str(path)!r} is outside this worker's results directory {root} "
                             "(celery.results_dir / REGRESS_RESULTS_DIR)")
    return resolved


# --------------------------------------------------------------------------------------
# The allow-list: places come from the worker's own configuration
# --------------------------------------------------------------------------------------

PARAMS_VARIABLE = "REGRESS_WATCH_PARAMS"
"""The worker's own params.yaml (``regress worker --params`` sets it; watch tasks read it too)."""
WORD_ENGINE_ARGS = frozenset({
    "kv_cache_dtype", "dtype", "quantization", "attention_backend", "scheduling_policy", "tokenizer_mode",
    "prefix_caching_hash_algo", "mamba_ssm_cache_dtype", "mamba_cache_dtype", "logprobs_mode", "runner",
    "convert", "task", "device", "reasoning_parser", "tool_call_parser", "uvicorn_log_level",
    "guided_decoding_backend", "override_attention_dtype",
})
"""Engine arguments a message may set to a plain word (``fp8``, ``FLASH_ATTN``): each picks one of
vLLM's built-in choices. Any other text (a host, a path, a module) only from the worker's params."""
NETWORK_ENV = re.compile(
    r"PROXY|(^|_)(URL|URI|ENDPOINTS?|HOST|HOSTNAME|IP|ADDR|ADDRESS|PORT|SERVERS?|TOKEN|KEY|SECRET|PASSWORD|PASSWD"
    r"|CREDENTIALS?|AUTH)($|_)|^(OTEL|AWS|AZURE|GOOGLE|GCS|S3|HF|HUGGING_FACE|GITHUB|GH|ACTIONS|RUNNER)_")
"""``env`` keys that name a network destination or hold a secret."""
MESSAGE_ENV_KEYS = frozenset({
    "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_BATCH_INVARIANT",
})
"""``env`` keys a message may set although none of the worker's candidates does: performance and
determinism knobs that choose no place, no code and no weights (the diagnosis probe's
``VLLM_BATCH_INVARIANT``, the CPU thread and KV-cache settings of the project's params and docs).
Any other key only where the worker's own params set it."""
PINNED_ENV = frozenset({
    "VLLM_USE_MODELSCOPE", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "DO_NOT_TRACK", "VLLM_USAGE_SOURCE",
    "VLLM_TEST_FORCE_LOAD_FORMAT", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
})
"""``env`` keys a message may give only the very value one of the worker's candidates gives them
(where the model comes from, usage reporting, dummy weights, unsafe deserialization): even when
the worker's params set the key, another value would undo what they chose."""
_ARG_NAME = re.compile(r"[a-z][a-z0-9_]*")
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+-]{0,63}")
_PLAIN_ENV_VALUE = re.compile(r"[A-Za-z0-9_.,:+=-]{0,256}")
_PORT = re.compile(r"(^|_)ports?($|_)")


@dataclass(frozen=True)
class OwnConfiguration:
    """The candidates of the worker's own params.yaml: where what a message names must come from."""

    path: Path
    candidates: tuple[CandidateSpec, ...]

    def describe(self) -> str:
        return f"{self.path}: {', '.join(c.name for c in self.candidates)}"


_loaded: dict[Path, tuple[tuple[int, int], OwnConfiguration]] = {}


def own_configuration(path: str | Path) -> OwnConfiguration:
    """The candidates of params file ``path`` (read again when the file changes); a
    :class:`~regress.errors.RegressError` (a ConfigError) when it cannot be loaded."""
    from regress.config import load_params

    path = Path(path).expanduser().resolve()
    try:
        stat = path.stat()
    except OSError:
        stat = None
    stamp = (stat.st_mtime_ns, stat.st_size) if stat is not None else (0, -1)
    cached = _loaded.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    params = load_params(path)
    own = OwnConfiguration(path, (params.baseline, *params.candidates.values()))
    _loaded[path] = (stamp, own)
    return own


def worker_configuration(where: str) -> OwnConfiguration:
    """This worker's own configuration; :class:`MessageRefused` when it has none to check against."""
    named = os.environ.get(PARAMS_VARIABLE)
    if not named:
        raise MessageRefused(f"{where}: this worker has no params of its own ({PARAMS_VARIABLE}, or `regress worker "
                             "--params`), so it replays no candidate: a message never brings its own configuration")
    try:
        return own_configuration(named)
    except RegressError as exc:
        raise MessageRefused(f"{where}: this worker's params ({named}) cannot be read: {exc}") from None


def _same_place(given: str | None, own: str | None, root: Path) -> bool:
    """Whether ``given`` names what the worker's ``own`` value names: the same text, or (for a
    relative path whose directory appeared after the params were read) the path resolved."""
    if given == own:
        return True
    if given is None or own is None or Path(own).is_absolute():
        return False
    return given == str((root / own).resolve())


def _value(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def engine_arg_problem(key: str, value: Any, backend: str = "vllm",
                       own_names: frozenset[str] | set[str] = frozenset()) -> str | None:
    """Why a message may not set engine argument ``key`` to ``value`` on its own (``None``: it may).
    For a server regress starts (its arguments become flags of vLLM's argparse, which expands
    abbreviations) the name must be exactly one of vLLM's engine arguments or one of ``own_names``
    (those the worker's candidates set); the offline engine takes keyword arguments, where an
    unknown name fails the engine's start and nothing is expanded."""
    from regress.engine_args import known_engine_args

    if not _ARG_NAME.fullmatch(key):
        return "not an engine argument name"
    denied = abbreviated_denied_arg(key)
    if denied == key:
        return "loads code or chooses where files go"
    if denied is not None:
        return f"vLLM's parser would read it as '{denied}', which loads code or chooses where files go"
    if backend == "server" and key not in own_names:  # argparse expands prefixes; LLM(**kwargs) does not
        releases, names = known_engine_args()
        if key not in names:
            return (f"not exactly the name of an engine argument of vLLM ({', '.join(releases)}) nor one the "
                    "worker's candidates set; vLLM's server would expand an abbreviation to another option")
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return "a port: the worker chooses where its engine listens" if _PORT.search(key) else None
    if isinstance(value, str):
        if key in WORD_ENGINE_ARGS and _WORD.fullmatch(value):
            return None
        return "text, which may name a host, a file or a module: only the worker's own params set it"
    if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
        return None
    return "a structured value, which may name a host, a file or a module: only the worker's own params set it"


def env_problem(key: str, value: str, own_keys: frozenset[str] | set[str] = frozenset()) -> str | None:
    """Why a message may not set engine variable ``key`` to ``value`` on its own (``None``: it may):
    ``key`` must be one of ``own_keys`` (those the worker's candidates set) or of
    :data:`MESSAGE_ENV_KEYS`, not one of :data:`PINNED_ENV`, and pass the deny rules."""
    if denied_env_key(key):
        return "loader, interpreter or path variables come from the worker's own environment"
    if NETWORK_ENV.search(key.upper()):
        return "names a network destination or holds a secret"
    if key.upper() in PINNED_ENV:
        return ("chooses where the model comes from, usage reporting or the weights: only the value the "
                "worker's own params give it")
    if key not in own_keys and key not in MESSAGE_ENV_KEYS:
        return (f"not a variable the worker's candidates set, nor one of {', '.join(sorted(MESSAGE_ENV_KEYS))}: "
                "set it in the worker's params")
    if not _PLAIN_ENV_VALUE.fullmatch(value):
        return "its value may name a file or a host"
    return None


def configuration_problems(candidate: CandidateSpec, own: OwnConfiguration) -> list[str]:
    """What ``candidate`` names that the worker's own configuration does not (empty: nothing)."""
    if any(c.model_dump() == candidate.model_dump() for c in own.candidates):
        return []
    root, mine = own.path.parent, own.candidates
    problems: list[str] = []
    if not any(_same_place(candidate.model, c.model, root) and candidate.revision == c.revision for c in mine):
        at = f" at revision {candidate.revision!r}" if candidate.revision else ""
        problems.append(f"model {candidate.model!r}{at} (none of the worker's candidates uses it)")
    for field, unset in (("tokenizer", (None,)), ("chat_template", (None,)), ("generation_config", ("vllm", "auto"))):
        value = getattr(candidate, field)
        if value not in unset and not any(_same_place(value, getattr(c, field), root) for c in mine):
            problems.append(f"{field} {value!r}")
    if candidate.quantization is not None and not _WORD.fullmatch(candidate.quantization) and not any(
            c.quantization == candidate.quantization for c in mine):
        problems.append(f"quantization {candidate.quantization!r}")
    url = candidate.server.url if candidate.server is not None else None
    key = candidate.server.api_key_env if candidate.server is not None else None
    servers = [(c.server.url, c.server.api_key_env) for c in mine if c.server is not None]
    if url is not None and not any(url == own_url for own_url, _ in servers):
        problems.append(f"server.url {url!r}")
    elif key is not None and (url, key) not in servers:
        # A key goes only to the server the worker's params pair it with.
        problems.append(f"server.api_key_env {key!r} (not this server's key in the worker's params)")
    own_args = {(k, _value(v)) for c in mine for k, v in c.engine_args.items()}
    own_names = {k for c in mine for k in c.engine_args}
    for arg, value in candidate.engine_args.items():
        why = (None if (arg, _value(value)) in own_args
               else engine_arg_problem(arg, value, candidate.backend, own_names))
        if why:
            problems.append(f"engine argument '{arg}' ({why})")
    own_env = {(k, v) for c in mine for k, v in c.env.items()}
    own_keys = {k for c in mine for k in c.env}
    for variable, value in candidate.env.items():
        why = None if (variable, value) in own_env else env_problem(variable, value, own_keys)
        if why:
            problems.append(f"env '{variable}' ({why})")
    return problems


def from_own_configuration(candidate: CandidateSpec, own: OwnConfiguration, where: str) -> None:
    """:class:`MessageRefused` unless everything ``candidate`` names comes from ``own``."""
    problems = configuration_problems(candidate, own)
    if problems:
        raise MessageRefused(f"{where}: candidate '{candidate.name}' refused: {'; '.join(problems)}. A message "
                             "may name only the models, files, servers and keys of the worker's own params "
                             f"({own.describe()}); add the candidate there")
