"""Served requests carry what clients send (issue 27): the server's own sampling defaults reach them.

vLLM's server fills every field a request leaves unset from its generation config. With
``server.sampling_fields: client`` (the default) regress's requests leave to the server what the
prompt set and the candidate do not set; what the server filled in is learnt (its start-up log,
a probe), checked, recorded in the manifest, and named by ``regress diff`` and the report as
input-defaults drift.

No engine: which fields a request carries in each mode, the plan's record of them and its
fingerprints, the log lines and probe answers read (hostile ones refused), the record's checks,
the configuration diff. Real servers (one module's worth): a server with ``--generation-config``
holding a repetition penalty fails a check through ``url:`` against a golden made through a
server without it, named as input defaults; the same server as the golden's passes, and so does
the penalised server with every field sent (``sampling_fields: all``); a server regress starts with
the same generation config has its defaults read from its log.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from conftest import run_cli

PENALTY = 1.3


# -- no engine: what a request carries ------------------------------------------------------


def _plan(candidate, **card_defaults):
    """The first request's sampling of the fixture prompt set planned for ``candidate`` (with
    ``card_defaults`` replacing the card's defaults)."""
    from regress.datasets import FIXTURE_PROMPTS, load_prompt_set
    from regress.records import SamplingSpec
    from regress.replay.plan import plan_replay

    prompt_set = load_prompt_set(FIXTURE_PROMPTS)
    if card_defaults:
        card = prompt_set.card.model_copy(update={"defaults": SamplingSpec(**card_defaults)})
        prompt_set = type(prompt_set)(**{**prompt_set.__dict__, "card": card})
    return plan_replay(candidate, prompt_set)


def _backend(spec):
    from regress.backends.vllm_server import VllmServerBackend

    backend = VllmServerBackend(spec.engine_spec())
    backend._model_name = "m"
    return backend


def _sent(backend, sampling):
    from regress.backends.base import GenerationRequest

    payload = backend._payload(GenerationRequest([1, 2, 3], sampling))
    return {k: v for k, v in payload.items() if k not in ("model", "prompt", "return_tokens_as_token_ids", "stream")}


def test_a_client_request_carries_what_the_layers_set_and_what_scoring_needs():
    from regress.records import CandidateSpec

    client = CandidateSpec(name="c", model="m", backend="server")
    every = CandidateSpec(name="a", model="m", backend="server", server={"sampling_fields": "all"})
    # The card says greedy, 48 tokens, top-5, seed 0: those go out, the server fills in the rest.
    sampling = _plan(client).tasks[0].prompts[0]["sampling"]
    assert sampling["explicit"] == ["logprobs", "max_tokens", "seed", "temperature"]
    assert _sent(_backend(client), sampling) == {"max_tokens": 48, "logprobs": 5, "temperature": 0.0, "seed": 0}
    assert _backend(client).sampling_applied(sampling)["left_to_server"] == [
        "repetition_penalty", "presence_penalty", "frequency_penalty", "top_k", "top_p", "min_p"]
    # A card that sets a penalty and nothing about temperature: the penalty goes out, and
    # temperature is regress's greedy 0 (never the server's 1.0); no seed for a greedy request.
    sampling = _plan(client, repetition_penalty=1.1, max_tokens=8).tasks[0].prompts[0]["sampling"]
    assert _sent(_backend(client), sampling) == {"max_tokens": 8, "logprobs": 5, "temperature": 0.0,
                                                 "repetition_penalty": 1.1}
    # Sampling: the seed goes out whoever chose the temperature, top_p stays the server's.
    sampling = _plan(client, temperature=0.7, max_tokens=8).tasks[0].prompts[0]["sampling"]
    assert _sent(_backend(client), sampling) == {"max_tokens": 8, "logprobs": 5, "temperature": 0.7, "seed": 0}
    # all: every field, regress's built-in values where nothing set one (min_p: regress has none).
    sampling = _plan(every).tasks[0].prompts[0]["sampling"]
    assert "explicit" not in sampling
    assert _sent(_backend(every), sampling) == {
        "max_tokens": 48, "logprobs": 5, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_tokens": 0, "seed": 0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": False}
    assert _backend(every).sampling_applied(sampling)["left_to_server"] == ["min_p"]
    # A sampling that records no explicit fields (planned before them) goes out whole, as before.
    legacy = {k: v for k, v in _plan(client).tasks[0].prompts[0]["sampling"].items() if k != "explicit"}
    assert _sent(_backend(client), legacy) == _sent(_backend(every), _plan(every).tasks[0].prompts[0]["sampling"])


