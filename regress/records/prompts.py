"""Prompt set records: one prompt (text or chat messages) and the card beside a prompt set."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from regress.records.base import _Strict
from regress.records.sampling import MAX_SAMPLES, SamplingSpec


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

    @field_validator("expected", mode="before")
    @classmethod
    def _expected_answers(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("must not be empty")
            return [value]
        if not isinstance(value, list):
            raise ValueError(f"must be a string or a list of strings (accepted answers), got {_json_type(value)}")
        if not value:
            raise ValueError("must hold at least one accepted answer")
        for i, answer in enumerate(value):
            where = f"answer {i + 1}: "
            if not isinstance(answer, str):
                raise ValueError(f"{where}must be a string, got {_json_type(answer)}")
            if not answer.strip():
                raise ValueError(f"{where}must not be empty")
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
