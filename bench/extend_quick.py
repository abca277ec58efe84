"""Quick timing of the CUDA extend kernel: 2k new tokens over a 16k cached prefix, 32 q / 8 kv heads, d128.

Prints the median time (triton.testing.do_bench) of kvq's extend with a bf16, q8_0 and fp8_e4m3 prefix, the
8-bit / bf16 ratio (target <= 1.1), and torch SDPA (flash) on bf16 with the same causal (bottom-right) mask
over contiguous K/V for context.
``python bench/extend_quick.py [--new N] [--prefix N] [--page-size N] [--dtype bf16|fp16] [--shape wide|deep|tall]``
"""

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import kvq  # noqa: E402
from kvq import backends  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="model (query and new K/V) dtype")
    ap.add_argument("--shape", choices=["auto", "wide", "deep", "tall"], default="auto",
                    help="CTA shape of the CUDA extend kernel (auto: the launcher's estimate; tall: 8-bit caches only)")
    a = ap.parse_args()
    print(f"backend: {backends.selection().active}; {torch.cuda.get_device_name()}; new {a.new}, prefix {a.prefix}, "
          f"heads {a.hq}/{a.hkv}, d {a.d}, page {a.page_size}, {a.dtype}, CTA shape {a.shape}")
    if a.shape != "auto" and backends.selection().active != "cuda":
        sys.exit("--shape picks a CTA shape of the CUDA kernel, but the active backend is not cuda")
    dev, dt = "cuda", torch.bfloat16 if a.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    n_pages = max(1, -(-a.prefix // a.page_size))  # a prefill (--prefix 0) still takes a one-page pool
    block_table = torch.randperm(n_pages, device=dev, dtype=torch.int32)[None]  # scattered pages
    k_pre = torch.randn(a.prefix, a.hkv, a.d, device=dev, dtype=dt)
    v_pre = torch.randn(a.prefix, a.hkv, a.d, device=dev, dtype=dt)
    pos = torch.arange(a.prefix, device=dev)
    slots = block_table[0, pos // a.page_size].long() * a.page_size + pos % a.page_size
    q = torch.randn(a.new, a.hq, a.d, device=dev, dtype=dt)
    k = torch.randn(a.new, a.hkv, a.d, device=dev, dtype=dt)
    v = torch.randn(a.new, a.hkv, a.d, device=dev, dtype=dt)
    prefix_lens = torch.tensor([a.prefix], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, a.new], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    visible = a.new * a.prefix + a.new * (a.new + 1) // 2
    flops = 4 * a.hq * a.d * visible

    times = {}
    shape = backends.pinned_cuda_kernel("set_extend_shape", a.shape) if a.shape != "auto" else contextlib.nullcontext()
    with shape:
        for name, cdt in ((a.dtype, dt), ("q8_0", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
            kc, ks = kvq.new_cache(n_pages, a.page_size, a.hkv, a.d, cdt, dev)
            vc, vs = kvq.new_cache(n_pages, a.page_size, a.hkv, a.d, cdt, dev)
            if a.prefix:
                kvq.store_kv(k_pre, v_pre, kc, vc, ks, vs, slots)
            args = (q, k, v, kc, vc, ks, vs, block_table, prefix_lens, cu, a.d ** -0.5, True, -1, 0.0, out)
            fn = lambda: torch.ops.kvq.extend_attention(*args)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            times[name] = do_bench(fn, warmup=25, rep=200, return_mode="median")
            print(f"kvq extend, {name:8s} prefix: {times[name]:8.3f} ms  {flops / times[name] / 1e9:7.1f} TFLOP/s")
    if a.prefix:
        for name in ("q8_0", "fp8_e4m3"):
            r = times[name] / times[a.dtype]
            print(f"{name} / {a.dtype} = {r:.3f}  ({'meets' if r <= 1.1 else 'MISSES'} the 1.1x target)")
    else:
        print("no cached prefix: the three runs differ only in the kernel instance (no 8-bit / bf16 target)")

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    g = a.hq // a.hkv
    qs = q.transpose(0, 1)[None]
    ks_ = torch.cat([k_pre, k]).repeat_interleave(g, 1).transpose(0, 1)[None].contiguous()
    vs_ = torch.cat([v_pre, v]).repeat_interleave(g, 1).transpose(0, 1)[None].contiguous()
    mask = causal_lower_right(a.new, a.prefix + a.new)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fn = lambda: F.scaled_dot_product_attention(qs, ks_, vs_, attn_mask=mask)  # noqa: E731
            fn()
            t = do_bench(fn, warmup=25, rep=200, return_mode="median")
        print(f"torch SDPA flash, {a.dtype} contiguous K/V: {t:8.3f} ms  {flops / t / 1e9:7.1f} TFLOP/s")
    except RuntimeError as e:
        print(f"torch SDPA flash unavailable: {str(e).splitlines()[0]}")


if __name__ == "__main__":
    main()
