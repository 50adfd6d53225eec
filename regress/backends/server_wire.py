"""Parsing vLLM server answers (the wire format): streams, choices, text and the small answers.

A streamed completion or chat completion becomes a checked
:class:`~regress.backends.base.RawGeneration` (:func:`read_completion`, :func:`read_chat`): one
choice per chunk, the one asked for; text only with the tokens it comes from; a finish reason that
says the output is whole, and nothing after it. The token ids and logprob rows of every answer are
read by :mod:`regress.backends.server_rows` (re-exported here), and the text is checked against the
ids by :mod:`regress.backends.server_text`. The small answers of the pre-run
checks are read here too: ``/version`` (:func:`server_version`), ``/v1/models``
(:func:`served_models`) and the one choice of an answer that is not streamed (:func:`one_choice`).

Anything else raises :class:`~regress.errors.ServerReplyError` saying what and where; the backend
adds the URL and the request.

Runs inside the candidate's environment: standard library and numpy at import.
"""

from __future__ import annotations

import re
import time
from typing import Any

from regress.backends.base import RawGeneration
from regress.backends.server_http import stream_limit
from regress.backends.server_rows import (  # noqa: F401  (re-exported: the backend and tests read them here)
    TOKEN_PREFIX,
    _rows,
    _shown,
    _token_id,
    _top_row,
    chat_rows,
    count,
    prompt_rows,
    stream_rows,
    token_ids,
)
from regress.backends.server_text import TextCheck
from regress.errors import ServerReplyError

FINISH_REASONS = frozenset({"stop", "length", "repetition"})
"""Finish reasons of a whole output (vLLM's ``abort`` and ``error`` mean it was cut short)."""
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]{0,99}", re.ASCII)
"""A version as ``/version`` reports one: PEP 440's characters (``0.10.2rc1.dev12+g1a2b3c.cu128``),
at most 100; it is recorded in the run's manifest and printed."""


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


# -- the small answers of the pre-run checks ------------------------------------------------


def server_version(answer: Any) -> str | None:
    """The vLLM version a ``/version`` answer reports; None where it names none (an answer of
    another shape, or no ``version``: a server without the route is no error). A version that is
    there must be one (:data:`_VERSION`): it crosses into the manifest, whose JSON cannot hold a
    lone surrogate, and is printed, where a control character would act on the terminal."""
    found = answer.get("version") if isinstance(answer, dict) else None
    if found is None:
        return None
    if not isinstance(found, str) or not _VERSION.fullmatch(found):
        raise ServerReplyError(f"/version reports the version {_shown(found)}: not a version (at most 100 ASCII "
                               "letters, digits and . + ! _ -, no control character or lone surrogate)")
    return found


