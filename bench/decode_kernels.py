"""Decode kernels side by side: the CUDA tensor-core kernel, the CUDA FMA kernel and the Triton kernel, for
bf16 / q8_0 / fp8_e4m3 caches, over GQA groups 1 to 8 (this decides which CUDA kernel serves which group).

    python bench/decode_kernels.py [--out results.json] [--quick]

Method as in kvq.benchmark: each configuration is replicated until the working set is at least 4x L2,
the calls over all replicas are captured in one CUDA graph, and a replay's time / replicas is one sample
(median reported). Bandwidth = bytes of K, V and scales read / time, as a fraction of a device-to-device
copy_ measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import kvq
from kvq import benchmark as kb

# (batch, tokens per sequence, query heads, kv heads, head_dim)
CASES = [(1, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (1, 131072, 32, 8, 128), (64, 4096, 32, 8, 128),
         (1, 4096, 16, 2, 256), (1, 32768, 16, 2, 256), (1, 131072, 16, 2, 256), (64, 4096, 16, 2, 256),
         (1, 32768, 32, 32, 128), (1, 32768, 32, 16, 128), (1, 32768, 9, 3, 64), (16, 8192, 32, 32, 128)]
QUICK = [(1, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (1, 131072, 32, 8, 128), (1, 4096, 16, 2, 256),
         (1, 32768, 9, 3, 64)]
FORMATS = ["bf16", "q8_0", "fp8_e4m3"]
PAGE = 16


def impls():
    from kvq import triton_backend

    def cuda(kind):
        def fn(*args):
            with kvq.backends.pinned_cuda_kernel("set_decode_kernel", kind):
                torch.ops.kvq.decode_attention(*args)
        return fn

    return {"cuda-tc": cuda("tc"), "cuda-fma": cuda("fma"), "triton": triton_backend.decode_attention}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="five shapes only")
    ap.add_argument("--impls", nargs="+", choices=["cuda-tc", "cuda-fma", "triton"], help="default: all three")
    args = ap.parse_args(argv)
    if kvq.backends.selection().active != "cuda":
        print("the CUDA extension is not active; build it first", file=sys.stderr)
        return 2
    kvq.set_index_checks(False)
    copy = kb.copy_bandwidth()
    bw = copy["bandwidth"]
    l2 = kb._l2_bytes()
    print(f"{torch.cuda.get_device_name()}: copy_ {bw / 1e9:.0f} GB/s")
    fns = {k: v for k, v in impls().items() if not args.impls or k in args.impls}
    rows = []
    for batch, ctx, hq, hkv, d in (QUICK if args.quick else CASES):
        for fmt in FORMATS:
            nbytes = kb.kv_bytes(batch * ctx, hkv, d, fmt)
            n = kb.rotation(nbytes, l2, 64)
            inputs = kb.decode_inputs(fmt, n, batch, ctx, hq, hkv, d, PAGE)
            ref = None
            line = f"B={batch:<3} ctx={ctx:<6} {hq}/{hkv} d{d} {fmt:<8}"
            for name, fn in fns.items():
                calls = inputs.calls(fn)
                t = kb.time_calls(calls)
                calls[0]()
                if ref is None:
                    ref = inputs.out.clone()
                diff = (inputs.out.float() - ref.float()).abs().max().item()
                frac = nbytes / (t.us * 1e-6) / bw
                rows.append(dict(batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d, fmt=fmt, impl=name, us=t.us,
                                 floor_us=kb.floor_us(nbytes, bw), frac_copy=frac, max_diff_vs_first=diff))
                line += f" | {name} {t.us:8.1f} us {100 * frac:5.1f}%"
            print(line, flush=True)
            del inputs
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
