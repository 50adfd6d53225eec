"""Warm engines: one engine per configuration, shared by every run that uses it.

Several runs of one configuration (a diagnosis runs the candidate batched together, alone and
again; candidates that differ only in sampling run on the baseline's engine) would otherwise
cost an engine start each; a plain local run starts one and closes it when the run ends.
:class:`WarmEngines` keeps one engine process per configuration (what the engine process is
started with) while its user runs, and the local executor runs on it
(:meth:`regress.replay.executors.LocalExecutor.on`): the same shard loop, engine restarts
included. A reused engine first forgets what its earlier runs left in its prefix cache
(:meth:`WarmEngines.acquire`), so a run computes what it would on an engine of its own. At
most ``keep`` engines stay alive (the least recently used is closed
first), so memory stays bounded; the diagnosis orders its runs so that each configuration's runs
come together. A caller that diagnoses several candidates (or replays one and then diagnoses
it) can pass one :class:`WarmEngines` to all of them.

A Celery worker keeps its engines in one too (:mod:`regress.worker.tasks`), with
``failure_ttl_s``: an engine that failed to start for a reason that is not a crash (a bad engine
argument, a missing model) is not started again for that long, so the later shards of the same
candidate fail at once instead of each paying for another doomed start.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from regress.engine.client import EngineProcess
from regress.engine.protocol import EngineInfo
from regress.envs import python_for
from regress.errors import EngineError, InputError, RegressError
from regress.records import CandidateSpec
from regress.watchdog import phase


def configuration_key(spec: CandidateSpec) -> str:
    """What makes two specs the same engine: what the engine process is started with (its
    environment, variables and engine spec), not the name, nor what is applied when the plan is
    made (sampling, generation_config defaults): a revert back to the baseline's configuration
    runs on the baseline's engine."""
    engine = {k: v for k, v in spec.engine_spec().items() if k != "name"}
    return json.dumps({"engine": engine, "package": spec.package, "requirements": list(spec.requirements),
                       "layered": spec.layered, "env": spec.env}, sort_keys=True, default=str)


def configuration_digest(spec: CandidateSpec) -> str:
    """A short name for :func:`configuration_key` (log file names)."""
    return hashlib.sha256(configuration_key(spec).encode()).hexdigest()[:16]


@dataclass
class WarmEngine:
    """A started engine and what it said when it loaded."""

    engine: EngineProcess
    info: EngineInfo
    environment: str | None
    """The candidate environment it runs in (None: regress's own)."""
    load_s: float
    runs: int = 0
    """Runs it finished."""
    cache_cleared: bool | None = None
    """Whether it forgot its earlier runs before the current one (None: started for it, nothing
    to forget)."""


