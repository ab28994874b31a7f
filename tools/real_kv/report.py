"""report.json -> report.md, and the CI bounds (ci_check.sh)."""

CODECS = ["fp8_e4m3", "fp8_e5m2", "kivi2", "kivi4"]

# CI bounds (--ci: prefix 384, 128 decode tokens). The measured values
# (docs/quality.md, "CI check") are beside each; each bound leaves a margin
# of about 3x on the side a regression would cross.
CI_BOUNDS = {
    "perplexity_max": 40.0,        # measured 25.3; a RoPE bug: hundreds
    "fp8_e4m3_kl_max": 3e-3,       # next-token KL (nats), measured 1.0e-3
    "fp8_e4m3_top1_min": 0.95,     # measured 1.000
    "kivi2_kl_max": 0.4,           # measured 0.109
    "kivi2_kl_min_over_fp8": 10.0,  # measured 108x
    "layer_fp8_attn_err_max": 0.10,   # measured 0.008-0.035
    "layer_kivi2_attn_err_min": 0.10,  # measured 0.28-0.49
}


def _f(x, digits=4):
    return f"{x:.{digits}f}"


def _e(x):
    return f"{x:.2e}"


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def headline_table(report):
    """Per codec: storage, element error (node round trip), attention error
    over the layers (eval), end-to-end next-token KL and top-1."""
    lines = [
        "| codec | bits/elem | tokens per GiB | K / V rel RMSE (median "
        "over layers) | attn out "
        "rel err, median (max) over layers | attn KL, median (max) | "
        "next-token KL | top-1 |", "|---|---|---|---|---|---|---|---|"]
    for c in ["none"] + CODECS:
        m = report["e2e"].get(c)
        if m is None:
            continue
        node = m["node"]
        bits = 16.0 * node["encoded_block_bytes"] / node["fp16_block_bytes"]
        errs = [r["eval"][c]["attn_err"] for r in report["layers"].values()]
        kls = [r["eval"][c]["attn_kl"] for r in report["layers"].values()]
        krm = _median([r["eval"][c]["k_rmse"]
                       for r in report["layers"].values()])
        vrm = _median([r["eval"][c]["v_rmse"]
                       for r in report["layers"].values()])
        lines.append(
            f"| {c} | {bits:.2f} | {m['per_gib_all_quantized']:,} | "
            f"{krm:.4f} / {vrm:.4f} | {_median(errs):.4f} ({max(errs):.4f}) | "
            f"{_e(_median(kls))} ({_e(max(kls))}) | {_e(m['kl_mean'])} | "
            f"{m['top1']:.3f} |")
    return lines


