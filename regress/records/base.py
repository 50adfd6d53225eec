"""Shared base of every record: the stored format version and the two pydantic base models.

:class:`_Strict` is for records read from user files (prompt sets, cards, candidates),
:class:`_Record` for records regress writes itself (manifests, scores, metrics).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

FORMAT_VERSION = 1
"""Version of the stored formats (manifests and shard files)."""


class _Strict(BaseModel):
    """Base for records read from user files: unknown fields are errors, no silent coercion."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Record(BaseModel):
    """Base for records regress writes itself: unknown fields are kept out, types coerced."""

    model_config = ConfigDict(extra="forbid", frozen=True)
