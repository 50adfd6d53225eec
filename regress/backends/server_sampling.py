"""What a served request carries, and what vLLM's server fills in for the rest.

vLLM's OpenAI-compatible server applies its own sampling defaults (the model's
``generation_config.json``, or ``--generation-config DIR`` / ``--override-generation-config``)
to every field a request leaves unset (vllm#15241: the best-known drift in its tracker). A
request that spells out every field never meets them, and a check through such requests passes
although the server's users see other text. So with ``server.sampling_fields: client`` (the
default) a request carries what a client's would: the fields the prompt set or the candidate set
(:attr:`regress.records.ResolvedSampling.explicit`), and what regress needs to score:

- ``max_tokens`` and ``logprobs``, always (a bounded output, scored token by token);
- ``temperature``, always: the layers' value, else regress's greedy 0. A request without one is
  sampled at the server's default (1.0 unless the generation config says otherwise), and a
  prompt set that says nothing about temperature is run greedy everywhere else in regress (the
  offline golden, the verdict's rules); the server's temperature default is still learnt and
  recorded, so ``regress diff`` names it;
- ``seed`` when the request samples (temperature > 0), so that golden and candidate draw alike.

``all`` sends every field regress has, as before (``min_p``, which regress has no field for, is
left to the server either way).

What the server fills in is learnt where it can be: from the start-up log of a server regress
started (:func:`defaults_from_log`: vLLM logs the defaults it took from the generation config), and
by a probe of any server (:func:`probe_requests`, :func:`probe_result`). Both are server output,
checked before anything is kept (:func:`checked_defaults`).

Runs inside the candidate's environment: standard library only.
"""

from __future__ import annotations

import ast
import re
from typing import Any

REQUEST_FIELDS = ("temperature", "top_p", "top_k", "min_tokens", "seed", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "ignore_eos")
"""regress's sampling fields a completion request can carry, by the server's names (``max_tokens``,
``logprobs`` and ``stop`` go out apart)."""
SERVER_DEFAULT_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                         "top_p", "min_p", "max_tokens")
"""The fields vLLM fills from its generation config (``ModelConfig.get_diff_sampling_param``;
the same tuple as :data:`regress.records.manifest.SERVER_DEFAULT_FIELDS`)."""
MODES = ("client", "all")

_INTEGER_FIELDS = ("top_k", "max_tokens")
_MAX_MAGNITUDE = 1e9
RANGES: dict[str, tuple[float, float]] = {
    "repetition_penalty": (1e-9, 100.0), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
    "temperature": (0.0, 100.0), "top_k": (-1, _MAX_MAGNITUDE), "top_p": (1e-9, 1.0), "min_p": (0.0, 1.0),
    "max_tokens": (1, _MAX_MAGNITUDE)}
"""Each field's values vLLM's ``SamplingParams`` takes (bounds included; a penalty or top_p above 0)."""
_MAX_LINE = 4096
"""Characters of one log line read for defaults (vLLM's line holds at most eight numbers)."""
_MAX_DICT = 1024
"""Characters of the logged defaults read as a Python literal."""
LOG_MARKER = "sampling param"
"""Lines of a server's log that may hold its defaults contain this (case-insensitive): vLLM 0.32's
"Default vLLM sampling parameters have been overridden by ...: `{...}`" and earlier releases'
"Using default completion sampling params from ...: {...}"."""
_LOG_PATTERNS = (
    re.compile(r"sampling parameters have been overridden by (?P<source>[^\n]{1,512}?): `?(?P<values>\{[^{}\n]{0,%d}\})"
               % _MAX_DICT),
    re.compile(r"Using default (?:completion |chat )?sampling params from (?P<source>[^\n:]{1,512}): "
               r"(?P<values>\{[^{}\n]{0,%d}\})" % _MAX_DICT),
)


def sent_fields(sampling: dict[str, Any], mode: str) -> dict[str, Any]:
    """The sampling fields (server names) a generation request carries, besides ``max_tokens`` and
    ``logprobs``: every one in ``all`` mode, or where the sampling records no explicit fields
    (a plan made without them: as before); in ``client`` mode the explicit ones, ``temperature``
    and, when sampling, ``seed``."""
    explicit = sampling.get("explicit")
    if mode == "all" or explicit is None:
        chosen = set(REQUEST_FIELDS)
    else:
        chosen = set(explicit) | {"temperature"}
        if sampling.get("temperature"):
            chosen.add("seed")
    out = {name: sampling[name] for name in REQUEST_FIELDS if name in chosen and sampling.get(name) is not None}
    if sampling.get("stop"):
        out["stop"] = list(sampling["stop"])
    return out


def left_to_server(sampling: dict[str, Any], mode: str) -> list[str]:
    """The fields the server fills in for this request (its defaults apply to them)."""
    sent = sent_fields(sampling, mode)
    return [name for name in SERVER_DEFAULT_FIELDS if name not in sent and name != "max_tokens"]


# -- what the server answers: checked before it is kept ---------------------------------


