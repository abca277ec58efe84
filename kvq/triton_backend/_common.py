"""Pieces shared by the Triton kernels: format codes, byte views of the cache, in-register dequantization."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .._checks import SUPPORTED_HEAD_DIMS

# The cache format, as a constexpr of every kernel (one compiled instance per format).
FMT_PLAIN, FMT_Q8_0, FMT_E4M3 = 0, 1, 2

# Triton's interpreter computes bf16 tl.dot wrongly (fp16 and fp32 are right). Under TRITON_INTERPRET=1 the
# wrappers set the DOT_F32 constexpr, which upcasts dot operands to fp32; compiled GPU kernels never see it,
# so the GPU path is exactly the one that runs in production.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def cache_format(cache: torch.Tensor) -> int:
    if cache.dtype == torch.int8:
        return FMT_Q8_0
    if cache.dtype == torch.float8_e4m3fn:
        return FMT_E4M3
    return FMT_PLAIN


# The attention kernels index head_dim with one tl.arange (a power of two). They are tested at the contract's
# head_dims and at 32 (one scale per row); larger powers of two are not, so they are refused rather than tried.
ATTENTION_HEAD_DIMS = (32,) + SUPPORTED_HEAD_DIMS


def check_head_dim(op: str, d: int) -> None:
    if d not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"kvq.{op}: the Triton backend's attention supports head_dim "
                         f"{', '.join(map(str, ATTENTION_HEAD_DIMS))}, got {d}; run this model's attention on "
                         "another backend (KVQ_BACKEND=reference). store_kv and dequantize take any multiple of 32")


def as_kernel_arg(cache: torch.Tensor) -> torch.Tensor:
    """fp8 caches travel as uint8 bytes: the kernels decode and encode e4m3 with integer arithmetic."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


