"""The reference numerics against independent oracles, on hand-built and random cases.

The oracles here share no code with kvq.reference: fp32 steps are done in numpy float32 (IEEE, one rounding
each), the final rounding in Python floats (exact for fp32 values), and e4m3 by nearest-neighbour search
over all 256 codes with ties to the even code.
"""

import math

import numpy as np
import pytest
import torch

from kvq import reference
from kvq.spec import BLOCK, KVQuantSpec

from common import random_paged, rel_err

# ---------------------------------------------------------------------------------------------- oracles
_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)
_E4M3_FINITE = [(c, v) for c, v in enumerate(_E4M3) if np.isfinite(v) and c not in (0x7F, 0xFF)]


def e4m3_code(y: float) -> int:
    """Round-to-nearest-even onto e4m3fn by search; the sign of zero is kept."""
    if y == 0:
        return 0x80 if math.copysign(1.0, y) < 0 else 0
    best = min(_E4M3_FINITE, key=lambda cv: (abs(cv[1] - y), cv[0] & 1, (cv[0] >= 0x80) != (y < 0)))
    # min() with (distance, odd code) picks the even code on a tie; a y that rounds to zero keeps its sign.
    return best[0]


def oracle_block(x: np.ndarray, fmt: str):
    """(codes as uint8, scale bits as uint16) of one 32-element block, per DESIGN.md."""
    x = x.astype(np.float32)
    m = np.float32(127.0 if fmt == "q8_0" else 448.0)
    amax = np.float32(np.max(np.abs(x))) if not np.isnan(x).any() else np.float32(np.nan)
    if not np.isfinite(amax):
        return np.zeros(BLOCK, np.uint8), np.uint16(0x7E00)
    with np.errstate(all="ignore"):
        d = np.float32(amax / m)
        inv = np.float32(0.0) if d == 0 else np.float32(np.float32(1.0) / d)
        y = (x * inv).astype(np.float32)
    y = np.where(np.isnan(y), np.float32(0), y)
    codes = []
    for v in y.tolist():
        if fmt == "q8_0":
            r = math.floor(abs(v) + 0.5) if abs(v) < 1e9 else abs(v)  # exact in float64 for fp32 v
            r = math.copysign(min(r, 127.0), v)
            codes.append(int(r) & 0xFF)
        else:
            codes.append(e4m3_code(float(np.clip(v, -448.0, 448.0))))
    return np.array(codes, np.uint8), np.float16(d).view(np.uint16)


def check_against_oracle(x: torch.Tensor, fmt: str):
    dt = KVQuantSpec.from_name(fmt).storage_dtype
    q, s = reference.quantize(x, dt)
    qb = q.view(torch.uint8).reshape(-1, BLOCK).numpy()
    sb = s.view(torch.int16).reshape(-1).numpy().view(np.uint16)
    xb = x.float().reshape(-1, BLOCK).numpy()
    for i in range(xb.shape[0]):
        codes, sbits = oracle_block(xb[i], fmt)
        assert sb[i] == sbits, f"block {i}: scale bits {sb[i]:#06x} != {sbits:#06x}"
        np.testing.assert_array_equal(qb[i], codes, err_msg=f"block {i} of {fmt}")


# ------------------------------------------------------------------------------------------ hand cases
def block_with(values, amax, dtype=torch.bfloat16):
    """A block holding ``values``, padded with random values below ``amax``, and one element equal to amax."""
    x = (torch.rand(BLOCK) * 2 - 1) * amax * 0.5
    x[: len(values)] = torch.tensor(values)
    x[-1] = amax
    return x.to(dtype)


def test_q8_0_half_ties_round_away_from_zero():
    # amax 127 gives d = 1, id = 1, y = x: the ties are exact.
    x = block_with([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 0.25, -0.75], 127.0)
    q, s = reference.quantize(x, torch.int8)
    assert q[:10].tolist() == [1, -1, 2, -2, 3, -3, 127, -127, 0, -1]
    assert s.item() == 1.0
    check_against_oracle(x, "q8_0")


