"""Sampling records: the layered sampling settings, the resolved sampling, and sample ids."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from regress.records.base import _Strict


class SamplingSpec(_Strict):
    """Sampling settings at one layer (built-in, candidate, dataset, prompt); ``None`` = not set here.

    Layers are merged in this order, later winning: built-in defaults, the candidate's
    ``sampling``, the prompt set's ``defaults``, the prompt's own ``sampling``. The prompt
    set outranks the candidate because the experiment (greedy, 64 tokens, top-5) belongs
    to the data, and golden and candidate must sample the same way.
    """

    temperature: float | None = Field(None, ge=0, le=100)
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int | None = Field(None, ge=-1)
    """Keep only the k most likely tokens; 0 or -1 disables."""
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    """Maximum number of generated tokens."""
    min_tokens: int | None = Field(None, ge=0)
    """Minimum number of generated tokens before EOS may end the output."""
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    """Per-request random seed (matters only when temperature > 0)."""
    stop: list[str] | None = None
    """Strings that end generation (not included in the text)."""
    logprobs: int | None = Field(None, ge=1, le=20)
    """How many top logprobs to keep per position (free-running and teacher-forced)."""
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    """Repetition penalty (1 = off)."""
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    """Presence penalty (0 = off)."""
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    """Frequency penalty (0 = off)."""
    ignore_eos: bool | None = None
    """Keep generating after EOS (fixed-length outputs, useful for throughput runs)."""

    @field_validator("stop")
    @classmethod
    def _stop_strings_non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    def set_fields(self) -> dict[str, Any]:
        """The fields set at this layer."""
        return {k: v for k, v in self.model_dump().items() if v is not None}

    def over(self, lower: "SamplingSpec") -> "SamplingSpec":
        """This layer merged over a lower one (fields set here win)."""
        return SamplingSpec(**{**lower.set_fields(), **self.set_fields()})


class ResolvedSampling(_Strict):
    """The sampling a prompt was actually run with: every field set."""

    temperature: float = 0.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k filter; 0 disables."""
    max_tokens: int = 64
    """Maximum generated tokens."""
    min_tokens: int = 0
    """Minimum generated tokens."""
    seed: int = 0
    """Per-request seed."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings."""
    logprobs: int = 5
    """Top logprobs kept per position."""
    repetition_penalty: float = 1.0
    """Repetition penalty."""
    presence_penalty: float = 0.0
    """Presence penalty."""
    frequency_penalty: float = 0.0
    """Frequency penalty."""
    ignore_eos: bool = False
    """Generate past EOS."""
    sample: int | None = Field(None, ge=0, exclude_if=lambda v: v is None)
    """Which sample of a sampled prompt this is (from 0); None for a prompt run once. Left out of
    the stored form when None, so greedy prompts are stored (and fingerprinted) as before."""
    samples: int | None = Field(None, ge=2, exclude_if=lambda v: v is None)
    """How many samples its prompt has (``samples:`` in the prompt set); None for a prompt run once."""
    explicit: list[str] | None = Field(None, exclude_if=lambda v: v is None)
    """The fields some layer set (the prompt, the prompt set's card, the candidate's ``sampling``, a
    ``generation_config`` regress applied), sorted; the rest are built-in defaults. Recorded only
    where a backend sends the set fields alone (the server backend's ``sampling_fields: client``:
    what a client leaves unset, the server fills in); None elsewhere, so that other runs are stored
    (and fingerprinted) as before."""

    @field_validator("explicit")
    @classmethod
    def _known_fields(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            unknown = sorted(set(value) - set(SamplingSpec.model_fields))
            if unknown:
                raise ValueError(f"not sampling fields: {unknown}")
        return value

    @classmethod
    def resolve(cls, *layers: SamplingSpec, record_explicit: bool = False) -> "ResolvedSampling":
        """Merge layers lowest first over the built-in defaults; ``record_explicit``: keep which
        fields the layers set (:attr:`explicit`)."""
        merged: dict[str, Any] = {}
        for layer in layers:
            merged.update(layer.set_fields())
        if "top_k" in merged and merged["top_k"] == -1:
            merged["top_k"] = 0
        if record_explicit:
            merged["explicit"] = sorted(merged)
        return cls(**merged)


MAX_SAMPLES = 1000
"""Most samples one prompt may ask for."""
SAMPLE_SEPARATOR = "#"
"""Between a sampled prompt's id and its sample number in the ids its samples are stored under
(``qa-007#0`` ... ``qa-007#7``)."""


def sample_id(prompt_id: str, k: int) -> str:
    """The id sample ``k`` of a sampled prompt is stored under."""
    return f"{prompt_id}{SAMPLE_SEPARATOR}{k}"


def prompt_of_sample(entry_id: str) -> str:
    """The prompt id of a sample's stored id (``qa-007#3`` -> ``qa-007``)."""
    return entry_id.rsplit(SAMPLE_SEPARATOR, 1)[0]