def test_only_client_served_plans_record_the_fields_set_and_change_fingerprint():
    from regress.records import CandidateSpec

    offline = CandidateSpec(name="o", model="m")
    client = CandidateSpec(name="s", model="m", backend="server")
    also_client = CandidateSpec(name="s", model="m", backend="server", server={"concurrency": 1})
    every = CandidateSpec(name="s", model="m", backend="server", server={"sampling_fields": "all"})
    # The default is left out of the stored form (the candidate's own fingerprint as before) ...
    assert "sampling_fields" not in also_client.model_dump()["server"]
    assert every.model_dump()["server"]["sampling_fields"] == "all"
    assert _backend(also_client).sampling_fields == _backend(client).sampling_fields == "client"
    # ... offline plans store their sampling as before (no record of explicit fields) ...
    assert all("explicit" not in p["sampling"] for t in _plan(offline).tasks for p in t.prompts)
    # ... and a client plan is another experiment than the same candidate's runs of before (which
    # sent every field): its plan and shards have fingerprints of their own.
    a, b = _plan(also_client), _plan(also_client.model_copy(update={"server": every.server}))
    assert a.fingerprint != b.fingerprint
    assert not {t.fingerprint for t in a.tasks} & {t.fingerprint for t in b.tasks}
    with pytest.raises(ValueError):
        from regress.records import ResolvedSampling

        ResolvedSampling(explicit=["temperature", "colour"])


# -- no engine: what the server says, checked -------------------------------------------------