def test_e4m3_midpoints_and_one_ulp_either_side():
    # amax 448 gives y = x; around 1.0 the e4m3 grid step is 1/8, so 1.0625 is a tie (to even: 1.0) and
    # 1.1875 a tie (to even: 1.25). fp16 input gives ulps of 2^-10 around them.
    ulp = 2.0 ** -10
    vals = [1.0625, 1.0625 - ulp, 1.0625 + ulp, 1.1875, 1.1875 - ulp, 1.1875 + ulp, -1.0625, -1.1875]
    x = block_with(vals, 448.0, torch.float16)
    q, _ = reference.quantize(x, torch.float8_e4m3fn)
    assert q[:8].float().tolist() == [1.0, 1.0, 1.125, 1.25, 1.125, 1.25, -1.0, -1.25]
    check_against_oracle(x, "fp8_e4m3")


def test_e4m3_subnormal_midpoints():
    # Below 2^-6 e4m3 steps by 2^-9: 1.5 * 2^-9 is a tie between codes 1 and 2 (to even: 2 * 2^-9).
    step = 2.0 ** -9
    vals = [0.5 * step, 1.5 * step, 2.5 * step, 0.5 * step + 2.0 ** -16, -1.5 * step]
    x = block_with(vals, 448.0, torch.float16)
    q, _ = reference.quantize(x, torch.float8_e4m3fn)
    assert (q[:5].float() / step).tolist() == [0.0, 2.0, 2.0, 1.0, -2.0]
    check_against_oracle(x, "fp8_e4m3")


