"""Writes a tiny Llama with random weights (no download): config and
safetensors only; the tests pass token ids, so no tokenizer is needed.

Usage: python make_tiny_llama.py DIR [--dtype float16|bfloat16]
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim 64: a size vLLM's CPU attention takes
        max_position_embeddings=2048,
        # Wide weights: greedy tokens then depend on every position's KV, so
        # loading the wrong KV changes them.
        initializer_range=0.2,
        torch_dtype=args.dtype,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.dir, safe_serialization=True)


if __name__ == "__main__":
    main()