def test_defaults_are_read_from_vllms_start_up_log_lines():
    from regress.backends.server_sampling import defaults_from_log

    current = ("(APIServer pid=7) WARNING 12-02 03:58:18 [model.py:1437] Default vLLM sampling parameters have been "
               "overridden by the model's `generation_config.json`: `{'repetition_penalty': 1.3, 'top_k': 20, "
               "'top_p': 0.8}`. If this is not intended, please relaunch vLLM instance with `--generation-config vllm`.")
    assert defaults_from_log(["INFO starting", current]) == {"repetition_penalty": 1.3, "top_k": 20, "top_p": 0.8}
    directory = ("WARNING [model.py:1437] Default vLLM sampling parameters have been overridden by /srv/gen: "
                 "`{'temperature': 0.6, 'max_tokens': 512}`. If this is not intended, ...")
    assert defaults_from_log([directory]) == {"temperature": 0.6, "max_tokens": 512}
    earlier = ("INFO 04-16 09:24:57 [serving_completion.py:61] Using default completion sampling params from model: "
               "{'repetition_penalty': 1.1, 'temperature': 0.7, 'top_k': 20, 'top_p': 0.8}")
    assert defaults_from_log([earlier]) == {"repetition_penalty": 1.1, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
    assert defaults_from_log(["INFO Application startup complete."]) == {}  # vLLM logs none when it applies none


@pytest.mark.parametrize("logged", [
    "{'repetition_penalty': float('nan')}",  # a call: not a literal
    "{'repetition_penalty': 1e999}",  # infinite
    "{'repetition_penalty': True}",  # a flag
    "{'repetition_penalty': '1.3'}",  # text
    "{'logits_processors': 1}",  # no field a server fills in
    "{'top_k': 2.5}",  # not whole
    "{'top_p': -1e12}",  # out of any range
    "{" + ", ".join(f"'top_p': {i}" for i in range(40)) + "}",  # repeated keys: the last (39) is no top_p
    "{'top_p': 1.5}", "{'min_p': -0.1}", "{'repetition_penalty': 0}", "{'max_tokens': 0}",  # outside vLLM's ranges
    "{'temperature': __import__('os').system('id')}",  # code
    "{'temperature': 1, 'min_p': [0] * 9}",
    "{'x" + "y" * 5000 + "': 1}",  # longer than anything read
])
def test_hostile_logged_defaults_are_refused(logged):
    from regress.backends.server_sampling import defaults_from_log

    line = f"WARNING Default vLLM sampling parameters have been overridden by the model's: `{logged}`."
    # Refused (None: not learnt); one longer than a log line is read for is no statement at all.
    assert defaults_from_log([line]) == ({} if len(logged) > 1024 else None), logged


def test_checked_defaults_and_the_record_refuse_what_no_server_fills_in():
    import math

    from pydantic import ValidationError

    from regress.backends.server_sampling import SERVER_DEFAULT_FIELDS, checked_defaults
    from regress.records.manifest import SERVER_DEFAULT_FIELDS as RECORDED, ServerDefaults

    from regress.backends.server_sampling import RANGES
    from regress.records.manifest import DEFAULT_RANGES

    assert SERVER_DEFAULT_FIELDS == RECORDED and RANGES == DEFAULT_RANGES  # engine side (no pydantic) and record agree
    assert checked_defaults({"top_k": 20.0, "repetition_penalty": 1.3}) == {"top_k": 20, "repetition_penalty": 1.3}
    for bad in ([("top_k", 1)], {"top_k": math.inf}, {"top_k": None}, {1: 1.0},
                {name: 1 for name in SERVER_DEFAULT_FIELDS} | {"extra": 1}):
        with pytest.raises(ValueError):
            checked_defaults(bad)
    record = ServerDefaults(learnt_from=["log", "probe"], values={"repetition_penalty": 1.3, "top_p": 1.0},
                            probed=["repetition_penalty"], changed_by_probe=["repetition_penalty", "min_p"])
    assert record.applied() == {"min_p": None, "repetition_penalty": 1.3}  # top_p 1.0 is neutral
    assert record.applied({"min_p"}) == {"min_p": None}
    for bad in ({"values": {"top_p": math.nan}}, {"values": {"seed": 1}}, {"values": {"top_p": "0.9"}},
                {"values": {"top_p": False}}, {"changed_by_probe": ["<script>"]}, {"learnt_from": ["rumour"]},
                {"probed": ["top_p"] * 9}):
        with pytest.raises(ValidationError):
            ServerDefaults(**bad)


def test_probe_answers_are_checked_and_a_wavering_server_concludes_nothing():
    from regress.backends.server_sampling import PROBE_TOKENS, probe_requests, probe_result, probe_tokens

    requests = probe_requests("m", [5, 6])
    greedy_neutral = [b for d, n, b in requests if d == "greedy" and n is None]
    assert len(greedy_neutral) == 2 and greedy_neutral[0]["repetition_penalty"] == 1.0
    without = {n: b for d, n, b in requests if n is not None}
    assert "repetition_penalty" not in without["repetition_penalty"] and without["top_p"]["temperature"] == 1.0
    assert all(b["max_tokens"] == PROBE_TOKENS and b["ignore_eos"] for _, _, b in requests)

    def answers(changed=(), waver=False):
        out = []
        for decoding, name, _ in requests:
            tokens = [1, 2, 3]
            if name in changed or (waver and name is None and decoding == "greedy" and out and out[-1][1] is None):
                tokens = [1, 2, 4]
            out.append((decoding, name, tokens))
        return out

    assert probe_result(answers()) == {"probed": ["repetition_penalty", "presence_penalty", "frequency_penalty",
                                                  "top_p", "top_k", "min_p"], "changed_by_probe": [],
                                       "inconclusive": False}
    assert probe_result(answers(changed={"repetition_penalty", "top_k"}))["changed_by_probe"] == [
        "repetition_penalty", "top_k"]
    wavering = probe_result(answers(changed={"repetition_penalty"}, waver=True))
    assert wavering["inconclusive"] and "repetition_penalty" not in wavering["probed"] + wavering["changed_by_probe"]

    def answer(tokens):
        return {"choices": [{"logprobs": {"tokens": tokens}}]}

    assert probe_tokens(answer(["token_id:7", "token_id:1023"]), 1024) == [7, 1023]
    for bad in (answer(["token_id:1024"]), answer(["7"]), answer(["token_id:1"] * (PROBE_TOKENS + 1)),
                answer("token_id:1"), {"choices": []}, [], answer([{"token": "token_id:1"}]),
                answer(["token_id:٣"])):
        with pytest.raises(ValueError):
            probe_tokens(bad, 1024)


def test_the_backend_probes_a_server_and_records_what_it_fills_in():
    """Through a stand-in server that changes its answer when a request leaves the penalty unset
    (as a server with a repetition-penalty default does): the probe names the field."""
    from fake_openai_server import FakeOpenAIServer

    def penalised(kind, value, body):
        if kind == "json" and body.get("max_tokens", 0) > 1 and "repetition_penalty" not in body:
            for choice in value["choices"]:
                choice["logprobs"]["tokens"] = [f"token_id:{(int(t[9:]) + 1) % 1024}"
                                                for t in choice["logprobs"]["tokens"]]
        return value

    for tamper, changed in ((None, []), (penalised, ["repetition_penalty"])):
        with FakeOpenAIServer("fixture", tamper=tamper) as fake:
            backend = _served_backend(fake.url)
            learnt = backend._learn_defaults()
        assert learnt["learnt_from"] == ["probe"] and learnt["changed_by_probe"] == changed, learnt
        assert not learnt["inconclusive"] and "repetition_penalty" in learnt["probed"]


def _served_backend(url: str):
    from regress.backends.vllm_server import VllmServerBackend
    from regress.records import CandidateSpec

    class Tokenizer:  # the probe only encodes its prompt
        def encode(self, text):
            return [ord(c) % 1024 for c in text[:12]]

    backend = VllmServerBackend(CandidateSpec(name="s", model="fixture", backend="server",
                                              server={"url": url}).engine_spec())
    backend._tokenizer, backend._vocab, backend._model_name = Tokenizer(), 1024, "fixture"
    return backend


def _manifest(effective_facts: dict):
    """A served run's manifest whose effective configuration records ``effective_facts``."""
    from regress.records import RunManifest

    effective = {"server": {"sampling_fields": "client"}, **effective_facts}
    return RunManifest.model_validate({
        "run_id": "r", "kind": "replay", "candidate": {"name": "c", "model": "m", "backend": "server"},
        "dataset": {"name": "d", "path": "d", "sha256": "0" * 64, "prompts": 1},
        "layout": {"shard_size": 1, "shards": []}, "versions": {"python": "3", "regress": "0"},
        "model": {"model": "m"}, "hardware": {"platform": "p"}, "env_vars": {}, "engine_args": {},
        "teacher_forced": False, "memory": {},
        "timings": {"engine_load_s": 0, "generation_s": 0, "total_s": 0, "prompt_tokens": 0, "output_tokens": 0,
                    "tokens_per_s": 0},
        "effective": effective})


def test_the_config_diff_names_server_defaults_as_input_defaults():
    from regress.report.configdiff import config_diff, input_defaults_drift

    left = ["repetition_penalty", "presence_penalty", "frequency_penalty", "top_k", "top_p", "min_p"]
    applied = [{"sampling": {}, "applied": {"temperature": 0.0, "left_to_server": left}}]
    none = _manifest({"server_defaults": {"learnt_from": ["probe"], "probed": left}, "sampling_applied": applied})
    logged = _manifest({"server_defaults": {"learnt_from": ["log", "probe"], "values": {"repetition_penalty": PENALTY},
                                            "probed": left, "changed_by_probe": ["repetition_penalty"]},
                        "sampling_applied": applied})
    probed = _manifest({"server_defaults": {"learnt_from": ["probe"], "probed": left,
                                            "changed_by_probe": ["repetition_penalty"]}, "sampling_applied": applied})
    assert input_defaults_drift(none, logged) == "input defaults: the server applied repetition_penalty 1.3 (golden: none)"
    assert "repetition_penalty (not neutral, value not reported)" in input_defaults_drift(none, probed)
    assert input_defaults_drift(none, none) is None and input_defaults_drift(logged, logged) is None
    # The penalty set by the prompt set (not left to the server): nothing of the server's applied.
    sent = [{"sampling": {}, "applied": {"repetition_penalty": 1.0, "left_to_server": left[1:]}}]
    explicit = _manifest({"server_defaults": logged.effective.server_defaults.model_dump(), "sampling_applied": sent})
    assert input_defaults_drift(none, explicit) is None
    rows = {(s.section, s.name): s for s in config_diff(none, logged)}
    assert rows[("input defaults", "server defaults applied")].candidate == "repetition_penalty 1.3"
    assert rows[("input defaults", "server defaults applied")].changed
    # An offline golden (no record: every field sent) counts as none applied.
    offline = _manifest({}).model_copy(update={"effective": None})
    assert rows[("input defaults", "server defaults applied")].baseline == "none"
    assert {(s.section, s.name): s.baseline for s in config_diff(offline, logged)}[
        ("input defaults", "server defaults applied")] == "none"
    assert input_defaults_drift(offline, logged).endswith("(golden: none)")


def test_the_drift_is_found_between_two_candidates_runs(tmp_path):
    """As `regress diff` reads them: the golden for the baseline, runs/<name> for a candidate."""
    from regress.report.configdiff import applied_differences, applied_input_defaults_drift

    class Project:  # the two places regress.config.Params names
        def golden_dir(self):
            return tmp_path / "golden"

        def run_dir(self, name):
            return tmp_path / "runs" / name

    left = ["repetition_penalty", "top_p"]
    applied = [{"sampling": {}, "applied": {"left_to_server": left}}]
    for where, name, values in (("golden", "baseline", {}), ("runs/c", "c", {"repetition_penalty": PENALTY})):
        manifest = _manifest({"server_defaults": {"learnt_from": ["log"], "values": values},
                              "sampling_applied": applied})
        manifest = manifest.model_copy(update={"candidate": manifest.candidate.model_copy(update={"name": name})})
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "manifest.json").write_text(manifest.model_dump_json())
    assert applied_input_defaults_drift(Project(), "baseline", "c") == (
        "input defaults: the server applied repetition_penalty 1.3 (golden: none)")
    rows = {s.name: (s.baseline, s.candidate) for s in applied_differences(Project(), "baseline", "c")}
    assert rows["server defaults applied"] == ("none", "repetition_penalty 1.3")
    assert applied_input_defaults_drift(Project(), "baseline", "missing") is None


