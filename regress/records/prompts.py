"""Prompt set records: one prompt (text or chat messages) and the card beside a prompt set."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from regress.records.base import _Strict
from regress.records.sampling import MAX_SAMPLES, SamplingSpec

MIN_CHOICES = 2
MAX_CHOICES = 26
"""A multiple-choice prompt holds 2 to 26 continuations (A to Z: no benchmark needs more, and each
one costs a prefill on every side)."""
MAX_CHOICE_CHARS = 4000
"""Longest continuation, in characters: a choice is an answer, not a document."""


FIELD_PROBLEM = "prompt_field"
"""pydantic error type of a problem found across fields (a model validator, whose errors pydantic
locates nowhere); its context's ``field`` names the field a reader should look at, and
:func:`regress.datasets.check_prompt_set` reports it there."""


def _field_problem(field: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(FIELD_PROBLEM, message.replace("{", "{{").replace("}", "}}"), {"field": field})


class Message(_Strict):
    """One chat message."""

    role: Literal["system", "user", "assistant", "tool"]
    """Who speaks."""
    content: str
    """What is said."""


class PromptRecord(_Strict):
    """One line of a prompt set (``datasets/prompts/<name>.jsonl``)."""

    id: str = Field(min_length=1, max_length=200)
    """Stable identifier; golden and candidate outputs are matched by it."""
    prompt: str | None = None
    """Plain text prompt, tokenized by the candidate's tokenizer."""
    messages: list[Message] | None = None
    """Chat conversation, rendered with the model's chat template (generation prompt added)."""
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    """Per-prompt sampling overrides."""
    tags: list[str] = Field(default_factory=list)
    """Free labels used to group and filter prompts in reports."""
    samples: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    """Run this prompt this many times (temperature > 0 only), each with its own seed derived from
    the prompt id and the resolved ``seed``; golden and candidate outputs are compared as
    distributions (:mod:`regress.metrics.sampled`). Overrides the card's ``samples``."""
    expected: list[str] | None = None
    """Checkable answer: a non-empty string, or a non-empty list of accepted strings (any one
    counts). An output is correct when it contains one, compared case-insensitively after NFKC
    and whitespace collapsing, on word boundaries (``4`` is not in ``14``; CJK: plain containment;
    see :mod:`regress.metrics.answers`). Scoring reports the answers golden and candidate get
    right and the flips between them. Stored as a list."""

    reject: list[str] | None = None
    """Answers that make an output wrong even where it also holds an expected one (needs
    ``expected``): the wrong options of a question, so that a hedge naming every one (``Paris,
    London or Rome``, ``A B C D``) is not counted right. Compared as ``expected`` is; a string or
    a list, stored as a list. A rejected answer may hold an accepted one (``Paris, Texas`` for
    ``Paris``), never be part of one (``York`` for ``New York``: every right output would hold it)."""

    choices: list[str] | None = None
    """Multiple choice: 2 to 26 distinct continuations, each scored by its log-likelihood after
    the rendered prompt (one prefill per choice, in the same engine session as the generation).
    A choice is tokenized on its own, without special tokens, and its tokens follow the prompt's
    tokens: write the separator it needs (``" Paris"`` after ``"The capital of France is"``, as
    lm-evaluation-harness's target delimiter does; nothing is added or stripped). Needs
    ``answer``; not with ``expected`` or ``samples``."""
    answer: int | None = None
    """Index (0-based) of the right choice in ``choices``."""

    @field_validator("choices", mode="before")
    @classmethod
    def _choice_list(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, list):
            raise ValueError(f"must be a list of {MIN_CHOICES} to {MAX_CHOICES} strings (continuations), "
                             f"got {_json_type(value)}")
        # The count first: a hostile list of a million entries is refused before it is walked.
        if not MIN_CHOICES <= len(value) <= MAX_CHOICES:
            raise ValueError(f"must hold {MIN_CHOICES} to {MAX_CHOICES} choices, got {len(value)}")
        seen: dict[str, int] = {}
        for i, choice in enumerate(value):
            where = f"choice {i}: "
            if not isinstance(choice, str):
                raise ValueError(f"{where}must be a string, got {_json_type(choice)}")
            if not choice.strip():
                raise ValueError(f"{where}must not be empty or only whitespace")
            if len(choice) > MAX_CHOICE_CHARS:
                raise ValueError(f"{where}is {len(choice)} characters long, at most {MAX_CHOICE_CHARS}")
            if choice in seen:
                raise ValueError(f"{where}is the same text as choice {seen[choice]} (two equal choices "
                                 "always score the same, so the pick between them is arbitrary)")
            seen[choice] = i
        return value

    @field_validator("answer", mode="before")
    @classmethod
    def _answer_index(cls, value: Any) -> Any:
        # JSON true is not index 1, nor 1.0: strict mode refuses both, but says so less plainly.
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"must be an integer index into 'choices' (0 = the first), got {_json_type(value)}")
        return value

    @field_validator("expected", "reject", mode="before")
    @classmethod
    def _expected_answers(cls, value: Any, info: Any) -> Any:
        if value is None:
            return None
        kind = "accepted answers" if info.field_name == "expected" else "rejected answers"
        from regress.metrics.answers import has_substance

        if isinstance(value, str):
            if not value.strip():
                raise ValueError("must not be empty")
            if not has_substance(value):
                raise ValueError(f"{value!r} holds no letter, digit or CJK character: almost any output "
                                 "would contain it")
            return [value]
        if not isinstance(value, list):
            raise ValueError(f"must be a string or a list of strings ({kind}), got {_json_type(value)}")
        if not value:
            raise ValueError(f"must hold at least one {kind[:-1]}")
        for i, answer in enumerate(value):
            where = f"answer {i + 1}: "
            if not isinstance(answer, str):
                raise ValueError(f"{where}must be a string, got {_json_type(answer)}")
            if not answer.strip():
                raise ValueError(f"{where}must not be empty")
            if not has_substance(answer):
                raise ValueError(f"{where}{answer!r} holds no letter, digit or CJK character: almost any "
                                 "output would contain it")
        return value

    @field_validator("id")
    @classmethod
    def _id_is_printable(cls, value: str) -> str:
        if value != value.strip() or any(ch in value for ch in "\n\r\t"):
            raise ValueError("must not contain leading/trailing whitespace, tabs or newlines")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, value: list[Message] | None) -> list[Message] | None:
        if value is not None:
            if not value:
                raise ValueError("must hold at least one message")
            if all(not m.content.strip() for m in value):
                raise ValueError("all messages are empty")
        return value

    @model_validator(mode="after")
    def _exactly_one_input(self) -> "PromptRecord":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'messages' (chat)")
        return self

    @model_validator(mode="after")
    def _reject_with_expected(self) -> "PromptRecord":
        if self.reject is None:
            return self
        if self.expected is None:
            raise _field_problem("reject", "needs 'expected': rejected answers only guard accepted ones")
        from regress.metrics.answers import contains_answer, normalise

        for i, wrong in enumerate(self.reject):
            for right in self.expected:
                w, r = normalise(wrong), normalise(right)
                if contains_answer(r, w):
                    raise _field_problem("reject", f"answer {i + 1} ({wrong!r}) is part of the accepted answer "
                                                   f"{right!r}: every output holding {right!r} would be wrong")
        return self

    @model_validator(mode="after")
    def _choices_with_answer(self) -> "PromptRecord":
        if self.choices is None:
            if self.answer is not None:
                raise _field_problem("answer", "needs 'choices' (the continuations it indexes)")
            return self
        if self.answer is None:
            raise _field_problem("answer", "required with 'choices': the 0-based index of the right choice")
        if not 0 <= self.answer < len(self.choices):
            raise _field_problem("answer", f"is {self.answer}, outside the {len(self.choices)} choices "
                                            f"(0 .. {len(self.choices) - 1})")
        if self.expected is not None:
            # One prompt, one answer check: a free-text answer and a choice could disagree about
            # whether the same side got it right.
            raise _field_problem("choices", "give either 'expected' (a free-text answer) or 'choices' with "
                                             "'answer', not both")
        if self.samples is not None and self.samples > 1:
            raise _field_problem("choices", "cannot go with 'samples': a choice's log-likelihood is one "
                                             "number per side, not a distribution; drop samples")
        return self

    def choice_input(self) -> dict[str, Any]:
        """What the engine side needs to score the choices (empty for a prompt without them): the
        texts, and the answer, recorded with the scores so that a run says what was asked."""
        if self.choices is None:
            return {}
        return {"choices": list(self.choices), "answer": self.answer}

    def payload(self) -> dict[str, Any]:
        """What the engine side needs to render this prompt."""
        if self.messages is not None:
            return {"messages": [m.model_dump() for m in self.messages]}
        return {"prompt": self.prompt}


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


class DatasetCard(_Strict):
    """The optional ``<name>.yaml`` beside a prompt set: description and dataset-level defaults."""

    description: str = ""
    """What the prompt set is for."""
    defaults: SamplingSpec = Field(default_factory=SamplingSpec)
    """Sampling defaults for every prompt of the set."""
    samples: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    """Samples per prompt for every prompt of the set that samples (temperature > 0); a prompt's
    own ``samples`` wins. Greedy prompts run once whatever this says."""
