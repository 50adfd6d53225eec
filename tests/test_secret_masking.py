"""Credentials in a candidate's engine arguments and environment stay out of manifest.json, the
report's configuration and summary.md (the GitHub job summary): masked by the setting's name as
well as by the value's shape, when the manifest is written and again where a report reads a
manifest written before (security review C, item 3)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from regress.redact import MASK, masked_pair, masked_setting, masked_settings, secret_setting

HF = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"
# Ordinary values (no token shape): only the name says they are credentials.
SECRET_ENV = {
    "WANDB_API_KEY": "0a1b2c3d4e5f60718293a4b5c6d7e8f9",
    "OPENAI_API_KEY": "plainvalue",
    "MY_SECRET": "xsecretx",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIexample",
    "AWS_ACCESS_KEY_ID": "idvalue123",
    "GITLAB_TOKEN": "glvalue123",
    "GOOGLE_CREDENTIALS": "credvalue123",
    "PROXY_AUTH_USER": "authuser123",
    "MY_SERVICE_PASSWORD": "pw-value-123",
}
PLAIN_ENV = {"OMP_NUM_THREADS": "2", "VLLM_BATCH_INVARIANT": "1"}
NESTED_SECRET = "nested-auth-value"


def _raw_values() -> list[str]:
    return [HF, NESTED_SECRET, *SECRET_ENV.values()]


def _assert_no_raw_secret(text: str) -> None:
    leaked = [v for v in _raw_values() if v in text]
    assert not leaked, f"raw secrets shown: {leaked}"


@pytest.mark.parametrize("name", [*SECRET_ENV, "hf_token", "api_key", "HF_TOKEN", "X_AUTH", "DB_PASS",
                                  "REGRESS_BROKER_KEY", "auth_token", "password", "S3_SECRET_ACCESS_KEY",
                                  "VLLM_API_KEY"])
def test_a_setting_named_for_a_credential_is_secret(name):
    assert secret_setting(name)


@pytest.mark.parametrize("name", [*PLAIN_ENV, "max_model_len", "kv_cache_dtype", "enforce_eager", "api_key_env",
                                  "bos_token_id", "max_num_batched_tokens", "tokenizer", "skip_tokenizer_init",
                                  "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD", "TOKENIZERS_PARALLELISM",
                                  "VLLM_CPU_KVCACHE_SPACE", "cache_key", "HF_HOME", "compilation_config"])
def test_an_ordinary_setting_is_not_secret(name):
    assert not secret_setting(name)


def test_no_known_engine_argument_but_hf_token_is_masked():
    from regress.engine_args import known_engine_args

    _, names = known_engine_args()
    assert sorted(n for n in names if secret_setting(n)) == ["hf_token"]


def test_masking_goes_into_dicts_and_lists_and_keeps_what_holds_no_secret():
    value = {"kv_connector": "x", "extra": {"auth_token": NESTED_SECRET, "port": 5, "keys": [HF, "plain"]},
             "password": 1234}
    assert masked_setting("kv_transfer_config", value) == {
        "kv_connector": "x", "extra": {"auth_token": MASK, "port": 5, "keys": [MASK, "plain"]}, "password": MASK}
    assert masked_setting("hf_token", HF) == MASK
    assert masked_setting("hf_token", 12345) == MASK  # a numeric secret too
    # A bool or None holds no credential: a CORS switch stays readable.
    assert masked_setting("allow_credentials", True) is True and masked_setting("hf_token", None) is None
    # A value's shape or a URL's credentials, under any name.
    assert masked_setting("VLLM_SOMETHING", HF) == MASK
    assert masked_setting("MIRROR", "https://u:pw@m.example/x") == "https://u:***@m.example/x"
    shown = masked_settings({**SECRET_ENV, **PLAIN_ENV})
    assert all(shown[k] == MASK for k in SECRET_ENV) and {k: shown[k] for k in PLAIN_ENV} == PLAIN_ENV
    assert masked_settings(shown) == shown  # idempotent: a stored form masked again is the same


def test_a_masked_pair_says_changed_only_when_both_raw_values_are_known():
    assert masked_pair("hf_token", "a-secret", "b-secret") == (MASK, MASK + " (changed)")
    assert masked_pair("hf_token", "a-secret", "a-secret") == (MASK, MASK)
    assert masked_pair("hf_token", MASK, "b-secret") == (MASK, MASK)  # one stored masked: not known
    assert masked_pair("hf_token", None, "b-secret") == (None, MASK)  # set on one side only: visible
    assert masked_pair("max_model_len", 512, 1024) == (512, 1024)
    a, b = masked_pair("cfg", {"auth_token": "one"}, {"auth_token": "two"})
    assert a == {"auth_token": MASK} and b == '{"auth_token": "***"} (changed)'


# --------------------------------------------------------------------------------------
# the manifest as written
# --------------------------------------------------------------------------------------


def _candidate(token: str = HF):
    from regress.records import CandidateSpec

    return CandidateSpec(name="leaky", model="m", env={**SECRET_ENV, **PLAIN_ENV},
                         engine_args={"hf_token": token, "max_model_len": 512,
                                      "kv_transfer_config": {"kv_connector": "c",
                                                             "kv_connector_extra_config": {"auth_token": NESTED_SECRET}}})


def _manifest(tmp_path: Path, candidate):
    from report_fixtures import build_case
    from regress.replay import plan_replay
    from regress.replay.executors import ExecutionOutcome
    from regress.replay.manifest import build_manifest

    prompt_set = build_case(tmp_path, prompts=4).prompt_set
    plan = plan_replay(candidate, prompt_set, generation_defaults={})
    # The engine reports the arguments it was given, as the offline backend does (all but `model`).
    info = {"versions": {"python": "3"}, "hardware": {"platform": "test"},
            "engine_args": dict(candidate.engine_args)}
    metas = [{"generation_s": 1.0, "prompt_tokens": 4, "output_tokens": 4}]
    return plan, build_manifest(plan, ExecutionOutcome(info, 1, 0.5, {}), metas, 2.0)


def test_the_manifest_holds_no_secret_engine_argument_or_variable(tmp_path):
    from regress.records import RunManifest

    plan, manifest = _manifest(tmp_path, _candidate())
    text = manifest.model_dump_json()
    _assert_no_raw_secret(text)
    assert manifest.engine_args["hf_token"] == MASK and manifest.candidate.engine_args["hf_token"] == MASK
    assert manifest.engine_args["kv_transfer_config"]["kv_connector_extra_config"]["auth_token"] == MASK
    assert all(manifest.env_vars[k] == MASK and manifest.candidate.env[k] == MASK for k in SECRET_ENV)
    # What holds no secret is kept as it was.
    assert manifest.env_vars["OMP_NUM_THREADS"] == "2" and manifest.candidate.env["OMP_NUM_THREADS"] == "2"
    assert manifest.engine_args["max_model_len"] == 512 and manifest.candidate.engine_args["max_model_len"] == 512
    assert manifest.engine_args["kv_transfer_config"]["kv_connector"] == "c"
    # It reads back (the stored form is a valid manifest), still without the secrets.
    again = RunManifest.model_validate_json(text)
    assert again.engine_args["hf_token"] == MASK
    # The run's identity is the plan's, from the raw values: another token is another plan.
    assert manifest.plan_fingerprint == plan.fingerprint
    other_plan, other = _manifest(tmp_path / "other", _candidate("hf_ZyXwVuTsRqPoNmLkJiHgFeDcBa987654"))
    assert other.model_dump_json().count(MASK) == manifest.model_dump_json().count(MASK)
    assert other_plan.fingerprint != plan.fingerprint and other.plan_fingerprint != manifest.plan_fingerprint


# --------------------------------------------------------------------------------------
# the report and summary.md from manifests already written (before the manifest masked them)
# --------------------------------------------------------------------------------------


def _old_case(tmp_path: Path, baseline_token: str | None = None):
    """The report fixture with the candidate's manifest holding secrets in full, as one written
    before masking would (the golden's too when ``baseline_token``)."""
    from report_fixtures import build_case

    case = build_case(tmp_path, prompts=6)
    m = case.run.manifest
    leaky = m.model_copy(update={"engine_args": {**m.engine_args, "hf_token": HF, "max_model_len": 2048,
                                                 "kv_transfer_config": {"extra": {"auth_token": NESTED_SECRET}}},
                                 "env_vars": {**m.env_vars, **SECRET_ENV, **PLAIN_ENV}})
    golden = case.score.golden
    if baseline_token is not None:
        golden = golden.model_copy(update={"engine_args": {**golden.engine_args, "hf_token": baseline_token}})
    run = copy.copy(case.run)
    run.manifest = leaky
    return case, run, case.score.model_copy(update={"run": leaky, "golden": golden})


def test_the_config_diff_of_old_manifests_masks_secrets_and_shows_the_rest(tmp_path):
    from regress.report.configdiff import config_diff

    _, _, score = _old_case(tmp_path, baseline_token="hf_BaselineTokenBaselineToken0123")
    rows = {(s.section, s.name): s for s in config_diff(score.golden, score.run)}
    _assert_no_raw_secret(json.dumps([vars(s) for s in rows.values()]))
    assert "hf_BaselineToken" not in json.dumps([vars(s) for s in rows.values()])
    token = rows[("engine arguments", "hf_token")]
    assert (token.baseline, token.candidate) == (MASK, MASK + " (changed)") and token.changed
    wandb = rows[("environment variables", "WANDB_API_KEY")]
    assert (wandb.baseline, wandb.candidate) == ("—", MASK) and wandb.changed  # newly set: visible
    assert rows[("environment variables", "OMP_NUM_THREADS")].candidate == "2"
    assert rows[("engine arguments", "max_model_len")].candidate == "2048"
    assert rows[("engine arguments", "kv_transfer_config")].candidate == '{"extra": {"auth_token": "***"}}'


def test_summary_and_report_render_no_secret_of_an_old_manifest(tmp_path):
    from regress.report.render import render_candidate
    from regress.report.summary import summary_markdown

    case, run, score = _old_case(tmp_path)
    md = summary_markdown(score)
    html = render_candidate(score, case.golden, run, case.prompt_set)
    for text in (md, html):
        _assert_no_raw_secret(text)
    lines = md.replace("\\_", "_").splitlines()  # summary.md escapes "_" in names
    assert "| environment variables: OMP_NUM_THREADS | `—` | `2` |" in lines
    assert "| engine arguments: max_model_len | `—` | `2048` |" in lines
    assert "| engine arguments: hf_token | `—` | `***` |" in lines
    assert "OMP_NUM_THREADS" in html and "WANDB_API_KEY" in html and "hf_token" in html


def test_engine_info_in_the_run_masks_secret_engine_arguments(tmp_path):
    """engine-info.json stays in the finished run beside manifest.json: its engine arguments are
    masked as the manifest's are, and the rest of the facts are kept as they are."""
    import json as _json

    from regress.replay.rundir import write_engine_info

    path = tmp_path / "engine-info.json"
    write_engine_info(path, {"info": {"engine_args": {"hf_token": "hf_abcdefghijklmnop1234", "max_model_len": 2048,
                                                      "hf_overrides": {"auth_token": "plainsecret"}},
                                      "versions": {"vllm": "0.32.0"}}, "memory": {"peak_rss_mib": 1.0}})
    text = path.read_text()
    assert "hf_abcdefghijklmnop1234" not in text and "plainsecret" not in text
    saved = _json.loads(text)
    assert saved["info"]["engine_args"]["max_model_len"] == 2048 and saved["info"]["versions"] == {"vllm": "0.32.0"}
    assert saved["memory"] == {"peak_rss_mib": 1.0}
