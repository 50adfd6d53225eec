"""Whether a served answer's text is what its token ids decode to (``backend: server``).

A server's answer carries an output twice: as token ids (``token_id:N``), on which exact match and
the first divergence are scored, and as text, on which edit distance, ROUGE-L, semantic similarity
and the expected-answer checks are. Nothing but this module ties the two together: a broken or
hostile server could send the golden's ids (scored identical) with any text, or the golden's text
with other ids. So the text is checked against the ids, decoded with the candidate's tokenizer (the
one regress renders prompts with, loaded from its directory), the way vLLM's server detokenizes a
request that leaves ``skip_special_tokens`` (true), ``spaces_between_special_tokens`` and
``include_stop_str_in_output`` (false) at their defaults, as regress's requests do:

- **decoded with the tokenizer's own decoder**, special tokens skipped: a fast tokenizer through its
  ``tokenizers`` backend (what vLLM's incremental detokenizer steps), else ``decode`` without the
  clean-up of tokenization spaces (vLLM joins token strings without it);
- **in the prompt's context**: the output's text is what decoding prompt + output adds to decoding
  the prompt (vLLM primes its detokenizer with the prompt: SentencePiece-style decoders drop a
  leading space only at the start of a text). The decode without the prompt is accepted too (a
  server that decodes the output alone): both are renderings of the same ids;
- **held back at an incomplete character**: an incremental detokenizer emits text only where the
  decode does not end in U+FFFD, so a character split across tokens waits for its last byte, and
  what still waits when the output ends is never sent. The text is then the decode of the longest
  prefix of the output whose decode is whole; the one-shot decode (ending in U+FFFD) is accepted
  too;
- **finish ``stop``**: the token that stopped the output (EOS, a stop token id) is not
  detokenized, so the decode without the last token is accepted;
- **stop strings** (the request's ``stop``): the text is cut before the stop string. Accepted when
  the text followed by one of the request's stop strings begins the decode, and that stop string
  ends in the text of the answer's last chunk of tokens (the server looks for a stop string in each
  step's new text and stops at the step that completes one).

Anything else is a :class:`~regress.errors.ServerReplyError` saying where the text and the decode
part, both shortened and escaped (the text may hold markup or control characters): exit 3 naming
the prompt, never a score.

Runs inside the candidate's environment: standard library at import; the tokenizer is the backend's.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from regress.errors import ServerReplyError
from regress.untrusted import without_controls

REPLACEMENT = "\ufffd"
"""What a decoder writes for bytes that are not (yet) a whole UTF-8 character."""
_CONTEXT = 16
"""Prompt tokens decoded before the output: enough for any decoder's start-of-text rule, and few
enough that checking a long prompt costs no more than a short one (the whole prompt is used where
these end inside a character)."""
_SHOWN = 48
"""Characters of the text and of the decode shown from where they part."""
_MARKUP = str.maketrans({c: f"\\u{ord(c):04x}" for c in "<>&'`"})


def shown(text: str) -> str:
    """``text`` quoted and escaped for any place a message goes (a terminal, a log, a page, a
    Markdown summary): JSON's escapes for quotes, backslashes and control characters, and ``<``,
    ``>``, ``&``, ``'`` and a backtick as ``\\u003c`` ...: no markup, no escape sequence survives."""
    return without_controls(json.dumps(text, ensure_ascii=False)).translate(_MARKUP)


