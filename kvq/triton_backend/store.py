"""Triton store (quantize K/V rows into the paged cache) and dequantize (gather cached rows back).

Numerics are those of :mod:`kvq.reference`, to the bit; the kernels avoid every shortcut that would break
bit equality: IEEE division (``div_rn``), round-half-away-from-zero by truncation plus the exact fractional
part (libdevice ``round`` is half-to-even in the interpreter) of the *rounded* product, so the store kernel
is compiled without fp contraction (``enable_fp_fusion=False``: ptxas would fuse ``x * id - trunc`` into an
fma and see the unrounded product), and e4m3 round-to-nearest-even done on the
fp32 bits (Triton's fp32->fp8 cast rounds through fp16 first on sm_89).

On a GPU a program whose blocks all have a normal-float (or zero, or non-finite) ``d`` takes a shorter path,
the one the CUDA store takes for such blocks: ``1/d`` is then finite, so ``x * (1/d)`` is never NaN and stays
within ``M + 0.0001``, where neither clamp can change a code; q8_0 rounds as ``trunc(y + copysign(0.5, y))``
with the add rounded toward zero, e4m3 by one ``cvt.rn.satfinite`` (so e4m3 only on sm_89 and newer). A
program with a block of ``amax`` below ~1e-36 takes the exact path above for all its blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (FMT_PLAIN, INTERPRET, as_kernel_arg, cache_format, cast, dequant, has_e4m3_cvt, has_pdl,
                      upcast)

# Launch the store as a programmatic dependent of the kernel before it where the GPU can (compute capability 9.0
# and newer): it waits for that kernel before any global access, and is scheduled as its last programs exit. On an
# H200, calls back to back in a CUDA graph: 2.7-7.4% less time with 4096 tokens (8x d128, 2x d256, 3x d64 kv heads),
# 1.3-1.5% at 3x d64 with 65536, within 0.2% at the other sizes. The tests turn it off to compare.
_PDL = True

# Four fp32 y (|y| < 127.5, a normal block's) to four q8_0 bytes, round half away from zero, ANDed with $5 (-1
# keeps them, 0 zeroes a non-finite block; the four elements are of one block, so $6-$8 are the same flag).
_Q8_FAST = tl.constexpr("""{
.reg .f32 h<4>;
.reg .b32 r<4>, lo, hi;
copysign.f32 h0, $1, 0f3F000000;
copysign.f32 h1, $2, 0f3F000000;
copysign.f32 h2, $3, 0f3F000000;
copysign.f32 h3, $4, 0f3F000000;
add.rz.f32 h0, $1, h0;
add.rz.f32 h1, $2, h1;
add.rz.f32 h2, $3, h2;
add.rz.f32 h3, $4, h3;
cvt.rzi.s32.f32 r0, h0;
cvt.rzi.s32.f32 r1, h1;
cvt.rzi.s32.f32 r2, h2;
cvt.rzi.s32.f32 r3, h3;
prmt.b32 lo, r0, r1, 0x0040;
prmt.b32 hi, r2, r3, 0x0040;
prmt.b32 lo, lo, hi, 0x5410;
and.b32 $0, lo, $5;
}""")
# Four fp32 to four e4m3 bytes: one round to nearest even, saturating at +-448; ANDed with $5 as above.
_E4M3_FAST = tl.constexpr("""{
.reg .b16 lo, hi;
.reg .b32 w;
cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
mov.b32 w, {lo, hi};
and.b32 $0, w, $5;
}""")


@triton.jit
def _e4m3_rne(y):
    """fp32 ``y`` (finite, |y| <= 448) -> e4m3fn bits, round to nearest even, sign kept (-0 -> 0x80)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    a = bits & 0x7FFFFFFF
    # Normals (|y| >= 2^-6): round the 23-bit mantissa to 3 bits, ties to even, then rebias 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals: the code is |y| / 2^-9 rounded to nearest even (2^-6 itself becomes code 8, the first normal).
    # The product is exact (a power-of-two scaling) and below 8, so adding 2^23 leaves ulp 1: the fp32 add
    # rounds it to nearest even and the integer lands in the low mantissa bits.
    t = a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    sub = t.to(tl.int32, bitcast=True) - 0x4B000000  # 0x4B000000 = 2^23
    mag = tl.where(a >= 0x3C800000, normal, sub)  # 0x3C800000 = 2^-6
    return mag | sign


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_exact(xf, inv, FMT: tl.constexpr):
    """Codes (int32) of ``xf`` scaled by ``inv``, for any block (NaN products, clamps, subnormal ``d``)."""
    M: tl.constexpr = 127.0 if FMT == 1 else 448.0
    y = xf * inv
    y = tl.where(y != y, 0.0, y)  # 0 * inf: a zero element of a block whose 1/d overflows
    y = tl.minimum(tl.maximum(y, -M), M)
    if FMT == 1:
        t = y.to(tl.int32)  # truncation toward zero
        fr = y - t.to(tl.float32)  # exact
        return t + tl.where(fr >= 0.5, 1, 0) - tl.where(fr <= -0.5, 1, 0)
    else:
        return _e4m3_rne(y)


