"""Planning a replay: which prompts go into which shard, with which sampling, and its fingerprints.

The fingerprints recognise a finished run or shard of the same plan.

Batch composition is part of the experiment: prompts keep the prompt set's order and are cut
into fixed-size shards, and a replay uses the golden's shard size unless told otherwise, so
golden and candidate see the same batches.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from regress.datasets import PromptSet
from regress.effective import generation_defaults as read_generation_defaults
from regress.engine.protocol import PromptInput, TeacherForcePair
from regress.errors import ConfigError
from regress.records import (FORMAT_VERSION, SAMPLE_SEPARATOR, CandidateSpec, ResolvedSampling, SamplingSpec,
                             ShardInfo, ShardLayout, sample_id)
from regress.runs import RunResult

DEFAULT_SHARD_SIZE = 64


def plan_layout(prompt_ids: list[str], shard_size: int) -> ShardLayout:
    """Cut prompts, in order, into consecutive shards of ``shard_size``."""
    if shard_size < 1:
        raise ConfigError(f"must be at least 1, got {shard_size}", field="shard_size")
    shards = []
    for index, start in enumerate(range(0, len(prompt_ids), shard_size)):
        ids = prompt_ids[start : start + shard_size]
        digest = hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()
        shards.append(ShardInfo(index=index, start=start, count=len(ids), prompt_ids_sha256=digest))
    return ShardLayout(shard_size=shard_size, shards=shards)


def model_sampling_defaults(candidate: CandidateSpec, defaults: dict[str, Any] | None = None) -> SamplingSpec:
    """The layer a candidate's ``generation_config`` adds (empty for ``vllm``): the model's defaults
    as a sampling layer. An unusable file or value is a :class:`ConfigError` naming the field.
    ``defaults``: :func:`~regress.effective.generation_defaults` of ``candidate`` when the caller
    has read them already (None: read here)."""
    if defaults is None:
        defaults = read_generation_defaults(candidate)
    try:
        return SamplingSpec.model_validate(defaults, strict=False)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"candidate '{candidate.name}': the defaults its generation_config "
                          f"{candidate.generation_config!r} supplies are not valid sampling: {problems}",
                          field="generation_config") from exc


def sends_client_fields(candidate: CandidateSpec) -> bool:
    """Whether the candidate's requests carry only the sampling fields a layer set, leaving the
    rest to the server's defaults (``backend: server`` with ``server.sampling_fields: client``,
    the default there): its resolved samplings record which fields were set."""
    return candidate.backend == "server" and (candidate.server is None or candidate.server.sampling_fields == "client")


def resolve_sampling(prompt_set: PromptSet, candidate: CandidateSpec,
                     defaults: dict[str, Any] | None = None) -> list[ResolvedSampling]:
    """Per prompt: built-in defaults < the model's generation_config defaults (only when the
    candidate's ``generation_config`` is not ``vllm``) < candidate sampling < prompt set defaults
    < prompt overrides. ``defaults``: the candidate's generation_config defaults, when read already."""
    model_defaults = model_sampling_defaults(candidate, defaults)
    explicit = sends_client_fields(candidate)
    return [
        ResolvedSampling.resolve(model_defaults, candidate.sampling, prompt_set.card.defaults, p.sampling,
                                 record_explicit=explicit)
        for p in prompt_set.prompts
    ]


