"""Runs the shipped text through the model and writes the KV cache as an
engine holds it, plus the statistics of the real keys.

Files (under OUT/kv):
  K.npy, V.npy          fp16 [layers, P, kv_heads, head_dim]: the cached
                        prefix of P tokens, post-RoPE K (engine layout)
  layerNN_K.npy/_V.npy  fp16 [P, kv_heads, head_dim]: one layer's slice, for
                        `kvcache-tool eval`
  layerNN_Q.npy         float32 [queries, kv_heads, head_dim]: post-RoPE
                        queries of decode positions after the prefix; query
                        j*G + g of kv head h is query head h*G + g (GQA
                        group G) at the j-th chosen decode position
"""
import os

import numpy as np

import model as kvmodel

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "text.txt")


def check_model(model, paris=True):
    """The model's own correctness checks: tokenizer round trip, the
    greedy chat answer. Raises AssertionError."""
    tk = model.tokenizer
    sample = "Dialogue: \"It's 3.14,\" she said; 2,306 ships in 1887.\n"
    assert tk.decode(tk.encode(sample)) == sample, "tokenizer round trip"
    if not paris:
        return None
    prompt = kvmodel.chat_prompt(tk, "What is the capital of France?")
    answer = tk.decode(kvmodel.greedy(model, prompt, 12,
                                      stop={tk.ids["<|im_end|>"]}))
    assert "Paris" in answer, f"greedy answer without Paris: {answer!r}"
    return answer


def text_tokens(model):
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    ids = model.tokenizer.encode(text)
    assert model.tokenizer.decode(ids) == text, "tokenizer round trip (text)"
    return ids


def run_text(model, ids, prefix, decode):
    """One forward over prefix + decode + 1 tokens (fp16 cache throughout).
    Returns the prefix cache, the decode tokens' queries and the fp16
    next-token log-probabilities at the decode positions, and the
    perplexity of the whole run."""
    tokens = ids[:prefix + decode + 1]
    assert len(tokens) == prefix + decode + 1, (
        f"the text has {len(ids)} tokens; {prefix + decode + 1} needed")
    hidden, ks, vs, qs = model.forward(tokens)
    ppl = kvmodel.perplexity(model, hidden, tokens)
    return {
        "tokens": tokens,
        "K": np.stack([k[:prefix] for k in ks]),
        "V": np.stack([v[:prefix] for v in vs]),
        "Q": [q[prefix:prefix + decode] for q in qs],
        "ppl": ppl,
    }


def gqa_queries(q, n_kv, positions):
    """[decode, n_head, D] -> [len(positions) * G, n_kv, D]."""
    n, n_head, d = q.shape
    g = n_head // n_kv
    q = q[positions].reshape(len(positions), n_kv, g, d)
    return np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(-1, n_kv, d),
                                dtype=np.float32)


def write_kv(out, run, n_kv, eval_positions, layers):
    os.makedirs(out, exist_ok=True)
    np.save(os.path.join(out, "K.npy"), run["K"])
    np.save(os.path.join(out, "V.npy"), run["V"])
    paths = {}
    for layer in layers:
        p = os.path.join(out, f"layer{layer:02d}_")
        np.save(p + "K.npy", run["K"][layer])
        np.save(p + "V.npy", run["V"][layer])
        np.save(p + "Q.npy", gqa_queries(run["Q"][layer], n_kv,
                                         eval_positions))
        paths[layer] = (p + "K.npy", p + "V.npy", p + "Q.npy")
    return paths


def key_statistics(k, q, head_dim):
    """Per layer: outlier channels of the keys and the attention sink.

    k: fp16 [P, H, D] post-RoPE keys; q: [decode, n_head, D] queries.
    A channel is an outlier when its RMS over the tokens exceeds 4x the
    median channel RMS of its head. RoPE pairs (i, i + D/2) rotate together;
    pair i turns by theta^(-2i/D) per token, so high i is the slowly
    rotating half. The sink is token 0: its key norm over the mean key norm
    of the other tokens, and the share of attention the decode queries give
    it.
    """
    kf = k.astype(np.float64)
    n_kv = kf.shape[1]
    half = head_dim // 2
    rms = np.sqrt((kf ** 2).mean(axis=0))  # [H, D]
    med = np.median(rms, axis=1, keepdims=True)
    out_mask = rms > 4 * med
    pairs = sorted({int(d % half) for h, d in zip(*np.nonzero(out_mask))})
    norms = np.linalg.norm(kf, axis=2)  # [P, H]
    sink_ratio = norms[0] / norms[1:].mean(axis=0)
    group = q.shape[1] // n_kv
    shares = []
    for hd in range(q.shape[1]):
        s = q[:, hd].astype(np.float64) @ kf[:, hd // group].T / np.sqrt(
            head_dim)
        s -= s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        shares.append(p[:, 0].mean())
    return {
        "outlier_channels": int(out_mask.sum()),
        "outlier_pairs": pairs,
        "max_rms_over_median": float((rms / med).max()),
        "sink_norm_ratio": [float(x) for x in sink_ratio],
        "sink_share": [float(x) for x in shares],
    }
