"""The PyTorch reference: exact quantization numerics and fp32 paged attention.

This module is the oracle for every backend and the CPU implementation of the ops. It follows
DESIGN.md's numerics to the bit; the comments say where a shortcut would break bit equality.

Quantization of one block of 32 elements ``x`` (bf16/fp16, upcast exactly to fp32)::

    amax = max |x|;  d = amax / M  (M = 127 for q8_0, 448 for fp8_e4m3);  scale = fp16(d)
    id = 1/d (0 when d == 0);  y = x * id
    q8_0:     q = clamp(round_half_away_from_zero(y), -127, 127)
    fp8_e4m3: q = e4m3fn_rne(clamp(y, -448, 448))
    dequant:  x' = float(q) * float(scale)

A block holding inf or NaN stores the canonical fp16 NaN (0x7E00) as its scale and zero values, so it
dequantizes to NaN and never to a finite number. ``y`` is NaN only for ``0 * inf`` (a zero element of a block
whose fp32 ``d`` is so small that ``1/d`` overflows); that element is stored as 0, its true value.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .spec import BLOCK, SCALE_DTYPE, KVQuantSpec

CANONICAL_NAN_F16 = 0x7E00


def quantize(x: Tensor, cache_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Quantize ``x[..., D]`` (D % 32 == 0) into ``(values[..., D] of cache_dtype, scales[..., D // 32] fp16)``."""
    spec = KVQuantSpec.from_cache_dtype(cache_dtype)
    assert spec.quantized, "quantize() needs int8 or float8_e4m3fn"
    xf = x.float().unflatten(-1, (-1, BLOCK))
    amax = xf.abs().amax(-1, keepdim=True)  # torch's amax propagates NaN
    # A tensor divisor: on CUDA, torch turns division by a Python scalar into a multiply by its reciprocal,
    # which is not the IEEE quotient DESIGN.md asks for (about 4% of blocks would get another d).
    d = amax / torch.full_like(amax, spec.max_magnitude)
    finite = torch.isfinite(d)
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    y = xf * inv
    y = torch.where(torch.isnan(y), torch.zeros_like(y), y)
    m = spec.max_magnitude
    y = y.clamp(-m, m)  # clamping first equals clamping after rounding: the bounds are representable
    if cache_dtype == torch.int8:
        t = y.trunc()
        q = torch.where((y - t).abs() >= 0.5, t + y.sign(), t)  # half away from zero; y - t is exact
        q = q.to(torch.int8)
    else:
        q = y.to(torch.float8_e4m3fn)  # one rounding from fp32, to nearest even
    q = torch.where(finite, q, torch.zeros((), dtype=q.dtype, device=q.device))
    # The NaN's bits are set, not converted: fp32 NaN -> fp16 gives 0x7E00 on a CPU but 0x7FFF on a GPU.
    nan = torch.tensor(CANONICAL_NAN_F16, dtype=torch.int16, device=d.device).view(SCALE_DTYPE)
    scale = torch.where(finite, d.to(SCALE_DTYPE), nan)
    return q.flatten(-2), scale.squeeze(-1)


def dequantize_values(q: Tensor, scale: Optional[Tensor]) -> Tensor:
    """``float(q) * float(scale)`` per 32-element block, in fp32; unquantized values are upcast."""
    if scale is None:
        return q.float()
    qf = q.float().unflatten(-1, (-1, BLOCK))
    return (qf * scale.float().unsqueeze(-1)).flatten(-2)


# --------------------------------------------------------------------------------------------------
# Ops (the reference backend). Shapes follow DESIGN.md; inputs are assumed checked (see _checks.py).
# --------------------------------------------------------------------------------------------------


