"""Decode attention timing on one GPU: B=1, 32 query / 8 kv heads, head_dim 128, long contexts.

Median of triton.testing.do_bench over caches rotated so that no call finds its cache in L2; achieved
bandwidth = bytes of K, V and scales read / time, compared with a device-to-device copy_ in the same run.
"""

import argparse
import math

import torch
import triton.testing

import kvq

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
p.add_argument("--formats", nargs="+", default=["bf16", "q8_0", "fp8_e4m3"])
p.add_argument("--backends", nargs="+", default=["cuda", "triton"])
args = p.parse_args()
dev = "cuda"
B, HQ, HKV, D, PAGE = 1, 32, 8, 128, 16
DT = {"bf16": torch.bfloat16, "q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}

buf = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
dst = torch.empty_like(buf)
t = triton.testing.do_bench(lambda: dst.copy_(buf), warmup=50, rep=300, return_mode="median")
copy_bw = 2 * buf.numel() / (t * 1e-3) / 1e9
print(f"device: {torch.cuda.get_device_name()}; copy_ bandwidth (read+write) {copy_bw:.0f} GB/s")
del buf, dst


def backend_fn(name):
    if name == "cuda":
        return torch.ops.kvq.decode_attention
    from kvq import triton_backend

    return triton_backend.decode_attention


for n in args.tokens:
    for fmt in args.formats:
        dt = DT[fmt]
        pages = B * n // PAGE
        per_set = 2 * pages * PAGE * HKV * D * (1 if dt != torch.bfloat16 else 2)
        per_set += 2 * pages * PAGE * HKV * D // 32 * 2 if dt != torch.bfloat16 else 0
        copies = max(2, math.ceil(400e6 / per_set))
        sets = []
        for _ in range(copies):
            kc, ks = kvq.new_cache(pages, PAGE, HKV, D, dt, dev)
            vc, vs = kvq.new_cache(pages, PAGE, HKV, D, dt, dev)
            for c in (kc, vc):
                c.view(torch.uint8).random_(0, 100)
            for s in (ks, vs):
                if s is not None:
                    s.copy_(torch.rand_like(s) * 0.01)
            sets.append((kc, vc, ks, vs))
        table = torch.randperm(pages, device=dev, dtype=torch.int32).view(B, -1)
        lens = torch.full((B,), n, dtype=torch.int32, device=dev)
        q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(q)
        for be in args.backends:
            try:
                fn = backend_fn(be)
            except Exception as e:  # a benchmark reports what it could not run
                print(f"{be}: unavailable ({e})")
                continue
            i = [0]

            def call():
                kc, vc, ks, vs = sets[i[0] % copies]
                i[0] += 1
                fn(q, kc, vc, ks, vs, table, lens, 1 / math.sqrt(D), -1, 0.0, out)

            kvq.set_index_checks(False)
            try:
                ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
            except Exception as e:
                print(f"{be} {fmt} {n}: failed: {e}")
                continue
            bw = per_set / (ms * 1e-3) / 1e9
            print(f"{be:6s} {fmt:8s} tokens={n:7d} {ms * 1e3:8.1f} us  {bw:6.0f} GB/s  {bw / copy_bw * 100:5.1f}% of copy_")
        del sets
        torch.cuda.empty_cache()
