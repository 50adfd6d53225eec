"""Checkable answers: is a prompt's expected answer in an output?

A prompt may carry ``expected`` (one accepted answer or several). An output is *correct* when it
contains any accepted answer, compared after Unicode NFKC normalisation, case folding and
collapsing every run of whitespace to one space. Containment is guarded at the answer's edges:

- an edge of the answer that is a letter, digit or ``_`` must not touch another letter, digit or
  ``_`` of the output, so ``4`` is not found in ``14`` or ``40``, ``Paris`` not in ``Parisian``
  (a single word or number matches on word boundaries; a phrase such as ``New York`` too);
- an answer that starts or ends with a digit is not found inside a longer number: not before or
  after a decimal or thousands separator, a fraction's slash or a time's colon next to a digit
  (``4`` is not in ``4.5``, ``4,000``, ``3/4`` or ``4:30``), and not right after a minus sign (``4``
  is not in ``-4`` or ``–4`` with an en dash; ``2-4`` still has it);
- CJK characters (Han, kana, Hangul) are never a boundary: CJK text is written without spaces,
  so a CJK answer is plain containment (``北京`` is in ``中国的首都是北京。``) and a number or a
  Latin word next to CJK text still matches (``4`` is in ``答案是4。``).

A prompt may also carry ``reject`` (wrong answers): an output holding one of them is not correct
even where it also holds an accepted answer, so a hedge that names every option is not counted
right (:class:`AnswerKey`).

Pure functions, no I/O: :func:`matching_answer`, :func:`rejected_answer` and :func:`is_correct`.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

_CJK = re.compile(
    "[\u1100-\u11ff\u2e80-\u2fdf\u3005-\u3007\u3021-\u3029\u3031-\u3035\u3038-\u303c\u3040-\u30ff\u3100-\u312f"
    "\u3130-\u318f\u31a0-\u31bf\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\ua960-\ua97f\uac00-\ud7ff\uf900-\ufaff"
    "\uff66-\uff9f\U00020000-\U0003134f]"
)
"""Han (with radicals and iteration marks), Hiragana, Katakana, Bopomofo and Hangul."""
_MINUS = "-"
"""A minus sign (:func:`normalise` writes U+2212 and the figure and en dashes as ``-``)."""
_DASHES = str.maketrans({"\u2212": "-", "\u2012": "-", "\u2013": "-"})
_SEPARATORS = ".,/:"
"""Decimal and thousands separators, a fraction's slash, a time's colon: a digit beyond one
continues the number."""


def normalise(text: str) -> str:
    """NFKC, case-folded, every run of whitespace one space, stripped, the minus sign and the
    figure and en dashes as ``-``, the combining dot above dropped (case folding turns Turkish
    ``İ`` into ``i`` + U+0307, which would never match ``I``): the form answers are compared in."""
    folded = unicodedata.normalize("NFKC", text).casefold().replace("\u0307", "")
    return " ".join(folded.translate(_DASHES).split())


def has_substance(answer: str) -> bool:
    """Whether an answer holds a letter, a digit or a CJK character: one of punctuation alone
    (``.``) would be found in almost any output."""
    return any(ch.isalnum() or _is_cjk(ch) for ch in normalise(answer))


def _is_cjk(ch: str) -> bool:
    return _CJK.match(ch) is not None


def _is_word(ch: str) -> bool:
    """A character that continues a word: letter, digit, ``_`` or a combining mark, but not CJK."""
    if _is_cjk(ch):
        return False
    return ch.isalnum() or ch == "_" or unicodedata.category(ch).startswith("M")


def _blocked_before(text: str, start: int, first: str) -> bool:
    """Does the output character before ``start`` continue the answer's first character?"""
    if start == 0:
        return False
    prev = text[start - 1]
    if _is_word(first) and _is_word(prev):
        return True
    if first.isdigit():
        if prev in _SEPARATORS and start >= 2 and text[start - 2].isdigit():
            return True
        if prev in _MINUS and (start < 2 or not _is_word(text[start - 2])):
            return True
    return False


def _blocked_after(text: str, end: int, last: str) -> bool:
    """Does the output character at ``end`` continue the answer's last character?"""
    if end >= len(text):
        return False
    nxt = text[end]
    if _is_word(last) and _is_word(nxt):
        return True
    return last.isdigit() and nxt in _SEPARATORS and end + 1 < len(text) and text[end + 1].isdigit()


def contains_answer(normalised_text: str, normalised_answer: str) -> bool:
    """Whether a :func:`normalise`\\ d output holds a :func:`normalise`\\ d answer (edges guarded)."""
    if not normalised_answer:
        return False
    first, last = normalised_answer[0], normalised_answer[-1]
    start = normalised_text.find(normalised_answer)
    while start >= 0:
        end = start + len(normalised_answer)
        if not _blocked_before(normalised_text, start, first) and not _blocked_after(normalised_text, end, last):
            return True
        start = normalised_text.find(normalised_answer, start + 1)
    return False


@dataclass(frozen=True)
class AnswerKey:
    """A prompt's accepted answers (``expected``) and the wrong ones that void them (``reject``)."""

    accepted: tuple[str, ...]
    rejected: tuple[str, ...] = ()

    @classmethod
    def of(cls, value: "AnswerKey | str | Iterable[str]") -> "AnswerKey":
        """A key from a key, one accepted answer or a list of them (no rejected ones)."""
        if isinstance(value, AnswerKey):
            return value
        return cls((value,) if isinstance(value, str) else tuple(value))


def _first_in(text: str, answers: Iterable[str]) -> str | None:
    for answer in answers:
        if contains_answer(text, normalise(answer)):
            return answer
    return None


def answers_in(output: str, key: "str | Iterable[str] | AnswerKey") -> tuple[str | None, str | None]:
    """(the first accepted answer ``output`` contains, if it holds no rejected one; the first
    rejected answer it contains), each as given or None: the output normalised once."""
    key = AnswerKey.of(key)
    text = normalise(output)
    rejected = _first_in(text, key.rejected)
    return (None if rejected is not None else _first_in(text, key.accepted)), rejected


def rejected_answer(output: str, rejected: Iterable[str]) -> str | None:
    """The first rejected answer (as given) that ``output`` contains; None when it holds none."""
    return _first_in(normalise(output), rejected)


def matching_answer(output: str, accepted: "str | Iterable[str] | AnswerKey",
                    rejected: Iterable[str] = ()) -> str | None:
    """The first accepted answer (as given) that ``output`` contains, if it contains no rejected
    one (``rejected``, or the key's); None otherwise."""
    key = AnswerKey.of(accepted)
    return answers_in(output, AnswerKey(key.accepted, (*key.rejected, *rejected)))[0]


def is_correct(output: str, accepted: "str | Iterable[str] | AnswerKey", rejected: Iterable[str] = ()) -> bool:
    """Whether ``output`` contains an accepted answer and no rejected one."""
    return matching_answer(output, accepted, rejected) is not None