@triton.jit
def _cells(c_ptr, page_stride, page, off, hb, el, NBT: tl.constexpr):
    """Pointers to blocks ``hb`` of row ``off`` of ``page`` in a cache plane whose rows hold ``NBT`` blocks of 32
    elements; the page stride may be anything (a view)."""
    return c_ptr + page * page_stride + off * (NBT * 32) + hb * 32 + el


@triton.jit
def _load_rows(x_ptr, sx_t, sx_h, tok, hb, el, mask, NB: tl.constexpr):
    """Blocks ``[BLOCKS, 32]`` of rows: ``tok, hb [BLOCKS, 1]`` the token and the flat (head, 32-element block)
    index within it, ``el [1, 32]``; ``mask [BLOCKS, 1]``."""
    return tl.load(x_ptr + tok * sx_t + (hb // NB) * sx_h + (hb % NB) * 32 + el, mask=mask, other=0.0)


@triton.jit
def _block_scale(x, FMT: tl.constexpr, INTERP: tl.constexpr):
    """Per 32-element block of ``x``: (x in fp32, d, 1/d (0 where d is 0), whether the block is finite, whether
    d is below the smallest normal float, which the short path cannot take)."""
    xf = upcast(x, INTERP)
    amax = tl.reduce(tl.abs(xf), 1, _max_nan, keep_dims=True)  # inf or NaN for a non-finite block
    finite = amax <= 3.4028234663852886e38  # FLT_MAX
    M: tl.constexpr = 127.0 if FMT == 1 else 448.0
    dsc = tl.math.div_rn(amax, tl.full(amax.shape, M, tl.float32))
    inv = tl.where(dsc == 0.0, 0.0, tl.math.div_rn(tl.full(dsc.shape, 1.0, tl.float32), dsc))
    tiny = finite & (dsc > 0.0) & (dsc < 1.1754943508222875e-38)  # FLT_MIN
    return xf, dsc, inv, finite, tiny


@triton.jit
def _store_codes(xf, dsc, inv, finite, c_ptr, sc_page, s_ptr, slot, page, off, hb, el, mask, SHORT,
                 NBT: tl.constexpr, FMT: tl.constexpr):
    """The codes and scales of one tensor's blocks; ``SHORT``: every block of the program has a normal-float,
    zero or non-finite d (and the GPU the instructions of the short path)."""
    CT: tl.constexpr = c_ptr.dtype.element_ty
    if SHORT:
        y = xf * inv
        keep = tl.broadcast_to(tl.where(finite, -1, 0), y.shape)
        if FMT == 1:
            q = tl.inline_asm_elementwise(_Q8_FAST, "=r,f,f,f,f,r,r,r,r", [y, keep], dtype=tl.int8,
                                          is_pure=True, pack=4)
        else:
            q = tl.inline_asm_elementwise(_E4M3_FAST, "=r,f,f,f,f,r,r,r,r", [y, keep], dtype=tl.uint8,
                                          is_pure=True, pack=4)
    else:
        q = tl.where(finite, _quantize_exact(xf, inv, FMT), 0).to(CT)
    tl.store(_cells(c_ptr, sc_page, page, off, hb, el, NBT), q, mask=mask)
    sbits = tl.where(finite, dsc.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32),
                     0x7E00)  # the canonical fp16 NaN
    tl.store(s_ptr + slot * NBT + hb, sbits.to(tl.int16), mask=mask)


@triton.jit
def _blocks(slot_ptr, num_tokens, num_slots, PAGE_SIZE: tl.constexpr, NBT: tl.constexpr, BLOCKS: tl.constexpr,
            WIDE: tl.constexpr):
    """This program's 32-element blocks, a run of the flat (token, block within the token) index, as ``[BLOCKS,
    1]``: token, block within the token, slot (0 where skipped), page, offset, and whether to keep it. Slot -1
    skips a token; so does an out-of-range slot (index checks off) and the tail past ``num_tokens``. ``WIDE``:
    the flat index needs 64 bits."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    i = pid * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    tok = i // NBT
    hb = i % NBT
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    keep = (slot >= 0) & (slot < num_slots)
    slot = tl.where(keep, slot, 0)
    return tok.to(tl.int64), hb, slot, slot // PAGE_SIZE, slot % PAGE_SIZE, keep


@triton.jit
def _store_kernel(k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
                  kc_ptr, vc_ptr, skc_page, svc_page, ks_ptr, vs_ptr, slot_ptr, num_tokens, num_slots,
                  PAGE_SIZE: tl.constexpr, NBT: tl.constexpr, NB: tl.constexpr, BLOCKS: tl.constexpr,
                  WIDE: tl.constexpr, FMT: tl.constexpr, INTERP: tl.constexpr, E4M3_CVT: tl.constexpr,
                  PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # launched as a dependent of the kernel before: wait before any global access
    tok, hb, slot, page, off, mask = _blocks(slot_ptr, num_tokens, num_slots, PAGE_SIZE, NBT, BLOCKS, WIDE)
    el = tl.arange(0, 32)[None, :]
    # The value planes may be views with any page stride; the scale planes are dense (checked), so a scale's
    # index is the slot's.
    if FMT == 0:
        # A plain copy keeps K's load and store before V's: the order the CUDA copy measured faster.
        x = _load_rows(k_ptr, sk_t, sk_h, tok, hb, el, mask, NB)
        tl.store(_cells(kc_ptr, skc_page, page, off, hb, el, NBT), x.to(kc_ptr.dtype.element_ty), mask=mask)
        x = _load_rows(v_ptr, sv_t, sv_h, tok, hb, el, mask, NB)
        tl.store(_cells(vc_ptr, svc_page, page, off, hb, el, NBT), x.to(vc_ptr.dtype.element_ty), mask=mask)
    else:
        # Both tensors are loaded before either is stored: a load may not move above a store that might alias
        # it, so K's stores would otherwise hold V's loads back by a round trip.
        xk = _load_rows(k_ptr, sk_t, sk_h, tok, hb, el, mask, NB)
        xv = _load_rows(v_ptr, sv_t, sv_h, tok, hb, el, mask, NB)
        fk, dk, ik, ok_k, tiny_k = _block_scale(xk, FMT, INTERP)
        fv, dv, iv, ok_v, tiny_v = _block_scale(xv, FMT, INTERP)
        if INTERP or (FMT == 2 and not E4M3_CVT):  # the short path needs PTX (and e4m3 conversions)
            short = False
        else:
            short = tl.max((tiny_k | tiny_v).to(tl.int32)) == 0
        _store_codes(fk, dk, ik, ok_k, kc_ptr, skc_page, ks_ptr, slot, page, off, hb, el, mask, short, NBT, FMT)
        _store_codes(fv, dv, iv, ok_v, vc_ptr, svc_page, vs_ptr, slot, page, off, hb, el, mask, short, NBT, FMT)


# 32-element blocks per program and warps: a thread holds 16 consecutive elements of K and of V, so its codes
# leave in one 16-byte store, and a program of one warp takes the short-path test without a barrier. The blocks
# are a run of the flat (token, block) index, so rows of 3 or 6 blocks (3 kv heads at head_dim 32 or 64) leave
# no lane idle. On an H200 (store of 65536 and 262144 tokens at 8x d128, 2x d256, 3x d64, in one process):
# 8-bit stores took 0.5-1.5% less time with 16 blocks in one warp than with 32 in two, 2-5% less than 64 in
# four and 5-10% less than 32 in one (eight elements per thread); bf16 the same within 0.5%.
_BLOCKS, _WARPS = 16, 1


def _launch(t: int, nbt: int) -> tuple[tuple[int], bool]:
    """The grid over ``t`` tokens of ``nbt`` blocks each, and whether the flat block index needs 64 bits."""
    return (triton.cdiv(t * nbt, _BLOCKS),), t * nbt + _BLOCKS >= 2 ** 31


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
    grid, wide = _launch(t, hkv * nb)
    pdl = _PDL and not INTERPRET and has_pdl(key.device)
    _store_kernel[grid](key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                        kc, vc, k_cache.stride(0), v_cache.stride(0), ks, vs, slot_mapping.contiguous(), t,
                        k_cache.shape[0] * page_size,
                        PAGE_SIZE=page_size, NBT=hkv * nb, NB=nb, BLOCKS=_BLOCKS, WIDE=wide, FMT=fmt,
                        INTERP=INTERPRET, E4M3_CVT=has_e4m3_cvt(key.device), PDL=pdl, num_warps=_WARPS,
                        launch_pdl=pdl,
                        # no mul+sub -> fma contraction: q8_0 rounding reads the fractional part of the rounded y
                        enable_fp_fusion=False)


@triton.jit
def _dequant_kernel(c_ptr, sc_page, s_ptr, slot_ptr, num_tokens, num_slots, out_ptr,
                    PAGE_SIZE: tl.constexpr, NBT: tl.constexpr, BLOCKS: tl.constexpr, WIDE: tl.constexpr,
                    FMT: tl.constexpr, INTERP: tl.constexpr):
    tok, hb, slot, page, off, keep = _blocks(slot_ptr, num_tokens, num_slots, PAGE_SIZE, NBT, BLOCKS, WIDE)
    el = tl.arange(0, 32)[None, :]
    raw = tl.load(_cells(c_ptr, sc_page, page, off, hb, el, NBT), mask=keep, other=0)
    if FMT == 0:
        x = raw.to(tl.float32)
    else:
        s = tl.load(s_ptr + slot * NBT + hb, mask=keep, other=0.0)
        x = dequant(raw, s, FMT)
    x = tl.where(keep, x, 0.0)
    tl.store(out_ptr + tok * (NBT * 32) + hb * 32 + el, cast(x, out_ptr.dtype.element_ty, INTERP),
             mask=tok < num_tokens)


def dequantize(cache, scale, slot_mapping, dtype):
    """Gather ``slot_mapping[T]`` tokens back to ``dtype``, ``[T, Hkv, D]``; slot -1 gives zeros."""
    t = slot_mapping.shape[0]
    _, page_size, hkv, d = cache.shape
    out = torch.empty(t, hkv, d, dtype=dtype, device=cache.device)
    if t == 0:
        return out
    nbt = hkv * (d // 32)
    fmt = cache_format(cache)
    c = as_kernel_arg(cache)
    s = c if scale is None else scale
    grid, wide = _launch(t, nbt)
    _dequant_kernel[grid](
        c, cache.stride(0), s, slot_mapping.contiguous(), t, cache.shape[0] * page_size, out,
        PAGE_SIZE=page_size, NBT=nbt, BLOCKS=_BLOCKS, WIDE=wide, FMT=fmt, INTERP=INTERPRET, num_warps=_WARPS)
    return out