def store_kv(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (-1 skips a token)."""
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page, off = slots // page_size, slots % page_size
    for x, cache, scale in ((key[keep], k_cache, k_scale), (value[keep], v_cache, v_scale)):
        if scale is None:
            cache[page, off] = x.to(cache.dtype)
        else:
            q, s = quantize(x, cache.dtype)
            cache[page, off] = q
            scale[page, off] = s


def dequantize(cache, scale, slot_mapping, dtype) -> Tensor:
    """Gather tokens ``slot_mapping[T]`` of a cache back to ``dtype``; slot -1 yields zeros. ``[T, Hkv, D]``."""
    page_size = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping.clamp(min=0)
    page, off = slots // page_size, slots % page_size
    x = dequantize_values(cache[page, off], None if scale is None else scale[page, off])
    x = torch.where(keep[:, None, None], x, torch.zeros((), device=x.device))
    return x.to(dtype)


def gather_sequence(cache, scale, pages: Tensor, length: int) -> Tensor:
    """The first ``length`` tokens of one sequence, dequantized to fp32: ``[length, Hkv, D]``."""
    page_size = cache.shape[1]
    n = -(-length // page_size)
    pages = pages[:n].long()
    x = dequantize_values(cache[pages], None if scale is None else scale[pages])
    return x.flatten(0, 1)[:length]


def attend(q, k, v, q_pos, k_pos, sm_scale, causal, window_left, logit_softcap) -> Tensor:
    """fp32 attention of ``q[n, Hq, D]`` over ``k, v[L, Hkv, D]`` (GQA by head groups).

    ``q_pos[n]``, ``k_pos[L]`` are token positions: causal keeps ``k_pos <= q_pos``, a window keeps
    ``k_pos >= q_pos - window_left``. A query that sees no key gets 0.
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qh = q.float().view(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    kh = k.float().permute(1, 2, 0)  # [Hkv, D, L]
    vh = v.float().permute(1, 0, 2)  # [Hkv, L, D]
    s = torch.matmul(qh, kh.unsqueeze(1)) * sm_scale  # [Hkv, G, n, L]
    if logit_softcap > 0:
        s = logit_softcap * torch.tanh(s / logit_softcap)
    visible = torch.ones(n, k.shape[0], dtype=torch.bool, device=q.device)
    if causal:
        visible &= k_pos[None, :] <= q_pos[:, None]
    if window_left >= 0:
        visible &= k_pos[None, :] >= q_pos[:, None] - window_left
    s = s.masked_fill(~visible, -math.inf)
    seen = visible.any(-1)  # [n]
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(seen[:, None], mx, torch.zeros_like(mx))
    p = torch.exp(s - mx)
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    o = torch.matmul(p, vh.unsqueeze(1))  # [Hkv, G, n, D]
    return o.permute(2, 0, 1, 3).reshape(n, hq, d)


def decode_attention(query, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, sm_scale,
                     window_left, logit_softcap, out) -> None:
    """One query per sequence (at position ``seq_lens[b] - 1``) over its paged cache, fp32 math."""
    for b in range(query.shape[0]):
        length = int(seq_lens[b])
        if length == 0:
            out[b] = 0
            continue
        k = gather_sequence(k_cache, k_scale, block_table[b], length)
        v = gather_sequence(v_cache, v_scale, block_table[b], length)
        pos = torch.arange(length, device=query.device)
        o = attend(query[b : b + 1], k, v, pos[-1:], pos, sm_scale, True, window_left, logit_softcap)
        out[b] = o[0].to(out.dtype)


def extend_attention(query, key, value, k_cache, v_cache, k_scale, v_scale, block_table, prefix_lens,
                     cu_seqlens_q, sm_scale, causal, window_left, logit_softcap, out) -> None:
    """New tokens of each sequence attend to its cached prefix (from the pages) and to their own exact K/V."""
    for b in range(prefix_lens.shape[0]):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if end == start:
            continue
        prefix = int(prefix_lens[b])
        k_new, v_new = key[start:end].float(), value[start:end].float()
        if prefix > 0:
            k = torch.cat([gather_sequence(k_cache, k_scale, block_table[b], prefix), k_new])
            v = torch.cat([gather_sequence(v_cache, v_scale, block_table[b], prefix), v_new])
        else:
            k, v = k_new, v_new
        k_pos = torch.arange(prefix + end - start, device=query.device)
        q_pos = k_pos[prefix:]
        o = attend(query[start:end], k, v, q_pos, k_pos, sm_scale, causal, window_left, logit_softcap)
        out[start:end] = o.to(out.dtype)