def served_models(answer: Any) -> list[dict[str, Any]]:
    """The models a ``/v1/models`` answer lists: ``data``, a list of objects, each with an ``id``
    (a name, not empty) and a ``root`` that is a name or null. The served name is what every
    request then carries: a model without one cannot be asked for."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ServerReplyError(f"/v1/models answered {_shown(answer)}: no list of models under 'data'")
    for model in data:
        if not isinstance(model, dict) or not isinstance(model.get("id"), str) or not model["id"]:
            raise ServerReplyError(f"/v1/models lists {_shown(model)}: not a model with an 'id' name")
        if model.get("root") is not None and not isinstance(model["root"], str):
            raise ServerReplyError(f"/v1/models lists the model {model['id']!r} with the root {_shown(model['root'])}, "
                                   "not a name")
    return data


def _index_zero(choice: Any) -> dict[str, Any]:
    """A choice that is the one asked for: an object whose ``index`` is the JSON number 0. vLLM
    always writes the index; a bool, a float or none at all equals 0 in Python but is not its
    answer."""
    if not isinstance(choice, dict):
        raise ServerReplyError(f"a choice that is {_shown(choice)}, not an object")
    index = choice.get("index")
    if type(index) is not int:
        raise ServerReplyError(f"a choice whose index is {_shown(index)}, not a whole number")
    if index != 0:
        raise ServerReplyError(f"a choice other than the one asked for: {_shown(choice)}")
    return choice


def one_choice(answer: Any, what: str) -> dict[str, Any]:
    """The choice of an answer that is not streamed (one was asked for): ``choices`` holds it alone."""
    if not isinstance(answer, dict):
        raise ServerReplyError(f"{what} is {_shown(answer)}, not a JSON object")
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise ServerReplyError(f"{what} has the choices {_shown(choices)}, not the one choice asked for")
    return _index_zero(choices[0])


def completion_probe(answer: Any) -> tuple[list[Any], Any, list[Any]] | None:
    """The tokens, ``top_logprobs`` rows and ``prompt_logprobs`` positions of the answer to the
    1-token completion probe, their shapes checked (their values are the row readers'); None where
    the server left them out or wrote tokens as text: it does not do what regress asks
    (``logprobs``, ``prompt_logprobs``, ``return_tokens_as_token_ids``), which is the user's choice
    of server, not a malformed answer."""
    choice = one_choice(answer, "the answer")
    logprobs, positions = choice.get("logprobs"), choice.get("prompt_logprobs")
    if logprobs is None or positions is None:
        return None
    tokens, tops = _object(logprobs, "logprobs").get("tokens"), logprobs.get("top_logprobs")
    if tokens is None or tops is None:
        return None
    if not isinstance(tokens, list) or len(tokens) != 1:
        raise ServerReplyError(f"{count(tokens)} tokens for a 1-token probe")
    if isinstance(tokens[0], str) and not tokens[0].startswith(TOKEN_PREFIX):
        return None
    if not isinstance(positions, list):
        raise ServerReplyError(f"prompt_logprobs {_shown(positions)}, not a list of positions")
    return tokens, tops, positions


def chat_probe(answer: Any, vocab: int | None) -> tuple[list[int], list[int], list[Any]] | None:
    """The prompt's token ids, the output's and the ``logprobs.content`` of the answer to the
    1-token chat probe, checked as far as their shapes (None as for :func:`completion_probe`:
    the server returns no token ids, or its tokens as text)."""
    choice = one_choice(answer, "the answer")
    prompt, output, logprobs = answer.get("prompt_token_ids"), choice.get("token_ids"), choice.get("logprobs")
    content = _object(logprobs, "logprobs").get("content")
    if prompt is None or output is None or content is None:
        return None
    if not isinstance(content, list) or not content:
        raise ServerReplyError(f"logprobs.content {_shown(content)}, not the probe's entries")
    first = content[0].get("token") if isinstance(content[0], dict) else None
    if isinstance(first, str) and not first.startswith(TOKEN_PREFIX):
        return None
    prompt_ids = token_ids(prompt, vocab, "prompt_token_ids")
    if not prompt_ids:
        raise ServerReplyError("no prompt_token_ids for a chat request (return_token_ids)")
    return prompt_ids, token_ids(output, vocab, "token_ids"), content


# -- streamed answers -------------------------------------------------------------------------


def _choices(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream chunk's choices: none (a chunk of usage only) or the one asked for, once. Two
    choices of index 0 in one chunk would be two pieces of one output in an order nobody vouches
    for, so they are refused rather than joined."""
    choices = chunk.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list):
        raise ServerReplyError(f"choices {_shown(choices)}, not a list")
    for choice in choices:
        _index_zero(choice)
    if len(choices) > 1:
        raise ServerReplyError(f"{len(choices)} choices of index 0 in one chunk, for the one choice asked for")
    return choices


def _text(value: Any) -> str:
    """A piece of output text: a string of Unicode text. JSON can spell a lone surrogate
    (``"\\ud800"``) and Python reads it, but no UTF-8 holds it: the shard, the manifest and
    every report would fail on it far from here."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ServerReplyError(f"text {_shown(value)}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ServerReplyError(f"text with a lone surrogate ({value[exc.start]!r} at character {exc.start}), "
                               "which is not Unicode text") from None
    return value


def _finished(finish: Any, text: str, n_tokens: int, max_tokens: int) -> str:
    """A streamed output's finish reason, once its stream is complete: one that says the output is
    whole and no more tokens than asked for."""
    if finish is None:
        raise ServerReplyError("the stream ended without a finish reason (cut short)")
    if not isinstance(finish, str) or finish not in FINISH_REASONS:
        raise ServerReplyError(f"the finish reason {_shown(finish)}, not one of {', '.join(sorted(FINISH_REASONS))} "
                               "(the output is not whole)")
    if n_tokens > max_tokens:
        raise ServerReplyError(f"{n_tokens} output tokens for max_tokens {max_tokens}")
    return finish


class _StreamTally:
    """What a streamed answer has said so far: its tokens with their logprob entries, its text,
    its finish reason and when its first token came; the rules both endpoints share are applied
    as chunks are added: text only with tokens, and nothing after the finish reason."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first: float | None = None
        self.tokens: list[Any] = []
        self.entries: list[Any] = []
        self.text: list[str] = []
        self.finish: Any = None
        self.last = 0
        """Tokens of the last chunk that had any: the server's last step (where a stop string ends)."""

    def add(self, choice: dict[str, Any], piece: str, tokens: list[Any], entries: list[Any]) -> None:
        if self.finish is not None:
            # vLLM sends nothing for a choice after its finish reason (usage comes in a chunk of
            # no choices): a later chunk would add to, or rewrite, an output already declared whole.
            said = ("tokens" if tokens else "text" if piece else
                    "another finish reason" if choice.get("finish_reason") is not None else "a choice")
            raise ServerReplyError(f"{said} after the finish reason {_shown(self.finish)}")
        if piece and not tokens:
            # Every piece of text is the detokenized form of tokens it comes with: text that no
            # token backs would be scored as the output without being in it.
            raise ServerReplyError(f"text without token ids (a chunk of {len(piece)} characters and no tokens)")
        if tokens:
            if self.first is None:
                self.first = time.perf_counter()
            self.tokens += tokens
            self.entries += entries
            self.last = len(tokens)
        self.text.append(piece)
        self.finish = choice.get("finish_reason")

    def finished(self, max_tokens: int) -> tuple[str, str, dict[str, float]]:
        """(text, finish reason, timing) of a stream that ended: see :func:`_finished`."""
        end = time.perf_counter()
        text = "".join(self.text)
        reason = _finished(self.finish, text, len(self.tokens), max_tokens)
        return text, reason, {"ttft_s": (self.first if self.first is not None else end) - self.sent,
                              "total_s": end - self.sent}