def test_single_rounding_not_through_fp16():
    # With amax 1000, y = x * fp32(448 / 1000) lands between fp16 values. Rounding y to fp16 first and then
    # to e4m3 differs from one rounding for values just off an e4m3 midpoint: find every fp16 x where the two
    # differ, and check that the reference and the oracle round once.
    x = torch.arange(0x3C00, 0x63D0, dtype=torch.int16).view(torch.float16)  # 1.0 .. 1000 in bit order
    x = x[x <= 1000]
    d = torch.tensor(1000.0, dtype=torch.float32) / 448
    y = x.float() * (1 / d)
    once = y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    twice = y.half().float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    sep = x[once != twice]
    assert sep.numel() > 10, "the case must separate one rounding from two"
    n = -(-sep.numel() // (BLOCK - 1))
    blocks = torch.full((n, BLOCK), 1.0, dtype=torch.float16)
    blocks[:, 0] = 1000.0
    blocks.view(-1)[torch.arange(sep.numel()) // (BLOCK - 1) * BLOCK + torch.arange(sep.numel()) % (BLOCK - 1) + 1] = sep
    check_against_oracle(blocks, "fp8_e4m3")


def test_clamping_at_the_block_maximum():
    for fmt, m in (("q8_0", 127), ("fp8_e4m3", 448)):
        x = torch.randn(40, BLOCK, dtype=torch.bfloat16) * 3
        q, _ = reference.quantize(x, KVQuantSpec.from_name(fmt).storage_dtype)
        assert q.float().abs().max().item() == m
        check_against_oracle(x, fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
def test_all_zero_block_and_negative_zero(fmt):
    x = torch.zeros(2, BLOCK, dtype=torch.bfloat16)
    x[1] = torch.randn(BLOCK)
    x[1, 3] = -0.0
    dt = KVQuantSpec.from_name(fmt).storage_dtype
    q, s = reference.quantize(x, dt)
    assert s[0].item() == 0 and (q[0].view(torch.uint8) == 0).all()
    assert (reference.dequantize_values(q, s)[0] == 0).all()
    assert q[1, 3].view(torch.uint8).item() == (0x80 if fmt == "fp8_e4m3" else 0)
    check_against_oracle(x, fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
def test_subnormal_fp16_scales(fmt):
    # amax of 1e-3 puts d = amax / M below fp16's smallest normal (6.1e-5).
    x = (torch.rand(16, BLOCK) * 2 - 1) * torch.logspace(-7, -3, 16)[:, None]
    x = x.to(torch.bfloat16)
    q, s = reference.quantize(x, KVQuantSpec.from_name(fmt).storage_dtype)
    assert (s.float().abs() < 6.1e-5).all() and (s != 0).any()
    check_against_oracle(x, fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
def test_fp32_subnormal_d_is_defined(fmt):
    # 1/d overflows to inf: nonzero elements saturate, zeros (0 * inf = NaN) stay 0, the scale is 0.
    x = torch.zeros(BLOCK, dtype=torch.bfloat16)
    x[:4] = torch.tensor([1e-38, -1e-38, 5e-39, 0.0])
    q, s = reference.quantize(x, KVQuantSpec.from_name(fmt).storage_dtype)
    assert s.item() == 0 and q[3].float().item() == 0
    check_against_oracle(x, fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_blocks_dequantize_to_nan(fmt, bad):
    x = torch.randn(3, BLOCK, dtype=torch.bfloat16)
    x[1, 7] = bad
    q, s = reference.quantize(x, KVQuantSpec.from_name(fmt).storage_dtype)
    assert s.view(torch.int16)[1].item() == 0x7E00 and (q[1].view(torch.uint8) == 0).all()
    xd = reference.dequantize_values(q, s)
    assert torch.isnan(xd[1]).all()
    assert torch.isfinite(xd[[0, 2]]).all()
    check_against_oracle(x, fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_blocks_match_oracle_and_error_bound(fmt, dtype):
    x = (torch.randn(64, 4, 64) * torch.logspace(-3, 2, 64)[:, None, None]).to(dtype)
    check_against_oracle(x, fmt)
    q, s = reference.quantize(x, KVQuantSpec.from_name(fmt).storage_dtype)
    err = (reference.dequantize_values(q, s) - x.float()).unflatten(-1, (-1, BLOCK)).abs()
    d = s.float().unsqueeze(-1)
    if fmt == "q8_0":
        # |x - q*d16| <= d/2 from rounding, plus 127 * |d - d16| from the fp16 scale rounding.
        amax = x.float().unflatten(-1, (-1, BLOCK)).abs().amax(-1, keepdim=True)
        bound = d / 2 + 127 * (amax / 127 - d).abs() + 1e-12
    else:
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, plus half a subnormal step, plus
        # |q| * |d - d16| from the fp16 scale rounding (large when d16 is an fp16 subnormal).
        xb = x.float().unflatten(-1, (-1, BLOCK))
        d32 = xb.abs().amax(-1, keepdim=True) / 448
        qf = q.float().unflatten(-1, (-1, BLOCK)).abs()
        bound = xb.abs() * (2 ** -4) * (1 + 2 ** -10) + d32 * 2 ** -10 + qf * (d32 - d).abs() + 1e-12
    assert (err <= bound * (1 + 1e-6)).all()


# -------------------------------------------------------------------------------------- store / gather
@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "bf16"])
def test_store_then_dequantize_round_trip(fmt):
    dt = {"q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}[fmt]
    p = random_paged([5, 17, 33], page_size=16, hkv=2, d=64, cache_dt=dt)
    for b, n in enumerate([5, 17, 33]):
        pos = torch.arange(n)
        pages = p.block_table[b].long()
        slots = pages[pos // 16] * 16 + pos % 16
        got = reference.dequantize(p.k_cache, p.k_scale, slots, torch.float32)
        want = p.k_src[b].float()
        if fmt == "bf16":
            assert torch.equal(got, want)
        else:
            q, s = reference.quantize(p.k_src[b], dt)
            assert torch.equal(got, reference.dequantize_values(q, s))
    slots = torch.tensor([-1, 0])
    assert (reference.dequantize(p.k_cache, p.k_scale, slots, torch.bfloat16)[0] == 0).all()


# ------------------------------------------------------------------------------------------- attention
def naive_attention(q, k, v, q_pos, k_pos, sm_scale, causal, window_left, softcap):
    """Per-query, per-head loops in float64: an independent check of reference.attend."""
    n, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    for i in range(n):
        for h in range(hq):
            keep = [j for j in range(k.shape[0])
                    if (not causal or k_pos[j] <= q_pos[i]) and (window_left < 0 or k_pos[j] >= q_pos[i] - window_left)]
            if not keep:
                continue
            s = torch.stack([(q[i, h].double() * k[j, h // g].double()).sum() * sm_scale for j in keep])
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            p = torch.softmax(s, 0)
            out[i, h] = sum(p[t] * v[j, h // g].double() for t, j in enumerate(keep))
    return out


@pytest.mark.parametrize("window_left,softcap,causal", [(-1, 0.0, True), (5, 0.0, True), (-1, 20.0, True),
                                                         (3, 0.0, False)])
def test_attend_matches_naive_loops(window_left, softcap, causal):
    n, L, hq, hkv, d = 4, 11, 4, 2, 32
    q, k, v = torch.randn(n, hq, d), torch.randn(L, hkv, d), torch.randn(L, hkv, d)
    k_pos = torch.arange(L)
    q_pos = k_pos[-n:]
    got = reference.attend(q, k, v, q_pos, k_pos, 0.3, causal, window_left, softcap)
    want = naive_attention(q, k, v, q_pos, k_pos, 0.3, causal, window_left, softcap)
    assert rel_err(got, want) < 1e-6


def test_decode_and_extend_references_agree():
    # The last token of an extend equals a decode over the full (stored) sequence.
    hq, hkv, d, n_new, prefix = 8, 2, 64, 7, 21
    p = random_paged([prefix + n_new], page_size=8, hkv=hkv, d=d, cache_dt=torch.bfloat16)
    q = torch.randn(n_new, hq, d, dtype=torch.bfloat16)
    k_new, v_new = p.k_src[0][prefix:], p.v_src[0][prefix:]
    out_e = torch.full_like(q, math.nan)
    reference.extend_attention(q, k_new, v_new, p.k_cache, p.v_cache, None, None, p.block_table,
                               torch.tensor([prefix], dtype=torch.int32), torch.tensor([0, n_new], dtype=torch.int32),
                               0.125, True, -1, 0.0, out_e)
    out_d = torch.full_like(q[-1:], math.nan)
    reference.decode_attention(q[-1:], p.k_cache, p.v_cache, None, None, p.block_table, p.seq_lens, 0.125, -1,
                               0.0, out_d)
    # Both are fp32 attention rounded once to bf16, but the products of 7 query rows and of 1 sum in different
    # orders (CPU BLAS blocking): fp32 results a few 1e-8 apart (outputs are of order 1), and a value near a
    # rounding boundary lands one bf16 ulp apart (about 4% of random draws). No further.
    a, b = out_e[-1:].float(), out_d.float()
    bound = torch.maximum(a.abs(), b.abs()) * 2.0 ** -7 + 1e-6
    assert bool(((a - b).abs() <= bound).all()), f"max difference {(a - b).abs().max().item():.3e}"
    assert not torch.isnan(out_e).any()


def test_zero_length_decode_row_is_zero():
    p = random_paged([0, 9], page_size=4, hkv=1, d=32, cache_dt=torch.int8)
    q = torch.randn(2, 2, 32, dtype=torch.bfloat16)
    out = torch.full_like(q, math.nan)
    reference.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens, 0.2,
                               -1, 0.0, out)
    assert (out[0] == 0).all() and torch.isfinite(out[1]).all()
