"""The CUDA decode's kv-head mapping: the rule ("auto") against one kv head per CTA ("cta"), one per warp
("warp"), at head_dim 256 one per CTA of column warps ("columns") and, for 8-bit caches at head_dim 64, two or
three kv heads per warp ("rows") pinned, over head layouts, batches and lengths (the sweeps behind the mapping rules
in csrc/torch/decode.cu).

    python bench/decode_mapping.py [--out results.json] [--fmt q8_0,fp8_e4m3,bf16] [--head-dims 64,128,256]
                                   [--rounds 3] [--sizes 1:131072,64:4096]

Method as in kvq.benchmark: each shape is replicated until the working set is at least 4x L2, the calls over all
replicas are captured in one CUDA graph, and a replay's time / replicas is one sample (median). The three
mappings are alternated ``--rounds`` times in one process and the fastest time of each is reported.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import kvq
from kvq import benchmark as kb
from kvq.backends import pinned_cuda_kernel

# (query heads, kv heads, head_dim) x (batch, tokens per sequence)
LAYOUTS = [(32, 8, 128), (40, 8, 128), (64, 8, 128), (16, 8, 128), (32, 32, 128), (28, 4, 128), (32, 4, 128),
           (32, 8, 64), (9, 3, 64), (16, 2, 256), (8, 4, 256), (32, 2, 256)]
SIZES = [(1, 1024), (1, 4096), (1, 8192), (1, 32768), (1, 65536), (2, 32768), (4, 16384), (8, 1024), (8, 8192),
         (64, 4096)]
MAPPINGS = ("auto", "cta", "warp")  # and "columns" at head_dim 256, "rows" for 8-bit caches at head_dim 64
PAGE = 16


def time_shape(fmt: str, batch: int, tokens: int, hq: int, hkv: int, d: int, rounds: int, l2: int) -> dict:
    replicas = kb.rotation(kb.kv_bytes(batch * tokens, hkv, d, fmt), l2, 16)
    calls = kb.decode_inputs(fmt, replicas, batch, tokens, hq, hkv, d, PAGE).calls(torch.ops.kvq.decode_attention)
    best = {}
    for _ in range(rounds):
        for m in MAPPINGS + (("columns",) if d == 256 else ()) + (("rows",) if d == 64 and fmt != "bf16" else ()):
            with pinned_cuda_kernel("set_decode_heads", m):
                best[m] = min(best.get(m, math.inf), kb.time_calls(calls).us)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the times (µs) as JSON here")
    ap.add_argument("--fmt", default="q8_0", help="comma list of q8_0, fp8_e4m3, bf16")
    ap.add_argument("--head-dims", default="64,128,256", help="comma list: the layouts of these head_dims only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", help="comma list of batch:tokens (default: the built-in sweep)")
    args = ap.parse_args()
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",")] if args.sizes else SIZES
    if kvq.backends.selection().active != "cuda":
        raise SystemExit("decode_mapping.py times the CUDA kernels: the CUDA extension is not active; build it first")
    l2 = kb._l2_bytes()
    res = {}
    for fmt in args.fmt.split(","):
        for hq, hkv, d in [lay for lay in LAYOUTS if str(lay[2]) in args.head_dims.split(",")]:
            for batch, tokens in sizes:
                best = time_shape(fmt, batch, tokens, hq, hkv, d, args.rounds, l2)
                key = f"{fmt} B{batch} {tokens} {hq}/{hkv} d{d}"
                res[key] = best
                print(f"{key:30s}", " ".join(f"{m}={v:8.2f}" for m, v in best.items()),
                      f"auto/best={best['auto'] / min(best.values()):.3f}", flush=True)
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"unit": "us", "shapes": res}, f, indent=1)


if __name__ == "__main__":
    main()
