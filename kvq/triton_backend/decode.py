"""Triton paged decode attention (flash-decoding) straight from the 8-bit or unquantized cache.

``out[b, h] = softmax(sm_scale * q[b, h] . K_b^T) V_b`` over the ``seq_lens[b]`` cached tokens (the query
is the token at position ``seq_lens[b] - 1``), with an optional sliding window and logit soft-cap;
reference: :func:`kvq.reference.decode_attention`.

Two launches, both sized from shapes only (no host sync, so CUDA graphs can capture them):

1. ``_decode_split``, grid ``[batch, num_kv_heads, num_splits]``: each program takes one kv head, all of
   its query heads (the GQA group, padded to 16 rows for ``tl.dot``) and one contiguous slice of the
   sequence; it loads each K/V tile once (int8/e4m3 bytes plus fp16 scales), dequantizes it in registers
   to fp16 (``_common.dequant_f16``: no int->float conversion instructions, which would bound the kernel
   below memory bandwidth), and keeps an fp32 online softmax. It writes its unnormalised partial output
   and (max, sum). With an 8-bit cache and ``_SCALE_AFTER_DOT`` set, ``_decode_split_sad`` runs instead: it
   feeds each [BLOCK_N, 32] block of codes to its own dot through one cast (at head_dim 128 the key blocks of
   whole rows to one batched dot) and applies the scales to the fp32 scores and to P (see its docstring).
2. ``_decode_merge``, grid ``[batch, num_q_heads, head_dim / 64]``: combines the partials, up to
   ``_MERGE_CHUNK`` splits per step; at batch 1 on sm_90 and newer, launched as a programmatic dependent of the
   first (``_PDL``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import (_I8_TO_F16, FMT_PLAIN, FMT_Q8_0, INTERPRET, as_kernel_arg, cache_format, cast, check_head_dim,
                      dequant, dequant_f16, fp16_query, fp16_row_scale, has_e4m3_cvt, has_pdl, i8x4_to_f16x2_ptx,
                      page_of, scaled_fp16, scores, softmax_step, upcast)

_LOG2E = 1.4426950408889634

# 8-bit caches: apply the per-32 scales to the dot products (scores) and to P (values) instead of to every
# loaded element, so each raw tile reaches tl.dot through a single cast (True, or 1); 2 does so for the scores
# only and dequantizes the values; False (0) dequantizes both before the dots. On an H200 (B=1, 128k tokens,
# 32/8 heads, d128, four warps per program) mode 2 ran in 164 us, mode 1 in 200 us and mode 0 in 214 us, hence
# the default. With the one-warp programs of _config, mode 1 still took 13-21% more time than mode 2 at batch 1-8
# with 32k-128k tokens and at batch 64 with 4k (32/8 d128; 9/3 d64 and 40/8 d128 at batch 1; q8_0 and fp8_e4m3).
_SCALE_AFTER_DOT = 2
# Splits the merge combines per step (the tests lower it to cross steps with short sequences).
_MERGE_CHUNK = 128
# Launch the merge as a programmatic dependent of the split kernel where the GPU can (compute capability 9.0
# and newer), so that its launch and start-up overlap the split kernel's last programs; at batch 1 only. On an
# H200, against plain stream order in one process (32/8 d128, 16/2 d256, 9/3 d64; q8_0, fp8_e4m3, bf16): at
# batch 1 up to 4k tokens 2-13% less time (bf16 at 32/8 d128 with 4k 0.5% more), at 32k-128k 1-3% less for 8-bit
# caches except 16/2 d256 (2.4% more at 128k); at batch 8 with 1k tokens 5-10% less at 9/3 and 32/8 heads for
# 8-bit but 16% more at 16/2 d256 (bf16 4-6% more at 32/8 and 16/2), and at batch 64 with 4k up to 4% more (9/3
# d64), for a reason not found. (The CUDA merge, launched the same way, lost at most 0.8% at any batch.) The
# tests turn it off to compare.
_PDL = True
# Where the merge is launched so, launch the split kernel as a programmatic dependent of the kernel before it
# (which it waits for before any global access): it is scheduled as that kernel's last programs exit. On an
# H200, calls back to back in a CUDA graph (30 shapes at batch 1: 32/8 d128, 16/2 d256, 9/3 d64; bf16, q8_0,
# fp8; 1k-128k tokens; alternated three times in one process): 1.9% less time (geometric mean; 0.913-1.002x);
# at batch 8 with 1k tokens 1-3% more, hence batch 1 only, as for the merge.
_SPLIT_PDL = True


@triton.jit
def _split_program(PDL: tl.constexpr, WAIT: tl.constexpr):
    # This program's (sequence, kv head, split), after the dependent-launch handshakes.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the merge may be scheduled (it waits for the partials)
    if WAIT:
        tl.extra.cuda.gdc_wait()  # launched as a dependent of the kernel before: wait before any global access
    return tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)


@triton.jit
def _split_range(len_ptr, b, max_len, window_left, num_splits, split, BLOCK_N: tl.constexpr):
    # The key positions [start, stop) of one split: each sequence spreads its own visible range over all splits,
    # in whole BLOCK_N tiles. Lengths (and pages, in page_of) are clamped to the tensors' extents, so bad indices
    # (with the host-side checks off) never reach memory outside them.
    seq_len = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), max_len)
    lo = tl.where(window_left >= 0, tl.maximum(seq_len - 1 - window_left, 0), 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    return start, tl.minimum(start + chunk, seq_len)


@triton.jit
def _load_tile(c_ptr, s_ptr, page, off, h, keep, d, stride_page,
               PAGE_SIZE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
               INTERP: tl.constexpr, E4M3_CVT: tl.constexpr):
    """Keys/values ``[BLOCK_N, D]`` of kv head ``h``: as stored (unquantized) or dequantized to fp16 (see
    ``dequant_f16``); ``page, off, keep: [BLOCK_N, 1]``."""
    row = page * stride_page + off * (HKV * D) + h * D  # [BLOCK_N, 1]
    if FMT == 0:
        return tl.load(c_ptr + row + d, mask=keep, other=0)
    else:
        # One fp16 scale per 32 elements: the tile is loaded as [BLOCK_N, D // 32, 32] so each scale is loaded
        # once and broadcast, and the codes reach the dequantization in the order they were loaded.
        NB: tl.constexpr = D // 32
        blk = tl.arange(0, NB)[None, :, None]
        el = tl.arange(0, 32)[None, None, :]
        raw = tl.load(c_ptr + row[:, :, None] + blk * 32 + el, mask=keep[:, :, None], other=0)
        slot = page * PAGE_SIZE + off
        s = tl.load(s_ptr + slot * (HKV * NB) + h * NB + tl.arange(0, NB)[None, :], mask=keep, other=0.0)
        x = dequant_f16(raw, s[:, :, None], FMT, INTERP, E4M3_CVT)
        return tl.reshape(x, (raw.shape[0], D))


@triton.jit
def _decode_split(q_ptr, sq_b, sq_h, kc_ptr, vc_ptr, sk_page, sv_page, ks_ptr, vs_ptr, bt_ptr, sbt_b, len_ptr,
                  acc_ptr, ml_ptr, num_splits, qk_scale, window_left, softcap, num_pages, max_len,
                  PAGE_SIZE: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, SOFTCAP: tl.constexpr,
                  INTERP: tl.constexpr, E4M3_CVT: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr):
    b, h, split = _split_program(PDL, WAIT)
    # The tensor-core dtype: the query's for an unquantized cache, fp16 for an 8-bit one (see dequant_f16).
    CT: tl.constexpr = q_ptr.dtype.element_ty if FMT == 0 else tl.float16

    start, stop = _split_range(len_ptr, b, max_len, window_left, num_splits, split, BLOCK_N)

    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    rows = h * G + g  # query heads of this kv head
    q = tl.load(q_ptr + b * sq_b + rows[:, None] * sq_h + d[None, :], mask=(g < G)[:, None], other=0.0)
    if FMT == 0:
        qk_row = qk_scale
        if INTERP:
            q = upcast(q, INTERP)  # see _common: the interpreter's bf16 tl.dot is wrong
    else:
        q, qk_row = fp16_query(q, qk_scale, INTERP)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        page, keep = page_of(bt_ptr + b * sbt_b, n, n < stop, num_pages, PAGE_SIZE)
        off = (n % PAGE_SIZE)[:, None]
        k = _load_tile(kc_ptr, ks_ptr, page, off, h, keep[:, None], d[None, :], sk_page,
                       PAGE_SIZE, HKV, D, FMT, INTERP, E4M3_CVT)
        if INTERP:
            k = upcast(k, INTERP)
        s = tl.dot(q, tl.trans(k))  # [GP, BLOCK_N] fp32
        s = tl.where(keep[None, :], scores(s, qk_row, softcap, SOFTCAP), float("-inf"))
        v = _load_tile(vc_ptr, vs_ptr, page, off, h, keep[:, None], d[None, :], sv_page,
                       PAGE_SIZE, HKV, D, FMT, INTERP, E4M3_CVT)
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, CT, INTERP)

    # partials: acc [B, Hq, S, D], ml [B, Hq, S, 2] (running max in log2 units, sum)
    part = (b * (HKV * G) + rows) * num_splits + split
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
    tl.store(ml_ptr + part * 2, m_i, mask=g < G)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=g < G)


@triton.jit
def _codes(ptrs, keep, FMT: tl.constexpr, INTERP: tl.constexpr, E4M3_CVT: tl.constexpr):
    """A tile of 8-bit codes as exact fp16 values (fp32 under the interpreter). Without the
    e4m3 convert instruction the bits land in an fp16 as the value times 2^-8; the caller folds the 2^8 into
    the scale."""
    raw = tl.load(ptrs, mask=keep, other=0)
    if INTERP:
        return dequant(raw, tl.full([1, 1], 1.0, tl.float32), FMT)
    elif FMT == 1:
        return tl.inline_asm_elementwise(_I8_TO_F16, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
    elif E4M3_CVT:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        b = raw.to(tl.int16)
        return (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)


# int8 x4 (one int32 word) -> four fp16, as _common._I8_TO_F16, unpacked to 16-bit outputs; e4m3 x4 -> four fp16 by
# two cvt.rn.f16x2.e4m3x2 (sm_89 and newer).
_I8X4_TO_F16 = tl.constexpr("{\n.reg .b32 t, m, a, b;\n" + i8x4_to_f16x2_ptx("$4", "a", "b")
                            + "mov.b32 {$0, $1}, a;\nmov.b32 {$2, $3}, b;\n}")
_E4M3X4_TO_F16 = tl.constexpr("""{
.reg .b16 lo, hi;
.reg .b32 a, b;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 a, lo;
cvt.rn.f16x2.e4m3x2 b, hi;
mov.b32 {$0, $1}, a;
mov.b32 {$2, $3}, b;
}""")


@triton.jit
def _codes_from_words(ptrs, keep, FMT: tl.constexpr):
    """``_codes`` for the value tiles (compiled GPU kernels; q8_0, or e4m3 with its convert instruction), from
    ``[BLOCK_N, 8]`` int32 words of four codes each. Decoded in the layout they are loaded in, the fp16 tile
    reaches the P @ V dot through a transposing shared-memory copy (ldmatrix.trans). Decoding the bytes where
    the dot wants them (``_codes``) made Triton gather them one byte per load, as that operand needs four
    consecutive tokens per thread: 20-24% of the split loop's instructions on sm_90 with triton 3.6 (1453 ->
    1106 per 32-token tile at head_dim 128, q8_0, one warp)."""
    w = tl.load(ptrs, mask=keep, other=0)
    if FMT == 1:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(_I8X4_TO_F16, "=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 4,
                                                   is_pure=True, pack=1)
    else:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(_E4M3X4_TO_F16, "=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 4,
                                                   is_pure=True, pack=1)
    # [BLOCK_N, 8, 2, 2] with [.., i, o] = c(2 i + o): row-major, code 4 j + k of the row is word j's c(k).
    x = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    return tl.reshape(x, w.shape[:-1] + [32])


@triton.jit
def _half(word, HI: tl.constexpr):
    """The fp16 in the low (HI 0) or high (HI 1) half of an int32 scale word, as fp32."""
    return ((word >> (16 * HI)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_split_sad(q_ptr, sq_b, sq_h, kc_ptr, vc_ptr, sk_page, sv_page, ks_ptr, vs_ptr, bt_ptr, sbt_b, len_ptr,
                      acc_ptr, ml_ptr, num_splits, qk_scale, window_left, softcap, num_pages, max_len,
                      PAGE_SIZE: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                      D: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, SOFTCAP: tl.constexpr,
                      INTERP: tl.constexpr, E4M3_CVT: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
                      V_AFTER: tl.constexpr, V_WORDS: tl.constexpr, K_ROWS: tl.constexpr):
    """``_decode_split`` for an 8-bit cache with the scales applied after the dots: per 32-column block b,
    ``S += (Q_b @ codes(K_b)^T) * kscale_b`` and ``acc_b += fp16(P * vscale_b / c_b) @ codes(V_b) * c_b``.
    Every code and scale is exact in fp16 and every product and sum is fp32, but the roundings differ from
    dequantize-then-dot (fp16(P * vscale) instead of fp16(P) and fp16(code * scale)). ``c_b``, the tile's
    largest scale of block b, keeps ``P * vscale`` clear of fp16 subnormals (and of overflow) whatever the
    scales' magnitude. ``V_AFTER`` False keeps the scale-after-dot for the scores only and dequantizes each
    [BLOCK_N, 32] value tile to fp16 as ``dequant_f16`` does (one P conversion per tile, no per-block max).
    ``V_WORDS``: the value codes are read as int32 words (``_codes_from_words``). ``K_ROWS``: the keys are read as
    whole rows ``[BLOCK_N, D]`` and their NB blocks meet the query's in one batched dot (the same products and sums)."""
    b, h, split = _split_program(PDL, WAIT)
    NB: tl.constexpr = D // 32
    # The e4m3 bit path yields code * 2^-8 (see _codes); the 2^8 rides on the fp32 scale, exactly.
    SCALE_MUL: tl.constexpr = 256.0 if (FMT == 2 and not E4M3_CVT and not INTERP) else 1.0

    start, stop = _split_range(len_ptr, b, max_len, window_left, num_splits, split, BLOCK_N)

    g = tl.arange(0, GP)
    e = tl.arange(0, 32)
    d = tl.arange(0, D)
    rows = h * G + g
    if K_ROWS:
        q = upcast(tl.load(q_ptr + b * sq_b + rows[:, None] * sq_h + d[None, :], mask=(g < G)[:, None], other=0.0),
                   INTERP)
        mul = fp16_row_scale(tl.max(tl.abs(q), axis=1))[:, None]  # see fp16_row_scale
    else:
        # Triton cannot index a tensor's columns dynamically: the query is kept as NB [GP, 32] blocks (a tuple,
        # unrolled with static_range), and so is the accumulator below.
        q_row = q_ptr + b * sq_b + rows[:, None] * sq_h + e[None, :]
        q32 = ()
        amax = tl.zeros([GP], tl.float32)
        for bb in tl.static_range(NB):
            qb = upcast(tl.load(q_row + bb * 32, mask=(g < G)[:, None], other=0.0), INTERP)
            amax = tl.maximum(amax, tl.max(tl.abs(qb), axis=1))
            q32 = q32 + (qb,)
        mul = fp16_row_scale(amax)[:, None]  # see fp16_row_scale
    qk_row = qk_scale / mul
    if K_ROWS:
        # The query's NB blocks of 32 columns meet the keys' in one batched dot, [NB, GP, 32] @ [NB, 32, BLOCK_N],
        # so that each key row is copied whole (one L2 request per row rather than one per 32-byte block).
        q3 = tl.permute(tl.reshape(scaled_fp16(q, mul, INTERP), [GP, NB, 32]), [1, 0, 2])
    qs = ()
    accs = ()
    for bb in tl.static_range(NB):
        if not K_ROWS:
            qs = qs + (scaled_fp16(q32[bb], mul, INTERP),)
        accs = accs + (tl.zeros([GP, 32], tl.float32),)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        page, keep = page_of(bt_ptr + b * sbt_b, n, n < stop, num_pages, PAGE_SIZE)
        off = (n % PAGE_SIZE)[:, None]
        k_base = kc_ptr + (page * sk_page + off * (HKV * D) + h * D)  # [BLOCK_N, 1]
        k_row = k_base + e[None, :]  # [BLOCK_N, 32]
        v_base = vc_ptr + (page * sv_page + off * (HKV * D) + h * D)  # [BLOCK_N, 1]
        v_row = v_base + e[None, :]
        if V_WORDS:  # the same rows as int32 words (head_dim and the page stride are multiples of 32 bytes)
            v_words = v_base.to(tl.pointer_type(tl.int32)) + tl.arange(0, 8)[None, :]
        slot = tl.reshape(page, (BLOCK_N,)) * PAGE_SIZE + n % PAGE_SIZE
        # The value scales (and the key scales of NB separate dots) travel as int32 words of two fp16 (NB is even):
        # [BLOCK_N] vectors of 4-byte elements the pipeliner copies asynchronously and reads back in the layout of
        # their use, so no block's scale needs a layout conversion (a [BLOCK_N, NB] tile did, through shared memory,
        # once per block). A key row's NB scales for the batched dot are one piece of 2 NB bytes: [NB, BLOCK_N].
        w_off = slot * (HKV * NB // 2) + h * (NB // 2)
        kws = ()
        vws = ()
        for j in tl.static_range(NB // 2):
            if not K_ROWS:
                kws = kws + (tl.load(ks_ptr + w_off + j, mask=keep, other=0),)
            vws = vws + (tl.load(vs_ptr + w_off + j, mask=keep, other=0),)

        if K_ROWS:
            ksc = tl.load(ks_ptr.to(tl.pointer_type(tl.float16)) + (slot * (HKV * NB) + h * NB)[None, :]
                          + tl.arange(0, NB)[:, None], mask=keep[None, :], other=0.0).to(tl.float32) * SCALE_MUL
            k3 = tl.permute(tl.reshape(_codes(k_base + d[None, :], keep[:, None], FMT, INTERP, E4M3_CVT),
                                       [BLOCK_N, NB, 32]), [1, 2, 0])
            s = tl.sum(tl.dot(q3, k3) * ksc[:, None, :], axis=0)  # [GP, BLOCK_N]
        else:
            s = tl.zeros([GP, BLOCK_N], tl.float32)
            for bb in tl.static_range(NB):
                kb = _codes(k_row + bb * 32, keep[:, None], FMT, INTERP, E4M3_CVT)
                ksb = _half(kws[bb // 2], bb % 2) * SCALE_MUL
                s += tl.dot(qs[bb], tl.trans(kb)) * ksb[None, :]
        s = tl.where(keep[None, :], scores(s, qk_row, softcap, SOFTCAP), float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if V_AFTER:
            # Each block's largest scale over the tile (one reduction per block).
            c_all = ()
            for bb in tl.static_range(NB):
                cb = tl.max(_half(vws[bb // 2], bb % 2), axis=0)
                c_all = c_all + (tl.where(cb > 0.0, cb, 1.0),)
        else:
            pv16 = cast(p, tl.float16, INTERP)
            if INTERP:
                pv16 = upcast(pv16, INTERP)
        new_accs = ()
        for bb in tl.static_range(NB):
            if V_WORDS:
                vb = _codes_from_words(v_words + bb * 8, keep[:, None], FMT)
            else:
                vb = _codes(v_row + bb * 32, keep[:, None], FMT, INTERP, E4M3_CVT)
            vsb = _half(vws[bb // 2], bb % 2)
            if V_AFTER:
                c = c_all[bb]
                pb = (p * (vsb * (1.0 / c))[None, :]).to(tl.float16)
                if INTERP:
                    pv = tl.dot(upcast(pb, INTERP), vb)
                else:
                    pv = tl.dot(pb, vb)
                new_accs = new_accs + (accs[bb] * alpha[:, None] + pv * (c * SCALE_MUL),)
            else:
                # Dequantize-then-dot numerics for the values: fp16(code * scale), as dequant_f16.
                if INTERP:
                    vb = (vb * (vsb * SCALE_MUL)[:, None]).to(tl.float16).to(tl.float32)
                else:
                    vb = vb * (vsb * SCALE_MUL).to(tl.float16)[:, None]
                new_accs = new_accs + (accs[bb] * alpha[:, None] + tl.dot(pv16, vb),)
        accs = new_accs

    part = (b * (HKV * G) + rows) * num_splits + split
    for bb in tl.static_range(NB):
        tl.store(acc_ptr + part[:, None] * D + bb * 32 + e[None, :], accs[bb], mask=(g < G)[:, None])
    tl.store(ml_ptr + part * 2, m_i, mask=g < G)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=g < G)


@triton.jit
def _decode_merge(acc_ptr, ml_ptr, out_ptr, so_b, so_h, num_splits, HQ: tl.constexpr, D: tl.constexpr,
                  DC: tl.constexpr, CH: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    """Combines the splits of one (sequence, query head) for DC output columns, CH splits at a time with a
    running maximum: a [CH, DC] tile stays in registers whatever the split count (all splits in one tile
    spilled at head_dim 256 with a few hundred splits), and short sequences get more programs in flight."""
    if PDL:
        tl.extra.cuda.gdc_wait()  # the split kernel's partials are written and visible
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.arange(0, CH)
    d = tl.program_id(2) * DC + tl.arange(0, DC)
    base = (b * HQ + h) * num_splits
    m_run = float("-inf")
    total = 0.0
    o = tl.zeros([DC], tl.float32)
    for s0 in range(0, num_splits, CH):
        part = base + s0 + c
        live = s0 + c < num_splits
        # All three loads first: none waits on another's latency.
        acc = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        m = tl.load(ml_ptr + part * 2, mask=live, other=float("-inf"))
        l = tl.load(ml_ptr + part * 2 + 1, mask=live, other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_use)
        w = tl.exp2(m - m_use)  # empty splits (m = -inf) weigh 0
        total = total * alpha + tl.sum(w * l, axis=0)
        o = o * alpha + tl.sum(acc * w[:, None], axis=0)
        m_run = m_new
    o = o / tl.maximum(total, 1.1754943508222875e-38)  # seq_len 0 -> 0
    tl.store(out_ptr + b * so_b + h * so_h + d, cast(o, out_ptr.dtype.element_ty, INTERP))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Registers per thread at which twelve one-warp programs share an SM: each of its four schedulers holds a quarter of
# the 64K registers, so three warps of at most 170 (allocated in steps of 8).
_TWELVE_REGS = 168


@functools.lru_cache(maxsize=None)
def _twelve_per_sm(device_index: int) -> bool:
    """Whether twelve head_dim-128 one-warp programs (two stages: about 12 KB of shared memory each, with the KB the
    GPU reserves per program) fit one SM: on sm_90 and sm_100 (228 KB), not on the 100 KB SMs of sm_89 and sm_120."""
    p = torch.cuda.get_device_properties(device_index)
    return p.regs_per_multiprocessor >= 65536 and p.shared_memory_per_multiprocessor >= 12 * 13 * 1024


def _config(query, k_cache, max_len, sad=None):
    """(BLOCK_N, num_splits, num_warps, num_stages, maxnreg), from shapes only; ``sad``: the scale-after-dot kernel
    runs; ``maxnreg``: Triton's register cap per thread, or None.

    Splits: enough programs for several resident CTAs per SM (the work per program is uniform, so a large
    count also makes the last wave short). The scale-after-dot kernel runs one warp per program up to head_dim
    128: a warp then owns its tiles' softmax, where four warps split each tile's columns and meet in shared
    memory for every row maximum and for P (on an H200, batch 1, 128k tokens: 22% less time at head_dim 128,
    47% less at 64). Programs of a single tile are the exception (below). At head_dim 256 the query and the
    accumulators fill a warp's registers, so one-warp programs run only where the grid is large (below).
    """
    batch, _, d = query.shape
    hkv = k_cache.shape[2]
    if INTERPRET:
        # Small tiles and several splits so short test sequences cross tile, page and split boundaries.
        return 16, max(1, min(4, triton.cdiv(max_len, 16))), 4, 1, None
    fmt = cache_format(k_cache)
    if sad is None:
        sad = _uses_sad(_SCALE_AFTER_DOT, fmt, d)
    plain = fmt == FMT_PLAIN
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    sms = _num_sms(index)
    if sad and d <= 128:
        # head_dim 64: half the bytes per tile, so more programs in flight (12 vs 8 per SM: up to 15% less time).
        block_n, per_sm, warps, stages = 32, (12 if d <= 64 else 8), 1, 3
    elif sad:
        block_n, per_sm, warps, stages = 64, 4, 2, 2
    else:
        # Dequantize-then-dot (mode 0) does more arithmetic per byte than the unquantized path, so it wants
        # more CTAs in flight.
        block_n, per_sm, warps, stages = (64 if d <= 128 else 32), (4 if plain else 8), 4, (3 if d <= 128 else 2)

    def split_count(block_n, per_sm):
        return max(1, min(round(per_sm * sms / (batch * hkv)), triton.cdiv(max_len, block_n), 256))

    def one_warp(splits, min_tiles, maxnreg):
        """One-warp programs of 32-token tiles and two stages, where the grid holds at least six per SM, each of at
        least ``min_tiles`` tiles; else None."""
        if splits * batch * hkv >= 6 * sms and triton.cdiv(max_len, splits * 32) >= min_tiles:
            return 32, splits, 1, 2, maxnreg
        return None

    if sad and d > 128:
        # One-warp programs of 32-token tiles at head_dim 256 (255 registers, a few spilled; six fit an H200 SM by
        # shared memory) where there are at least six per SM, each of at least six tiles. On an H200 against the
        # two-warp programs below, alternated in one process: q8_0 0.83-0.89x the time at 16/2 heads (batch 8 with
        # 32k-128k tokens, batch 64 with 4k-32k) and 0.86-0.94x at 32/4, 32/8, 16/8 and 16/16 heads; fp8_e4m3
        # 0.89-0.97x. Where the split cap or the sequence leaves fewer or shorter programs (batch 1 with 128k tokens
        # at 16/2 heads: 512 programs, 8/1 heads: 256; batch 64 with 1k: four tiles each) they took up to 26% more.
        launch = one_warp(split_count(32, 8), 6, None)
        if launch:
            return launch
    if sad and 64 < d <= 128 and _twelve_per_sm(index):
        # At head_dim 128 the one-warp programs compile to 168-175 registers, so eight share an SM. Capped at 168
        # with two stages, twelve do; the split count is rounded down so that they all fit one wave (rounded up, 1600
        # programs for 1584 slots took 1.3x the time). Taken where that grid holds at least six programs per SM of at
        # least four tiles each: on an H200 against eight per SM, alternated in one process, 0.90-1.00x the time at
        # 42 shapes (32/8 heads at batch 1 with 128k tokens 112.8 -> 108.9 us q8_0; batch 64 with 4k 0.93-0.96x;
        # 32/4, 40/8, 64/8, 16/16 and 32/32 heads). Grids of two programs per SM (8/1 heads at batch 1) took 1.18x,
        # and programs of under four tiles (batch 1 with 8k-16k tokens) 1.03-1.09x, so they keep the eight.
        launch = one_warp(max(1, min(12 * sms // (batch * hkv), triton.cdiv(max_len, 32), 256)), 4, _TWELVE_REGS)
        if launch:
            return launch
    splits = split_count(block_n, per_sm)
    tiles = triton.cdiv(max_len, splits * block_n)  # per program
    if sad and d <= 128 and tiles < 4:
        # One-warp programs of under four tiles spend more on their partials and the merge than the extra
        # programs buy: splits for four programs per SM instead (on an H200, batch 1: 32/8 heads d64 with 8k
        # tokens 12.6 -> 9.9 us q8_0, 4k 8.0 -> 7.9; 32/8 and 64/8 d128 with 4k-8k 3-5% less; 9/3 d64 with 8k
        # 2% more).
        splits = split_count(block_n, 4)
        tiles = triton.cdiv(max_len, splits * block_n)
    if sad and d > 128 and (tiles <= 1 or (tiles == 2 and splits * batch * hkv <= 2 * sms)):
        # Two warps suit programs that walk several tiles; four split each tile's columns between them, which
        # shortens programs of one tile, and of two where the programs fill the SMs at most twice. (Two-tile
        # programs in larger grids took 8-17% less time with two warps on an H200: 16/2, 32/4, 16/8 and 8/1 heads,
        # batch 1-32, 512-32k tokens, q8_0 and fp8_e4m3, e.g. 16/2 heads at batch 1 with 32k tokens 33.2 -> 29.0 us;
        # 8/1 heads at batch 1, 256 programs, up to 8% more.) Where those programs do not fill the SMs once,
        # 32-token tiles on twice the programs as well (on an H200, batch 1, 16/2 heads: 9.4 vs 10.4 us at 4k
        # tokens, 7.0 vs 9.1 at 1k; with batch 8 at 1k, where they would fill them twice, 15 vs 13 us).
        warps = 4
        if splits * batch * hkv <= sms:
            block_n, splits = 32, split_count(32, per_sm)
    elif sad and d > 64 and tiles <= 1 and splits * batch * hkv <= 2 * sms:
        # The same for one-tile programs at head_dim 128, where they fill the SMs at most twice (on an H200,
        # batch 1 with 1k tokens: 4-8% less time at 32/8 heads; 32/8 with 2k, 512 programs, 2% more). At head_dim
        # 64, where one warp reads the values as words, one warp is faster (batch 1: 9/3 heads with 1k-2k tokens
        # 3-5% less time than four warps, 32/8 with 1k 5%).
        warps, stages = 4, 2
    elif sad and warps == 1 and triton.cdiv(max_len, splits * block_n) == 1:
        # A program of one tile has no next tile to prefetch: two stages.
        # On an H200 against three stages (28 cells of 9/3, 32/4 d64 and 32/8, 16/4, 64/8, 8/1 d128, batch 1-16
        # with 512-8k tokens, q8_0 and fp8_e4m3; old and new alternated in one process, outputs equal to the bit):
        # 0.892-1.011x the time, geometric mean 0.964x (9/3 heads at batch 1 with 2k tokens, q8_0: 5.37 -> 5.18 us),
        # while two copies of the old code differed by up to 7% on single cells; a first run of three rounds had
        # 0.979x (0.953-1.037x). Programs of two tiles keep three (2k tokens in 32 splits: 5.79 against 6.16 us).
        stages = 2
    return block_n, splits, warps, stages, None


def _uses_sad(mode: int, fmt: int, d: int) -> bool:
    """The scale-after-dot kernel reads the scales as int32 pairs, so it needs an even count per row."""
    return mode != 0 and fmt != FMT_PLAIN and (d // 32) % 2 == 0


def _sad_loads(fmt: int, d: int, warps: int, e4m3_cvt: bool) -> tuple[bool, bool]:
    """How the scale-after-dot kernel reads a launch's tiles: ``(V_WORDS, K_ROWS)``."""
    # Value codes as words (_codes_from_words) in one-warp programs (head_dim 64 and 128, several tiles each; at 256 the
    # one-warp programs were measured with words only), for q8_0 and for e4m3 with the convert instruction (the
    # interpreter runs no inline assembly). On an H200, against the byte path in the same run (1k-128k tokens, batch
    # 1-64): at head_dim 64 q8_0 2-20% less time (9/3 heads, batch 1, 128k tokens: 37.0 -> 29.7 us), fp8 13% less to 2%
    # more; at 128 q8_0 11% less to 1% more (32/8 heads, batch 1, 128k: 120.7 -> 115.6 us), fp8 9% less to 3% more; but
    # at 40/8 heads (five query heads per kv head), whose byte path ran 8% faster than 32/8 heads on the same bytes,
    # 1-8% more. Also q8_0 in two-warp programs (head_dim 256, several tiles each), where the bytes are gathered one at
    # a time from shared memory and spill (sm_90: 255 registers and 8 bytes of stack, 168 and none with words): 2-3%
    # less time at 16/2 heads (batch 1 with 128k tokens, 8 with 32k, 64 with 4k-8k), 0.4% more at batch 1 with 32k; fp8
    # there 1% less to 3% more, and four-warp single-tile programs 1-9% more, so they keep the bytes.
    words = warps <= 2 and (fmt == FMT_Q8_0 or (warps == 1 and e4m3_cvt)) and not INTERPRET
    # Key rows whole, into one batched dot (K_ROWS), in one-warp programs at head_dim 128. On an H200 against one
    # 32-byte block per dot, alternated in one process: 0.89-0.99x the time at all 24 cells tried (8/1 to 64/8 heads,
    # batch 1-64, 4k-256k tokens, q8_0 and fp8_e4m3; 32/8 heads at batch 1 with 128k tokens q8_0 109.5 -> 101.8 us); at
    # head_dim 256 1.03-1.22x (its one-warp programs then spill) and at 64 0.94-1.14x, and the four-warp single-tile
    # programs (batch 1 with 1k tokens) took 1.24x in a benchmark run, so those keep the blocks. The interpreter, where
    # warps mean nothing, runs the rows at head_dim 128 so that the tests on a CPU cover them.
    return words, d == 128 and (warps == 1 or INTERPRET)


def decode_attention(query, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, sm_scale, window_left,
                     logit_softcap, out, *, config=None) -> None:
    """Shapes and semantics: :func:`kvq.ops.decode_attention`. ``config`` overrides :func:`_config` (tuning):
    ``(BLOCK_N, num_splits, num_warps, num_stages)``, optionally followed by a ``_SCALE_AFTER_DOT`` value for
    8-bit caches and a register cap per thread (Triton's ``maxnreg``; ``None`` for none)."""
    batch, hq, d = query.shape
    check_head_dim("decode_attention", d)
    if batch == 0:
        return
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    max_len = block_table.shape[1] * page_size
    mode = int(_SCALE_AFTER_DOT if config is None or len(config) < 5 else config[4])
    if mode not in (0, 1, 2):
        raise ValueError(f"kvq.decode_attention: scale-after-dot mode must be 0, 1 or 2, got {mode}")
    fmt = cache_format(k_cache)
    sad = _uses_sad(mode, fmt, d)
    if config:
        block_n, splits, warps, stages = config[:4]
        maxnreg = config[5] if len(config) > 5 else None
    else:
        block_n, splits, warps, stages, maxnreg = _config(query, k_cache, max_len, sad)
    launch = {} if maxnreg is None or INTERPRET else dict(maxnreg=maxnreg)
    e4m3_cvt = has_e4m3_cvt(query.device)
    pdl = _PDL and batch == 1 and not INTERPRET and has_pdl(query.device)
    wait = _SPLIT_PDL and pdl
    words, k_rows = _sad_loads(fmt, d, warps, e4m3_cvt)
    kernel, extra = (_decode_split_sad, dict(V_AFTER=mode == 1, V_WORDS=words, K_ROWS=k_rows)) if sad else \
        (_decode_split, {})
    kc, vc = as_kernel_arg(k_cache), as_kernel_arg(v_cache)
    ks, vs = (kc, vc) if fmt == FMT_PLAIN else (k_scale, v_scale)
    if sad:
        ks, vs = ks.view(torch.int32), vs.view(torch.int32)
    acc = torch.empty(batch, hq, splits, d, dtype=torch.float32, device=query.device)
    ml = torch.empty(batch, hq, splits, 2, dtype=torch.float32, device=query.device)
    kernel[(batch, hkv, splits)](
        query, query.stride(0), query.stride(1), kc, vc, k_cache.stride(0), v_cache.stride(0), ks, vs,
        block_table, block_table.stride(0), seq_lens.contiguous(), acc, ml, splits, sm_scale * _LOG2E, window_left,
        float(logit_softcap), k_cache.shape[0], max_len, PAGE_SIZE=page_size, HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), D=d,
        BLOCK_N=block_n, FMT=fmt, SOFTCAP=logit_softcap > 0, INTERP=INTERPRET,
        E4M3_CVT=e4m3_cvt, PDL=pdl, WAIT=wait, num_warps=warps, num_stages=stages, launch_pdl=wait, **extra, **launch)
    dc = min(d, 64)
    _decode_merge[(batch, hq, d // dc)](acc, ml, out, out.stride(0), out.stride(1), splits, HQ=hq, D=d, DC=dc,
                                        CH=min(triton.next_power_of_2(splits), _MERGE_CHUNK), INTERP=INTERPRET,
                                        PDL=pdl, num_stages=1, launch_pdl=pdl)
