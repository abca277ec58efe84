"""Triton store (quantize K/V rows into the paged cache) and dequantize (gather cached rows back).

Numerics are those of :mod:`kvq.reference`, to the bit; the kernels avoid every shortcut that would break
bit equality: IEEE division (``div_rn``), round-half-away-from-zero by truncation plus the exact fractional
part (libdevice ``round`` is half-to-even in the interpreter) of the *rounded* product, so the store kernel
is compiled without fp contraction (``enable_fp_fusion=False``: ptxas would fuse ``x * id - trunc`` into an
fma and see the unrounded product), and e4m3 round-to-nearest-even done on the
fp32 bits (Triton's fp32->fp8 cast rounds through fp16 first on sm_89).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FMT_PLAIN, INTERPRET, as_kernel_arg, cache_format, cast, dequant, upcast



@triton.jit
def _e4m3_rne(y):
    """fp32 ``y`` (finite, |y| <= 448) -> e4m3fn bits, round to nearest even, sign kept (-0 -> 0x80)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    a = bits & 0x7FFFFFFF
    # Normals (|y| >= 2^-6): round the 23-bit mantissa to 3 bits, ties to even, then rebias 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals: the code is |y| / 2^-9 rounded to nearest even (2^-6 itself becomes code 8, the first normal).
    t = a.to(tl.float32, bitcast=True) * 512.0  # exact: a power-of-two scaling
    ti = t.to(tl.int32)  # truncation; t >= 0
    fr = t - ti.to(tl.float32)  # exact
    sub = ti + ((fr > 0.5) | ((fr == 0.5) & ((ti & 1) == 1))).to(tl.int32)
    mag = tl.where(a >= 0x3C800000, normal, sub)  # 0x3C800000 = 2^-6
    return mag | sign


@triton.jit
def _store_rows(x_ptr, sx_t, sx_h, c_ptr, sc_page, s_ptr, tok, slot, page, off, heads, blk, el, keep,
                HKV: tl.constexpr, NB: tl.constexpr, FMT: tl.constexpr, INTERP: tl.constexpr):
    """One token's rows for a tile of heads: ``heads [BH,1,1]``, ``blk [1,NBP,1]``, ``el [1,1,32]``."""
    mask = (heads < HKV) & (blk < NB) & keep
    d = blk * 32 + el
    x = tl.load(x_ptr + tok * sx_t + heads * sx_h + d, mask=mask, other=0.0)
    dst = page * sc_page + off * (HKV * NB * 32) + heads * (NB * 32) + d
    if FMT == 0:
        tl.store(c_ptr + dst, x.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        xf = upcast(x, INTERP)
        bad = tl.max(((xf != xf) | (tl.abs(xf) == float("inf"))).to(tl.int32), axis=2, keep_dims=True)
        amax = tl.max(tl.abs(xf), axis=2, keep_dims=True)
        M: tl.constexpr = 127.0 if FMT == 1 else 448.0
        dsc = tl.math.div_rn(amax, tl.full(amax.shape, M, tl.float32))
        inv = tl.where(dsc == 0.0, 0.0, tl.math.div_rn(tl.full(dsc.shape, 1.0, tl.float32), dsc))
        y = xf * inv
        y = tl.where(y != y, 0.0, y)  # 0 * inf: a zero element of a block whose 1/d overflows
        y = tl.minimum(tl.maximum(y, -M), M)
        if FMT == 1:
            t = y.to(tl.int32)  # truncation toward zero
            fr = y - t.to(tl.float32)  # exact
            q = t + tl.where(fr >= 0.5, 1, 0) - tl.where(fr <= -0.5, 1, 0)
        else:
            q = _e4m3_rne(y)
        q = tl.where(bad != 0, 0, q)
        tl.store(c_ptr + dst, q.to(c_ptr.dtype.element_ty), mask=mask)
        sbits = tl.where(bad != 0, 0x7E00,  # the canonical fp16 NaN
                          dsc.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32))
        sdst = slot * (HKV * NB) + heads * NB + blk
        tl.store(s_ptr + sdst, sbits.to(tl.int16), mask=(heads < HKV) & (blk < NB) & keep)