def _object(value: Any, what: str) -> dict[str, Any]:
    """An optional object of a choice (``logprobs``, ``delta``): absent or null is empty."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ServerReplyError(f"{what} {_shown(value)}, not an object")
    return value


async def read_completion(client: Any, path: str, payload: dict[str, Any], vocab: int | None, *,
                          text_check: TextCheck | None) -> RawGeneration:
    """One streamed completion (``payload`` asks ``logprobs`` k with ``return_tokens_as_token_ids``):
    every chunk with text has ``logprobs`` and one ``top_logprobs`` row per token, and the stream
    ends with a finish reason and ``[DONE]``; the text is what the ids decode to after the prompt
    (``text_check``; None only where a test reads the wire format alone). ``client`` is a
    :class:`~regress.backends.server_http.ServerClient`."""
    k = int(payload["logprobs"])
    max_tokens = int(payload["max_tokens"])
    tally = _StreamTally()
    # Only collect while streaming (the client shares the CPU with the server); parse after.
    async for chunk in client.events(path, payload, limit=stream_limit(len(payload["prompt"]), max_tokens, k + 1)):
        for choice in _choices(chunk):
            piece = _text(choice.get("text"))
            logprobs = _object(choice.get("logprobs"), "logprobs")
            new = logprobs.get("tokens")
            new = [] if new is None else new
            rows = logprobs.get("top_logprobs")
            rows = [] if rows is None and not new else rows
            if not isinstance(new, list) or not isinstance(rows, list) or len(rows) != len(new):
                raise ServerReplyError(f"a chunk with {count(new)} tokens and {count(rows)} top_logprobs rows "
                                       "(one row per token)")
            tally.add(choice, piece, new, rows)
    text, reason, timing = tally.finished(max_tokens)
    ids, logprob_rows = stream_rows(tally.tokens, tally.entries, k, vocab)
    if text_check is not None:
        text_check.check(text, ids, payload["prompt"], reason, payload.get("stop"), tally.last)
    return RawGeneration(output_token_ids=ids, text=text, finish_reason=reason, logprobs=logprob_rows, timing=timing)


async def read_chat(client: Any, path: str, payload: dict[str, Any], k: int, prompt_tokens: int,
                    vocab: int | None, *, text_check: TextCheck | None) -> RawGeneration:
    """One streamed chat completion: the prompt's token ids (``return_token_ids``) from a chunk,
    then each chunk's ``token_ids`` with as many ``logprobs.content`` entries; the stream ends with
    a finish reason and ``[DONE]``; the content is what the ids decode to after the prompt ids the
    server reports (``text_check``, as for :func:`read_completion`). ``prompt_tokens``: regress's
    own count, for the byte limit."""
    max_tokens = int(payload["max_tokens"])
    prompt_ids: list[int] | None = None
    tally = _StreamTally()
    limit = stream_limit(prompt_tokens, max_tokens, int(payload["top_logprobs"]) + 2)
    async for chunk in client.events(path, payload, limit=limit):
        if chunk.get("prompt_token_ids") is not None:
            said = token_ids(chunk["prompt_token_ids"], vocab, "prompt_token_ids")
            if prompt_ids is not None and said != prompt_ids:  # which of the two did the output follow?
                raise ServerReplyError(f"two different prompt_token_ids in one stream ({len(prompt_ids)} and "
                                       f"{len(said)} tokens)")
            prompt_ids = said
        for choice in _choices(chunk):
            piece = _text(_object(choice.get("delta"), "delta").get("content"))
            content = _object(choice.get("logprobs"), "logprobs").get("content")
            content = [] if content is None else content
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
    rows = chat_rows(tally.tokens, tally.entries, k, vocab)
    if text_check is not None:
        text_check.check(text, tally.tokens, prompt_ids, reason, payload.get("stop"), tally.last, what="content")
    return RawGeneration(output_token_ids=tally.tokens, text=text, finish_reason=reason,
                         logprobs=rows, prompt_token_ids=prompt_ids,
                         timing=timing)
