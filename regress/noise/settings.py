"""``noise:`` in params.yaml: which noise arms measure the baseline's own floor, and how it is applied.

Opt-in. Example::

    noise:
      arms: [rerun, batch, alone]     # or mappings: {name: batch, shard_size: 4}
                                      # implementation noise: float32, compile
                                      # a server baseline also: concurrency ({name: concurrency, concurrency: 16})
      k: 2                            # run-level bounds become max(configured, k x floor)
      quantile: 0.95                  # which per-prompt noise value is "the floor"

Only pydantic here: :mod:`regress.config` imports it while loading params.yaml.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ArmName = Literal["rerun", "batch", "alone", "concurrency", "float32", "compile"]
NOT_YET: dict[str, str] = {}
"""Arms named in the schema but not available, with why."""
DEFAULT_CONCURRENCY = 8
"""The ``concurrency`` arm's requests in flight when not given (or 1 when the golden had more)."""


class NoiseArm(BaseModel):
    """One way of running the baseline again that changes nothing but how the arithmetic is grouped."""

    model_config = ConfigDict(extra="forbid")

    name: ArmName
    """``rerun`` (same layout as the golden), ``batch`` (another shard size), ``alone`` (shard size 1);
    implementation noise: ``float32`` (the baseline computed in float32: how much of the golden is its
    own dtype's rounding, the size of the difference another kernel or release makes) and ``compile``
    (torch.compile if the baseline runs eager, eager if it compiles)."""
    shard_size: int | None = Field(None, ge=1, le=100_000)
    """``batch`` only: prompts per engine batch (default: the golden's doubled)."""
    concurrency: int | None = Field(None, ge=1, le=1024)
    """``concurrency`` only (a baseline with ``backend: server``): requests in flight at once
    (default 8, or 1 when the golden was made with more)."""

    @model_validator(mode="after")
    def _check(self) -> "NoiseArm":
        if self.name in NOT_YET:
            raise ValueError(f"arm '{self.name}' is {NOT_YET[self.name]}")
        if self.shard_size is not None and self.name != "batch":
            raise ValueError(f"shard_size applies to the 'batch' arm only, not '{self.name}'")
        if self.concurrency is not None and self.name != "concurrency":
            raise ValueError(f"concurrency applies to the 'concurrency' arm only, not '{self.name}'")
        return self

    @property
    def key(self) -> str:
        """The arm's name in noise.json and its run directory (``golden/noise-arms/<key>``)."""
        if self.name == "batch" and self.shard_size:
            return f"batch-{self.shard_size}"
        if self.name == "concurrency" and self.concurrency:
            return f"concurrency-{self.concurrency}"
        return self.name

    @property
    def on_golden_engine(self) -> bool:
        """Whether the arm runs the golden's own engine configuration and changes only what it is
        sent (another shard size): run locally, it reuses the golden's engine, its cache cleared,
        instead of starting another. A ``rerun`` starts its own: the engine's start is part of
        what it repeats."""
        return self.name in ("batch", "alone")

    def concurrency_for(self, golden_concurrency: int) -> int:
        """The requests in flight this arm replays with, for a golden made with ``golden_concurrency``."""
        if self.concurrency is not None:
            return self.concurrency
        return 1 if golden_concurrency > 1 else DEFAULT_CONCURRENCY

    def shard_size_for(self, golden_shard_size: int) -> int:
        """The shard size this arm replays with, for a golden cut into ``golden_shard_size``."""
        if self.name == "alone":
            return 1
        if self.name == "batch":
            return self.shard_size or golden_shard_size * 2
        return golden_shard_size

    def changed(self, golden_shard_size: int, golden_concurrency: int = 1) -> str:
        """What the arm changed, in words."""
        if self.name == "float32":
            return "precision: the baseline computed in float32 (its own dtype's rounding, measured)"
        if self.name == "compile":
            return "kernels: the baseline with torch.compile toggled (eager against compiled)"
        if self.name == "concurrency":
            return (f"requests in flight: {self.concurrency_for(golden_concurrency)} instead of {golden_concurrency} "
                    "(the server batches whatever is in flight together)")
        if self.name == "rerun":
            return f"nothing: the baseline again, shard size {golden_shard_size} as the golden"
        if self.name == "alone":
            return f"each prompt alone (shard size 1 instead of {golden_shard_size})"
        return f"batch composition: shard size {self.shard_size_for(golden_shard_size)} instead of {golden_shard_size}"


class NoiseSettings(BaseModel):
    """The ``noise:`` section."""

    model_config = ConfigDict(extra="forbid")

    arms: list[NoiseArm] = Field(min_length=1)
    """The arms to run, by name (``rerun``, ``batch``, ``alone``, ``concurrency``) or as mappings."""
    k: float = Field(2.0, ge=1, le=1000)
    """Run-level KL / same-top-1 bounds become max(configured, k x floor)."""
    quantile: float = Field(0.95, gt=0, le=1)
    """Which per-prompt noise value is the run-level floor (0.95: the 95th percentile of prompts)."""

    @field_validator("arms", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="after")
    def _unique(self) -> "NoiseSettings":
        keys = [a.key for a in self.arms]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"arm '{twice[0]}' is listed twice")
        return self