def e2e_table(report):
    lines = [
        "| cache | bits/elem (block) | tokens per GiB, every block "
        "quantized | tokens per GiB, this chain | tokens quantized | "
        "K rel RMSE | V rel RMSE | next-token KL mean (nats) | KL p99 | "
        "top-1 agreement |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in report["e2e"].items():
        node = m["node"]
        bits = 16.0 * node["encoded_block_bytes"] / node["fp16_block_bytes"]
        lines.append(
            f"| {name} | {bits:.2f} | {m['per_gib_all_quantized']:,} | "
            f"{m['per_gib_this_chain']:,} | {m['quantized_tokens']} of "
            f"{report['prefix']} | {_f(m['k_rmse'])} | {_f(m['v_rmse'])} | "
            f"{_e(m['kl_mean'])} | {_e(m['kl_p99'])} | {m['top1']:.3f} |")
    return lines


def layer_table(report):
    head = "| layer | " + " | ".join(
        f"{c} attn err | {c} attn KL" for c in CODECS) + " |"
    lines = [head, "|---|" + "---|" * (2 * len(CODECS))]
    for layer, r in report["layers"].items():
        cells = []
        for c in CODECS:
            e = r["eval"].get(c)
            cells += [_f(e["attn_err"]), _e(e["attn_kl"])] if e else ["", ""]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return lines


def ablation_table(report):
    lines = ["| layer | codec | K rel RMSE per channel / per token | attn "
             "err per channel / per token | ratio | attn KL per channel / "
             "per token | ratio |", "|---|---|---|---|---|---|---|"]
    for layer, r in report["layers"].items():
        for c in ("kivi2", "kivi4"):
            a = r["eval"][c]
            b = r["eval"][f"{c}, keys per token (ablation)"]
            lines.append(
                f"| {layer} | {c} | {_f(a['k_rmse'])} / {_f(b['k_rmse'])} | "
                f"{_f(a['attn_err'])} / {_f(b['attn_err'])} | "
                f"{b['attn_err'] / max(a['attn_err'], 1e-12):.2f} | "
                f"{_e(a['attn_kl'])} / {_e(b['attn_kl'])} | "
                f"{b['attn_kl'] / max(a['attn_kl'], 1e-30):.2f} |")
    return lines


def keys_table(report):
    lines = ["| layer | outlier channels (of 192) | their RoPE pairs "
             "(i, i+32) | max channel RMS / median | sink key norm / mean, "
             "per kv head | sink attention share, per query head |",
             "|---|---|---|---|---|---|"]
    for layer, r in report["layers"].items():
        k = r["keys"]
        lines.append(
            f"| {layer} | {k['outlier_channels']} | "
            f"{', '.join(map(str, k['outlier_pairs'])) or '-'} | "
            f"{k['max_rms_over_median']:.1f} | "
            f"{', '.join(f'{x:.2f}' for x in k['sink_norm_ratio'])} | "
            f"{', '.join(f'{x:.2f}' for x in k['sink_share'])} |")
    return lines


def skip_table(report):
    lines = ["| codec | fp16 layers | tokens per GiB, every block "
             "quantized | next-token KL mean | top-1 |", "|---|---|---|---|---|"]
    for c, m in report.get("skip", {}).items():
        lines.append(f"| {c} | {m['fp16_layers']} | "
                     f"{m['per_gib_all_quantized']:,} | {_e(m['kl_mean'])} | "
                     f"{m['top1']:.3f} |")
    return lines


def markdown(report):
    out = [
        f"SmolLM2-135M-Instruct (Q4_1 weights), {report['text_tokens']} "
        f"text tokens; cached prefix {report['prefix']} tokens, "
        f"{report['decode']} decode tokens re-run on each cache; perplexity "
        f"(fp16 cache) {report['perplexity']:.2f}; Paris check: "
        f"{report['paris']!r}; {report['total_s']:.0f} s in all.", "",
        "#### Headline", ""]
    out += headline_table(report)
    out += ["", "#### End to end (through kvcache-node)", ""]
    out += e2e_table(report)
    out += ["", "#### Per layer (`kvcache-tool eval`, every block quantized)",
            ""]
    out += layer_table(report)
    out += ["", "#### KIVI keys: per channel vs per token", ""]
    out += ablation_table(report)
    out += ["", "#### Real keys: outlier channels and the sink", ""]
    out += keys_table(report)
    if report.get("skip"):
        out += ["", "#### Skip lists (most sensitive layers kept fp16)", ""]
        out += skip_table(report)
    return "\n".join(out) + "\n"


def ci_assertions(report):
    b = CI_BOUNDS
    e2e = report["e2e"]
    fails = []
    if report["perplexity"] > b["perplexity_max"]:
        fails.append(f"perplexity {report['perplexity']:.1f}")
    fp8, kivi2 = e2e["fp8_e4m3"], e2e["kivi2"]
    if fp8["kl_mean"] > b["fp8_e4m3_kl_max"]:
        fails.append(f"fp8_e4m3 next-token KL {fp8['kl_mean']:.2e}")
    if fp8["top1"] < b["fp8_e4m3_top1_min"]:
        fails.append(f"fp8_e4m3 top-1 {fp8['top1']:.3f}")
    # The node quantized what it should: fp8 every block, KIVI all but the
    # blocks of the last 128 tokens (its residual window).
    if fp8["quantized_tokens"] != report["prefix"]:
        fails.append(f"fp8_e4m3: {fp8['quantized_tokens']} tokens quantized")
    if kivi2["quantized_tokens"] != report["prefix"] - 128:
        fails.append(f"kivi2: {kivi2['quantized_tokens']} tokens quantized")
    if kivi2["kl_mean"] > b["kivi2_kl_max"]:
        fails.append(f"kivi2 next-token KL {kivi2['kl_mean']:.2e}")
    if kivi2["kl_mean"] < b["kivi2_kl_min_over_fp8"] * fp8["kl_mean"]:
        fails.append(f"kivi2 KL {kivi2['kl_mean']:.2e} not above "
                     f"{b['kivi2_kl_min_over_fp8']}x fp8's")
    for layer, r in report["layers"].items():
        e = r["eval"]
        if e["fp8_e4m3"]["attn_err"] > b["layer_fp8_attn_err_max"]:
            fails.append(f"layer {layer} fp8_e4m3 attn err "
                         f"{e['fp8_e4m3']['attn_err']:.3f}")
        if e["kivi2"]["attn_err"] < b["layer_kivi2_attn_err_min"]:
            fails.append(f"layer {layer} kivi2 attn err "
                         f"{e['kivi2']['attn_err']:.3f}")
        if e["none"]["attn_err"] != 0:
            fails.append(f"layer {layer}: codec none not exact")
    if fails:
        raise SystemExit("quality on real KV: bounds crossed: " +
                         "; ".join(fails))
    print("quality on real KV: every bound holds")
