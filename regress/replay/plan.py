"""Planning a replay: which prompts go into which shard, with which sampling, and the
fingerprints that recognise a finished run or shard of the same plan.

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

from regress.datasets import PromptSet
from regress.engine.protocol import PromptInput, TeacherForcePair
from regress.errors import ConfigError
from regress.records import FORMAT_VERSION, CandidateSpec, ResolvedSampling, ShardInfo, ShardLayout
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


def resolve_sampling(prompt_set: PromptSet, candidate: CandidateSpec) -> list[ResolvedSampling]:
    """Per prompt: built-in defaults < candidate sampling < prompt set defaults < prompt overrides."""
    return [
        ResolvedSampling.resolve(candidate.sampling, prompt_set.card.defaults, p.sampling)
        for p in prompt_set.prompts
    ]


@dataclass
class ShardTask:
    """One shard of a plan: what the engine gets for it, but not where its result goes."""

    index: int
    prompts: list[PromptInput]
    teacher_force: list[TeacherForcePair | None] | None
    """The golden's tokens per prompt, scored teacher-forced; None for a free-running-only run."""
    fingerprint: str
    """Identifies exactly this shard of exactly this plan (stamped on its result file)."""

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

    @property
    def teacher_forced(self) -> bool:
        """Whether the shards score the golden's completions teacher-forced."""
        return any(t.teacher_force is not None for t in self.tasks)


def _check_golden(prompt_set: PromptSet, golden: RunResult) -> None:
    missing = [p.id for p in prompt_set.prompts if p.id not in golden]
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
) -> ReplayPlan:
    """Plan a golden run (``golden=None``) or a replay against ``golden``."""
    if golden is not None:
        _check_golden(prompt_set, golden)
        if shard_size is None:
            shard_size = golden.manifest.layout.shard_size
    shard_size = shard_size or DEFAULT_SHARD_SIZE
    prompt_ids = [p.id for p in prompt_set.prompts]
    layout = plan_layout(prompt_ids, shard_size)
    sampling = resolve_sampling(prompt_set, candidate)
    forced = golden is not None and teacher_force
    identity = {
        "format": FORMAT_VERSION,
        "candidate": candidate.model_dump(mode="json"),
        "dataset": prompt_set.sha256,
        "layout": layout.fingerprint(),
        "golden": golden.manifest.run_id if golden is not None else None,
        "teacher_force": forced,
    }
    plan_fingerprint = _digest(json.dumps(identity, sort_keys=True))
    tasks = []
    for shard in layout.shards:
        prompts = prompt_set.prompts[shard.start : shard.start + shard.count]
        inputs: list[PromptInput] = [
            {"id": p.id, "payload": p.payload(), "sampling": sampling[shard.start + j].model_dump()}
            for j, p in enumerate(prompts)
        ]
        pairs: list[TeacherForcePair | None] | None = None
        if forced:
            assert golden is not None
            pairs = []
            for p in prompts:
                row = golden.position(p.id)
                pairs.append([golden.prompt_token_ids(row).tolist(), golden.output_token_ids(row).tolist()])
        fingerprint = _shard_fingerprint(plan_fingerprint, shard.index, inputs, pairs)
        tasks.append(ShardTask(shard.index, inputs, pairs, fingerprint))
    return ReplayPlan(
        run_id=uuid.uuid4().hex,
        kind="golden" if golden is None else "replay",
        candidate=candidate,
        prompt_set=prompt_set,
        layout=layout,
        tasks=tasks,
        golden=golden,
        fingerprint=plan_fingerprint,
    )