class WarmEngines:
    """Engines kept warm across runs (use as a context manager; closing stops them all)."""

    def __init__(self, *, keep: int = 1, shard_timeout_s: float | None = None, failure_ttl_s: float | None = None):
        self.keep = max(1, keep)
        self.shard_timeout_s = shard_timeout_s
        self.failure_ttl_s = failure_ttl_s
        self._warm: dict[str, WarmEngine] = {}
        self._start_failures: dict[str, tuple[float, RegressError]] = {}
        self._launched: dict[str, tuple[EngineProcess, str | None, float]] = {}
        self.loads = 0

    def __enter__(self) -> "WarmEngines":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self._launched:
            _, (engine, _, _) = self._launched.popitem()
            engine.abandon()
        while self._warm:
            _, warm = self._warm.popitem()
            warm.engine.close()

    def prestart(self, spec: CandidateSpec, *, log: Path, load_timeout_s: float | None = None) -> bool:
        """Start ``spec``'s engine in the background, for an :meth:`acquire` that may come later:
        its imports and load overlap what the caller does meanwhile. Nothing is built: False
        (and nothing started) when its environment does not exist yet or it is already there.
        It does not count against ``keep`` until acquired; :meth:`close` stops it if never used."""
        from regress.envs import EnvSpec, find_env
        from regress.records.candidate import CURRENT_ENVIRONMENT

        key = configuration_key(spec)
        if key in self._warm or key in self._launched:
            return False
        try:
            if spec.package == CURRENT_ENVIRONMENT:
                python, environment = python_for(spec)[0], None
            else:
                env = find_env(EnvSpec.for_candidate(spec), who=f"candidate '{spec.name}': ")
                if env is None:
                    return False
                python, environment = env.python, str(env.path)
        except RegressError:
            return False  # acquire() says what is wrong with it, as it would without a prestart
        engine = EngineProcess(spec, python, log, load_timeout_s=load_timeout_s)
        try:
            engine.launch()
        except BaseException as exc:
            engine.abandon()
            if isinstance(exc, RegressError):
                return False  # as above: the acquire that may come starts it again and reports it
            raise
        self._launched[key] = (engine, environment, time.monotonic())
        return True

    def acquire(self, spec: CandidateSpec, *, log: Path, vocab_out: Path | None = None,
                load_timeout_s: float | None = None,
                on_status: Callable[[str], None] | None = None,
                fresh: bool = False) -> tuple[WarmEngine, bool]:
        """The warm engine of ``spec``'s configuration, started when there is none (its log to
        ``log``, its vocabulary to ``vocab_out``); returns it and whether it was started now. A
        reused engine writes the vocabulary to ``vocab_out`` too.

        A reused engine is always first asked to forget its earlier runs' requests
        (:meth:`EngineProcess.reset_cache`, vLLM's prefix cache): what a run computes must not
        depend on which runs this engine served before (a diagnosis probe that sends the same
        prompts again, a worker's shard after another run's). One that dies or is confused by
        the question is replaced. ``fresh``: the caller needs what a freshly started engine
        computes (a noise arm measures the baseline's own variation, a probe compares with it),
        so an engine that cannot say it forgot is replaced too; without ``fresh`` it is used
        as it is, and :attr:`WarmEngine.cache_cleared` records False for the run's facts."""
        status = on_status or (lambda message: None)
        key = configuration_key(spec)
        self._refuse_recent_failure(key, spec)
        warm = self._warm.pop(key, None)
        if warm is not None:
            forgot = self._forgets(warm)
            if forgot is None or (fresh and not forgot):
                why = "did not answer a cache reset" if forgot is None else "cannot clear its cache"
                status(f"the warm engine of '{spec.name}' {why}: starting a fresh one")
                warm.engine.close()
                warm = None
        if warm is not None:
            self._warm[key] = warm  # most recently used last: the least recently used goes first
            if vocab_out is not None:
                try:
                    warm.engine.write_vocabulary(vocab_out)
                except EngineError:
                    pass  # a tokenizer without a vocabulary only costs the report its token texts
            return warm, False
        while len(self._warm) >= self.keep:
            oldest = next(iter(self._warm))
            self._warm.pop(oldest).engine.close()
        launched = self._launched.pop(key, None)
        if launched is not None:
            engine, environment, started = launched
            engine.move_log(log)
            status(f"engine for '{spec.name}' started in the background; waiting for it to load")
        else:
            status(f"preparing environment for {spec.package}")
            with phase("environment", spec.package):
                python, env, _ = python_for(spec, on_line=lambda line: status(f"pip: {line[:100]}"))
            environment = str(env.path) if env is not None else None
            status(f"loading engine for '{spec.name}' ({spec.backend}, {spec.dtype})")
            engine = EngineProcess(spec, python, log, load_timeout_s=load_timeout_s)
            started = time.monotonic()
        try:
            with phase("engine_start", f"candidate '{spec.name}'"):
                if launched is None:
                    info = dict(engine.start(vocab_out=vocab_out))
                else:
                    info = dict(engine.wait_loaded())
                    if vocab_out is not None:
                        try:
                            engine.write_vocabulary(vocab_out)
                        except EngineError:
                            pass  # as for a reused engine: the report only loses its token texts
        except (EngineError, InputError) as exc:
            engine.close()
            if self.failure_ttl_s is not None and not getattr(exc, "retryable", False):
                self._start_failures[key] = (time.monotonic(), exc)
            raise
        except BaseException:
            engine.close()
            raise
        self._start_failures.pop(key, None)
        self.loads += 1
        warm = WarmEngine(engine, info, environment, float(info.get("engine_load_s", time.monotonic() - started)))
        self._warm[key] = warm
        return warm, True

    @staticmethod
    def _forgets(warm: WarmEngine) -> bool | None:
        """Whether ``warm`` cleared what its earlier runs left (recorded on it for the run's
        facts); None when it could not answer (dead, or a malformed reply): not to be reused."""
        try:
            warm.cache_cleared = warm.engine.reset_cache()
        except EngineError:
            warm.cache_cleared = False
            return None
        return warm.cache_cleared

    def _refuse_recent_failure(self, key: str, spec: CandidateSpec) -> None:
        failed = self._start_failures.get(key)
        if failed is None or self.failure_ttl_s is None:
            return
        age = time.monotonic() - failed[0]
        if age >= self.failure_ttl_s:
            return
        detail = str(failed[1]).removeprefix(f"candidate '{spec.name}': ")
        raise EngineError(f"{detail} [not started again: the same engine failed to start on this worker "
                          f"{age:.0f} s ago; next attempt after {self.failure_ttl_s:.0f} s]",
                          candidate=spec.name, retryable=False)

    def drop_launched(self, spec: CandidateSpec) -> None:
        """Stop ``spec``'s engine if :meth:`prestart` started it and nothing acquired it."""
        launched = self._launched.pop(configuration_key(spec), None)
        if launched is not None:
            launched[0].abandon()

    def discard(self, spec: CandidateSpec) -> None:
        """Close and forget ``spec``'s engine (it died; the next :meth:`acquire` starts another)."""
        self.drop_launched(spec)
        warm = self._warm.pop(configuration_key(spec), None)
        if warm is not None:
            warm.engine.close()
