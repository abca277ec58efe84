"""Properties of the 8-bit formats over random shapes and values (hypothesis).

Hypothesis draws the structure (shape, dtype, magnitude range, how many zeros, signed zeros, subnormals,
exact ties and non-finite values); torch fills the tensor from a drawn seed, so a failure replays from the
printed example. Checked on every finite block: the error bound of each format, idempotence, sign symmetry;
on blocks holding inf/NaN: they dequantize to NaN and leave every other block alone; and the Triton store
writes the same bytes as the reference (in Triton's interpreter on CPU, on the GPU when there is one).
"""

import math
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvq
from kvq import reference
from kvq.spec import BLOCK

from common import INTERPRET, TRITON_DEVICE, backend_ops, poison_, runs_triton

FORMATS = {"q8_0": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}
HEAD_DIMS = (32, 64, 96, 128, 256)
FP16_MAX = 65504.0
# Positive finite e4m3 values, in order: the midpoints of neighbours are the exact ties of round-to-nearest.
_E4M3 = torch.arange(0x00, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
E4M3_MIDPOINTS = (_E4M3[1:] + _E4M3[:-1]) / 2

# (smallest, largest) log2 magnitude of a block. bf16 reaches its subnormals (2^-133) and magnitudes whose
# scale amax / M overflows fp16; fp16 spans its own range.
EXP_RANGE = {torch.bfloat16: (-140, 40), torch.float16: (-26, 15)}

# KVQ_PROPERTY_EXAMPLES scales every property's example count (a longer hunt: KVQ_PROPERTY_EXAMPLES=5000).
N = int(os.environ.get("KVQ_PROPERTY_EXAMPLES", "300"))
fast = settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw, nonfinite=False):
    """(x [tokens, kv heads, head_dim], recipe) with every block drawn at its own magnitude."""
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.sampled_from(HEAD_DIMS)))
    lo, hi = EXP_RANGE[dtype]
    a = draw(st.integers(lo, hi))
    b = draw(st.integers(a, min(hi, a + draw(st.sampled_from([0, 4, 30, 200])))))
    recipe = dict(
        seed=draw(st.integers(0, 2**31 - 1)), exps=(a, b),
        p_zero=draw(st.sampled_from([0.0, 0.05, 0.5])), p_negzero=draw(st.sampled_from([0.0, 0.05, 0.5])),
        p_subnormal=draw(st.sampled_from([0.0, 0.1])), p_tie=draw(st.sampled_from([0.0, 0.3, 1.0])),
        p_nonfinite=draw(st.sampled_from([0.05, 0.3])) if nonfinite else 0.0,
        fmt=draw(st.sampled_from(list(FORMATS))))
    return make_values(shape, dtype, **recipe), recipe


def make_values(shape, dtype, seed, exps, p_zero, p_negzero, p_subnormal, p_tie, p_nonfinite, fmt):
    g = torch.Generator().manual_seed(seed)
    t, h, d = shape
    nb = d // BLOCK
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)
    e = torch.randint(exps[0], exps[1] + 1, (t, h, nb, 1), generator=g).double()
    x = torch.randn(t, h, nb, BLOCK, generator=g, dtype=torch.float64) * torch.exp2(e)
    r = rand(x.shape)
    tiny = torch.finfo(dtype).smallest_normal
    sign = torch.where(rand(x.shape) < 0.5, -1.0, 1.0)
    x = torch.where(r < p_subnormal, sign * tiny * rand(x.shape), x)
    x = torch.where(rand(x.shape) < p_zero, 0.0, x)
    x = torch.where(rand(x.shape) < p_negzero, -0.0, x)
    # Tie blocks: amax = M * 2^k makes d = 2^k and 1/d exact, so y = x / 2^k hits the format's exact
    # midpoints (n + 1/2 for q8_0, midpoints of neighbouring codes for e4m3). k keeps every value and the
    # scale representable in the input dtype.
    m = FORMATS[fmt][1]
    k_lo, k_hi = (-100, 20) if dtype == torch.bfloat16 else (-14, 7)
    k = torch.randint(k_lo, k_hi + 1, (t, h, nb, 1), generator=g).double()
    if fmt == "q8_0":
        mid = torch.randint(-126, 127, x.shape, generator=g).double() + 0.5
    else:
        mid = E4M3_MIDPOINTS[torch.randint(0, len(E4M3_MIDPOINTS), x.shape, generator=g)] * sign
    tie = mid * torch.exp2(k)
    at = torch.randint(0, BLOCK, (t, h, nb, 1), generator=g)
    tie.scatter_(-1, at, m * torch.exp2(k) * torch.where(rand(t, h, nb, 1) < 0.5, -1.0, 1.0))
    x = torch.where(rand(t, h, nb, 1) < p_tie, tie, x)
    fmax = torch.finfo(dtype).max
    x = x.clamp(-fmax, fmax)  # finite stays finite in the input dtype; inf/NaN come only from below
    if p_nonfinite:
        bad = torch.tensor([math.inf, -math.inf, math.nan], dtype=torch.float64)
        pick = bad[torch.randint(0, 3, x.shape, generator=g)]
        blocks = rand(t, h, nb, 1) < p_nonfinite
        x = torch.where(blocks & (rand(x.shape) < 0.1), pick, x)
        x = torch.where(blocks & (torch.arange(BLOCK) == at), pick, x)  # at least one per chosen block
    return x.flatten(-2).to(dtype)