def sample_seed(prompt_id: str, k: int, seed: int) -> int:
    """Sample ``k``'s seed: derived from the prompt id, the sample number and the resolved
    ``seed`` (change ``seed`` to reseed every sample), so it never depends on order or batching."""
    digest = hashlib.sha256(f"{seed}|{prompt_id}|{k}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True)
class Entry:
    """One request of a plan: a prompt run once, or one sample of a sampled prompt."""

    id: str
    """The id its result is stored under (the prompt id, or ``<prompt id>#<k>`` for sample k)."""
    prompt: Any
    """The prompt record."""
    sampling: ResolvedSampling


def sample_count(prompt: Any, card_samples: int | None, sampling: ResolvedSampling) -> int:
    """How many times a prompt runs: its ``samples`` (else the card's) when it samples, else 1."""
    n = prompt.samples if prompt.samples is not None else card_samples
    if n is None or n <= 1:
        return 1
    if sampling.temperature == 0:
        if prompt.samples is None:
            return 1  # the card's samples apply to sampling prompts only
        raise ConfigError(f"prompt '{prompt.id}' asks for {n} samples at temperature 0 (greedy outputs are all "
                          "the same): set a temperature above 0 or drop samples", field="samples")
    return n


def plan_entries(prompt_set: PromptSet, candidate: CandidateSpec,
                 defaults: dict[str, Any] | None = None) -> list[Entry]:
    """Every request, in prompt set order: a sampled prompt becomes its samples, one after another.
    ``defaults``: the candidate's generation_config defaults, when read already."""
    entries: list[Entry] = []
    for prompt, sampling in zip(prompt_set.prompts, resolve_sampling(prompt_set, candidate, defaults)):
        n = sample_count(prompt, prompt_set.card.samples, sampling)
        if n > 1 and prompt.choices is not None:
            # The prompt set refuses this where it can tell; a candidate's own temperature above 0
            # with the card's samples is only known here.
            raise ConfigError(f"prompt '{prompt.id}' has choices but would run as {n} samples (the card's samples "
                              f"at temperature {sampling.temperature}): a prompt with choices is not sampled; give "
                              "it \"samples\": 1 or temperature 0", field="samples", file=str(prompt_set.path))
        if n == 1:
            entries.append(Entry(prompt.id, prompt, sampling))
            continue
        for k in range(n):
            update = {"sample": k, "samples": n, "seed": sample_seed(prompt.id, k, sampling.seed)}
            entries.append(Entry(sample_id(prompt.id, k), prompt, sampling.model_copy(update=update)))
    seen: set[str] = set()
    for e in entries:
        if e.id in seen:
            raise ConfigError(f"two requests would be stored under the id '{e.id}': a sampled prompt's samples are "
                              f"stored as '<id>{SAMPLE_SEPARATOR}<k>'; rename the prompt whose id is '{e.id}'",
                              file=str(prompt_set.path))
        seen.add(e.id)
    return entries


@dataclass
class ShardTask:
    """One shard of a plan: what the engine gets for it, but not where its result goes."""

    index: int
    prompts: list[PromptInput]
    teacher_force: list[TeacherForcePair | None] | None
    """The golden's tokens per prompt, scored teacher-forced; None for a free-running-only run."""
    fingerprint: str
    """Identifies exactly this shard of exactly this plan (stamped on its result file)."""
    generate: bool = True
    """False: prefill only (a quick check, :mod:`regress.quick`): the golden's completions
    teacher-forced, nothing generated."""

    @property
    def size(self) -> int:
        """Prompts in the shard."""
        return len(self.prompts)


@dataclass
class ReplayPlan:
    """Everything needed to run a candidate over a prompt set, and to recognise finished shards."""

    run_id: str
    kind: str
    candidate: CandidateSpec
    prompt_set: PromptSet
    layout: ShardLayout
    tasks: list[ShardTask]
    golden: RunResult | None
    fingerprint: str
    shard_timeout_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    generation_defaults: dict[str, Any] | None = None
    """The candidate's generation_config defaults the plan's sampling was resolved with
    (:func:`~regress.effective.generation_defaults`, read once): the manifest records them."""

    @property
    def teacher_forced(self) -> bool:
        """Whether the shards score the golden's completions teacher-forced."""
        return any(t.teacher_force is not None for t in self.tasks)

    @property
    def prefill_only(self) -> bool:
        """Whether nothing is generated: only the golden's completions are prefilled (a quick check)."""
        return bool(self.tasks) and not any(t.generate for t in self.tasks)


def _check_golden(prompt_set: PromptSet, golden: RunResult, entries: list[Entry]) -> None:
    missing = [e.id for e in entries if e.id not in golden]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(
            f"{len(missing)} prompt(s) of {prompt_set.path} are not in the golden {golden.path}: {shown}; "
            "re-run `regress golden` after changing the prompt set"
        )
    if golden.manifest.dataset.sha256 != prompt_set.sha256:
        raise ConfigError(
            f"the prompt set {prompt_set.path} changed since the golden {golden.path} was made "
            f"(sha256 {prompt_set.sha256[:12]} vs {golden.manifest.dataset.sha256[:12]}); re-run `regress golden`"
        )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _shard_fingerprint(plan_fingerprint: str, index: int, prompts: list[PromptInput],
                       forced: list[TeacherForcePair | None] | None) -> str:
    # This exact form (the shard request as first sent, sorted keys) is what result files of
    # earlier runs are stamped with: changing it would make them look unfinished.
    identity = {"op": "shard", "index": index, "prompts": prompts, "teacher_force": forced}
    return _digest(plan_fingerprint + json.dumps(identity, sort_keys=True))


def plan_replay(
    candidate: CandidateSpec,
    prompt_set: PromptSet,
    *,
    golden: RunResult | None = None,
    shard_size: int | None = None,
    teacher_force: bool = True,
    generation_defaults: dict[str, Any] | None = None,
    generate: bool = True,
) -> ReplayPlan:
    """Plan a golden run (``golden=None``) or a replay against ``golden``. ``generation_defaults``:
    the candidate's generation_config defaults when the caller has read them (None: read here).

    ``generate=False``: a prefill-only replay (a quick check, :mod:`regress.quick`): every prompt
    run once gets one prefill of its prompt + the golden's completion, nothing is generated.
    Sampled prompts are left out: what they test is the distribution of new samples."""
    defaults = read_generation_defaults(candidate) if generation_defaults is None else generation_defaults
    entries = plan_entries(prompt_set, candidate, defaults)
    if not generate:
        if golden is None:
            raise ConfigError("a prefill-only run needs a golden to prefill", field="generate")
        entries = [e for e in entries if not e.sampling.samples]
    return _plan(candidate, prompt_set, entries, golden=golden, shard_size=shard_size,
                 teacher_force=teacher_force or not generate, defaults=defaults,
                 purpose=None if generate else PREFILL_ONLY)


PREFILL_ONLY = "prefill-only"
"""What a plan with ``generate=False`` is for (part of its fingerprint)."""


SCORED_POSITIONS = "completion"
"""Where teacher forcing asks the engine for logprobs (part of a prefill-only plan's fingerprint)."""


GOLDEN_SCORING = "golden-scores-samples"
"""What a plan from :func:`plan_golden_scoring` is for (part of its fingerprint)."""


def plan_golden_scoring(baseline: CandidateSpec, prompt_set: PromptSet, run: RunResult, *,
                        golden: RunResult | None = None, shard_size: int | None = None) -> ReplayPlan | None:
    """The baseline scoring a candidate run's samples: every sample of a sampled prompt, fed to the
    baseline teacher-forced (prompt + the candidate's sample), so that the golden's model says how
    likely it finds what the candidate sampled. Its shards are prefill only (nothing is generated:
    only the teacher-forced logprobs are used), after the prompt as the baseline renders it, the
    context the golden's own samples were drawn in. None when the prompt set has no sampled prompt, or when
    every sample is the ``golden``'s own (same prompt ids, same tokens): the golden's free run
    already holds its model's logprobs of those (:func:`regress.metrics.sampled.candidate_track`),
    and the engine load is saved.

    The plan's "golden" is the candidate ``run``: its tokens are what is teacher-forced."""
    defaults = read_generation_defaults(baseline)
    entries = [e for e in plan_entries(prompt_set, baseline, defaults) if e.sampling.samples]
    if golden is not None:
        entries = [e for e in entries if not _same_sample(run, golden, e.id)]
    if not entries:
        return None
    entries = [Entry(e.id, e.prompt, e.sampling.model_copy(update={"max_tokens": 1, "min_tokens": 0}))
               for e in entries]
    return _plan(baseline, prompt_set, entries, golden=run, shard_size=shard_size or run.manifest.layout.shard_size,
                 teacher_force=True, purpose=GOLDEN_SCORING, defaults=defaults)


def _same_sample(run: RunResult, golden: RunResult, entry_id: str) -> bool:
    """Whether ``run``'s entry is the golden's: the same prompt ids and the same output tokens."""
    if entry_id not in golden or entry_id not in run:
        return False
    mine, theirs = run[entry_id], golden[entry_id]
    return (np.array_equal(mine.prompt_token_ids, theirs.prompt_token_ids)
            and np.array_equal(mine.output_token_ids, theirs.output_token_ids))


def _plan(candidate: CandidateSpec, prompt_set: PromptSet, entries: list[Entry], *, golden: RunResult | None,
          shard_size: int | None, teacher_force: bool, purpose: str | None = None,
          defaults: dict[str, Any] | None = None) -> ReplayPlan:
    if golden is not None:
        _check_golden(prompt_set, golden, entries)
        if shard_size is None:
            shard_size = golden.manifest.layout.shard_size
    shard_size = shard_size or DEFAULT_SHARD_SIZE
    layout = plan_layout([e.id for e in entries], shard_size)
    forced = golden is not None and teacher_force
    identity = {
        "format": FORMAT_VERSION,
        "candidate": candidate.model_dump(mode="json"),
        "dataset": prompt_set.sha256,
        "layout": layout.fingerprint(),
        "golden": golden.manifest.run_id if golden is not None else None,
        "teacher_force": forced,
    }
    if purpose is not None:  # left out otherwise: the fingerprints of existing runs stay as they were
        identity["purpose"] = purpose
    if purpose == PREFILL_ONLY:
        # A quick check compares prefill with prefill (its reference, its noise arm, the candidate):
        # a reference scored at every prompt position, before the engine scored only the
        # completion's (regress.backends.vllm_scored_positions), is made again, not mixed in.
        identity["scored_positions"] = SCORED_POSITIONS
    if sends_client_fields(candidate):
        # Its requests leave fields to the server now: a served run finished before (every field
        # explicit, the candidate stored the same) is another experiment and must not be reused.
        identity["sampling_fields"] = "client"
    plan_fingerprint = _digest(json.dumps(identity, sort_keys=True))
    tasks = []
    for shard in layout.shards:
        chosen = entries[shard.start : shard.start + shard.count]
        # choice_input() is empty for a prompt without choices, so the shard fingerprints of
        # existing runs (which hash these inputs) stay as they were.
        inputs: list[PromptInput] = [
            {"id": e.id, "payload": e.prompt.payload(), "sampling": e.sampling.model_dump(),
             **e.prompt.choice_input()}  # type: ignore[typeddict-item]
            for e in chosen
        ]
        pairs: list[TeacherForcePair | None] | None = None
        if forced:
            assert golden is not None
            pairs = []
            for e in chosen:
                row = golden.position(e.id)
                pairs.append([golden.prompt_token_ids(row).tolist(), golden.output_token_ids(row).tolist()])
        fingerprint = _shard_fingerprint(plan_fingerprint, shard.index, inputs, pairs)
        tasks.append(ShardTask(shard.index, inputs, pairs, fingerprint,
                               generate=purpose not in (PREFILL_ONLY, GOLDEN_SCORING)))
    return ReplayPlan(
        run_id=uuid.uuid4().hex,
        kind="golden" if golden is None else "replay",
        candidate=candidate,
        prompt_set=prompt_set,
        layout=layout,
        tasks=tasks,
        golden=golden,
        fingerprint=plan_fingerprint,
        generation_defaults=defaults,
    )