def checked_defaults(raw: Any) -> dict[str, int | float]:
    """Defaults a server reported, as ``{field: number}``: a mapping of at most
    ``len(SERVER_DEFAULT_FIELDS)`` entries, every name one of :data:`SERVER_DEFAULT_FIELDS`, every
    value a finite number (no flag, no text) in the field's range (:data:`RANGES`), ``top_k`` and
    ``max_tokens`` whole. Raises ValueError saying what is wrong (names shortened: they are the server's text)."""
    if not isinstance(raw, dict):
        raise ValueError(f"not a mapping of defaults but {type(raw).__name__}")
    if len(raw) > len(SERVER_DEFAULT_FIELDS):
        raise ValueError(f"{len(raw)} entries; a server fills in at most {len(SERVER_DEFAULT_FIELDS)} fields")
    out: dict[str, int | float] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or name not in SERVER_DEFAULT_FIELDS:
            raise ValueError(f"{str(name)[:40]!r} is not a field a server fills in ({', '.join(SERVER_DEFAULT_FIELDS)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}: {str(value)[:40]!r} is not a number")
        # Magnitude first, by comparison: math.isfinite(10 ** 400) raises OverflowError (a whole
        # number too large for a float), and NaN fails the comparison too.
        if not abs(value) <= _MAX_MAGNITUDE:
            shown = (f"a whole number of about {value.bit_length() * 30103 // 100000 + 1} digits"
                     if isinstance(value, int) else repr(value))
            raise ValueError(f"{name}: {shown} is not a finite number of magnitude <= {_MAX_MAGNITUDE:g}")
        if name in _INTEGER_FIELDS and value != int(value):
            raise ValueError(f"{name}: {value!r} is not a whole number")
        low, high = RANGES[name]
        if not low <= value <= high:
            raise ValueError(f"{name}: {value!r} is outside {low:g} .. {high:g}")
        out[name] = int(value) if name in _INTEGER_FIELDS else value
    return out


def defaults_from_log(lines: list[str]) -> dict[str, int | float] | None:
    """The defaults vLLM's server logged at start (the first line that states them), checked; {}
    when no line states any (vLLM logs none when it applies none); None when a line states some
    that cannot be read or fail the checks (recorded as not learnt, never guessed)."""
    for line in lines:
        text = line[:_MAX_LINE]
        for pattern in _LOG_PATTERNS:
            match = pattern.search(text)
            if match is None:
                continue
            try:
                # A Python literal (vLLM logs str(dict)): literal_eval runs no code.
                return checked_defaults(ast.literal_eval(match.group("values")))
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return None
    return {}


# -- the probe ------------------------------------------------------------------------------

PROBE_TOKENS = 24
PROBE_SEED = 20261202
GREEDY_PROBED = ("repetition_penalty", "presence_penalty", "frequency_penalty")
"""Fields that change greedy decoding, probed at temperature 0."""
SAMPLED_PROBED = ("top_p", "top_k", "min_p")
"""Fields that change only sampling, probed at temperature 1 with a fixed seed."""
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
           "top_p": 1.0, "top_k": 0, "min_p": 0.0}
PROBE_TEXT = "one two three four, one two three four, one two three four, one two three"
"""A repetitive prompt: the penalties bite on what the prompt and the output repeat."""


def probe_requests(model: str, prompt_ids: list[int]) -> list[tuple[str, str | None, dict[str, Any]]]:
    """The probe's requests as (decoding, field left unset or None for the neutral request, body):
    per decoding (greedy, sampled) the neutral request twice (every field explicit and neutral: a
    server whose two answers differ cannot be probed) and one per probed field without it."""
    out: list[tuple[str, str | None, dict[str, Any]]] = []
    for decoding, probed, extra in (("greedy", GREEDY_PROBED, {"temperature": 0.0}),
                                    ("sampled", SAMPLED_PROBED, {"temperature": 1.0, "seed": PROBE_SEED})):
        base = {"model": model, "prompt": list(prompt_ids), "max_tokens": PROBE_TOKENS, "ignore_eos": True,
                "logprobs": 1, "return_tokens_as_token_ids": True, **extra, **NEUTRAL}
        out += [(decoding, None, dict(base)), (decoding, None, dict(base))]
        for name in probed:
            out.append((decoding, name, {k: v for k, v in base.items() if k != name}))
    return out


def probe_result(answers: list[tuple[str, str | None, list[int]]]) -> dict[str, Any]:
    """From each probe request's output token ids (as :func:`probe_requests` listed them), the
    record's probe part: the fields probed, those whose leaving unset changed the output, and
    whether a neutral request answered twice differently (then nothing is concluded for that
    decoding)."""
    neutral: dict[str, list[list[int]]] = {}
    for decoding, name, tokens in answers:
        if name is None:
            neutral.setdefault(decoding, []).append(tokens)
    steady = {d: len(runs) >= 2 and all(r == runs[0] for r in runs) for d, runs in neutral.items()}
    probed = [name for decoding, name, _ in answers if name is not None and steady.get(decoding)]
    changed = [name for decoding, name, tokens in answers
               if name is not None and steady.get(decoding) and tokens != neutral[decoding][0]]
    return {"probed": probed, "changed_by_probe": changed, "inconclusive": not all(steady.values())}


def probe_tokens(answer: Any, vocab: int | None) -> list[int]:
    """The output token ids of a probe answer (``logprobs.tokens`` as ``token_id:N``), checked:
    at most :data:`PROBE_TOKENS`, each an id in the vocabulary. Raises ValueError otherwise."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    logprobs = choice.get("logprobs") if choice is not None else None
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if not isinstance(tokens, list) or len(tokens) > PROBE_TOKENS:
        raise ValueError(f"a probe answer without its tokens (at most {PROBE_TOKENS}) in logprobs.tokens")
    ids = []
    for token in tokens:
        match = re.fullmatch(r"token_id:([0-9]{1,10})", token, re.ASCII) if isinstance(token, str) else None
        if match is None or (vocab is not None and int(match.group(1)) >= vocab):
            raise ValueError(f"a probe answer's token {str(token)[:40]!r} is not a token id in the vocabulary")
        ids.append(int(match.group(1)))
    return ids
