"""Token ids, logprobs and LogprobRows read from a vLLM server's answers, every value checked.

Completions report tokens as ``token_id:N`` (``return_tokens_as_token_ids``) with ``top_logprobs``
per position; teacher forcing reads ``prompt_logprobs``; the chat endpoint reports
``logprobs.content``. Logprobs the server clamped to -9999 (JSON has no infinity) are read back
as -inf.

Every value is checked as it is read, since what a server answers is scored: a token id is
``token_id:N`` (ASCII digits) inside the vocabulary, a logprob a finite JSON number <= 0, there is
one row per token and each row holds the chosen token and the full top-k
(:func:`regress.backends.base.rows_problem` checks the rows built). A row must also agree with
itself (:func:`_contradiction`): best first, no token twice under any spelling, one logprob per
token, a chosen token left out of its top-k no more likely than the k-th entry, and a best entry
above the clamp. Anything else raises :class:`~regress.errors.ServerReplyError` saying what and
where; the backend adds the URL and the request.

Runs inside the candidate's environment: standard library and numpy at import.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, Iterable

import numpy as np

from regress.backends.base import LOGPROB_TOLERANCE, LogprobRows, rows_problem
from regress.errors import ServerReplyError

TOKEN_PREFIX = "token_id:"
_MIN_LOGPROB = -9999.0
"""vLLM's OpenAI server writes ``max(logprob, -9999.0)`` (JSON has no infinity), so -9999 stands
for any logprob at or below it: read back as -inf, a probability of 0 as near as makes no
difference. No distribution over a vocabulary of V tokens puts its most likely token that low (its
logprob is at least -ln V, about -12 for 150k tokens), so a row whose best entry is at the clamp
is refused (:func:`_contradiction`) rather than scored as a row of -inf."""
_ID = re.compile(r"(?:token_id:)?([0-9]{1,10})", re.ASCII)
_PREFIXED_IDS = re.compile(r"token_id:[0-9]{1,10}(?: token_id:[0-9]{1,10})*", re.ASCII)
_INT32_BOUND = 2 ** 31


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


def _differ(a: float, b: float) -> bool:
    """Whether two logprobs of one token disagree by more than float rounding (-inf equals -inf)."""
    return a != b and not abs(a - b) <= LOGPROB_TOLERANCE


def _contradiction(rows: LogprobRows, tokens: Any) -> str | None:
    """What makes rows that :func:`rows_problem` passed contradict themselves (None: nothing), with
    ``tokens`` the chosen token of each row (None: not known, those checks skipped).

    Every comparison allows :data:`LOGPROB_TOLERANCE`, as rows_problem does for a chosen token
    against its row's best: vLLM takes the chosen token's logprob and the top-k from one tensor
    (equal values arrive equal), but a server may compute the two apart, in another precision or
    kernel, and a difference of float rounding is no contradiction worth a refusal."""
    token_lp, top_ids, top_lp = rows.token_logprobs, rows.top_ids, rows.top_logprobs
    if not len(token_lp) or not top_ids.shape[1]:
        return None
    clamped = top_lp[:, 0] == -np.inf
    if clamped.any():
        i = int(np.argmax(clamped))
        return (f"the best entry of the top-k row at position {i} is at the server's -9999 clamp (probability 0): "
                "no distribution's most likely token is that unlikely")
    if tokens is None:
        return None
    chosen = np.asarray(tokens, np.int64).reshape(-1)
    listed = top_ids == chosen[:, None]
    with np.errstate(invalid="ignore"):  # -inf - -inf: the same value
        apart = listed & (np.abs(top_lp - token_lp[:, None]) > LOGPROB_TOLERANCE)
    if apart.any():
        i, j = (int(x) for x in np.argwhere(apart)[0])
        return (f"token {int(chosen[i])} at position {i} has two logprobs: {float(token_lp[i])!r} as the chosen "
                f"token and {float(top_lp[i, j])!r} in its top-k")
    above = ~listed.any(axis=1) & (token_lp > top_lp[:, -1] + LOGPROB_TOLERANCE)
    if above.any():
        i = int(np.argmax(above))
        return (f"the chosen token {int(chosen[i])} at position {i} ({float(token_lp[i])!r}) is left out of its "
                f"top-k although more likely than the k-th entry ({float(top_lp[i, -1])!r})")
    return None


def _checked(rows: LogprobRows, k: int, vocab: int | None, tokens: Any = None) -> LogprobRows:
    problem = rows_problem(rows, k, vocab) or _contradiction(rows, tokens)
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
          vocab: int | None = None, tokens: list[int] | None = None) -> LogprobRows:
    """LogprobRows from per-position lists, checked: each row must hold ``k`` ids and logprobs
    (and, given the chosen ``tokens``, agree with them: :func:`_contradiction`)."""
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
    return _checked(LogprobRows(token_lp, top_ids, top_lp), k, vocab, tokens)


def _twice(flat_ids: np.ndarray, lengths: np.ndarray, tops: list[dict[str, float]]) -> str | None:
    """A token named twice in one ``top_logprobs`` row (None: none is). The keys of a JSON object
    differ, but ``token_id:5`` and ``token_id:05`` are one token, which would then carry two
    logprobs, or stand twice in its row."""
    row_of = np.repeat(np.arange(len(lengths)), lengths)
    order = np.lexsort((flat_ids, row_of))
    ids, rows = flat_ids[order], row_of[order]
    same = (ids[1:] == ids[:-1]) & (rows[1:] == rows[:-1])
    if not same.any():
        return None
    i, token = int(rows[1:][same][0]), int(ids[1:][same][0])
    spellings = ", ".join(repr(key) for key in tops[i] if _token_id(key) == token)
    return f"the top_logprobs row at output position {i} names token {token} twice ({spellings})"


def stream_rows(tokens: list[str], tops: list[dict[str, float]], k: int,
                vocab: int | None = None) -> tuple[list[int], LogprobRows]:
    """A streamed completion's token ids and LogprobRows, from its ``tokens`` and ``top_logprobs``
    (one row per token, each the chosen token and the top-k: k or k+1 entries).

    Vectorized for the usual layout (the chosen token first, then the others in rank order, and
    the chosen token ranked first or outside the top-k); any other row goes through
    :func:`_top_row`."""
    if not isinstance(tokens, list) or not isinstance(tops, list):
        raise ServerReplyError(f"tokens {_shown(tokens)} and top_logprobs {_shown(tops)}, not two lists")
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
    twice = _twice(flat_ids, lengths, tops)
    if twice is not None:
        raise ServerReplyError(twice)
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
    return token_ids, _checked(LogprobRows(token_lp, top_ids, top_lp), k, vocab, chosen_ids)


def prompt_rows(positions: list[Any], token_ids: list[int], first: int, k: int,
                vocab: int | None = None) -> LogprobRows:
    """Positions ``first .. first+len(token_ids)-1`` of a response's ``prompt_logprobs`` (a dict of
    token id to ``{logprob, rank}`` per position: the top-k by rank and the given token) as
    LogprobRows, top-k by rank. Ranks and logprobs must agree: an entry ranked after another is
    no more likely than it."""
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
            if tid in by_id:  # "5" and "token_id:05" are one token
                raise ServerReplyError(f"{where} names token {tid} twice")
            rank = value.get("rank") if isinstance(value, dict) else None
            if type(rank) is not int or rank < 1:
                raise ServerReplyError(f"{where}: token {tid} has the rank {_shown(rank)}, not a number from 1")
            by_id[tid] = (rank, _logprob(value.get("logprob"), f"{where}: a logprob"))
        entry = by_id.get(token)
        if entry is None:
            raise ServerReplyError(f"{where} lacks the given token {token}")
        # By rank, the more likely first among equal ranks (the given token's rank may tie a
        # top-k entry's): then the logprobs must not rise, or the top-k cut below would keep a
        # less likely token and drop a more likely one.
        ranked = sorted((rank, -lp, tid) for tid, (rank, lp) in by_id.items())
        for (rank_a, minus_a, tid_a), (rank_b, minus_b, tid_b) in zip(ranked, ranked[1:]):
            if -minus_b > -minus_a + LOGPROB_TOLERANCE:
                raise ServerReplyError(f"{where}: token {tid_b} (rank {rank_b}, {-minus_b!r}) is more likely than "
                                       f"token {tid_a} (rank {rank_a}, {-minus_a!r}): ranks and logprobs disagree")
        row = [(tid, -minus) for rank, minus, tid in ranked if rank <= k][:k]
        chosen.append(entry[1])
        ids.append([tid for tid, _ in row])
        lps.append([lp for _, lp in row])
    return _rows(chosen, ids, lps, k, vocab, token_ids)


def chat_rows(token_ids: list[int], contents: list[dict[str, Any]], k: int, vocab: int | None = None) -> LogprobRows:
    """A chat completion's LogprobRows from ``logprobs.content`` (one entry per token: the chosen
    token's ``logprob`` and ``top_logprobs`` as ``[{token: "token_id:N", logprob}]``, the chosen
    token first, then the others in rank order). Ids come from ``token_id:N``, never from decoded
    strings; the chosen token is put back at its place by logprob and the row cut to k. The list
    must agree with itself: the others best first, no token twice, and the chosen token, where
    listed, with the logprob of its entry."""
    if not isinstance(contents, list):
        raise ServerReplyError(f"logprobs.content is {_shown(contents)}, not a list of entries")
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
        others: list[tuple[int, float]] = []
        seen: set[int] = set()
        for other in listed:
            if not isinstance(other, dict):
                raise ServerReplyError(f"{where}: a top_logprobs entry is {_shown(other)}, not an object")
            tid = _in_vocabulary(_token_id(other.get("token")), vocab, f"{where}: a top_logprobs token")
            value = _logprob(other.get("logprob"), f"{where}: a top_logprobs logprob")
            if tid in seen:
                raise ServerReplyError(f"{where}: top_logprobs lists token {tid} twice")
            seen.add(tid)
            if tid == token:  # dropped below (put back by its entry's logprob): the two must agree
                if _differ(value, lp):
                    raise ServerReplyError(f"{where}: top_logprobs gives the chosen token {token} the logprob "
                                           f"{value!r}, its entry {lp!r}")
                continue
            # Checked over the whole list, not only the k kept: a better token past the cut
            # would otherwise be dropped silently.
            if others and value > others[-1][1] + LOGPROB_TOLERANCE:
                raise ServerReplyError(f"{where}: top_logprobs is not best first (token {tid} at {value!r} after "
                                       f"token {others[-1][0]} at {others[-1][1]!r})")
            others.append((tid, value))
        place = 0
        while place < len(others) and others[place][1] > lp:
            place += 1
        row = (others[:place] + [(token, lp)] + others[place:])[:k]
        chosen.append(lp)
        ids.append([tid for tid, _ in row])
        lps.append([v for _, v in row])
    return _rows(chosen, ids, lps, k, vocab, token_ids)
