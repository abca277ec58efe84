"""Small store/dequantize/decode/extend calls for compute-sanitizer, with both CUDA decode kernels, each kv-head
mapping of the tensor-core one, every decode merge, and all four extend CTA shapes.

    compute-sanitizer --tool memcheck python csrc/tools/memcheck_smoke.py      # out-of-range slots and pages
    compute-sanitizer --tool initcheck python csrc/tools/memcheck_smoke.py --full
    KVQ_BACKEND=triton compute-sanitizer --tool memcheck python csrc/tools/memcheck_smoke.py   # Triton kernels

Default: out-of-range slots and pages with the index checks off (the kernels must skip them). ``--full``:
every slot of the caches is stored first and only valid indices are used, so that initcheck can tell a
kernel that reads memory nobody wrote from a test that decodes pages it never filled.
"""

import contextlib
import sys

import torch

import kvq
from kvq.backends import extension, pinned_cuda_kernel


def pinned(setter: str, choice: str):
    """One kernel choice of kvq._C for the block; nothing to pin where only Triton is installed."""
    return pinned_cuda_kernel(setter, choice) if extension()[0] is not None else contextlib.nullcontext()


full = "--full" in sys.argv
kvq.set_index_checks(False)
torch.manual_seed(0)
dev = "cuda"
for cache_dt in (torch.int8, torch.float8_e4m3fn, torch.bfloat16):
    for d, page_size, hq, hkv in ((64, 1, 2, 2), (128, 16, 32, 8), (256, 5, 16, 1), (128, 3, 12, 1), (256, 128, 16, 8),
                                  (64, 7, 9, 3), (64, 32, 9, 3), (256, 16, 32, 2), (128, 16, 32, 2)):
        pages = 40
        kc, ks = kvq.new_cache(pages, page_size, hkv, d, cache_dt, dev)
        vc, vs = kvq.new_cache(pages, page_size, hkv, d, cache_dt, dev)
        n = pages * page_size if full else 30  # at most the 40 slots of the smallest cache (page size 1)
        key = torch.randn(n, hkv, d, dtype=torch.bfloat16, device=dev)
        value = torch.randn_like(key)
        value[::5] *= 1e5  # scales whose products leave fp16: the tiles holding them take the bf16 P V of the decode
        slots = torch.randperm(pages * page_size, device=dev)[:n]
        if not full:
            slots[0], slots[1], slots[2] = -1, pages * page_size, -9  # skipped, never written
        torch.ops.kvq.store_kv(key, value, kc, vc, ks, vs, slots)
        torch.ops.kvq.dequantize(kc, ks, slots, torch.float16)
        table = torch.randint(0, pages, (3, 12), dtype=torch.int32, device=dev)
        if not full:
            table[1, 2] = pages + 7  # guarded: skipped
            table[2, 0] = -1
        lens = torch.tensor([0, 12 * page_size, 3], dtype=torch.int32, device=dev)
        q = torch.randn(3, hq, d, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(q)
        for kernel, heads in (("tc", "cta"), ("tc", "warp"), ("tc", "columns"), ("tc", "rows"), ("fma", "auto")):
            with pinned("set_decode_kernel", kernel), pinned("set_decode_heads", heads):
                torch.ops.kvq.decode_attention(q, kc, vc, ks, vs, table, lens, 0.1, -1, 0.0, out)
                lens[1] = 12 * page_size if full else 10 ** 6  # beyond the block table: clamped
                torch.ops.kvq.decode_attention(q, kc, vc, ks, vs, table, lens, 0.1, 20, 10.0, out)
        # extend: sequences with 0, 5 and 70 new tokens over prefixes read from the same pages
        new = torch.tensor([0, 5, 70], device=dev)
        cu = torch.cat([new.new_zeros(1), new.cumsum(0)]).to(torch.int32)
        t = int(new.sum())
        prefix = torch.tensor([3, 12 * page_size - 7, 0 if full else 10 ** 6], dtype=torch.int32, device=dev)
        qx = torch.randn(t, hq, d, dtype=torch.bfloat16, device=dev)
        kx, vx = torch.randn(2, t, hkv, d, dtype=torch.bfloat16, device=dev).unbind(0)
        outx = torch.empty_like(qx)
        for shape, splits in (("wide", "1"), ("deep", "1"), ("tall", "1"), ("small", "1"), ("wide", "3"), ("deep", "2"),
                              ("tall", "4"), ("small", "2")):
            with pinned("set_extend_shape", shape), pinned("set_extend_splits", splits):
                torch.ops.kvq.extend_attention(qx, kx, vx, kc, vc, ks, vs, table, prefix, cu, 0.1, True, -1, 0.0, outx)
                torch.ops.kvq.extend_attention(qx, kx, vx, kc, vc, ks, vs, table, prefix, cu, 0.1, True, 30, 5.0, outx)


def filled_cache(cache_dt, hkv: int, d: int):
    """K and V caches of 40 pages of 16 tokens, every slot stored."""
    kc, ks = kvq.new_cache(40, 16, hkv, d, cache_dt, dev)
    vc, vs = kvq.new_cache(40, 16, hkv, d, cache_dt, dev)
    key = torch.randn(640, hkv, d, dtype=torch.bfloat16, device=dev)
    torch.ops.kvq.store_kv(key, torch.randn_like(key), kc, vc, ks, vs, torch.arange(640, device=dev))
    return kc, vc, ks, vs


# One long sequence: over 64 splits, merged 32 columns per CTA.
for cache_dt in (torch.int8, torch.bfloat16):
    kc, vc, ks, vs = filled_cache(cache_dt, 2, 256)
    table = torch.randint(0, 40, (1, 4096), dtype=torch.int32, device=dev)
    lens = torch.tensor([65536], dtype=torch.int32, device=dev)
    q = torch.randn(1, 16, 256, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    for heads in ("auto", "warp", "columns"):
        with pinned("set_decode_heads", heads):
            torch.ops.kvq.decode_attention(q, kc, vc, ks, vs, table, lens, 0.1, -1, 0.0, out)
# More (sequence, kv head) pairs than the GPU holds at once: splits chosen to fill whole waves.
for cache_dt in (torch.int8, torch.bfloat16):
    kc, vc, ks, vs = filled_cache(cache_dt, 8, 128)
    table = torch.randint(0, 40, (160, 128), dtype=torch.int32, device=dev)
    lens = torch.randint(0, 2049, (160,), dtype=torch.int32, device=dev)
    q = torch.randn(160, 32, 128, dtype=torch.bfloat16, device=dev)
    torch.ops.kvq.decode_attention(q, kc, vc, ks, vs, table, lens, 0.1, -1, 0.0, torch.empty_like(q))
# bf16 at head_dim 128, one sequence of up to 4k tokens: the plan's splits for one CTA per SM (decode.cu).
kc, vc, ks, vs = filled_cache(torch.bfloat16, 8, 128)
table = torch.randint(0, 40, (1, 256), dtype=torch.int32, device=dev)
q = torch.randn(1, 32, 128, dtype=torch.bfloat16, device=dev)
for n in (4096, 3001):
    lens = torch.tensor([n], dtype=torch.int32, device=dev)
    torch.ops.kvq.decode_attention(q, kc, vc, ks, vs, table, lens, 0.1, -1, 0.0, torch.empty_like(q))
# Every merge, by pinned split counts (decode.cuh's launch_decode_merge): a warp per query head (2-16 parts; the
# batch of 40 puts the 5-16 part lists there too at head_dim 256 on an H200), one pass (and for 17-64 parts over 32
# columns, on the small grids of batch 3 and 5), two passes, at every head_dim and both query dtypes; sequences of
# 0-3000 tokens, so that some splits see none.
for d, hq, hkv, batch in ((64, 9, 3, 5), (128, 8, 2, 3), (256, 8, 2, 40)):
    kc, vc, ks, vs = filled_cache(torch.int8, hkv, d)
    table = torch.randint(0, 40, (batch, 188), dtype=torch.int32, device=dev)
    lens = torch.randint(0, 3001, (batch,), dtype=torch.int32, device=dev)
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(batch, hq, d, dtype=dtype, device=dev)
        for splits in ("2", "4", "5", "16", "17", "64", "65", "256"):
            with pinned("set_decode_splits", splits):
                torch.ops.kvq.decode_attention(q, kc, vc, ks, vs, table, lens, 0.1, -1, 0.0, torch.empty_like(q))
torch.cuda.synchronize()
print(f"memcheck smoke ({'all slots written' if full else 'out-of-range indices'}): ok")