def blocks(t):
    return t.unflatten(-1, (-1, BLOCK))


def fp32_d(x, m):
    """``d = amax / M`` in fp32 as the quantizer computes it, as float64, ``[..., nb, 1]``."""
    amax = blocks(x.float()).abs().amax(-1, keepdim=True)
    return (amax / torch.full_like(amax, m)).double()  # a tensor divisor: the IEEE quotient on every device


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


# ----------------------------------------------------------------------------------------- error bound
@fast
@given(cases(nonfinite=True))
def test_error_bound_on_finite_blocks(case):
    x, recipe = case
    dt, m = FORMATS[recipe["fmt"]]
    q, s = reference.quantize(x, dt)
    x64 = blocks(x.double())
    err = (x64 - blocks(reference.dequantize_values(q, s).double())).abs()
    amax = x64.abs().amax(-1, keepdim=True)
    d = fp32_d(x, m)
    s64 = s.double().unsqueeze(-1)
    # y = x * fl(1/d) carries two fp32 roundings, |y - x/d| <= M * 2^-22: the last term covers d * that.
    slack = 2.0 ** -20 * amax
    if dt == torch.int8:
        # Rounding to an integer loses d/2; storing d as fp16 moves each |q| <= 127 by |d - fp16(d)|.
        bound = d / 2 + 127 * (d - s64).abs() + slack
    else:
        # e4m3 rounding loses 2^-4 of |y| (3 mantissa bits), or half a subnormal step 2^-10 below 2^-6; the
        # fp16 scale adds |q| * |d - fp16(d)| with |q| <= 448 (the 1 + 2^-4 because the first term is taken
        # of |x|, not of |q| * fp16(d)). Without this term the bound fails wherever fp16(d) is subnormal
        # (amax < 2^-14 * 448): there fp16 keeps fewer than 11 bits of d.
        bound = 2.0 ** -4 * x64.abs() + 2.0 ** -10 * s64 + 448 * (1 + 2.0 ** -4) * (d - s64).abs() + slack
    finite = blocks(torch.isfinite(x.float())).all(-1, keepdim=True)
    assert torch.isnan(s64[~finite]).all()  # (what such blocks hold is test_non_finite_...)
    scaled = (finite & torch.isfinite(s64)).expand_as(err)
    assert (err <= bound)[scaled].all(), f"worst excess {(err - bound)[scaled].max().item():.3g}"
    # amax / M above fp16's range stores an infinite scale: those blocks dequantize to inf (q != 0) or NaN
    # (q == 0) — never to a wrong finite number.
    over = finite & ~torch.isfinite(s64)
    assert torch.isinf(s64[over]).all() and (d[over] * 1.0005 > FP16_MAX).all()
    assert not torch.isfinite(err[over.expand_as(err)]).any()