def test_regress_diff_knows_a_started_servers_defaults_before_it_runs(tmp_path):
    from regress.effective import LEARNT_AT_RUN, differences
    from regress.records import CandidateSpec

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text(json.dumps({"repetition_penalty": PENALTY, "do_sample": False}))
    a = CandidateSpec(name="a", model=str(tmp_path / "model"), backend="server")
    b = CandidateSpec(name="b", model=str(tmp_path / "model"), backend="server",
                      engine_args={"generation_config": str(tmp_path / "gen"),
                                   "override_generation_config": {"top_p": 0.9}})
    url = CandidateSpec(name="u", model=str(tmp_path / "model"), backend="server",
                        server={"url": "http://h:8000", "sampling_fields": "all"})
    found = {(d.source, d.name): (d.baseline, d.candidate) for d in differences(a, b)}
    assert found[("input defaults", "server defaults")] == ("-", '{"repetition_penalty": 1.3, "top_p": 0.9}')
    found = {(d.source, d.name): (d.baseline, d.candidate) for d in differences(a, url)}
    assert found[("input defaults", "server defaults")] == ("-", LEARNT_AT_RUN)
    assert found[("input defaults", "sampling fields sent")] == ("client", "all")
    # An offline candidate sends every field; a started server without defaults adds nothing else.
    offline = CandidateSpec(name="o", model=str(tmp_path / "model"))
    assert {(d.source, d.name) for d in differences(offline, a) if d.source == "input defaults"} == {
        ("input defaults", "sampling fields sent")}


