"""The bisect's binary search: narrow the releases down to the first bad one.

The search checks the bad version, then the middle of what is left, until the first bad release
is pinned down. Every step is a normal check (:func:`regress.checks.run_check`): replay against
the golden in the version's cached environment, score, report, a line in the trend history. The
state is saved after each step (:mod:`regress.bisect.record`).

A version whose environment cannot be built has one of two kinds of failure
(:mod:`regress.envs.failures`). Permanent (no such release, it does not resolve, its build
fails): the version is recorded as skipped and the search goes around it; if the first bad
release is then one of several, the answer says which versions it may also be. Transient (the
package index unreachable, the network, a full disk, a time-out, pip killed): the failure is
recorded with its cause and the bisect stops (exit 3), since whatever broke the install would
break the next one too; run again, it tries that version again. Any other failure stops the
bisect (exit 3) the same way, with the finished checks kept: running the command again continues.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from regress.bisect.plan import BisectRange, candidate_for, next_version, template_digest
from regress.bisect.record import BisectCheck, BisectState, load_state, save_state, state_path
from regress.config import Params
from regress.errors import CandidateEnvError, TransientEnvError, UnresolvableEnvError
from regress.records import CandidateSpec

if TYPE_CHECKING:
    from regress.checks import CheckResult
    from regress.replay import Executor, ProgressSink

MAX_REGRESSIONS_KEPT = 200
"""Flipped prompt ids kept per check in the state (the scores keep all of them)."""


@dataclass
class BisectResult:
    state: BisectState
    path: Path
    ran_now: list[str] = field(default_factory=list)
    """Versions checked by this call (the rest came from the state)."""
    notes: list[str] = field(default_factory=list)


ProgressFactory = Callable[[str], "ProgressSink"]


def _fresh_state(rng: BisectRange, template: CandidateSpec, golden_run_id: str, index: str) -> BisectState:
    return BisectState(package=rng.package, good=rng.good, bad=rng.bad, template=template.name,
                       template_sha256=template_digest(template), golden_run_id=golden_run_id, index=index,
                       versions=rng.versions)


def _resumable(state: BisectState | None, fresh: BisectState, notes: list[str]) -> BisectState:
    """The saved state when it asks the same question of the same golden and template; its checks
    of versions still in range are kept when the index now lists other versions."""
    if state is None:
        return fresh
    if state.golden_run_id != fresh.golden_run_id:
        notes.append("the golden changed since the saved checks: starting over")
        return fresh
    if state.template_sha256 != fresh.template_sha256:
        notes.append(f"candidate '{fresh.template}' changed since the saved checks: starting over")
        return fresh
    kept = [c for c in state.checks if c.version in fresh.versions]
    resumed = fresh.model_copy(update={"checks": kept, "started_at": state.started_at})
    done = list(resumed.outcomes)
    if state.versions != fresh.versions:
        notes.append(f"the index lists other versions than when the bisect started: {len(done)} check(s) kept")
    if done:
        notes.append(f"resuming: {len(done)} check(s) already done ({', '.join(done)})")
    for failed in resumed.transient:
        notes.append(f"trying {failed.version} again: its install failed transiently ({failed.cause})")
    return resumed


def _check_record(version: str, spec: CandidateSpec, result: "CheckResult", root: Path, seconds: float) -> BisectCheck:
    report = result.scored.report
    regressions = [s.prompt_id for s in report.scores if s.prompt_class == "regression"]
    page = result.scored.page
    try:
        page_rel = str(Path(page).resolve().relative_to(root.resolve())) if page else None
    except ValueError:
        page_rel = str(page)
    m = report.metrics
    return BisectCheck(
        version=version, candidate=spec.name, outcome="fail" if result.gating_failed else "pass",
        verdict=m.verdict, run_id=result.manifest.run_id, report=page_rel,
        regressions=regressions[:MAX_REGRESSIONS_KEPT], identical=getattr(m, "identical", None),
        prompts=getattr(m, "prompts", None), mean_teacher_forced_kl=getattr(m, "mean_teacher_forced_kl", None),
        seconds=round(seconds, 1))


def _conclude(state: BisectState) -> BisectState:
    outcomes = state.outcomes
    version, lo, hi = next_version(state.versions, outcomes)
    now = datetime.now(timezone.utc)
    if version is not None:
        return state.model_copy(update={"status": "running", "updated_at": now})
    bad = state.versions[-1]
    if outcomes.get(bad) != "fail":
        return state.model_copy(update={"status": "no-regression", "first_bad": None, "last_good": None,
                                        "untested_before": [], "updated_at": now})
    untested = [v for v in state.versions[lo + 1:hi] if outcomes.get(v) == "skipped"]
    return state.model_copy(update={
        "status": "found", "first_bad": state.versions[hi],
        "last_good": state.versions[lo] if lo >= 0 else state.good,
        "untested_before": untested, "updated_at": now})


def bisect(
    params: Params,
    rng: BisectRange,
    template: CandidateSpec,
    *,
    index: str,
    executor: "Executor | None" = None,
    progress: ProgressFactory | None = None,
    on_check: Callable[[BisectState, BisectCheck], None] | None = None,
    restart: bool = False,
    force: bool = False,
    layered: bool = True,
) -> BisectResult:
    """Search ``rng`` for the first release that fails against the golden, checking ``template``
    with each version pinned. Resumes from ``bisect/<package>-<good>-<bad>.json`` unless
    ``restart``; ``force`` replays a version even when an up-to-date run of it exists."""
    from regress.checks import run_check
    from regress.runs import load_run

    golden = load_run(params.golden_dir())
    baseline_name = (params.golden_baseline(golden.manifest) or params.baseline).name
    path = state_path(params.root, rng.package, rng.good, rng.bad)
    notes: list[str] = []
    fresh = _fresh_state(rng, template, golden.manifest.run_id, index)
    state = _resumable(None if restart else load_state(path), fresh, notes)
    state = _conclude(state)
    save_state(path, state)
    ran: list[str] = []
    while True:
        version, _, _ = next_version(state.versions, state.outcomes)
        if version is None:
            break
        spec = candidate_for(template, rng.package, version, baseline_name=baseline_name, layered=layered)
        started = time.monotonic()
        sink = progress(f"{rng.package} {version} (check {state.checked + 1})") if progress else None
        try:
            with sink if hasattr(sink, "__enter__") else nullcontext():  # type: ignore[union-attr]
                result = run_check(params, spec, executor=executor, progress=sink, force=force,
                                   source="bisect", release=(rng.package, version))
            check = _check_record(version, spec, result, params.root, time.monotonic() - started)
        except CandidateEnvError as exc:
            # Only a failure known to be permanent takes the version out of the search; any other
            # (the index down, a full disk, a damaged cached environment) is tried again later.
            transient = not isinstance(exc, UnresolvableEnvError)
            cause = getattr(exc, "cause", None) or "its environment could not be built or used"
            kind = "transient" if transient else "permanent"
            if version == state.versions[-1]:
                # Without --bad there is nothing to search from: say so, record nothing.
                raise _same_kind(exc, f"{rng.package} {version} (--bad) could not be installed ({kind}: {cause}), "
                                      f"so the bisect cannot start"
                                      + ("; run the command again to retry" if transient else "") + f": {exc}") from exc
            # Permanent: go around it (git bisect's "skip"); the answer names it if it matters.
            # Transient: recorded, and the bisect stops until whatever broke the install is back.
            check = BisectCheck(version=version, candidate=spec.name, outcome="transient" if transient else "skipped",
                                detail=str(exc).splitlines()[0][:500], cause=cause,
                                seconds=round(time.monotonic() - started, 1))
            if transient:
                state = _conclude(state.model_copy(update={"checks": [*state.checks, check]}))
                save_state(path, state)
                if on_check is not None:
                    on_check(state, check)
                raise TransientEnvError(
                    f"{rng.package} {version} could not be installed, a transient failure ({cause}); it is recorded "
                    f"in {path} and tried again when you run the command again (the {state.checked} finished "
                    f"check(s) are kept): {exc}", cause=cause) from exc
        ran.append(version)
        state = _conclude(state.model_copy(update={"checks": [*state.checks, check]}))
        save_state(path, state)
        if on_check is not None:
            on_check(state, check)
    return BisectResult(state, path, ran, notes)


def _same_kind(exc: CandidateEnvError, message: str) -> CandidateEnvError:
    """``message`` as an error of ``exc``'s kind (transient, permanent or neither), its cause kept."""
    if isinstance(exc, (TransientEnvError, UnresolvableEnvError)):
        return type(exc)(message, cause=exc.cause)
    return CandidateEnvError(message)