# ----------------------------------------------------------------------------------------- idempotence
@fast
@given(cases(nonfinite=True))
def test_quantizing_the_dequantized_block_gives_the_same_bytes(case):
    x, recipe = case
    dt, _ = FORMATS[recipe["fmt"]]
    q, s = reference.quantize(x, dt)
    xr = reference.dequantize_values(q, s)
    # The premise: q * scale is exact in fp32 (an 8-bit code times an 11-bit fp16 value; never subnormal),
    # so the dequantized block is exactly representable. It is NOT representable in bf16/fp16 in general
    # (up to 18 significant bits), which is why the property is stated on the fp32 values.
    assert torch.equal(xr.double(), blocks(q.double()).mul(s.double().unsqueeze(-1)).flatten(-2)) or \
        not torch.isfinite(s).all()
    q2, s2 = reference.quantize(xr, dt)
    # Why it holds: amax' = M * s exactly (some |q| = M), so d' = fl(M * s / M) = s, fp16(d') = s, and
    # y' = q * s * fl(1/s) is within an fp32 ulp of q, which rounds back to q.
    # Where it cannot hold: a nonzero d whose fp16 scale underflows to 0 (amax < about 2^-25 * M: all
    # codes dequantize to 0, so re-quantizing gives zero codes), and an fp16 scale that overflows to inf
    # (dequantizes to inf/NaN, which re-quantizes to the NaN block). Blocks holding inf/NaN are included:
    # they dequantize to NaN and store the same canonical NaN block again.
    qb, sb = blocks(q), s
    lost = ((sb == 0) & (qb != 0).any(-1)) | torch.isinf(sb)
    keep = ~lost
    assert torch.equal(bits(blocks(q2))[keep], bits(qb)[keep])
    assert torch.equal(bits(s2)[keep], bits(sb)[keep])


# ------------------------------------------------------------------------------------------ symmetry
@fast
@given(cases(nonfinite=True))
def test_negating_the_input_negates_the_codes_and_keeps_the_scale(case):
    x, recipe = case
    dt, m = FORMATS[recipe["fmt"]]
    q1, s1 = reference.quantize(x, dt)
    q2, s2 = reference.quantize(-x, dt)
    assert torch.equal(bits(s1), bits(s2))
    finite = blocks(torch.isfinite(x.float())).all(-1, keepdim=True).expand(*s1.shape, BLOCK)
    b1, b2 = blocks(bits(q1)), blocks(bits(q2))
    # Non-finite blocks store zero codes whatever the sign.
    assert (b1[~finite] == 0).all() and (b2[~finite] == 0).all()
    if dt == torch.int8:
        assert torch.equal(b2[finite], -b1[finite])
        return
    # e4m3 keeps the sign of zero (-0 is code 0x80), except in one corner: when fp32 1/d overflows (d
    # subnormal in fp32, amax < about 2^-119; bf16 input only), 0 * inf is NaN and a zero element is stored
    # as +0 whatever its sign. Every other element has its sign bit flipped.
    d32 = fp32_d(x, m).float()
    inv_inf = ((d32 > 0) & torch.isinf(1.0 / d32)).expand_as(b1)  # d == 0 uses 1/d := 0
    zero_there = finite & inv_inf & (blocks(x.float()) == 0)
    assert (b1[zero_there] == 0).all() and (b2[zero_there] == 0).all()
    flip = finite & ~zero_there
    assert torch.equal(b2[flip], b1[flip] ^ 0x80)


# -------------------------------------------------------------------------------------- non-finite
@fast
@given(cases(nonfinite=True))
def test_non_finite_blocks_dequantize_to_nan_and_leave_others_alone(case):
    x, recipe = case
    dt, _ = FORMATS[recipe["fmt"]]
    bad = ~blocks(torch.isfinite(x.float())).all(-1)  # [t, h, nb]
    clean = torch.where(torch.isfinite(x), x, torch.ones((), dtype=x.dtype))
    q, s = reference.quantize(x, dt)
    qc, sc = reference.quantize(clean, dt)
    xr = blocks(reference.dequantize_values(q, s))
    assert torch.isnan(xr[bad]).all()
    assert (bits(s)[bad] == 0x7E00).all()
    assert torch.equal(bits(blocks(q))[~bad], bits(blocks(qc))[~bad])
    assert torch.equal(bits(s)[~bad], bits(sc)[~bad])