# -- real servers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def penalty_config(fixture_model: Path, tmp_path_factory) -> Path:
    """A ``--generation-config`` directory: the fixture model's generation config plus a
    repetition penalty."""
    out = tmp_path_factory.mktemp("generation-config")
    config = json.loads((fixture_model / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": PENALTY}))
    return out


@pytest.fixture(scope="module")
def two_servers(fixture_model: Path, penalty_config: Path, tmp_path_factory):
    """Two real servers of the fixture model, the golden's settings: one plain (vLLM's defaults:
    the model's generation config, which has no sampling defaults) and one started with
    ``--generation-config`` holding the penalty. Started side by side (each ~30 s)."""
    from test_server_backend import _start_server

    logs = tmp_path_factory.mktemp("servers")
    servers = []
    try:
        started = time.monotonic()
        servers.append(_start_server(fixture_model, logs / "plain.log"))
        servers.append(_start_server(fixture_model, logs / "penalty.log", "--generation-config", str(penalty_config)))
        print(f"two servers healthy in {time.monotonic() - started:.1f} s")
        penalty_log = (logs / "penalty.log").read_text(errors="replace")
        assert "overridden by" in penalty_log and str(PENALTY) in penalty_log, penalty_log[-3000:]
        yield {"plain": servers[0][1], "penalty": servers[1][1]}
    finally:
        for server, _ in servers:
            server.stop()


@pytest.fixture(scope="module")
def defaults_workspace(tmp_path_factory, fixture_model: Path, penalty_config: Path, two_servers) -> Path:
    """A project whose golden was made through the plain server (``url:``), and candidates through
    the penalised one (as clients send, and with every field), the plain one again, and a server
    regress starts itself with the penalised generation config."""
    from conftest import write_params
    from regress.datasets import FIXTURE_PROMPTS, write_demo_prompts

    root = tmp_path_factory.mktemp("defaults-workspace")
    write_demo_prompts(root / "datasets" / "prompts", which=FIXTURE_PROMPTS)
    write_params(root, model=fixture_model, baseline={"backend": "server", "server": {"url": two_servers["plain"]}},
                 candidates={
                     "plain": {"server": {"url": two_servers["plain"], "concurrency": 2}},
                     "penalty": {"server": {"url": two_servers["penalty"]}},
                     "penalty-all": {"server": {"url": two_servers["penalty"], "sampling_fields": "all"}},
                     "own-penalty": {"server": {"concurrency": 4},
                                     "engine_args": {"generation_config": str(penalty_config)}},
                 })
    started = time.monotonic()
    result = run_cli("golden", cwd=root)
    print(f"golden through the plain server: {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, result.stderr
    return root


def _check(workspace: Path, name: str):
    from collections import Counter

    from regress.scoring import read_scored_run

    started = time.monotonic()
    result = run_cli("check", name, cwd=workspace)
    assert result.returncode in (0, 1), result.stderr
    classes = Counter(s.prompt_class for s in read_scored_run(workspace / "scores" / name).scores)
    print(f"{name}: exit {result.returncode}, {dict(classes)} in {time.monotonic() - started:.1f} s")
    return result.returncode, classes


def _effective(workspace: Path, run: str) -> dict:
    where = workspace / ("golden" if run == "golden" else f"runs/{run}")
    return json.loads((where / "manifest.json").read_text())["effective"]


@pytest.mark.engine
@pytest.mark.server
def test_the_golden_server_probed_neutral(defaults_workspace: Path):
    golden = _effective(defaults_workspace, "golden")
    assert golden["server"]["sampling_fields"] == "client"
    assert golden["server_defaults"]["learnt_from"] == ["probe"]
    assert golden["server_defaults"]["changed_by_probe"] == [] and "repetition_penalty" in golden["server_defaults"]["probed"]
    assert all("repetition_penalty" in e["applied"]["left_to_server"] for e in golden["sampling_applied"])


@pytest.mark.engine
@pytest.mark.server
def test_a_server_with_other_defaults_fails_and_is_named_input_defaults(defaults_workspace: Path):
    code, classes = _check(defaults_workspace, "penalty")
    assert code == 1, classes
    assert classes["identical"] < 40 and classes["regression"] + classes["drift"] > 0, classes
    effective = _effective(defaults_workspace, "penalty")
    assert effective["server_defaults"]["changed_by_probe"] == ["repetition_penalty"]
    diff = run_cli("diff", "penalty", "--json", cwd=defaults_workspace)
    assert diff.returncode == 0, diff.stderr
    applied = {s["setting"]: s for s in json.loads(diff.stdout)["applied_differences"]}
    row = applied["server defaults applied"]
    assert row["baseline"] == "none" and row["candidate"].startswith("repetition_penalty"), row
    text = run_cli("diff", "penalty", cwd=defaults_workspace).stdout
    assert "server defaults applied: none -> repetition_penalty" in text, text
    page = (defaults_workspace / "reports" / "penalty" / "index.html").read_text(encoding="utf-8")
    assert "input defaults" in page and "server defaults applied" in page
    summary = (defaults_workspace / "reports" / "penalty" / "summary.md").read_text(encoding="utf-8")
    assert "input defaults: server defaults applied" in summary, summary


@pytest.mark.engine
@pytest.mark.server
def test_the_same_defaults_pass_and_every_field_sent_neutralises_them(defaults_workspace: Path):
    code, classes = _check(defaults_workspace, "plain")
    assert code == 0 and set(classes) <= {"identical", "benign"}, classes
    code, classes = _check(defaults_workspace, "penalty-all")
    assert code == 0 and set(classes) <= {"identical", "benign"}, classes
    effective = _effective(defaults_workspace, "penalty-all")
    # The server still has the penalty (the probe sees it) but no request left it unset.
    assert effective["server_defaults"]["changed_by_probe"] == ["repetition_penalty"]
    assert all(e["applied"]["left_to_server"] == ["min_p"] for e in effective["sampling_applied"])
    from regress.report.configdiff import input_defaults_drift
    from regress.runs import read_manifest

    assert input_defaults_drift(read_manifest(defaults_workspace / "golden"),
                                read_manifest(defaults_workspace / "runs" / "penalty-all")) is None


@pytest.mark.engine
@pytest.mark.server
def test_a_started_servers_defaults_are_read_from_its_log(defaults_workspace: Path):
    code, classes = _check(defaults_workspace, "own-penalty")
    assert code == 1, classes
    defaults = _effective(defaults_workspace, "own-penalty")["server_defaults"]
    assert defaults["learnt_from"] == ["log", "probe"] and defaults["values"] == {"repetition_penalty": PENALTY}
    assert defaults["changed_by_probe"] == ["repetition_penalty"]
    from regress.report.configdiff import input_defaults_drift
    from regress.runs import read_manifest

    assert input_defaults_drift(read_manifest(defaults_workspace / "golden"),
                                read_manifest(defaults_workspace / "runs" / "own-penalty")) == (
        f"input defaults: the server applied repetition_penalty {PENALTY} (golden: none)")
    # Known before it runs (read from the generation config it is started with); the golden's url
    # server's only from its run.
    text = run_cli("diff", "own-penalty", cwd=defaults_workspace).stdout
    line = next(line for line in text.splitlines() if line.strip().startswith("server defaults:"))
    assert line.endswith(f'-> {{"repetition_penalty": {PENALTY}}}') and "learnt when it runs" in line, text
