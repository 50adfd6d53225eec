"""The fixture LLM: byte-identical builds, loads with transformers, realistic confidence.

What is asserted, and why (numbers measured with DEFAULT_STEPS = 90, seed 0, on the
2-core CPU machine, transformers float32, greedy, the 40 demo prompts, 1757 positions):

    median top-1 probability       0.883   asserted in [0.75, 0.97]
    near-ties (top1 - top2 < 0.1)  3.1 %   asserted >= 5 positions and <= 15 %
    positions with top-1 > 0.5     81 %    asserted >= 60 %

Seed 1 gives 0.870 / 3.0 % / 82 %. The ranges leave room for another CPU or a library patch
release (which may change the float32 weights in the last bits) and still catch a fixture
that memorised its corpus (130 steps: median 0.98) or is undertrained (70 steps: 0.55,
6.5 % near-ties, only 56 % of positions above 0.5).

vLLM is not loaded here (slow); the engine tests load the same fixture with it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO_JSONL = REPO / "regress" / "data" / "prompts" / "fixture.jsonl"
DEMO_YAML = REPO / "regress" / "data" / "prompts" / "fixture.yaml"

EXPECTED_FILES = {
    "chat_template.jinja",
    "config.json",
    "fixture.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
NEAR_TIE_NATS = 0.1


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's fixture model when conftest provides one, else built once here."""
    try:
        return Path(request.getfixturevalue("fixture_model"))
    except pytest.FixtureLookupError:
        from regress.fixture_model import build_fixture_model

        out = tmp_path_factory.mktemp("fixture") / "model"
        build_fixture_model(out)
        return out


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    """Tokenizer and float32 model, run on one thread: the model is tiny, and OpenMP threads
    spinning against another busy process made generation 30x slower here."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        yield tokenizer, model
    finally:
        torch.set_num_threads(threads)


def _demo_rows() -> list[dict]:
    return [json.loads(line) for line in DEMO_JSONL.read_text(encoding="utf-8").splitlines() if line.strip()]


def _prompt_ids(tokenizer, row: dict) -> list[int]:
    if "messages" in row:
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
    else:
        text = row["prompt"]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def confidence(hf) -> dict:
    """Top-1 probability and top1-top2 logprob gap at every greedy position of the demo set."""
    import torch

    tokenizer, model = hf
    top1: list[float] = []
    gaps: list[float] = []
    for row in _demo_rows():
        ids = torch.tensor([_prompt_ids(tokenizer, row)])
        max_tokens = row.get("sampling", {}).get("max_tokens", 48)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        for logits in out.logits:
            best = torch.topk(torch.log_softmax(logits[0].float(), dim=-1), 2).values
            top1.append(float(best[0].exp()))
            gaps.append(float(best[0] - best[1]))
    return {"top1": top1, "gaps": gaps}


# --------------------------------------------------------------------------- import


def test_import_does_not_import_torch():
    code = (
        "import sys, regress.fixture_model as fm\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'tokenizers', 'vllm'))\n"
        "assert not heavy, heavy\n"
        "assert fm.DEFAULT_STEPS > 0 and len(fm.corpus_files()) >= 5\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- corpus


def test_corpus_is_package_data_of_the_right_size_and_kinds():
    from regress.fixture_model import corpus_files, corpus_sha256, corpus_text

    files = corpus_files()
    assert [p.name for p in files] == sorted(p.name for p in files)
    size = sum(p.stat().st_size for p in files)
    assert 15_000 <= size <= 40_000, size
    text = corpus_text()
    assert "def " in text and "<|im_start|>assistant\n" in text and "的" in text
    assert corpus_sha256() == corpus_sha256() and len(corpus_sha256()) == 64


# --------------------------------------------------------------------------- build


def test_build_twice_is_byte_identical_and_restores_torch_state(model_dir: Path, tmp_path: Path):
    import torch

    from regress.fixture_model import DEFAULT_STEPS, corpus_sha256, build_fixture_model, hash_files

    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    rng = torch.random.get_rng_state()

    result = build_fixture_model(tmp_path / "again")

    assert set(result["files"]) == EXPECTED_FILES
    assert hash_files(tmp_path / "again") == result["files"]
    first = hash_files(model_dir)
    assert {name: first.get(name) for name in result["files"]} == result["files"]
    assert (result["steps"], result["seed"]) == (DEFAULT_STEPS, 0)
    assert result["stats"]["corpus_tokens"] > 5_000 and result["stats"]["parameters"] > 100_000

    info = json.loads((tmp_path / "again" / "fixture.json").read_text(encoding="utf-8"))
    assert info["steps"] == DEFAULT_STEPS and info["seed"] == 0 and info["corpus_sha256"] == corpus_sha256()

    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == det
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # staging dir removed


def test_config_is_what_vllm_needs(model_dir: Path):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (1024, 128, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 64)
    assert config["max_position_embeddings"] >= 4096

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F32"}

    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert sorted(generation["eos_token_id"]) == [0, 2]


# --------------------------------------------------------------------------- transformers


def test_tokenizer_special_tokens_and_chat_template(hf):
    tokenizer, _ = hf
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert len(tokenizer) == 1024
    ids = tokenizer("The cat sat on the kitchen window")["input_ids"]
    assert 0 not in ids and tokenizer.decode(ids) == "The cat sat on the kitchen window"  # no BOS, lossless
    assert tokenizer.decode(tokenizer("泡绿茶的时候，水不要太热。")["input_ids"]) == "泡绿茶的时候，水不要太热。"

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == rendered.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # special tokens are single tokens


def test_greedy_generation_continues_the_corpus(hf):
    import torch

    tokenizer, model = hf
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([tokenizer("Baking bread at home is mostly a matter of", add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]).startswith(" patience")

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does a database index do?"}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tokenizer(chat, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    assert out.shape[1] > ids.shape[1]  # generates something, stopping at <|im_end|> or the limit


def test_confidence_is_like_a_real_model(confidence):
    top1, gaps = confidence["top1"], confidence["gaps"]
    n = len(top1)
    assert n >= 1000, n
    median = statistics.median(top1)
    near_ties = sum(g < NEAR_TIE_NATS for g in gaps)
    confident = sum(p > 0.5 for p in top1) / n
    summary = f"median top-1 {median:.3f}, near-ties {near_ties}/{n}, top-1 > 0.5 at {confident:.0%}"
    assert 0.75 <= median <= 0.97, summary
    assert near_ties >= 5, summary
    assert near_ties / n <= 0.15, summary
    assert confident >= 0.60, summary


# --------------------------------------------------------------------------- demo prompt set


def test_demo_prompt_set_shape_and_long_prompts(hf):
    import yaml

    tokenizer, _ = hf
    rows = _demo_rows()
    allowed = {"id", "prompt", "messages", "tags", "sampling"}
    sampling_keys = {
        "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "seed", "stop", "logprobs",
        "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
    }
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 40
    for r in rows:
        assert set(r) <= allowed and (("prompt" in r) != ("messages" in r)), r["id"]
        assert set(r.get("sampling", {})) <= sampling_keys, r["id"]
        for m in r.get("messages", []):
            assert set(m) == {"role", "content"} and m["role"] in {"system", "user", "assistant"}
    by_kind = {k: [r for r in rows if r["id"].startswith(k + "-")] for k in ("en", "zh", "code", "long", "chat")}
    assert sum(map(len, by_kind.values())) == 40 and all(by_kind.values())
    assert all("messages" in r for r in by_kind["chat"])

    lengths = [len(_prompt_ids(tokenizer, r)) for r in by_kind["long"]]
    assert len(lengths) == 2 and all(1500 <= n <= 3000 for n in lengths), lengths

    card = yaml.safe_load(DEMO_YAML.read_text(encoding="utf-8"))
    assert card["defaults"] == {"temperature": 0, "max_tokens": 48, "logprobs": 5, "seed": 0}
