"""Which prompts a quick check prefills: all of them, or a stratified screening sample.

A quick check (:mod:`regress.quick`) prefills every prompt run once by default. A fleet that
checks every nightly build can screen with fewer (``quick: {prompts: N}`` in params.yaml, or
``--quick-prompts N``): on a CPU a prompt's prefill costs most of what its generation does, so the
prefill of the whole set is most of a quick check (docs/benchmarks.md), and the changes a nightly
build brings (kernels, precision, another release) move every prompt's logprobs, which a sample
sees as well as the whole set does (the demo's damage ladder: docs/verdicts.md).

The sample is chosen so that it covers what such changes depend on, and so that it is the same
sample every time (the baseline's prefill reference and every candidate prefill the same
prompts in the same batches):

- **every tag** (language, task, format): the tag's prompt whose id hashes lowest;
- **the longest sequence** (prompt + golden completion): kernels change with shapes;
- **the rest by length**: the remaining prompts sorted by length, cut into as many equal strata
  as places are left, the lowest-hashing id of each stratum.

What a sample cannot see: damage confined to the few prompts it leaves out (one token's
embedding, one rare script's tokenization). The full check, or a quick check of every prompt,
prefills them all; the sample's size and what it left out are written into its verdict.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from regress.datasets import PromptSet
    from regress.runs import RunResult

MAX_SAMPLE = 1_000_000


class QuickSettings(BaseModel):
    """The ``quick:`` section of params.yaml."""

    model_config = ConfigDict(extra="forbid")

    prompts: int = Field(0, ge=0, le=MAX_SAMPLE)
    """How many prompts a quick check prefills: 0 (the default) every prompt run once; N a
    stratified sample of N (see :mod:`regress.quick_sample`). ``--quick-prompts`` overrides it."""

    def size(self, override: int | None) -> int:
        """The sample size in force: ``--quick-prompts`` when given, else this section's."""
        return self.prompts if override is None else override


@dataclass(frozen=True)
class QuickSample:
    """The prompts a quick check prefills, and of how many."""

    prompts: "PromptSet"
    """The prompt set restricted to the sample (same version: its sha256 is the whole set's)."""
    chosen: int
    eligible: int
    """Prompts a quick check could prefill: those the golden ran once (sampled prompts never)."""

    @property
    def whole(self) -> bool:
        return self.chosen == self.eligible

    def describe(self) -> str:
        if self.whole:
            return f"every one of the {self.eligible} prompt(s) run once"
        return (f"a stratified sample of {self.chosen} of the {self.eligible} prompts run once (every tag, the "
                f"longest, the rest spread by length); damage confined to the {self.eligible - self.chosen} "
                "left out is not seen: --quick-prompts 0 prefills all")


def _rank(prompt_id: str) -> str:
    # The id alone: the same prompt keeps its place in the order when the set around it changes.
    return hashlib.sha256(prompt_id.encode("utf-8")).hexdigest()


def choose(lengths: dict[str, int], tags: dict[str, list[str]], size: int) -> set[str]:
    """``size`` ids of ``lengths`` (id -> sequence length): every tag, the longest, then one per
    length stratum of the rest. All of them when ``size`` is 0 or not below their number."""
    ids = sorted(lengths, key=lambda i: (lengths[i], _rank(i)))
    if size <= 0 or size >= len(ids):
        return set(ids)
    chosen: set[str] = set()
    by_tag: dict[str, list[str]] = {}
    for pid in ids:
        for tag in tags.get(pid, []):
            by_tag.setdefault(tag, []).append(pid)
    for tag in sorted(by_tag):
        if len(chosen) >= size:
            break
        if not chosen.intersection(by_tag[tag]):
            chosen.add(min(by_tag[tag], key=_rank))
    if len(chosen) < size:
        chosen.add(ids[-1])
    rest = [pid for pid in ids if pid not in chosen]
    places = size - len(chosen)
    for k in range(places):
        stratum = rest[k * len(rest) // places: (k + 1) * len(rest) // places]
        if stratum:
            chosen.add(min(stratum, key=_rank))
    return chosen


def quick_sample(prompt_set: "PromptSet", golden: "RunResult", size: int) -> QuickSample:
    """The prompts of ``prompt_set`` a quick check of ``size`` prefills (0: every one the golden ran
    once), lengths taken from the golden (prompt tokens + its completion)."""
    eligible = [p for p in prompt_set.prompts if p.id in golden]
    lengths = {}
    for p in eligible:
        row = golden.position(p.id)
        lengths[p.id] = len(golden.prompt_token_ids(row)) + len(golden.output_token_ids(row))
    chosen = choose(lengths, {p.id: list(p.tags) for p in eligible}, size)
    if len(chosen) == len(eligible):  # the set as it is: the plans (and their reuse) of a whole quick check
        return QuickSample(prompt_set, len(chosen), len(eligible))
    kept = [p for p in prompt_set.prompts if p.id in chosen]
    return QuickSample(dataclasses.replace(prompt_set, prompts=kept, _by_id={}), len(chosen), len(eligible))
