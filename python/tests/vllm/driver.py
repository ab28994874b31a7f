"""Runs one real vLLM engine (CPU) over token-id prompts and writes what it
generated as JSON; the end-to-end tests start it in fresh processes.

  python driver.py run --model DIR --prompts P.json --out R.json
         [--node HOST:PORT] [--codec none] [--block-size 32]
         [--max-batched-tokens N] [--num-blocks N] [--max-model-len N]
         [--timeout-s S]
  python driver.py poison --model DIR --prompts P.json --node HOST:PORT
         [--block-size 32]   (random KV under the prompts' keys, no engine)

P.json: [{"tokens": [...], "cache_salt": "..." (optional)}, ...]
R.json: {"outputs": [{"tokens": [...], "cached": N}, ...], "seconds": S}
"""

import argparse
import json
import os
import time

# One process: the connector's scheduler and worker run here, and an engine
# that dies takes the test with it rather than leaving a child behind.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _prompts(path):
    with open(path) as f:
        return json.load(f)


def run(args) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        seed=0,
        enable_prefix_caching=True,
    )
    if args.max_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_batched_tokens
        kwargs["enable_chunked_prefill"] = True
    if args.num_blocks:
        kwargs["num_gpu_blocks_override"] = args.num_blocks
    if args.node:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvcacheConnector",
            "kv_connector_module_path": "kvcache.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "nodes": [args.node],
                "codec": args.codec,
                "timeout_s": args.timeout_s,
                "lookup_timeout_s": args.timeout_s,
            },
        }
    llm = LLM(**kwargs)
    prompts = []
    for p in _prompts(args.prompts):
        prompt = TokensPrompt(prompt_token_ids=p["tokens"])
        if p.get("cache_salt"):
            prompt["cache_salt"] = p["cache_salt"]
        prompts.append(prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    start = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "outputs": [
            {
                "tokens": list(o.outputs[0].token_ids),
                "cached": int(o.num_cached_tokens or 0),
            }
            for o in outs
        ],
        "seconds": time.monotonic() - start,
        "connector": _connector_counters(llm) if args.node else {},
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


def _connector_counters(llm) -> dict:
    """Both connector roles' counters (one process: see the top)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return {"scheduler": dict(scheduler.counters), "worker": dict(worker.counters)}


def poison(args) -> None:
    """Writes random KV under the keys the connector would use."""
    import numpy as np

    import kvcache
    from kvcache._shared import model_id
    from kvcache.vllm import _Settings, namespace_name

    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    heads = config["num_key_value_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    settings = _Settings(
        nodes=[args.node],
        namespace_prefix="vllm/",
        model_id=model_id(args.model, ""),
        codec="none",
        seed=0,
        timeout_s=5.0,
        lookup_timeout_s=5.0,
        save_decode=True,
        client_options={},
    )
    dtype = {"float16": "fp16", "bfloat16": "bf16"}[args.dtype]
    ns = namespace_name(settings, dtype, args.block_size, 0, 1)
    client = kvcache.ClusterClient([args.node])
    spec = kvcache.NamespaceSpec(
        ns,
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        tokens_per_block=args.block_size,
        codec="none",
        dtype=dtype,
        model=settings.model_id,
    )
    client.register_namespace(spec)
    rng = np.random.default_rng(7)
    for p in _prompts(args.prompts):
        keys = kvcache.block_hash_chain(p["tokens"], args.block_size)
        blocks = rng.standard_normal((len(keys), spec.block_elements)).astype(
            np.float16
        )
        client.put(ns, keys, blocks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["run", "poison"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out")
    parser.add_argument("--node")
    parser.add_argument("--codec", default="none")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=0)
    parser.add_argument("--num-blocks", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    if args.mode == "run":
        run(args)
    else:
        poison(args)


if __name__ == "__main__":
    main()
