#!/usr/bin/env python3
"""kvcache-tool roundtrip against an independent NumPy reference, bit for bit.

The reference follows BRIEF section 4 directly, in NumPy float32 arithmetic
(IEEE single, no fused multiply-add) with float16 round-to-nearest-even
casts (bf16: round to nearest even on the float32 bits, the same
arithmetic; KIVI's zero and scale in the source dtype): FP8 by searching the table of every finite code's value (nearest,
ties to the even code, saturation to the largest finite), KIVI by min-max
groups per channel (keys) or per token (values). Also checks that bad
input gets one clear line and a non-zero exit. Exit 77 (skipped) without
NumPy.

Usage: kvcache_tool_test.py PATH/TO/kvcache-tool
"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
except ImportError:
    print("numpy is not installed: skipped (pip install -r tests/requirements.txt)")
    sys.exit(77)

TOOL = sys.argv[1]
f32 = np.float32


def fp8_table(exp_bits, man_bits, bias, finite_codes):
    """Values of the non-negative codes 0 .. finite_codes-1, from the format."""
    values = []
    for code in range(finite_codes):
        e = code >> man_bits
        m = code & ((1 << man_bits) - 1)
        if e == 0:
            v = m / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        values.append(v)
    return np.array(values, dtype=np.float64)


E4M3 = fp8_table(4, 3, 7, 0x7F)   # 0x7F is NaN; max 448
E5M2 = fp8_table(5, 2, 15, 0x7C)  # 0x7C is inf; max 57344


class Fp16:
    """The fp16 source dtype: values are numpy float16."""
    name, npy = "fp16", np.float16

    @staticmethod
    def to_f32(x):
        return x.astype(f32)

    @staticmethod
    def from_f32(a):  # round to nearest even
        return np.asarray(a, dtype=f32).astype(np.float16)


class Bf16:
    """The bf16 source dtype: values are uint16 bit patterns."""
    name, npy = "bf16", np.uint16

    @staticmethod
    def to_f32(x):
        return (x.astype(np.uint32) << 16).view(f32)

    @staticmethod
    def from_f32(a):  # round to nearest even (the inputs here hold no NaN)
        b = np.asarray(a, dtype=f32).view(np.uint32).astype(np.uint64)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def fp8_round(q, table):
    """Nearest table value to each float32 in q, ties to the even code."""
    a = np.abs(q.astype(np.float64))
    a = np.minimum(a, table[-1])  # satfinite
    hi = np.searchsorted(table, a, side="left")
    hi = np.clip(hi, 0, len(table) - 1)
    lo = np.clip(hi - 1, 0, len(table) - 1)
    d_lo = a - table[lo]
    d_hi = table[hi] - a
    pick = np.where(d_lo < d_hi, lo, hi)
    tie = (d_lo == d_hi) & (lo != hi)
    pick = np.where(tie, np.where(lo % 2 == 0, lo, hi), pick)
    return np.copysign(table[pick], q).astype(f32)


def ref_fp8(x, table, static_scale=None, src=Fp16):
    out = np.empty_like(x)
    for h in range(x.shape[1]):
        xs = src.to_f32(x[:, h, :])
        if static_scale is None:
            amax = f32(np.max(np.abs(xs)))
            scale = f32(1.0) if amax == 0 else f32(amax / f32(table[-1]))
        else:
            scale = f32(static_scale)
        q = (xs / scale).astype(f32)
        code_values = fp8_round(q, table)
        out[:, h, :] = src.from_f32((code_values * scale).astype(f32))
    return out


def kivi_group(x, bits, src=Fp16):
    """Quantize then dequantize one group (1-d array of the source dtype)."""
    xs = src.to_f32(x)
    mn, mx = f32(xs.min()), f32(xs.max())
    if mn == 0:
        mn = f32(0.0)
    if mx == 0:
        mx = f32(0.0)
    levels = f32((1 << bits) - 1)
    zero = src.to_f32(src.from_f32(mn))
    scale = src.to_f32(src.from_f32(f32(mx - mn) / levels))
    if scale == 0:
        codes = np.zeros_like(xs)
    else:
        codes = np.clip(np.rint(((xs - zero) / scale).astype(f32)), 0, levels)
    return src.from_f32(((codes.astype(f32) * scale).astype(f32) + zero))


def ref_kivi(x, bits, tensor, g=32, src=Fp16):
    t_n, h_n, d_n = x.shape
    out = np.empty_like(x)
    for h in range(h_n):
        if tensor == "key":  # per channel, groups of g tokens
            for t0 in range(0, t_n, g):
                for d in range(d_n):
                    out[t0:t0 + g, h, d] = kivi_group(x[t0:t0 + g, h, d],
                                                      bits, src)
        else:  # per token, groups of g channels
            for t in range(t_n):
                for c0 in range(0, d_n, g):
                    out[t, h, c0:c0 + g] = kivi_group(x[t, h, c0:c0 + g],
                                                      bits, src)
    return out


def run(args, expect_ok=True):
    p = subprocess.run([TOOL] + args, capture_output=True, text=True, timeout=60)
    if expect_ok and p.returncode != 0:
        raise AssertionError(f"{args}: exit {p.returncode}: {p.stderr}")
    return p


def make_input(rng):
    x = rng.standard_normal((64, 2, 64)).astype(np.float16)
    x[0, 0, :8] = np.array([0.0, -0.0, 6e-8, -6e-8, 1e-5, 65504, -3.5, 3.5],
                           dtype=np.float16)
    x[1:33, 1, 5] = np.float16(2.0)          # a constant KIVI key group
    x[40, 1, :] = np.float16(0.25)            # a constant KIVI value group
    x[50, 0, 7] = np.float16(300.0)           # a single outlier
    return x


def check_codecs(src, x, src_file, dst):
    """Every codec's roundtrip of x (source dtype src) against the reference."""
    failures = 0
    cases = [
        ("none", "key", [], lambda: x),
        ("fp8_e4m3", "key", [], lambda: ref_fp8(x, E4M3, src=src)),
        ("fp8_e4m3", "value", [], lambda: ref_fp8(x, E4M3, src=src)),
        ("fp8_e5m2", "value", [], lambda: ref_fp8(x, E5M2, src=src)),
        ("fp8_e4m3", "key", ["--scale", "1.0"],
         lambda: ref_fp8(x, E4M3, 1.0, src)),  # 65504 and 300 saturate to 448
        ("fp8_e5m2", "key", ["--scale", "0.5"],
         lambda: ref_fp8(x, E5M2, 0.5, src)),
        ("kivi2", "key", [], lambda: ref_kivi(x, 2, "key", src=src)),
        ("kivi2", "value", [], lambda: ref_kivi(x, 2, "value", src=src)),
        ("kivi4", "key", [], lambda: ref_kivi(x, 4, "key", src=src)),
        ("kivi4", "value", [], lambda: ref_kivi(x, 4, "value", src=src)),
    ]
    for codec, tensor, extra, reference in cases:
        run(["roundtrip", "--codec", codec, "--tensor", tensor,
             "--dtype", src.name] + extra + [src_file, dst])
        got = np.load(dst)
        want = reference()
        assert got.dtype == src.npy and got.shape == x.shape, got.dtype
        diff = np.count_nonzero(got.view(np.uint16) != want.view(np.uint16))
        label = f"{src.name} {codec} {tensor} {' '.join(extra)}".strip()
        if diff:
            failures += 1
            i = np.argwhere(got.view(np.uint16) != want.view(np.uint16))[0]
            print(f"FAIL {label}: {diff} values differ, first at {tuple(i)}:"
                  f" tool {got[tuple(i)]!r} reference {want[tuple(i)]!r}")
        else:
            print(f"ok   {label}: {x.size} values bit-identical")
    return failures


