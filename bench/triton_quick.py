"""Quick timing of the Triton decode kernel against the device's copy bandwidth (one GPU).

    PYTHONPATH=. python bench/triton_quick.py [--sweep] [--out results.json]

Times are GPU times of CUDA-graph replays (eager times, which include Python and launch overhead, are printed
alongside).

Decode at B=1 with 4k/32k/128k tokens and B=64 with 4k, 32 query / 8 kv heads, head_dim 128, page size 16,
bf16 vs q8_0 vs fp8_e4m3. The floor is (bytes of K, V and scales read) / (bandwidth of a device-to-device
``copy_`` of a 2 GiB buffer, read + write bytes), measured in the same run. Several caches are rotated so
that the working set exceeds L2. ``--sweep`` also times alternative tile/split configurations.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import triton
from triton.testing import do_bench

from kvq.triton_backend import decode as tdec

HQ, HKV, D, PAGE = 32, 8, 128, 16
FORMATS = {"bf16": torch.bfloat16, "q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
CASES = [(1, 4096), (1, 32768), (1, 131072), (64, 4096)]


def copy_bandwidth() -> float:
    n = 2 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=200, return_mode="median")
    del x, y
    return 2 * n / (ms * 1e-3)


def kv_bytes(fmt: str, batch: int, length: int) -> int:
    per = {"bf16": 2.0, "q8_0": 1.0625, "fp8_e4m3": 1.0625}[fmt]
    return int(2 * batch * length * HKV * D * per)


def make(fmt: str, batch: int, length: int, copies: int):
    """One pool holding ``copies`` disjoint sets of pages, and one block table per set."""
    pages_per = math.ceil(length / PAGE)
    num_pages = copies * batch * pages_per
    dt = FORMATS[fmt]
    shape = (num_pages, PAGE, HKV, D)
    if dt == torch.bfloat16:
        kc = torch.randn(shape, device="cuda", dtype=dt)
        vc = torch.randn(shape, device="cuda", dtype=dt)
        ks = vs = None
    else:
        raw = torch.randint(-127, 128, (2, *shape), device="cuda", dtype=torch.int8)
        if dt == torch.float8_e4m3fn:
            raw &= 0x77  # keep clear of the e4m3 NaN code
        kc, vc = raw[0].view(dt), raw[1].view(dt)
        ks = torch.rand(num_pages, PAGE, HKV, D // 32, device="cuda").half() * 0.02
        vs = torch.rand_like(ks) * 0.02
    perm = torch.randperm(num_pages, device="cuda", dtype=torch.int64).int()
    tables = perm.view(copies, batch, pages_per)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, kc, vc, ks, vs, tables, seq_lens


def time_decode(fmt, batch, length, config=None, rep=200, graph=True):
    """Median us per decode call. ``graph``: one CUDA graph replays a call per cache copy, so the time is
    the GPU's alone (no Python or launch overhead); otherwise eager calls rotate over the copies."""
    copies = max(1, math.ceil(256e6 / kv_bytes(fmt, batch, length)))
    q, kc, vc, ks, vs, tables, seq_lens = make(fmt, batch, length, copies)
    out = torch.empty_like(q)

    def call(i):
        tdec.decode_attention(q, kc, vc, ks, vs, tables[i], seq_lens, D ** -0.5, -1, 0.0, out, config=config)

    call(0)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(copies):
                call(i)
        ms = do_bench(g.replay, warmup=25, rep=rep, return_mode="median") / copies
    else:
        state = {"i": 0}

        def run():
            call(state["i"] % copies)
            state["i"] += 1

        ms = do_bench(run, warmup=25, rep=rep, return_mode="median")
    del kc, vc, ks, vs
    return ms * 1e3


def default_config(fmt, batch, length):
    q = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.empty(1, PAGE, HKV, D, device="cuda", dtype=FORMATS[fmt])
    return tdec._config(q, kc, math.ceil(length / PAGE) * PAGE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop the sweep after this many seconds")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{dev}; triton {triton.__version__}, torch {torch.__version__}")
    print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    rows = []
    for batch, length in CASES:
        for fmt in FORMATS:
            cfg = default_config(fmt, batch, length)
            us = time_decode(fmt, batch, length)
            eager = time_decode(fmt, batch, length, graph=False)
            floor_us = kv_bytes(fmt, batch, length) / bw * 1e6
            rows.append(dict(batch=batch, length=length, fmt=fmt, config=list(cfg), us=us, eager_us=eager,
                             floor_us=floor_us, frac=floor_us / us))
            print(f"B={batch:3d} L={length:6d} {fmt:9s} cfg={cfg}: {us:8.1f} us (eager {eager:7.1f})  floor "
                  f"{floor_us:8.1f} us  {100 * floor_us / us:5.1f}% of copy bandwidth", flush=True)
    sweep = []
    if args.sweep:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        tiles = [(64, 4, 2), (128, 8, 2), (64, 4, 3), (128, 4, 2)]  # (BLOCK_N, num_warps, num_stages)
        for batch, length in [(1, 131072), (1, 4096), (64, 4096)]:
            splits = sorted({max(1, round(k * sms / (batch * HKV))) for k in (1, 2, 4, 8)})
            for fmt in ("q8_0", "bf16", "fp8_e4m3"):
                for bn, warps, stages in tiles:
                    for sp in splits:
                        cfg = (bn, sp, warps, stages)
                        if time.time() - t0 > args.budget_s:
                            break
                        try:
                            us = time_decode(fmt, batch, length, cfg, rep=80)
                        except Exception as e:  # a config that does not compile or fit is reported, not fatal
                            print(f"  sweep {fmt} B={batch} L={length} cfg={cfg}: failed: {type(e).__name__}: {e}")
                            continue
                        floor_us = kv_bytes(fmt, batch, length) / bw * 1e6
                        sweep.append(dict(batch=batch, length=length, fmt=fmt, config=list(cfg), us=us,
                                          frac=floor_us / us))
                        print(f"  sweep B={batch:3d} L={length:6d} {fmt:9s} cfg={cfg}: {us:8.1f} us  "
                              f"{100 * floor_us / us:5.1f}%", flush=True)
        best = {}
        for r in sweep:
            key = (r["batch"], r["length"], r["fmt"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
        for (batch, length, fmt), r in best.items():
            print(f"best B={batch:3d} L={length:6d} {fmt:9s} cfg={tuple(r['config'])}: {r['us']:8.1f} us  "
                  f"{100 * r['frac']:5.1f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=dev, copy_bw=bw, rows=rows, sweep=sweep), f, indent=1)


if __name__ == "__main__":
    main()
