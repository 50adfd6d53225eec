"""Quantize a model with llm-compressor: ``python -m regress.quantize_entry``.

It runs in the llm-compressor environment (see :mod:`regress.quantize`). Standard library,
torch, transformers and llmcompressor only.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description="Quantize a model with llm-compressor (oneshot, RTN).")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scheme", required=True, help="llm-compressor preset scheme, e.g. W8A8, W4A16, FP8_DYNAMIC")
    parser.add_argument("--calibration", required=True, help="JSON file: a list of calibration texts")
    parser.add_argument("--group-size", type=int, default=None,
                        help="int4 weight group size instead of the preset's 128 (which must divide the hidden size)")
    parser.add_argument("--max-seq-length", type=int, default=256)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread: the same checkpoint bytes on every run
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    with open(args.calibration, encoding="utf-8") as fh:
        texts = json.load(fh)

    def tokenize(row):
        return tokenizer(row["text"], truncation=True, max_length=args.max_seq_length, add_special_tokens=False)

    dataset = Dataset.from_dict({"text": texts}).map(tokenize, remove_columns=["text"])
    if args.group_size is None:
        recipe = QuantizationModifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"])
    else:
        # The preset with another group size: SmolLM2-135M's hidden size 576 is not a multiple of
        # the presets' 128 ("columns=576, group_size=128"), so its int4 scheme is spelled out.
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

        preset = preset_name_to_scheme(args.scheme, ["Linear"])
        weights = preset.weights.model_copy(update={"group_size": args.group_size, "strategy": "group"})
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs.model_validate(weights.model_dump()),
                                    input_activations=preset.input_activations)
        recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=args.max_seq_length,
            num_calibration_samples=len(texts))
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
