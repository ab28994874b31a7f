"""Codec quality on a real model's KV cache (docs/quality.md).

  tools/real_kv/run.sh [--out DIR] [--ci]

Runs SmolLM2-135M-Instruct over tools/real_kv/text.txt, dumps every layer's
cache (extract.py), sends the cached prefix through a real kvcache-node for
each codec (kvcache-tool node-roundtrip: put as one chain, get as fp16),
re-runs the next decode tokens on the round-tripped cache and compares their
next-token distributions with the fp16 cache's; then `kvcache-tool eval` per
layer (attention error and KL, and KIVI's per-token key ablation) and the
real keys' outlier and sink statistics. Writes OUT/report.md and
OUT/report.json. --ci: the short version with asserted bounds (ci_check.sh).
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np

import extract
import model as kvmodel
import report as kvreport

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TPB = 32  # tokens per block in the store


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default=os.environ.get(
        "BUILD_DIR", os.path.join(ROOT, "build")))
    p.add_argument("--out", default=None)
    p.add_argument("--ci", action="store_true",
                   help="short run with asserted bounds")
    p.add_argument("--decode", type=int, default=None)
    p.add_argument("--prefix", type=int, default=None)
    return p.parse_args()


class Node:
    """A kvcache-node on a free local port, host memory, no data plane."""

    def __init__(self, build, log):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [os.path.join(build, "service", "kvcache-node"),
             f"--listen=127.0.0.1:{self.port}", "--metrics-listen=",
             "--memory=host:2GiB", "--data-plane=none", "--workers=2"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.target = f"127.0.0.1:{self.port}"
        deadline = time.time() + 20
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvcache-node exited; see {log}")
            time.sleep(0.1)
        raise RuntimeError(f"kvcache-node did not listen; see {log}")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def tool(build, *args):
    r = subprocess.run([os.path.join(build, "tools", "kvcache-tool"),
                        *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"kvcache-tool {args[0]}: {r.stderr.strip()}")
    return r.stdout


def node_roundtrip(build, node, kv_dir, name, codec, extra=()):
    out_k = os.path.join(kv_dir, f"node_{name}_K.npy")
    out_v = os.path.join(kv_dir, f"node_{name}_V.npy")
    info = json.loads(tool(build, "node-roundtrip", f"--node={node.target}",
                           f"--codec={codec}", f"--namespace=real-kv/{name}",
                           f"--tokens-per-block={TPB}", *extra,
                           os.path.join(kv_dir, "K.npy"),
                           os.path.join(kv_dir, "V.npy"), out_k, out_v))
    return np.load(out_k), np.load(out_v), info


def decode_metrics(model, run, prefix, k, v, ref_lp):
    """Next-token KL(fp16 || codec) and top-1 agreement at the decode
    positions, the decode tokens attending to the given prefix cache."""
    tokens = run["tokens"][prefix:-1]
    hidden, _, _, _ = model.forward(tokens, prefix, list(k), list(v))
    lp = kvmodel.log_softmax(model.logits(hidden))
    kl = (np.exp(ref_lp) * (ref_lp - lp)).sum(axis=1)
    top1 = (ref_lp.argmax(axis=1) == lp.argmax(axis=1)).mean()
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
            "kl_max": float(kl.max()), "top1": float(top1)}, lp


_ROW = re.compile(r"^\| ([^|]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                  r"([\d.]+) \| ([\d.e+-]+) \|$")


def eval_layer(build, paths):
    rows = {}
    for line in tool(build, "eval", *paths).splitlines():
        m = _ROW.match(line.strip())
        if m:
            rows[m.group(1).strip()] = {
                "bits": float(m.group(2)), "k_rmse": float(m.group(3)),
                "v_rmse": float(m.group(4)), "attn_err": float(m.group(5)),
                "attn_kl": float(m.group(6))}
    return rows


def tokens_per_gib(info, prefix):
    """From the node's block sizes: tokens of this model per GiB."""
    enc = info["encoded_block_bytes"]
    fp16 = info["fp16_block_bytes"]
    kept = info["stored_codecs"].count("none")
    quantized = len(info["stored_codecs"]) - kept
    chain = (quantized * enc + kept * fp16) if info["codec"] != "none" else (
        len(info["stored_codecs"]) * fp16)
    return {"per_gib_all_quantized": (1 << 30) * TPB // enc,
            "per_gib_this_chain": int((1 << 30) * prefix / chain),
            "quantized_tokens": quantized * TPB}


