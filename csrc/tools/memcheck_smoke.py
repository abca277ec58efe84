"""Small store/dequantize/decode calls, including out-of-range slots and pages with the index checks off,
for `compute-sanitizer --tool memcheck python csrc/tools/memcheck_smoke.py`."""

import torch

import kvq
from kvq import reference

kvq.set_index_checks(False)
torch.manual_seed(0)
dev = "cuda"
for cache_dt in (torch.int8, torch.float8_e4m3fn, torch.bfloat16):
    for d, page_size, hq, hkv in ((64, 1, 2, 2), (128, 16, 32, 8), (256, 5, 16, 1)):
        pages = 40
        kc, ks = kvq.new_cache(pages, page_size, hkv, d, cache_dt, dev)
        vc, vs = kvq.new_cache(pages, page_size, hkv, d, cache_dt, dev)
        n = 30  # at most the 40 slots of the smallest cache (page size 1)
        key = torch.randn(n, hkv, d, dtype=torch.bfloat16, device=dev)
        value = torch.randn_like(key)
        slots = torch.randperm(pages * page_size, device=dev)[:n]
        slots[0], slots[1], slots[2] = -1, pages * page_size, -9  # skipped, never written
        torch.ops.kvq.store_kv(key, value, kc, vc, ks, vs, slots)
        torch.ops.kvq.dequantize(kc, ks, slots, torch.float16)
        table = torch.randint(0, pages, (3, 12), dtype=torch.int32, device=dev)
        table[1, 2] = pages + 7  # guarded: skipped
        table[2, 0] = -1
        lens = torch.tensor([0, 12 * page_size, 3], dtype=torch.int32, device=dev)
        q = torch.randn(3, hq, d, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(q)
        torch.ops.kvq.decode_attention(q, kc, vc, ks, vs, table, lens, 0.1, -1, 0.0, out)
        lens[1] = 10 ** 6  # beyond the block table: clamped
        torch.ops.kvq.decode_attention(q, kc, vc, ks, vs, table, lens, 0.1, 20, 10.0, out)
torch.cuda.synchronize()
print("memcheck smoke: ok")
