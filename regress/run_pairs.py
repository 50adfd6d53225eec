"""What only a golden and a run together can show is wrong with them.

Their values one by one are checked as they are read (:mod:`regress.run_values`); here: a golden
whose manifest says it is not one, a run that is not a replay against a golden, teacher-forced tokens that are not the golden's, a
candidate that does not hold the golden's whole prompt set. Each is an input error (exit 2)
naming the file (and field)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from regress.errors import ConfigError, StorageError
from regress.runs import MANIFEST, RunResult, shard_file


def shard_of(run: RunResult, row: int) -> Path:
    """The shard file holding ``run``'s row ``row``."""
    for shard in run.manifest.layout.shards:
        if shard.start <= row < shard.start + shard.count:
            return shard_file(run.path, shard.index)
    return run.path


def check_teacher_forced(run: RunResult, golden: RunResult) -> None:
    """Every teacher-forced sequence of ``run`` is the golden's completion of its prompt (or a
    start of it: teacher forcing cut to fit a context is recorded as ``teacher_force_cut``)."""
    if not run.teacher_forced:
        return
    a = run.arrays
    offsets, forced = a["tf_offsets"], a["tf_tokens"]
    for i, pid in enumerate(run.prompt_ids):
        if pid not in golden:
            continue
        tf = forced[int(offsets[i]):int(offsets[i + 1])]
        theirs = golden.output_token_ids(golden.position(pid))
        n = min(len(tf), len(theirs))
        if not np.array_equal(tf[:n], theirs[:n]):
            at = int(np.argmax(tf[:n] != theirs[:n]))
            raise StorageError(
                f"{shard_of(run, i)}: array 'tf_tokens' of prompt {pid[:60]!r} is not the golden's completion "
                f"({golden.path}): token {at} is {int(tf[at])}, the golden's {int(theirs[at])}; "
                "teacher forcing scores the golden's tokens: replay it again")


def check_pair(golden: RunResult, run: RunResult) -> None:
    """What makes ``golden`` and ``run`` not a golden and a run to score against it: a golden whose
    manifest says it is a replay, or a run whose teacher-forced tokens are not the golden's."""
    if golden.manifest.kind != "golden":
        raise StorageError(f"{golden.path / MANIFEST}: 'kind' is {golden.manifest.kind!r}: not a golden "
                           "(`regress golden` makes one)")
    check_teacher_forced(run, golden)


def check_same_entries(golden: RunResult, run: RunResult) -> None:
    """A candidate is scored on the whole prompt set: ``run`` must hold every entry of ``golden``
    (each prompt, and each sample of a sampled prompt), as it holds no entry the golden lacks
    (:func:`regress.scoring.score_runs`). A try (``regress check --tags/--limit``) is scored on
    part of it and does not come here."""
    missing = [pid for pid in golden.prompt_ids if pid not in run]
    if missing:
        raise ConfigError(f"{len(missing)} prompt(s) of the golden {golden.path} are not in {run.path} "
                          f"(first: {missing[0]}); a candidate is scored on the whole prompt set: replay it again")
    if run.manifest.kind != "replay" or run.manifest.golden is None:
            raise StorageError(f"{run.path / MANIFEST}: 'kind' is {run.manifest.kind!r} with no 'golden': not a replay "
                           "of a candidate against a golden (`regress replay` makes one)")