@triton.jit
def _store_kernel(k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
                  kc_ptr, vc_ptr, skc_page, svc_page, ks_ptr, vs_ptr, slot_ptr, num_slots,
                  PAGE_SIZE: tl.constexpr, HKV: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
                  BH: tl.constexpr, FMT: tl.constexpr, INTERP: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    keep = (slot >= 0) & (slot < num_slots)  # -1 skips the token; so does a bad slot (checks off)
    slot = tl.where(keep, slot, 0)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    heads = (tl.program_id(1) * BH + tl.arange(0, BH))[:, None, None]
    blk = tl.arange(0, NBP)[None, :, None]
    el = tl.arange(0, 32)[None, None, :]
    # The value planes may be views with any page stride; the scale planes are dense (checked), so a scale's
    # index is the slot's.
    _store_rows(k_ptr, sk_t, sk_h, kc_ptr, skc_page, ks_ptr, tok, slot, page, off, heads, blk, el, keep,
                HKV, NB, FMT, INTERP)
    _store_rows(v_ptr, sv_t, sv_h, vc_ptr, svc_page, vs_ptr, tok, slot, page, off, heads, blk, el, keep,
                HKV, NB, FMT, INTERP)


def _heads_per_program(hkv: int, d: int) -> int:
    return max(1, min(triton.next_power_of_2(hkv), 2048 // triton.next_power_of_2(d)))


def store_kv(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """One launch writes K, V and both scale planes. Shapes and semantics: :func:`kvq.reference.store_kv`."""
    t, hkv, d = key.shape
    if t == 0:
        return
    page_size, nb = k_cache.shape[1], d // 32
    fmt = cache_format(k_cache)
    kc, vc = as_kernel_arg(k_cache), as_kernel_arg(v_cache)
    # Scales are written as int16 bits so a non-finite block gets exactly the canonical NaN.
    ks, vs = (kc, vc) if fmt == FMT_PLAIN else (k_scale.view(torch.int16), v_scale.view(torch.int16))
    bh = _heads_per_program(hkv, d)
    grid = (t, triton.cdiv(hkv, bh))
    _store_kernel[grid](key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                        kc, vc, k_cache.stride(0), v_cache.stride(0), ks, vs, slot_mapping.contiguous(),
                        k_cache.shape[0] * page_size,
                        PAGE_SIZE=page_size, HKV=hkv, NB=nb, NBP=triton.next_power_of_2(nb), BH=bh, FMT=fmt,
                        INTERP=INTERPRET, num_warps=4,
                        # no mul+sub -> fma contraction: q8_0 rounding reads the fractional part of the rounded y
                        enable_fp_fusion=False)


@triton.jit
def _dequant_kernel(c_ptr, sc_page, s_ptr, slot_ptr, num_slots, out_ptr,
                    PAGE_SIZE: tl.constexpr, HKV: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
                    BH: tl.constexpr, FMT: tl.constexpr, INTERP: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    keep = (slot >= 0) & (slot < num_slots)
    slot = tl.where(keep, slot, 0)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    heads = (tl.program_id(1) * BH + tl.arange(0, BH))[:, None, None]
    blk = tl.arange(0, NBP)[None, :, None]
    el = tl.arange(0, 32)[None, None, :]
    inb = (heads < HKV) & (blk < NB)
    d = blk * 32 + el
    raw = tl.load(c_ptr + page * sc_page + off * (HKV * NB * 32) + heads * (NB * 32) + d, mask=inb & keep,
                  other=0)
    if FMT == 0:
        x = raw.to(tl.float32)
    else:
        sidx = slot * (HKV * NB) + heads * NB + blk
        s = tl.load(s_ptr + sidx, mask=inb & keep, other=0.0)
        x = dequant(raw, s, FMT)
    x = tl.where(keep, x, 0.0)
    tl.store(out_ptr + tok * (HKV * NB * 32) + heads * (NB * 32) + d, cast(x, out_ptr.dtype.element_ty, INTERP),
             mask=inb)


def dequantize(cache, scale, slot_mapping, dtype):
    """Gather ``slot_mapping[T]`` tokens back to ``dtype``, ``[T, Hkv, D]``; slot -1 gives zeros."""
    t = slot_mapping.shape[0]
    _, page_size, hkv, d = cache.shape
    out = torch.empty(t, hkv, d, dtype=dtype, device=cache.device)
    if t == 0:
        return out
    nb = d // 32
    fmt = cache_format(cache)
    c = as_kernel_arg(cache)
    s = c if scale is None else scale
    bh = _heads_per_program(hkv, d)
    _dequant_kernel[(t, triton.cdiv(hkv, bh))](c, cache.stride(0), s, slot_mapping.contiguous(),
                                               cache.shape[0] * page_size, out, PAGE_SIZE=page_size,
                                               HKV=hkv, NB=nb, NBP=triton.next_power_of_2(nb), BH=bh, FMT=fmt,
                                               INTERP=INTERPRET)
    return out