@triton.jit
def dequant(raw, scale, FMT: tl.constexpr):
    """``float(q) * float(scale)`` in fp32, bit-exact with the reference; ``scale`` broadcasts over ``raw``.

    e4m3 -> fp16 is a shift: e4m3 bits ``seeeemmm`` placed at fp16 bits 14..7 give the same value scaled by
    2^-8 (exponent bias 7 vs 15, subnormals included), so the 2^8 goes into the scale (exact in fp32: the
    scale is an fp16 value) and the one fp32 product rounds exactly like ``float(q) * float(scale)``.
    """
    if FMT == 1:
        return raw.to(tl.float32) * scale.to(tl.float32)
    else:
        b = raw.to(tl.int16)
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * (scale.to(tl.float32) * 256.0)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """fp32 -> ``dtype``, round to nearest even.

    Triton's interpreter truncates fp32 -> bf16; under TRITON_INTERPRET=1 (the INTERP constexpr, set only by
    the wrappers then) the rounding is done on the bits instead. Compiled kernels use the plain cast.
    """
    if INTERP and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def scores(s, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw ``q . k`` -> the logit in log2 units: ``sm_scale * s`` or ``softcap * tanh(sm_scale * s / softcap)``,
    times log2(e). ``qk_scale`` is ``sm_scale * log2(e)``; tanh(x) = 1 - 2 / (exp(2x) + 1) saturates cleanly."""
    if SOFTCAP:
        cap2 = softcap * 1.4426950408889634
        t = s * (qk_scale / cap2)
        return cap2 * (1.0 - 2.0 / (tl.exp2(t * 2.8853900817779268) + 1.0))
    else:
        return s * qk_scale


@triton.jit
def fp16_row_scale(amax):
    """2^k per query row ([R] fp32, from the row's largest magnitude ``amax``) that brings that magnitude into
    [2^14, 2^15). Over an 8-bit cache a query goes to the tensor cores in fp16; a bf16 row times 2^k is exact
    there whatever its magnitude (but for elements more than 2^28 below its largest), and the scores are
    multiplied back by 2^-k, exactly. A zero or non-finite row gets k = 0; k is clamped to [-120, 100]."""
    ex = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.where((amax > 0.0) & (amax < float("inf")), tl.minimum(tl.maximum(14 - ex, -120), 100), 0)
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scaled_fp16(x, mul, INTERP: tl.constexpr):
    """fp32 ``x * mul`` as fp16 (widened back to fp32 under the interpreter, see upcast)."""
    x = (x * mul).to(tl.float16)
    if INTERP:
        x = upcast(x, INTERP)
    return x


@triton.jit
def fp16_query(q, qk_scale, INTERP: tl.constexpr):
    """A query tile ``[R, D]`` for fp16 dots over an 8-bit cache, each row times its fp16_row_scale, and the
    logit scale per row ``[R, 1]`` that takes the scores back."""
    q32 = upcast(q, INTERP)
    mul = fp16_row_scale(tl.max(tl.abs(q32), axis=1))[:, None]
    return scaled_fp16(q32, mul, INTERP), qk_scale / mul


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, DT: tl.constexpr, INTERP: tl.constexpr):
    """One online-softmax update with masked logits ``s [M, N]`` (-inf = hidden) and values ``v [N, D]`` in
    ``DT``; P is cast to ``DT`` before P @ V, as on tensor cores. A row that has seen nothing keeps m = -inf."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if INTERP:
        pv = tl.dot(upcast(cast(p, DT, INTERP), INTERP), upcast(v, INTERP))
    else:
        pv = tl.dot(p.to(DT), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def upcast(x, INTERP: tl.constexpr):
    """bf16/fp16 -> fp32, exactly. Triton's interpreter mishandles bf16 subnormals, so under
    TRITON_INTERPRET=1 bf16 is widened on the bits (a bf16 is the top half of an fp32)."""
    if INTERP and x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


def i8x4_to_f16x2_ptx(src: str, lo: str, hi: str) -> str:
    """PTX turning the four int8 of the 32-bit ``src`` into fp16 pairs ``lo`` (bytes 0, 1) and ``hi`` (bytes 2,
    3) without the int->float conversion unit (a quarter-rate pipe that bounds an 8-bit decode far below memory
    bandwidth): u = q + 128 goes into the mantissa of 1024.0 (fp16 0x6400 | u = 1024 + u), and 1152 = 1024 + 128
    is subtracted, exactly. Uses .b32 registers ``t`` and ``m``, which the caller declares."""
    return (f"xor.b32 t, {src}, 0x80808080;\n"
            f"prmt.b32 {lo}, t, 0x64646464, 0x5150;\n"
            f"prmt.b32 {hi}, t, 0x64646464, 0x5352;\n"
            "mov.b32 m, 0x64806480;\n"
            f"sub.rn.f16x2 {lo}, {lo}, m;\n"
            f"sub.rn.f16x2 {hi}, {hi}, m;\n")


# int8 x4 -> fp16 x4 (pack=4 over an int8 tensor: two packed fp16 pairs out).
_I8_TO_F16 = tl.constexpr("{\n.reg .b32 t, m;\n" + i8x4_to_f16x2_ptx("$2", "$0", "$1") + "}")


def has_e4m3_cvt(device: torch.device) -> bool:
    """sm_89 and newer convert e4m3 pairs to fp16 in one instruction; older GPUs take the bit path."""
    return _at_least(device, (8, 9))


def has_pdl(device: torch.device) -> bool:
    """sm_90 and newer run programmatic dependent launches (griddepcontrol)."""
    return _at_least(device, (9, 0))


def _at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    return device.type == "cuda" and _capability(device.index if device.index is not None else -1) >= capability


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(torch.cuda.current_device() if index < 0 else index)


@triton.jit
def dequant_f16(raw, scale, FMT: tl.constexpr, INTERP: tl.constexpr, E4M3_CVT: tl.constexpr):
    """``fp16(float(q) * float(scale))``: the reference dequantization rounded once to fp16.

    The 8-bit code is exact in fp16 and its product with an fp16 scale is exact in fp32, so one fp16
    multiply rounds exactly like the fp32 product cast to fp16. The attention kernels feed these fp16 values
    to the tensor cores whatever the query dtype (int8 and e4m3 codes are not all exact in bf16 with a
    scale applied, and fp16 keeps 3 more bits). Queries are brought into fp16's range first (fp16_row_scale)
    and the decode applies key scales after its dots, but values, and the keys of the extend's prefix, are
    these fp16 products: on the Triton 8-bit path |v| (and |k| in extend) must stay below 65504.
    """
    if INTERP:
        return dequant(raw, scale, FMT).to(tl.float16)
    else:
        if FMT == 1:
            h = tl.inline_asm_elementwise(_I8_TO_F16, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
        elif E4M3_CVT:
            h = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # cvt.rn.f16x2.e4m3x2
        else:
            b = raw.to(tl.int16)  # see dequant: the e4m3 bits shifted into an fp16 are the value times 2^-8
            h = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0
        return h * scale


@triton.jit
def page_of(bt_row_ptr, n, keep, num_pages, PAGE_SIZE: tl.constexpr):
    """The page holding token ``n`` of a sequence (``[N, 1]`` int64) and ``keep`` narrowed to pages inside
    ``[0, num_pages)``: a bad block-table entry drops its keys instead of reading outside the cache."""
    pg = tl.load(bt_row_ptr + n // PAGE_SIZE, mask=keep, other=0)
    keep = keep & (pg >= 0) & (pg < num_pages)
    return tl.where(keep, pg, 0).to(tl.int64)[:, None], keep
