"""Triton extend (chunked prefill) attention: ragged new tokens over their paged prefix and their own K/V.

Token ``i`` of sequence ``b`` (rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``) sits at position
``prefix_lens[b] + i``; it attends to the ``prefix_lens[b]`` cached tokens (dequantized in registers) and
to the new keys (exact), causally unless ``causal=False``, with an optional window and soft-cap. Prefill is
``prefix_lens = 0``. Reference: :func:`kvq.reference.extend_attention`.

A program owns one kv head and ``BLOCK_M`` rows, each a (new token, query head) pair: ``GP`` query heads of
that kv head (the largest power of two dividing ``G``, up to 16) times ``BLOCK_M // GP`` tokens, so that every
key and value tile, dequantized once, serves several heads, as the CUDA kernel's rows of token x GQA head do.

The grid comes from shapes only: ``total_tokens // TOK + batch`` row blocks (``TOK = BLOCK_M // GP`` tokens
each) per group of ``GP`` query heads, in one grid dimension with the head groups varying fastest and the row
blocks from the last down, so that the late blocks (more keys when causal) of every head start first. Sequence
``b`` owns row blocks ``cu[b] // TOK + b ...`` (at most ``cdiv(n_b, TOK)`` of them, which never reach the next
sequence's first block); a program finds its sequence by binary search over ``cu_seqlens_q`` and idles when
its block is past the end of the sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (FMT_PLAIN, INTERPRET, as_kernel_arg, cache_format, cast, check_head_dim, fp16_query,
                      has_e4m3_cvt, page_of, scores, softmax_step, upcast)
from .decode import _LOG2E, _load_tile, _num_sms


@triton.jit
def _extend_kernel(q_ptr, sq_t, sq_h, k_ptr, sk_t, sk_h, v_ptr, sv_t, sv_h,
                   kc_ptr, vc_ptr, skc_page, svc_page, ks_ptr, vs_ptr, bt_ptr, sbt_b, prefix_ptr, cu_ptr,
                   out_ptr, so_t, so_h, batch, total, qk_scale, window_left, softcap, num_pages, max_len,
                   PAGE_SIZE: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr,
                   CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr, E4M3_CVT: tl.constexpr):
    NHG: tl.constexpr = HKV * G // GP  # groups of GP query heads
    TOK: tl.constexpr = BLOCK_M // GP  # new tokens per row block
    h0 = (tl.program_id(0) % NHG) * GP  # the group's first query head
    pid = tl.num_programs(0) // NHG - 1 - tl.program_id(0) // NHG  # row block
    hk = h0 // G
    DT: tl.constexpr = q_ptr.dtype.element_ty
    # The tensor-core dtype for the cached prefix: fp16 for an 8-bit cache (see _common.dequant_f16).
    CT: tl.constexpr = DT if FMT == 0 else tl.float16

    # The last sequence whose first row block cu[b] // TOK + b is <= pid.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // TOK + mid <= pid:
            lo = mid
        else:
            hi = mid
    b = lo
    # Offsets and lengths are clamped to the tensors' extents (see decode.py).
    row0 = tl.minimum(tl.maximum(tl.load(cu_ptr + b), 0), total)
    n_new = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1), row0), total) - row0
    mblk = pid - (row0 // TOK + b)
    first = mblk * TOK  # the block's first new token; windows are checked per row below
    if first >= n_new:
        return
    prefix = tl.minimum(tl.maximum(tl.load(prefix_ptr + b), 0), max_len)

    r = tl.arange(0, BLOCK_M)
    m = first + r // GP  # each row's index among the new tokens
    h = h0 + r % GP  # and its query head
    rmask = m < n_new
    d = tl.arange(0, D)
    tok = (row0 + m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * sq_t + h[:, None] * sq_h + d[None, :], mask=rmask[:, None], other=0.0)
    if INTERP:
        q = upcast(q, INTERP)  # see _common: the interpreter's bf16 tl.dot is wrong
    if FMT == 0:
        qc = q
        qk_row = qk_scale
    else:
        qc, qk_row = fp16_query(q, qk_scale, INTERP)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    # 1) the cached prefix (positions 0..prefix-1 are all <= every query position)
    p_lo = tl.where(window_left >= 0, tl.maximum(prefix + first - window_left, 0), 0)
    for n0 in range(p_lo, prefix, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        page, keep = page_of(bt_ptr + b * sbt_b, n, n < prefix, num_pages, PAGE_SIZE)
        off = (n % PAGE_SIZE)[:, None]
        k = _load_tile(kc_ptr, ks_ptr, page, off, hk, keep[:, None], d[None, :], skc_page,
                       PAGE_SIZE, HKV, D, FMT, INTERP, E4M3_CVT)
        if INTERP:
            k = upcast(k, INTERP)
        s = scores(tl.dot(qc, tl.trans(k)), qk_row, softcap, SOFTCAP)
        vis = keep[None, :] & ((window_left < 0) | (n[None, :] >= (prefix + m)[:, None] - window_left))
        s = tl.where(vis, s, float("-inf"))
        v = _load_tile(vc_ptr, vs_ptr, page, off, hk, keep[:, None], d[None, :], svc_page,
                       PAGE_SIZE, HKV, D, FMT, INTERP, E4M3_CVT)
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, CT, INTERP)

    # 2) the new keys, exact (positions prefix + j)
    j_lo = tl.where(window_left >= 0, tl.maximum(first - window_left, 0), 0)
    j_hi = n_new
    if CAUSAL:
        j_hi = tl.minimum(first + TOK, n_new)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        keep = j < j_hi
        kt = (row0 + j).to(tl.int64)
        k = tl.load(k_ptr + kt[:, None] * sk_t + hk * sk_h + d[None, :], mask=keep[:, None], other=0.0)
        if INTERP:
            k = upcast(k, INTERP)
        s = scores(tl.dot(q, tl.trans(k)), qk_scale, softcap, SOFTCAP)
        vis = keep[None, :] & ((window_left < 0) | (j[None, :] >= m[:, None] - window_left))
        if CAUSAL:
            vis = vis & (j[None, :] <= m[:, None])
        s = tl.where(vis, s, float("-inf"))
        v = tl.load(v_ptr + kt[:, None] * sv_t + hk * sv_h + d[None, :], mask=keep[:, None], other=0.0)
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, DT, INTERP)

    o = acc / tl.maximum(l_i, 1.1754943508222875e-38)[:, None]  # a row that sees no key gets 0
    tl.store(out_ptr + tok[:, None] * so_t + h[:, None] * so_h + d[None, :], cast(o, DT, INTERP),
             mask=rmask[:, None])


def _heads_per_program(g: int, block_m: int) -> int:
    """The query heads a program packs into its rows: the largest power of two that divides the GQA ratio
    ``g``, up to 16 and ``block_m``. On an H200 packing took 0.84-1.00x the time of one head per program at
    32/8 and 32/4 heads with 128-row programs over an 8-bit prefix (bf16 0.90-1.01x; 0.96-1.03x with 64-row ones),
    but 1.44x at 9/3 heads (three heads in rows of 64, 8-bit prefix), so a ratio packs only its power of two."""
    p = 1
    while g % (2 * p) == 0 and 2 * p <= min(16, block_m):
        p *= 2
    return p


def _config(d: int, quantized: bool, total: int, batch: int, hq: int, g: int, device) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), from shapes only.

    Measured on an H200 (``bench/results/h200-2026-12-01-triton-extend-configs.json``: 32/8, 32/4 and 8/8 heads at
    d128, 16/2 at d256, 9/3 at d64; batch 1, chunks of 512-8192 tokens over prefixes of 0-32k; against the one
    config per head_dim used before, 64x64 tiles on four warps, 64x32 on eight at d256):
    - head_dim 128, row blocks of 128 where they still make two programs per SM (so that each key tile, and its
      dequantization, serves twice the rows): 0.85-0.89x the time for bf16 (32-key tiles, three stages), 0.81-0.84x
      over an 8-bit prefix and 0.95-0.97x in prefill (64-key tiles). Where they fill the SMs once or less they took
      up to 2.2x, so smaller grids keep 64 rows (with three stages for bf16: 0.94-0.96x).
    - head_dim 256: four warps on 64x32 tiles where the grid is large, 0.45-0.52x the time of eight (2048-8192 new
      tokens at 16/2 heads); 64-key tiles on eight warps where it is small, 0.61-0.76x (512 new tokens).
    Every config here needs at most 82 KB of shared memory (compiled for sm_89), within what sm_89 and sm_120 give.
    """
    if INTERPRET:
        return 16, 16, 4, 1  # small tiles so short test sequences span several row and key blocks
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())

    def waves(block_m):  # programs per SM
        gp = _heads_per_program(g, block_m)
        return (total // (block_m // gp) + batch) * (hq // gp) / sms
    if d > 128:
        return (64, 32, 4, 2) if waves(64) >= 2 else (64, 64, 8, 2)
    if d == 128 and waves(128) >= 2:
        return (128, 64, 4, 2) if quantized else (128, 32, 4, 3)
    return (64, 64, 4, 2) if quantized else (64, 64, 4, 3)


def extend_attention(query, key, value, k_cache, v_cache, k_scale, v_scale, block_table, prefix_lens,
                     cu_seqlens_q, sm_scale, causal, window_left, logit_softcap, out, *, config=None,
                     heads_per_program=None) -> None:
    """Shapes and semantics: :func:`kvq.ops.extend_attention`. ``config`` overrides :func:`_config` and
    ``heads_per_program`` (a divisor of the GQA ratio) :func:`_heads_per_program`."""
    total, hq, d = query.shape
    check_head_dim("extend_attention", d)
    batch = prefix_lens.shape[0]
    if total == 0 or batch == 0:
        return
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    fmt = cache_format(k_cache)
    g = hq // hkv
    block_m, block_n, warps, stages = config or _config(d, fmt != FMT_PLAIN, total, batch, hq, g, query.device)
    kc, vc = as_kernel_arg(k_cache), as_kernel_arg(v_cache)
    ks, vs = (kc, vc) if fmt == FMT_PLAIN else (k_scale, v_scale)
    gp = heads_per_program or _heads_per_program(g, block_m)
    if g % gp or block_m % gp:
        raise ValueError(f"kvq.extend_attention: heads_per_program={gp} must divide the GQA ratio {g} and "
                         f"BLOCK_M={block_m}")
    grid = ((total // (block_m // gp) + batch) * (hq // gp),)
    _extend_kernel[grid](
        query, query.stride(0), query.stride(1), key, key.stride(0), key.stride(1), value, value.stride(0),
        value.stride(1), kc, vc, k_cache.stride(0), v_cache.stride(0), ks, vs, block_table,
        block_table.stride(0), prefix_lens.contiguous(), cu_seqlens_q.contiguous(), out, out.stride(0),
        out.stride(1), batch, total, sm_scale * _LOG2E, window_left, float(logit_softcap), k_cache.shape[0],
        block_table.shape[1] * page_size, PAGE_SIZE=page_size, HKV=hkv, G=g, GP=gp, D=d,
        BLOCK_M=block_m, BLOCK_N=block_n, FMT=fmt, CAUSAL=bool(causal), SOFTCAP=logit_softcap > 0,
        INTERP=INTERPRET, E4M3_CVT=has_e4m3_cvt(query.device), num_warps=warps, num_stages=stages)
