"""Parsing vLLM server answers (the wire format) into token ids and LogprobRows.

Completions report tokens as ``token_id:N`` (``return_tokens_as_token_ids``) with ``top_logprobs``
per position; teacher forcing reads ``prompt_logprobs``; the chat endpoint reports
``logprobs.content``. Streamed answers are read as server-sent ``data:`` lines. Logprobs the server
clamped to -9999 (JSON has no infinity) are read back as -inf.

Runs inside the candidate's environment: standard library and numpy at import.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, AsyncIterator

import numpy as np

from regress.backends.base import LogprobRows
from regress.backends.server_process import shown_url
from regress.errors import ServerHTTPError

TOKEN_PREFIX = "token_id:"
_MIN_LOGPROB = -9999.0
"""The server clamps -inf logprobs to this (JSON has no infinity); read back as -inf."""


def _token_id(key: str) -> int:
    return int(key[len(TOKEN_PREFIX):] if key.startswith(TOKEN_PREFIX) else key)


def _logprob(value: float) -> float:
    return float("-inf") if value is None or value <= _MIN_LOGPROB else float(value)


def _top_row(token: int, entries: dict[str, float], k: int) -> tuple[float, list[int], list[float]]:
    """One position of a completion's ``top_logprobs``: the chosen token's logprob and the top-k
    by rank. The server lists the chosen token first, then the top-k in rank order (the chosen
    token once only: when it is among the top-k it is left out there, and put back here at its
    place by logprob). Clamped values (-9999) are turned back into -inf by :func:`_rows`."""
    ids = [_token_id(key) for key in entries]
    lps = list(entries.values())
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


def _rows(chosen: list[float], ids: list[list[int]], lps: list[list[float]], k: int) -> LogprobRows:
    n = len(chosen)
    if n == 0:
        return LogprobRows.empty(k)
    if all(len(row) == k for row in ids):
        top_ids = np.array(ids, np.int32).reshape(n, k)
        top_lp = np.array(lps, np.float32).reshape(n, k)
    else:
        top_ids = np.full((n, k), -1, np.int32)
        top_lp = np.full((n, k), -np.inf, np.float32)
        for i, (row_ids, row_lps) in enumerate(zip(ids, lps)):
            top_ids[i, :len(row_ids)] = row_ids[:k]
            top_lp[i, :len(row_lps)] = row_lps[:k]
    token_lp = np.array(chosen, np.float32)
    token_lp[token_lp <= _MIN_LOGPROB] = -np.inf
    top_lp[top_lp <= _MIN_LOGPROB] = -np.inf
    return LogprobRows(token_lp, top_ids, top_lp)


def stream_rows(tokens: list[str], tops: list[dict[str, float]], k: int) -> tuple[list[int], LogprobRows]:
    """A streamed completion's token ids and LogprobRows, from its ``tokens`` and ``top_logprobs``.

    Vectorized for the usual layout (the chosen token first, then the others in rank order, and
    the chosen token ranked first or outside the top-k); any other row goes through
    :func:`_top_row`."""
    n = len(tokens)
    token_ids = [_token_id(t) for t in tokens]
    if n == 0:
        return token_ids, LogprobRows.empty(k)
    lengths = np.fromiter(map(len, tops), np.int64, n)
    keys = " ".join(itertools.chain.from_iterable(tops)).replace(TOKEN_PREFIX, "").split()
    flat_ids = np.array(keys, dtype=np.int64) if keys else np.zeros(0, np.int64)
    flat_lps = np.fromiter(itertools.chain.from_iterable(d.values() for d in tops), np.float64, len(keys))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    chosen_ids = np.asarray(token_ids, np.int64)
    top_ids = np.full((n, k), -1, np.int32)
    top_lp = np.full((n, k), -np.inf, np.float32)
    safe = np.minimum(starts, max(len(keys) - 1, 0))
    first_is_chosen = (lengths > 0) & (flat_ids[safe] == chosen_ids) if len(keys) else np.zeros(n, bool)
    chosen = np.where(first_is_chosen, flat_lps[safe] if len(keys) else 0.0, np.nan)
    # Outside the top-k: k others after it. Ranked first: it and the k-1 others, in order.
    second = np.minimum(starts + 1, max(len(keys) - 1, 0))
    ranked_first = (lengths == k) & ((k == 1) | (flat_lps[second] <= chosen)) if len(keys) else first_is_chosen
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
    return token_ids, LogprobRows(token_lp, top_ids, top_lp)


def prompt_rows(positions: list[Any], token_ids: list[int], first: int, k: int) -> LogprobRows:
    """Positions ``first .. first+len(token_ids)-1`` of a response's ``prompt_logprobs`` (a dict of
    token id to ``{logprob, rank}`` per position) as LogprobRows, top-k by rank."""
    chosen: list[float] = []
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for i, token in enumerate(token_ids):
        position = positions[first + i] or {}
        by_id = {_token_id(key): value for key, value in position.items()}
        entry = by_id.get(token)
        if entry is None:
            raise RuntimeError(f"the server's prompt_logprobs lack the given token at position {first + i}")
        row = sorted(((int(v["rank"]), tid, _logprob(v["logprob"])) for tid, v in by_id.items()
                      if v.get("rank") is not None and 1 <= int(v["rank"]) <= k))
        chosen.append(_logprob(entry["logprob"]))
        ids.append([tid for _, tid, _ in row])
        lps.append([lp for _, _, lp in row])
    return _rows(chosen, ids, lps, k)


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


def chat_rows(token_ids: list[int], contents: list[dict[str, Any]], k: int) -> LogprobRows:
    """A chat completion's LogprobRows from ``logprobs.content`` (one entry per token: the chosen
    token's ``logprob`` and ``top_logprobs`` as ``[{token: "token_id:N", logprob}]``, the chosen
    token first, then the others in rank order). Ids come from ``token_id:N``, never from decoded
    strings; the chosen token is put back at its place by logprob and the row cut to k."""
    chosen: list[float] = []
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for token, entry in zip(token_ids, contents):
        value = entry.get("logprob")
        lp = float(value) if value is not None else float("nan")
        others = [(_token_id(str(t["token"])), float(t["logprob"])) for t in entry.get("top_logprobs") or ()]
        others = [(tid, v) for tid, v in others if tid != token]
        place = 0
        while place < len(others) and others[place][1] > lp:
            place += 1
        row = (others[:place] + [(token, lp)] + others[place:])[:k] if value is not None else others[:k]
        chosen.append(lp)
        ids.append([tid for tid, _ in row])
        lps.append([v for _, v in row])
    return _rows(chosen, ids, lps, k)


async def _events(session: Any, url: str, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of one streamed answer (server-sent ``data:`` lines) up to ``[DONE]``; an
    error status or an error chunk raises."""
    async with session.post(url, json=payload) as response:
        if response.status != 200:
            raise ServerHTTPError(shown_url(url), response.status, await response.text())
        async for raw in response.content:
            if not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"the server at {shown_url(url)} failed a request: {chunk['error']}")
            yield chunk