@settings(max_examples=max(1, N // 4), deadline=None)
@given(cases(nonfinite=True))
def test_non_finite_key_or_value_reaches_the_attention_output(case):
    # Through the public ops, one sequence whose tokens are the drawn rows. A non-finite block in a kv head's
    # K makes every query head of that group NaN (the scores are NaN); in V it makes exactly that block's 32
    # output columns NaN in the group. Nothing else changes.
    x, recipe = case
    dt, _ = FORMATS[recipe["fmt"]]
    t, hkv, d = x.shape
    # Finite values stay moderate so that a finite logit or a finite weighted sum cannot overflow on its own.
    x = torch.where(torch.isfinite(x), x.float().clamp(-1e3, 1e3), x.float()).to(x.dtype)
    kc, ks = kvq.new_cache(t, 1, hkv, d, dt)
    vc, vs = kvq.new_cache(t, 1, hkv, d, dt)
    side = torch.randn(t, hkv, d).to(x.dtype)
    x_is_key = recipe["seed"] % 2 == 0
    key, value = (x, side) if x_is_key else (side, x)
    kvq.store_kv(key, value, kc, vc, ks, vs, torch.arange(t))
    q = torch.randn(1, hkv * 2, d, dtype=x.dtype)
    out = kvq.decode_attention(q, kc, vc, ks, vs, torch.arange(t, dtype=torch.int32)[None],
                               torch.tensor([t], dtype=torch.int32), sm_scale=1e-3)
    bad = blocks(~torch.isfinite(x.float())).any(-1, keepdim=True).any(0)  # [hkv, nb, 1]
    if x_is_key:
        want_nan = bad.any(-2, keepdim=True).expand(hkv, d // BLOCK, BLOCK)
    else:
        want_nan = bad.expand(hkv, d // BLOCK, BLOCK)
    want_nan = want_nan.reshape(hkv, 1, d).expand(hkv, 2, d)
    heads = out.float().view(hkv, 2, d)
    assert torch.isnan(heads[want_nan]).all()
    assert torch.isfinite(heads[~want_nan]).all()


# -------------------------------------------------------------------------------- backends agree
# Few examples: the interpreter is slow, and on a GPU each new shape compiles the kernels again.
@runs_triton
@settings(max_examples=max(1, N // 10), deadline=None)
@given(cases(nonfinite=True), st.sampled_from(["q8_0", "fp8_e4m3", "bf16"]), st.sampled_from([1, 3, 16]),
       st.integers(0, 2**31 - 1))
def test_triton_store_writes_the_reference_bytes(case, fmt, page_size, seed):
    x, recipe = case
    ops = backend_ops("triton")
    device = TRITON_DEVICE
    t, hkv, d = x.shape
    dt = FORMATS[fmt][0] if fmt in FORMATS else x.dtype
    g = torch.Generator().manual_seed(seed)
    if INTERPRET and x.dtype == torch.bfloat16:
        # Triton's interpreter converts bf16 subnormals to fp32 wrongly (its bf16 -> fp32 path loses them);
        # compiled kernels do not, so on a GPU they stay in.
        x = torch.where(x.abs() < torch.finfo(x.dtype).smallest_normal, torch.zeros_like(x), x)
    value = x.flip(0)  # other values, same special cases
    pages = -(-2 * t // page_size) + 1
    slots = torch.randperm(pages * page_size, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.2] = -1
    key, value, slots = x.to(device), value.to(device), slots.to(device)
    planes = []
    for _ in range(2):
        kc, ks = kvq.new_cache(pages, page_size, hkv, d, dt, device)
        vc, vs = kvq.new_cache(pages, page_size, hkv, d, dt, device)
        for p in (kc, vc, ks, vs):
            if p is not None:
                poison_(p)
        planes.append([kc, vc, ks, vs])
    reference.store_kv(key, value, *planes[0], slots)
    ops.store_kv(key, value, *planes[1], slots)
    for want, got in zip(planes[0], planes[1]):
        if want is not None:
            assert torch.equal(bits(got), bits(want))
    # And the gather back agrees too (NaN where the reference has NaN).
    kc, _, ks, _ = planes[0]
    written = slots[slots >= 0]
    got = ops.dequantize(kc, ks, written, x.dtype)
    want = reference.dequantize(kc, ks, written, x.dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