def main():
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    out = args.out or os.path.join(args.build, "real_kv" + (
        "_ci" if args.ci else ""))
    kv_dir = os.path.join(out, "kv")
    os.makedirs(kv_dir, exist_ok=True)
    t0 = time.time()
    model = kvmodel.Model()
    report = {"load_s": time.time() - t0}
    report["paris"] = extract.check_model(model)
    ids = extract.text_tokens(model)
    decode = args.decode or (128 if args.ci else 256)
    prefix = args.prefix or (384 if args.ci else
                             (len(ids) - 1 - decode) // TPB * TPB)
    run = extract.run_text(model, ids, prefix, decode)
    report.update(text_tokens=len(ids), prefix=prefix, decode=decode,
                  perplexity=run["ppl"])
    print(f"model loaded in {report['load_s']:.0f} s; Paris: "
          f"{report['paris']!r}; {len(ids)} text tokens; perplexity over "
          f"{prefix + decode + 1} tokens {run['ppl']:.2f}", flush=True)
    assert run["ppl"] < 40, f"perplexity {run['ppl']:.1f}: forward broken"
    eval_layers = [0, 1, model.n_layer // 2] if args.ci else list(
        range(model.n_layer))
    eval_pos = np.arange(0, decode, 8 if args.ci else 4)
    paths = extract.write_kv(kv_dir, run, model.n_kv, eval_pos, eval_layers)

    variants = [("none", "none", ()), ("fp8_e4m3", "fp8_e4m3", ()),
                ("kivi2", "kivi2", ())]
    if not args.ci:
        variants += [("fp8_e5m2", "fp8_e5m2", ()), ("kivi4", "kivi4", ()),
                     ("kivi2, no residual", "kivi2", ("--residual-tokens=0",)),
                     ("kivi4, no residual", "kivi4", ("--residual-tokens=0",))]
    e2e = run_variants(args, model, run, prefix, kv_dir, out, variants)
    report["e2e"] = e2e
    report["layers"] = {}
    for layer in eval_layers:
        report["layers"][layer] = {
            "eval": eval_layer(args.build, paths[layer]),
            "keys": extract.key_statistics(run["K"][layer], run["Q"][layer],
                                           model.head_dim)}
        print(f"layer {layer}: eval done", flush=True)
    if not args.ci:
        report["skip"] = run_skip_lists(args, model, run, prefix, kv_dir, out,
                                        report)
    report["total_s"] = time.time() - t0
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = kvreport.markdown(report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    if args.ci:
        kvreport.ci_assertions(report)
    print(f"done in {report['total_s']:.0f} s; {out}/report.md")


def run_variants(args, model, run, prefix, kv_dir, out, variants):
    """Each codec through the node, then the decode tokens on its cache."""
    node = Node(args.build, os.path.join(out, "node.log"))
    results = {}
    try:
        ref_lp = None
        for name, codec, extra in variants:
            k, v, info = node_roundtrip(args.build, node, kv_dir,
                                        name.replace(", ", "-").replace(
                                            " ", "-"), codec, extra)
            if codec == "none":
                assert np.array_equal(k, run["K"]) and np.array_equal(
                    v, run["V"]), "codec none did not round-trip exactly"
                hidden, _, _, _ = model.forward(run["tokens"][prefix:-1],
                                                prefix, list(k), list(v))
                ref_lp = kvmodel.log_softmax(model.logits(hidden))
                metrics = {"kl_mean": 0.0, "kl_p99": 0.0, "kl_max": 0.0,
                           "top1": 1.0}
            else:
                metrics, _ = decode_metrics(model, run, prefix, k, v, ref_lp)
            kf, vf = run["K"].astype(np.float32), run["V"].astype(np.float32)
            metrics["k_rmse"] = float(np.sqrt(((k - kf) ** 2).sum() /
                                              (kf ** 2).sum()))
            metrics["v_rmse"] = float(np.sqrt(((v - vf) ** 2).sum() /
                                              (vf ** 2).sum()))
            metrics.update(tokens_per_gib(info, prefix))
            metrics["node"] = {k2: info[k2] for k2 in (
                "encoded_block_bytes", "fp16_block_bytes",
                "node_stored_bytes", "node_residual_blocks")}
            results[name] = metrics
            print(f"{name}: next-token KL {metrics['kl_mean']:.2e}, top-1 "
                  f"{metrics['top1']:.3f}", flush=True)
    finally:
        node.stop()
    return results


def run_skip_lists(args, model, run, prefix, kv_dir, out, report):
    """kivi2 and fp8_e4m3 with the layers of the largest attention error
    kept fp16 (the policy's fp16_layers)."""
    results = {}
    node = Node(args.build, os.path.join(out, "node_skip.log"))
    try:
        ref_k, ref_v, _ = node_roundtrip(args.build, node, kv_dir, "ref-none",
                                         "none")
        hidden, _, _, _ = model.forward(run["tokens"][prefix:-1], prefix,
                                        list(ref_k), list(ref_v))
        ref_lp = kvmodel.log_softmax(model.logits(hidden))
        for codec in ("kivi2", "fp8_e4m3"):
            errs = {l: r["eval"][codec]["attn_err"]
                    for l, r in report["layers"].items()}
            worst = sorted(errs, key=errs.get, reverse=True)[:3]
            skip = ",".join(str(l) for l in sorted(worst))
            k, v, info = node_roundtrip(
                args.build, node, kv_dir, f"{codec}-skip", codec,
                (f"--fp16-layers={skip}",))
            metrics, _ = decode_metrics(model, run, prefix, k, v, ref_lp)
            metrics.update(tokens_per_gib(info, prefix))
            metrics["fp16_layers"] = skip
            results[codec] = metrics
            print(f"{codec} with fp16 layers {skip}: next-token KL "
                  f"{metrics['kl_mean']:.2e}", flush=True)
    finally:
        node.stop()
    return results


if __name__ == "__main__":
    sys.exit(main())