def main():
    rng = np.random.default_rng(7)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        src_file = os.path.join(tmp, "in.npy")
        dst = os.path.join(tmp, "out.npy")
        x16 = make_input(rng)
        xb = Bf16.from_f32(x16.astype(f32))
        xb[60, 1, 60] = Bf16.from_f32(f32(1e30))  # beyond fp16's range
        for src, x in ((Fp16, x16), (Bf16, xb)):
            np.save(src_file, x)
            failures += check_codecs(src, x, src_file, dst)
        x = x16
        np.save(src_file, x)

        # Bad input: one line on stderr, non-zero exit, no output file.
        f32_file = os.path.join(tmp, "f32.npy")
        np.save(f32_file, x.astype(np.float32))
        odd_file = os.path.join(tmp, "odd.npy")
        np.save(odd_file, x[:48])
        nan_file = os.path.join(tmp, "nan.npy")
        y = x.copy()
        y[3, 1, 4] = np.float16(np.inf)
        np.save(nan_file, y)
        bf16_file = os.path.join(tmp, "bf16.npy")
        np.save(bf16_file, xb)
        bad = [
            (["roundtrip", "--codec", "fp8_e4m3", "--tensor", "key", f32_file],
             "float16"),
            (["roundtrip", "--codec", "fp8_e4m3", "--tensor", "key", bf16_file],
             "for --dtype fp16"),
            (["roundtrip", "--codec", "fp8_e4m3", "--tensor", "key",
              "--dtype", "bf16", src_file], "bf16 bit patterns (<u2)"),
            (["roundtrip", "--codec", "kivi2", "--tensor", "key", odd_file],
             "divide"),
            (["roundtrip", "--codec", "fp8_e4m3", "--tensor", "key", nan_file],
             "head 1"),
        ]
        for args, needle in bad:
            out = os.path.join(tmp, "bad_out.npy")
            p = run(args + [out], expect_ok=False)
            lines = p.stderr.strip().splitlines()
            ok = (p.returncode == 1 and len(lines) == 1 and needle in lines[0]
                  and not os.path.exists(out))
            if not ok:
                failures += 1
                print(f"FAIL bad input {args[-1]}: exit {p.returncode}, "
                      f"stderr {p.stderr!r}")
            else:
                print(f"ok   bad input rejected: {lines[0]}")
    if failures:
        print(f"{failures} failure(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
