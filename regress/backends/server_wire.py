"""Parsing vLLM server answers (the wire format) into checked token ids and LogprobRows.

Completions report tokens as ``token_id:N`` (``return_tokens_as_token_ids``) with ``top_logprobs``
per position; teacher forcing reads ``prompt_logprobs``; the chat endpoint reports
``logprobs.content``. Logprobs the server clamped to -9999 (JSON has no infinity) are read back
as -inf.

Every value is checked as it is read, since what a server answers is scored: a token id is
``token_id:N`` (ASCII digits) inside the vocabulary, a logprob a finite JSON number <= 0, there is
one row per token and each row holds the chosen token and the full top-k
(:func:`regress.backends.base.rows_problem` checks the rows built). Anything else raises
:class:`~regress.errors.ServerReplyError` saying what and where; the backend adds the URL and the
request.

Runs inside the candidate's environment: standard library and numpy at import.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from typing import Any, Iterable

import numpy as np

from regress.backends.base import LOGPROB_TOLERANCE, LogprobRows, RawGeneration, rows_problem
from regress.backends.server_http import stream_limit
from regress.errors import ServerReplyError

TOKEN_PREFIX = "token_id:"
_MIN_LOGPROB = -9999.0
"""The server clamps -inf logprobs to this (JSON has no infinity); read back as -inf."""
_ID = re.compile(r"(?:token_id:)?([0-9]{1,10})", re.ASCII)
_PREFIXED_IDS = re.compile(r"token_id:[0-9]{1,10}(?: token_id:[0-9]{1,10})*", re.ASCII)
_INT32_BOUND = 2 ** 31
FINISH_REASONS = frozenset({"stop", "length", "repetition"})
"""Finish reasons of a whole output (vLLM's ``abort`` and ``error`` mean it was cut short)."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def count(value: Any) -> str:
    """How many entries a list has, for messages (else what it is instead)."""
    return str(len(value)) if isinstance(value, list) else _shown(value)


def _token_id(key: Any) -> int:
    """A token id as the server writes it (``token_id:N`` or ``N``)."""
    match = _ID.fullmatch(key) if isinstance(key, str) else None
    if match is None:
        raise ServerReplyError(f"{_shown(key)} is not a token id ('token_id:N')")
    return int(match.group(1))


def _in_vocabulary(token: int, vocab: int | None, what: str) -> int:
    bound = vocab if vocab is not None else _INT32_BOUND
    if not 0 <= token < bound:
        raise ServerReplyError(f"{what} id {token} is outside the vocabulary (0 .. {bound - 1})")
    return token


def token_ids(values: Any, vocab: int | None, what: str) -> list[int]:
    """A list of JSON integer token ids (``prompt_token_ids``, ``token_ids``), each in the vocabulary."""
    if not isinstance(values, list):
        raise ServerReplyError(f"{what} is {_shown(values)}, not a list of token ids")
    for value in values:
        if type(value) is not int:
            raise ServerReplyError(f"{what} holds {_shown(value)}, not a token id")
        _in_vocabulary(value, vocab, what)
    return list(values)


def _prefixed_ids(keys: list[Any], vocab: int | None, what: str) -> np.ndarray:
    """``token_id:N`` strings as int64 ids, in the vocabulary: one pattern over the joined keys
    (each key then yields exactly one id), one key at a time only to name a bad one."""
    if not keys:
        return np.zeros(0, np.int64)
    joined = " ".join(k if isinstance(k, str) else "?" for k in keys)
    if not _PREFIXED_IDS.fullmatch(joined):
        bad = next(k for k in keys if not (isinstance(k, str) and _PREFIXED_IDS.fullmatch(k)))
        raise ServerReplyError(f"{what} {_shown(bad)} is not a token id ('token_id:N')")
    ids = np.array(joined.replace(TOKEN_PREFIX, "").split(), dtype=np.int64)
    if len(ids) != len(keys):  # a key holding a space would yield two ids
        raise ServerReplyError(f"{what} ids do not match their keys (a key holds a space)")
    bound = vocab if vocab is not None else _INT32_BOUND
    bad_ids = ids >= bound
    if bad_ids.any():
        raise ServerReplyError(f"{what} id {int(ids[bad_ids][0])} is outside the vocabulary (0 .. {bound - 1})")
    return ids


def _number(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:
            return math.inf
    raise ServerReplyError(f"a logprob of {_shown(value)}, not a number")


def _values(values: Iterable[Any], count: int, what: str) -> np.ndarray:
    """JSON logprobs as float64, each a finite number <= 0 (not yet clamped)."""
    out = np.fromiter(map(_number, values), np.float64, count)
    bad = ~np.isfinite(out) | (out > LOGPROB_TOLERANCE)
    if bad.any():
        raise ServerReplyError(f"{what} of {float(out[bad][0])!r} (a logprob is a finite number <= 0)")
    return out


def _logprob(value: Any, what: str = "a logprob") -> float:
    """One JSON logprob: a finite number <= 0, the server's -9999 clamp read back as -inf."""
    lp = _number(value)
    if not math.isfinite(lp) or lp > LOGPROB_TOLERANCE:
        raise ServerReplyError(f"{what} of {lp!r} (a logprob is a finite number <= 0)")
    return float("-inf") if lp <= _MIN_LOGPROB else lp


def _checked(rows: LogprobRows, k: int, vocab: int | None) -> LogprobRows:
    problem = rows_problem(rows, k, vocab)
    if problem is not None:
        raise ServerReplyError(problem)
    return rows


def _top_row(token: int, entries: dict[str, float], k: int) -> tuple[float, list[int], list[float]]:
    """One position of a completion's ``top_logprobs``: the chosen token's logprob and the top-k
    by rank. The server lists the chosen token first, then the top-k in rank order (the chosen
    token once only: when it is among the top-k it is left out there, and put back here at its
    place by logprob). Clamped values (-9999) are turned back into -inf by :func:`_rows`; a
    chosen token missing from its row gets NaN (refused by :func:`_rows`' check)."""
    ids = [_token_id(key) for key in entries]
    lps = [_number(v) for v in entries.values()]
    if not ids:
        return float("nan"), [], []
    if ids[0] != token:  # not the server's order: find the chosen token, rank the rest by logprob
        chosen = lps[ids.index(token)] if token in ids else float("nan")
        ranked = sorted(((lp, tid) for tid, lp in zip(ids, lps) if tid != token), key=lambda x: -x[0])
        ids, lps = [token, *(t for _, t in ranked)], [chosen, *(lp for lp, _ in ranked)]
    chosen = lps[0]
    if len(ids) > k:  # the chosen token first, then k others
        return chosen, ids[1:k + 1], lps[1:k + 1]
    place = 1
    while place < len(lps) and lps[place] > chosen:
        place += 1
    return chosen, ids[1:place] + [token] + ids[place:], lps[1:place] + [chosen] + lps[place:]


def _rows(chosen: list[float], ids: list[list[int]], lps: list[list[float]], k: int,
          vocab: int | None = None) -> LogprobRows:
    """LogprobRows from per-position lists, checked: each row must hold ``k`` ids and logprobs."""
    n = len(chosen)
    if n == 0:
        return LogprobRows.empty(k)
    for i, (row_ids, row_lps) in enumerate(zip(ids, lps)):
        if len(row_ids) != k or len(row_lps) != k:
            raise ServerReplyError(f"a row of {len(row_ids)} top logprobs at position {i}, for a top-{k}")
    flat = np.array(ids, np.int64).reshape(n, k)
    bound = vocab if vocab is not None else _INT32_BOUND
    if ((flat < 0) | (flat >= bound)).any():  # before int32, which would wrap a large id into a small one
        bad = flat[(flat < 0) | (flat >= bound)][0]
        raise ServerReplyError(f"top-k token id {int(bad)} is outside the vocabulary (0 .. {bound - 1})")
    top_ids = flat.astype(np.int32)
    top_lp = np.array(lps, np.float64).reshape(n, k).astype(np.float32)
    token_lp = np.array(chosen, np.float64).astype(np.float32)
    token_lp[token_lp <= _MIN_LOGPROB] = -np.inf
    top_lp[top_lp <= _MIN_LOGPROB] = -np.inf
    return _checked(LogprobRows(token_lp, top_ids, top_lp), k, vocab)


def stream_rows(tokens: list[str], tops: list[dict[str, float]], k: int,
                vocab: int | None = None) -> tuple[list[int], LogprobRows]:
    """A streamed completion's token ids and LogprobRows, from its ``tokens`` and ``top_logprobs``
    (one row per token, each the chosen token and the top-k: k or k+1 entries).

    Vectorized for the usual layout (the chosen token first, then the others in rank order, and
    the chosen token ranked first or outside the top-k); any other row goes through
    :func:`_top_row`."""
    n = len(tokens)
    if len(tops) != n:
        raise ServerReplyError(f"{len(tops)} top_logprobs rows for {n} tokens")
    chosen_ids = _prefixed_ids(list(tokens), vocab, "the token")
    token_ids = chosen_ids.tolist()
    if n == 0:
        return token_ids, LogprobRows.empty(k)
    for i, row in enumerate(tops):
        if not isinstance(row, dict) or not k <= len(row) <= k + 1:
            size = len(row) if isinstance(row, dict) else _shown(row)
            raise ServerReplyError(f"the top_logprobs row at output position {i} holds {size} entries, "
                                   f"not the chosen token and the top {k}")
    lengths = np.fromiter(map(len, tops), np.int64, n)
    keys = list(itertools.chain.from_iterable(tops))
    flat_ids = _prefixed_ids(keys, vocab, "a top_logprobs token")
    flat_lps = _values(itertools.chain.from_iterable(d.values() for d in tops), len(keys), "a top_logprobs logprob")
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    top_ids = np.full((n, k), -1, np.int32)
    top_lp = np.full((n, k), -np.inf, np.float32)
    first_is_chosen = flat_ids[starts] == chosen_ids
    chosen = np.where(first_is_chosen, flat_lps[starts], np.nan)
    # Outside the top-k: k others after it. Ranked first: it and the k-1 others, in order.
    second = np.minimum(starts + 1, len(keys) - 1)
    ranked_first = (lengths == k) & ((k == 1) | (flat_lps[second] <= chosen))
    outside = first_is_chosen & (lengths == k + 1)
    inside = first_is_chosen & ranked_first & ~outside
    columns = np.arange(k)
    for mask, offset in ((outside, 1), (inside, 0)):
        rows = np.nonzero(mask)[0]
        if rows.size:
            index = starts[rows, None] + offset + columns[None, :]
            top_ids[rows] = flat_ids[index]
            top_lp[rows] = flat_lps[index]
    for i in np.nonzero(~(outside | inside))[0]:
        lp, row_ids, row_lps = _top_row(token_ids[i], tops[i], k)
        chosen[i] = lp
        top_ids[i, :len(row_ids[:k])] = row_ids[:k]
        top_lp[i, :len(row_lps[:k])] = row_lps[:k]
    token_lp = chosen.astype(np.float32)
    token_lp[token_lp <= _MIN_LOGPROB] = -np.inf
    top_lp[top_lp <= _MIN_LOGPROB] = -np.inf
    return token_ids, _checked(LogprobRows(token_lp, top_ids, top_lp), k, vocab)


def prompt_rows(positions: list[Any], token_ids: list[int], first: int, k: int,
                vocab: int | None = None) -> LogprobRows:
    """Positions ``first .. first+len(token_ids)-1`` of a response's ``prompt_logprobs`` (a dict of
    token id to ``{logprob, rank}`` per position: the top-k by rank and the given token) as
    LogprobRows, top-k by rank."""
    if not isinstance(positions, list):
        raise ServerReplyError(f"prompt_logprobs is {_shown(positions)}, not a list of positions")
    if len(positions) < first + len(token_ids):
        raise ServerReplyError(f"prompt_logprobs has {len(positions)} positions, not {first + len(token_ids)}")
    chosen: list[float] = []
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for i, token in enumerate(token_ids):
        where = f"prompt_logprobs position {first + i}"
        position = positions[first + i]
        if not isinstance(position, dict) or len(position) > k + 1:
            size = f"{len(position)} entries" if isinstance(position, dict) else _shown(position)
            raise ServerReplyError(f"{where} holds {size}, not the top {k} and the given token")
        by_id: dict[int, tuple[int, float]] = {}
        for key, value in position.items():
            tid = _in_vocabulary(_token_id(key), vocab, f"{where}: a token")
            rank = value.get("rank") if isinstance(value, dict) else None
            if type(rank) is not int or rank < 1:
                raise ServerReplyError(f"{where}: token {tid} has the rank {_shown(rank)}, not a number from 1")
            by_id[tid] = (rank, _logprob(value.get("logprob"), f"{where}: a logprob"))
        entry = by_id.get(token)
        if entry is None:
            raise ServerReplyError(f"{where} lacks the given token {token}")
        row = sorted((rank, tid, lp) for tid, (rank, lp) in by_id.items() if rank <= k)[:k]
        chosen.append(entry[1])
        ids.append([tid for _, tid, _ in row])
        lps.append([lp for _, _, lp in row])
    return _rows(chosen, ids, lps, k, vocab)


class ChatPromptIds(list):
    """The token ids regress rendered for a chat prompt, carrying its ``messages``: with the chat
    endpoint the messages are sent and the server's own ids come back (see
    :attr:`RawGeneration.prompt_token_ids`)."""

    def __init__(self, ids: list[int], messages: list[Any]):
        super().__init__(ids)
        self.messages = messages


def chat_top_logprobs(k: int, greedy: bool) -> int:
    """``top_logprobs`` of a chat request for a top-k. The chat endpoint lists the chosen token
    first and then cuts the list to ``top_logprobs`` entries: sampled, one more is asked for (up
    to 20, vLLM's default ``max_logprobs``) to keep the k best when the chosen token is not among
    them. Greedy, the chosen token is the best, and exactly k keeps the server's order of tokens
    with equal logprobs the same as the completions endpoint's (its top-k is not stable)."""
    return k if greedy or k >= 20 else k + 1


def chat_rows(token_ids: list[int], contents: list[dict[str, Any]], k: int, vocab: int | None = None) -> LogprobRows:
    """A chat completion's LogprobRows from ``logprobs.content`` (one entry per token: the chosen
    token's ``logprob`` and ``top_logprobs`` as ``[{token: "token_id:N", logprob}]``, the chosen
    token first, then the others in rank order). Ids come from ``token_id:N``, never from decoded
    strings; the chosen token is put back at its place by logprob and the row cut to k."""
    if len(contents) != len(token_ids):
        raise ServerReplyError(f"{len(contents)} logprob entries for {len(token_ids)} tokens")
    chosen: list[float] = []
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for i, (token, entry) in enumerate(zip(token_ids, contents)):
        where = f"the logprobs of output position {i}"
        if not isinstance(entry, dict):
            raise ServerReplyError(f"{where} are {_shown(entry)}, not an object")
        named = _in_vocabulary(_token_id(entry.get("token")), vocab, f"{where}: the token")
        if named != token:
            raise ServerReplyError(f"{where} are for token {named}, but the token there is {token}")
        lp = _logprob(entry.get("logprob"), f"{where}: a logprob")
        listed = entry.get("top_logprobs")
        if not isinstance(listed, list) or len(listed) > k + 2:
            raise ServerReplyError(f"{where}: top_logprobs is {_shown(listed)}, not a list of at most {k + 2}")
        others = []
        for other in listed:
            if not isinstance(other, dict):
                raise ServerReplyError(f"{where}: a top_logprobs entry is {_shown(other)}, not an object")
            tid = _in_vocabulary(_token_id(other.get("token")), vocab, f"{where}: a top_logprobs token")
            value = _logprob(other.get("logprob"), f"{where}: a top_logprobs logprob")
            if tid != token:
                others.append((tid, value))
        place = 0
        while place < len(others) and others[place][1] > lp:
            place += 1
        row = (others[:place] + [(token, lp)] + others[place:])[:k]
        chosen.append(lp)
        ids.append([tid for tid, _ in row])
        lps.append([v for _, v in row])
    return _rows(chosen, ids, lps, k, vocab)


# -- streamed answers -------------------------------------------------------------------------


def _choices(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream chunk's choices: the one asked for (index 0), each an object."""
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise ServerReplyError(f"choices {_shown(choices)}, not a list")
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            raise ServerReplyError(f"a choice other than the one asked for: {_shown(choice)}")
    return choices


def _text(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ServerReplyError(f"text {_shown(value)}, not a string")
    return value


def _finished(finish: Any, text: str, n_tokens: int, max_tokens: int) -> str:
    """A streamed output's finish reason, once its stream is complete: one that says the output is
    whole, no more tokens than asked for, and no text without tokens."""
    if finish is None:
        raise ServerReplyError("the stream ended without a finish reason (cut short)")
    if finish not in FINISH_REASONS:
        raise ServerReplyError(f"the finish reason {_shown(finish)}, not one of {', '.join(sorted(FINISH_REASONS))} "
                               "(the output is not whole)")
    if n_tokens > max_tokens:
        raise ServerReplyError(f"{n_tokens} output tokens for max_tokens {max_tokens}")
    if text and not n_tokens:
        raise ServerReplyError(f"text without token ids ({len(text)} characters, no tokens)")
    return str(finish)


class _StreamTally:
    """What a streamed answer has said so far: its tokens with their logprob entries, its text,
    its finish reason and when its first token came; the rules both endpoints share (no token
    after the finish reason) are applied as chunks are added."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first: float | None = None
        self.tokens: list[Any] = []
        self.entries: list[Any] = []
        self.text: list[str] = []
        self.finish: Any = None

    def add(self, choice: dict[str, Any], piece: str, tokens: list[Any], entries: list[Any]) -> None:
        if tokens:
            if self.finish is not None:
                raise ServerReplyError("tokens after the finish reason")
            if self.first is None:
                self.first = time.perf_counter()
            self.tokens += tokens
            self.entries += entries
        self.text.append(piece)
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]

    def finished(self, max_tokens: int) -> tuple[str, str, dict[str, float]]:
        """(text, finish reason, timing) of a stream that ended: see :func:`_finished`."""
        end = time.perf_counter()
        text = "".join(self.text)
        reason = _finished(self.finish, text, len(self.tokens), max_tokens)
        return text, reason, {"ttft_s": (self.first if self.first is not None else end) - self.sent,
                              "total_s": end - self.sent}


async def read_completion(client: Any, path: str, payload: dict[str, Any], vocab: int | None) -> RawGeneration:
    """One streamed completion (``payload`` asks ``logprobs`` k with ``return_tokens_as_token_ids``):
    every chunk with text has ``logprobs`` and one ``top_logprobs`` row per token, and the stream
    ends with a finish reason and ``[DONE]``. ``client`` is a
    :class:`~regress.backends.server_http.ServerClient`."""
    k = int(payload["logprobs"])
    max_tokens = int(payload["max_tokens"])
    tally = _StreamTally()
    # Only collect while streaming (the client shares the CPU with the server); parse after.
    async for chunk in client.events(path, payload, limit=stream_limit(len(payload["prompt"]), max_tokens, k + 1)):
        for choice in _choices(chunk):
            piece = _text(choice.get("text"))
            logprobs = choice.get("logprobs")
            new: Any = []
            rows: Any = []
            if logprobs is None:
                if piece:
                    raise ServerReplyError("text without token ids (a chunk with text but no logprobs)")
            else:
                new = logprobs.get("tokens") or []
                rows = logprobs.get("top_logprobs") if new else []
                if not isinstance(new, list) or not isinstance(rows, list) or len(rows) != len(new):
                    raise ServerReplyError(f"a chunk with {count(new)} tokens and {count(rows)} top_logprobs rows "
                                           "(one row per token)")
            tally.add(choice, piece, new, rows)
    text, reason, timing = tally.finished(max_tokens)
    ids, logprob_rows = stream_rows(tally.tokens, tally.entries, k, vocab)
    return RawGeneration(output_token_ids=ids, text=text, finish_reason=reason, logprobs=logprob_rows, timing=timing)


async def read_chat(client: Any, path: str, payload: dict[str, Any], k: int, prompt_tokens: int,
                    vocab: int | None) -> RawGeneration:
    """One streamed chat completion: the prompt's token ids (``return_token_ids``) from a chunk,
    then each chunk's ``token_ids`` with as many ``logprobs.content`` entries; the stream ends with
    a finish reason and ``[DONE]``. ``prompt_tokens``: regress's own count, for the byte limit."""
    max_tokens = int(payload["max_tokens"])
    prompt_ids: list[int] | None = None
    tally = _StreamTally()
    limit = stream_limit(prompt_tokens, max_tokens, int(payload["top_logprobs"]) + 2)
    async for chunk in client.events(path, payload, limit=limit):
        if chunk.get("prompt_token_ids") is not None:
            prompt_ids = token_ids(chunk["prompt_token_ids"], vocab, "prompt_token_ids")
        for choice in _choices(chunk):
            delta = choice.get("delta") or {}
            piece = _text(delta.get("content") if isinstance(delta, dict) else delta)
            logprobs = choice.get("logprobs")
            if logprobs is None and piece:
                raise ServerReplyError("text without token ids (a chunk with content but no logprobs)")
            content = (logprobs or {}).get("content") or []
            if not isinstance(content, list):
                raise ServerReplyError(f"logprobs.content {_shown(content)}, not a list")
            ids = choice.get("token_ids")
            if ids is None:  # no return_token_ids per chunk: the ids of the logprob entries
                ids = [_token_id(c.get("token") if isinstance(c, dict) else c) for c in content]
            ids = token_ids(ids, vocab, "token_ids")
            if len(ids) != len(content):
                raise ServerReplyError(f"a chunk with {len(ids)} token ids and {len(content)} logprob entries")
            tally.add(choice, piece, ids, content)
    if not prompt_ids:
        raise ServerReplyError("no prompt_token_ids for a chat request (return_token_ids)")
    text, reason, timing = tally.finished(max_tokens)
    return RawGeneration(output_token_ids=tally.tokens, text=text, finish_reason=reason,
                         logprobs=chat_rows(tally.tokens, tally.entries, k, vocab), prompt_token_ids=prompt_ids,
                         timing=timing)
