"""``python -m kvq demo``: store one random KV cache in each format, attend, and report bytes and error.

The error of each format is measured against attention over the unquantized bf16 K/V, for decode (one query
per sequence) and for extend (new tokens over the cached prefix).
"""

from __future__ import annotations

import argparse
import math

import torch

import kvq
from kvq import backends
from kvq.spec import KVQuantSpec


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvq demo", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens per sequence for the extend step")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    b, n, hq, hkv, d, ps = args.batch, args.context, args.q_heads, args.kv_heads, args.head_dim, args.page_size
    which = "reference (CPU)" if dev.type == "cpu" else backends.selection().active
    print(f"kvq demo on {dev} (backend: {which}): batch {b}, {n} cached tokens, {hq}/{hkv} heads, "
          f"head_dim {d}, page size {ps}")

    torch.manual_seed(0)
    pages_per_seq = math.ceil((n + args.new_tokens) / ps)
    num_pages = b * pages_per_seq
    block_table = torch.randperm(num_pages, device=dev).int().view(b, pages_per_seq)
    pos = torch.arange(n, device=dev)
    slots = (block_table[:, pos // ps].long() * ps + pos % ps).reshape(-1)
    k = torch.randn(b * n, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b * n, hkv, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    seq_lens = torch.full((b,), n, dtype=torch.int32, device=dev)
    nt = args.new_tokens
    q_new = torch.randn(b * nt, hq, d, device=dev, dtype=torch.bfloat16)
    k_new = torch.randn(b * nt, hkv, d, device=dev, dtype=torch.bfloat16)
    v_new = torch.randn(b * nt, hkv, d, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(0, (b + 1) * nt, nt, dtype=torch.int32, device=dev)

    rows, base = [], None
    for name in ("bf16", "q8_0", "fp8_e4m3"):
        spec = KVQuantSpec.from_name(name)
        kc, ks = kvq.new_cache(num_pages, ps, hkv, d, spec.cache_dtype(torch.bfloat16), dev)
        vc, vs = kvq.new_cache(num_pages, ps, hkv, d, spec.cache_dtype(torch.bfloat16), dev)
        kvq.store_kv(k, v, kc, vc, ks, vs, slots)
        out_d = kvq.decode_attention(q, kc, vc, ks, vs, block_table, seq_lens)
        out_e = kvq.extend_attention(q_new, k_new, v_new, kc, vc, ks, vs, block_table, seq_lens, cu)
        nbytes = sum(t.numel() * t.element_size() for t in (kc, vc, ks, vs) if t is not None)
        if base is None:
            base = (out_d, out_e, nbytes)
        rows.append((name, nbytes, nbytes / base[2], _rel(out_d, base[0]), _rel(out_e, base[1])))

    print(f"\n{'format':<10} {'KV bytes':>12} {'vs bf16':>8} {'decode rel err':>15} {'extend rel err':>15}")
    for name, nbytes, ratio, ed, ee in rows:
        print(f"{name:<10} {nbytes:>12,} {ratio:>7.3f}x {ed:>15.2e} {ee:>15.2e}")
    saved = 1 - rows[1][2]
    print(f"\n8-bit KV saves {saved:.1%} of the cache ({1 / rows[1][2]:.2f}x the tokens in the same memory); "
          "errors are relative L2 norms against attention over the bf16 cache.")
    return 0
