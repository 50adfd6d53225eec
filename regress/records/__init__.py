"""Typed records: what regress reads, writes and passes between its parts.

Every stored record carries ``format_version`` so that a reader can refuse (or migrate)
files written by another release. Bump :data:`FORMAT_VERSION` whenever a stored field
changes meaning or a required field is added.

The heavy per-token arrays of a run are not pydantic fields: they live in columnar shard
files (see :mod:`regress.storage`) and are exposed here as numpy views through
:class:`Generation` and :class:`LogprobTrack`.

This package is a face: the records live in modules by domain and are imported from here.

- :mod:`~regress.records.base`: :data:`FORMAT_VERSION` and the base models (``_Strict`` for
  user files, ``_Record`` for what regress writes);
- :mod:`~regress.records.sampling`: sampling layers, the resolved sampling, sample ids;
- :mod:`~regress.records.prompts`: prompt set lines and cards;
- :mod:`~regress.records.candidate`: candidates and the ``server`` backend's settings;
- :mod:`~regress.records.manifest`: run manifests and their parts;
- :mod:`~regress.records.generation`: per-prompt results, views over shard arrays;
- :mod:`~regress.records.scores`: per-prompt scores, latency, metrics.json and the scored run.
"""

from __future__ import annotations

from regress.records.base import FORMAT_VERSION, _Record, _Strict
from regress.records.candidate import CURRENT_ENVIRONMENT, REGRESS_CREDENTIAL_VARIABLES, CandidateSpec, ServerSettings
from regress.records.generation import Generation, LogprobTrack
from regress.records.manifest import (
    AppliedSampling,
    DatasetRef,
    EffectiveConfig,
    GoldenRef,
    Hardware,
    Memory,
    ModelInfo,
    RunManifest,
    ShardFile,
    ShardInfo,
    ShardLayout,
    Timings,
    TokenizerFacts,
    Versions,
)
from regress.records.prompts import DatasetCard, Message, PromptRecord
from regress.records.sampling import (
    MAX_SAMPLES,
    SAMPLE_SEPARATOR,
    ResolvedSampling,
    SamplingSpec,
    prompt_of_sample,
    sample_id,
)
from regress.records.scores import (
    AnswerCheck,
    LatencyComparison,
    LatencyStats,
    MetricValue,
    PromptClass,
    PromptScore,
    RunMetrics,
    ScoredRun,
)

__all__ = [
    "FORMAT_VERSION",
    # The base models are private, but records elsewhere (regress.bisect.record) subclass _Record.
    "_Record",
    "_Strict",
    "SamplingSpec",
    "ResolvedSampling",
    "MAX_SAMPLES",
    "SAMPLE_SEPARATOR",
    "sample_id",
    "prompt_of_sample",
    "Message",
    "PromptRecord",
    "DatasetCard",
    "CURRENT_ENVIRONMENT",
    "REGRESS_CREDENTIAL_VARIABLES",
    "ServerSettings",
    "CandidateSpec",
    "ShardInfo",
    "ShardLayout",
    "DatasetRef",
    "GoldenRef",
    "Versions",
    "ModelInfo",
    "Hardware",
    "Timings",
    "Memory",
    "ShardFile",
    "AppliedSampling",
    "TokenizerFacts",
    "EffectiveConfig",
    "RunManifest",
    "LogprobTrack",
    "Generation",
    "PromptClass",
    "MetricValue",
    "AnswerCheck",
    "PromptScore",
    "LatencyStats",
    "LatencyComparison",
    "RunMetrics",
    "ScoredRun",
]