def _decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """Decoding as vLLM's detokenizers do: a fast tokenizer's ``tokenizers`` backend (``decode`` of
    transformers would also clean up tokenization spaces where the tokenizer's config asks it to),
    else the tokenizer's ``decode`` without that clean-up; special tokens skipped either way."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and callable(getattr(backend, "decode", None)):
        return lambda ids: backend.decode(list(ids), skip_special_tokens=True)
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


class _Rendering:
    """The texts an output's ids may be sent as, after one context (prompt ids, or none)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: list[int], ids: list[int]):
        self.decode, self.context, self.ids = decode, context, ids
        self.base = decode(context) if context else ""
        # Each prefix decoded once: the held-back scans of the whole output and of all but its
        # last token walk the same prefixes, and an answer that ends inside a character for
        # many tokens would otherwise cost a decode per prefix per scan.
        self._decoded: dict[int, str | None] = {}

    def whole(self, n: int) -> str | None:
        """What the first ``n`` output ids add to the context's decode (None: the decode of the
        context is not where the longer decode starts, so nothing can be told apart from it)."""
        if n not in self._decoded:
            full = self.decode(self.context + self.ids[:n])
            self._decoded[n] = full[len(self.base):] if full.startswith(self.base) else None
        return self._decoded[n]

    def streamed(self, n: int) -> str | None:
        """The text an incremental detokenizer has sent after the first ``n`` output ids: the
        decode of the longest prefix of them whose decode does not end inside a character."""
        for m in range(n, -1, -1):
            text = self.whole(m)
            if text is not None and not text.endswith(REPLACEMENT):
                return text
        return None

    def explains(self, text: str, finish: str, stop: Sequence[str], last: int) -> bool:
        """Whether ``text`` is a rendering of the ids the server may send (module docstring)."""
        n = len(self.ids)
        whole = self.whole(n)
        if whole is None:
            return False
        if text == whole:
            return True
        sent = whole if not whole.endswith(REPLACEMENT) else self.streamed(n)
        if text == sent:
            return True
        if finish != "stop" or not n:
            return False
        if text in (self.whole(n - 1), self.streamed(n - 1)):  # the stop token is not detokenized
            return True
        for word in stop:
            if word and any(t is not None and t.startswith(text + word) for t in (sent, whole)):
                before = self.streamed(n - last) or ""
                if len(text) + len(word) > len(before):
                    return True
        return False


class TextCheck:
    """The check of a served answer's text against its token ids, with the candidate's tokenizer."""

    def __init__(self, tokenizer: Any):
        self._decode = _decoder(tokenizer)

    def _contexts(self, prompt_ids: Sequence[int]) -> list[list[int]]:
        """The prompt's last tokens (all of them where those end inside a character), then none."""
        prompt = list(prompt_ids)
        context = prompt[-_CONTEXT:]
        if context and REPLACEMENT in self._decode(context)[-1:]:
            context = prompt
        return [context, []] if context else [[]]

    def check(self, text: str, output_ids: Sequence[int], prompt_ids: Sequence[int], finish: str,
              stop: Sequence[str] | None, last: int, what: str = "text") -> None:
        """Raise :class:`ServerReplyError` unless ``text`` is what ``output_ids`` decode to after
        ``prompt_ids`` (module docstring), for an output that finished for ``finish`` under the
        request's ``stop`` strings, ``last`` of its ids in its last chunk. ``what``: the answer's
        name for its text (``text``, ``content``), for the message."""
        ids = list(output_ids)
        renderings = [_Rendering(self._decode, context, ids) for context in self._contexts(prompt_ids)]
        if any(r.explains(text, finish, list(stop or ()), max(1, min(last, len(ids)))) for r in renderings):
            return
        first = renderings[0]
        expected = first.streamed(len(ids))
        expected = expected if expected is not None else self._decode(ids)
        raise ServerReplyError(_mismatch(text, expected, len(ids), what))


def _mismatch(text: str, expected: str, n: int, what: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(text, expected)) if a != b), min(len(text), len(expected)))
    start = max(0, at - 8)

    def part(s: str) -> str:
        piece = s[start:start + _SHOWN]
        return ("..." if start else "") + shown(piece) + ("..." if start + _SHOWN < len(s) else "")

    note = (" (a server with a reasoning or tool-call parser moves text out of the content)"
            if what == "content" else "")
    return (f"the {what} is not what its {n} token ids decode to (the candidate's tokenizer, special tokens "
            f"skipped, as vLLM's server detokenizes): from character {at} the server sent {part(text)} "
            f"({len(text)} characters) where the ids decode to {part(expected)} ({len(expected)} characters); "
            f"scored, the {what} would stand for an output the ids do not hold{note}")
