"""CUDA-specific tests of the compiled kernels (kvq._C) against the reference, on a GPU.

Parity of the ops over every backend lives in test_store.py / test_attention.py; here: rounding ties and
non-finite blocks on the GPU, slots and pages out of range with the index checks off, decode edge cases
(GQA groups, windows, softcap, empty sequences, NaN propagation) and CUDA-graph capture.
"""

import math

import pytest
import torch

import kvq
from kvq import reference

from common import FLOOR, attend, backend_ops, decode_truth, poison_, random_paged, rel_err

pytestmark = pytest.mark.gpu
QUANT = {"q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


@pytest.fixture
def ops():
    return backend_ops("cuda")


@pytest.fixture(params=["cuda", "cuda-fma", "cuda-warp", "cuda-columns", "cuda-rows"])
def decode_ops(request):
    """The CUDA ops with either decode kernel (tensor cores, FMA), and the tensor-core kernel with one kv head
    per warp (CTAs of fewer warps where the kv heads do not divide into its warps: two at 2 kv heads), with
    the warps of a CTA dividing head_dim (at head_dim 256, every cache format) or with two or three kv heads per
    warp (8-bit caches at head_dim 64)."""
    return backend_ops(request.param)


def _bytes(t):
    return t.view(torch.uint8) if t.dtype != torch.float16 else t.view(torch.int16)


def _store(fn, key, value, cache_dt, pages, page_size, slots, dev):
    """A fresh poisoned cache on ``dev``, stored into by ``fn``; returns (k, v, k_scale, v_scale) on CPU."""
    t, hkv, d = key.shape
    kc, ks = kvq.new_cache(pages, page_size, hkv, d, cache_dt, dev)
    vc, vs = kvq.new_cache(pages, page_size, hkv, d, cache_dt, dev)
    for x in (kc, vc, ks, vs):
        if x is not None:
            poison_(x)
    fn(key.to(dev), value.to(dev), kc, vc, ks, vs, slots.to(dev))
    return tuple(None if x is None else x.cpu() for x in (kc, vc, ks, vs))


def _store_both(ops, key, value, cache_dt, pages, page_size, slots):
    """Store with the CUDA op and with the reference (on CPU)."""
    return (_store(ops.store_kv, key, value, cache_dt, pages, page_size, slots, "cuda"),
            _store(reference.store_kv, key, value, cache_dt, pages, page_size, slots, "cpu"))


def _assert_same_bytes(got, want):
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert torch.equal(_bytes(g), _bytes(w))


def _special_rows(t, hkv, d, dtype):
    """Rows whose scaled values land on rounding ties of q8_0 (x.5) and of e4m3 (midpoints), and blocks
    holding zeros, inf, NaN, tiny values and values whose scale is near the smallest normal float."""
    x = torch.randn(t, hkv, d) * 3
    blocks = x.view(t, hkv, d // 32, 32)
    ties = torch.arange(-15, 16, dtype=torch.float32) + 0.5  # q8_0 ties when d == 1 (amax 127)
    blocks[0, 0, 0, :31] = ties
    blocks[0, 0, 0, 31] = 127.0
    mids = torch.tensor([17.0, 19.0, 9.0, 13.0, 0.5 * (0.015625 + 0.017578125), 104.0, 232.0, 240.0])
    blocks[1 % t, 0, 0, :8] = mids  # e4m3 ties when d == 1 (amax 448)
    blocks[1 % t, 0, 0, 8:] = 0.0
    blocks[1 % t, 0, 0, 31] = 448.0
    blocks[2 % t, 0, -1] = 0.0
    blocks[3 % t, -1, 0, 5] = math.inf
    blocks[4 % t, -1, -1, 7] = math.nan
    blocks[5 % t, 0, 0] = torch.randn(32) * 1e-38
    # Scales near the smallest normal float, where the kernel switches between its two quantizers.
    blocks[6 % t, 1 % hkv, 0] = torch.randn(32) * 1e-35
    blocks[7 % t, 1 % hkv, -1] = torch.randn(32) * 1e-36
    return x.to(dtype)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "same"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,page_size", [(64, 1), (128, 16), (256, 7)])
def test_store_bytes_match_reference_including_ties(ops, fmt, dtype, d, page_size):
    cache_dt = QUANT.get(fmt, dtype)
    t, hkv = 24, 3
    pages = -(-t // page_size) + 2  # room for every token, and some unused slots that must keep their poison
    key = _special_rows(t, hkv, d, dtype)
    value = (torch.randn(t, hkv, d) * 50).to(dtype)
    slots = torch.randperm(pages * page_size)[:t]
    slots[3] = -1
    got, want = _store_both(ops, key.cuda(), value.cuda(), cache_dt, pages, page_size, slots)
    _assert_same_bytes(got, want)


@pytest.mark.parametrize("cache_dt", [torch.int8, torch.bfloat16])
def test_store_accepts_strided_rows_from_a_fused_qkv(ops, cache_dt):
    t, hq, hkv, d = 10, 8, 2, 128
    qkv = torch.randn(t, hq + 2 * hkv, d, dtype=torch.bfloat16, device="cuda")
    key, value = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    slots = torch.randperm(4 * 16)[:t]
    got, want = _store_both(ops, key, value, cache_dt, 4, 16, slots)
    _assert_same_bytes(got, want)


@pytest.mark.parametrize("fmt", ["q8_0", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
def test_store_skips_out_of_range_slots_with_checks_off(ops, fmt, d):
    cache_dt = QUANT.get(fmt, torch.bfloat16)
    t, hkv, pages, page_size = 12, 2, 3, 4
    key = torch.randn(t, hkv, d, dtype=torch.bfloat16)
    value = torch.randn(t, hkv, d, dtype=torch.bfloat16)
    slots = torch.randperm(pages * page_size)[:t]
    bad = slots.clone()
    bad[[1, 4, 7]] = torch.tensor([pages * page_size, 10 ** 9, -5])
    good = slots.clone()
    good[[1, 4, 7]] = -1
    kvq.set_index_checks(False)
    try:
        got = _store(ops.store_kv, key, value, cache_dt, pages, page_size, bad, "cuda")
    finally:
        kvq.set_index_checks(True)
    want = _store(reference.store_kv, key, value, cache_dt, pages, page_size, good, "cpu")
    _assert_same_bytes(got, want)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_dequantize_matches_reference_bit_for_bit(ops, fmt, out_dtype):
    cache_dt = QUANT.get(fmt, torch.bfloat16)
    p = random_paged([37, 5], 8, 2, 128, cache_dt, device="cuda")
    slots = torch.tensor([0, 3, -1, 17, 40, 5], device="cuda")
    got = ops.dequantize(p.k_cache, p.k_scale, slots, out_dtype)
    want = reference.dequantize(p.k_cache, p.k_scale, slots, out_dtype)
    assert torch.equal(_bytes(got), _bytes(want))


def _decode_and_reference(ops, p, q, sm, window_left=-1, softcap=0.0):
    """The op's decode of ``q`` over the paged cache ``p`` into a poisoned output, and the reference's in fp32."""
    out = poison_(torch.empty_like(q))
    ops.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens, sm,
                         window_left, softcap, out)
    ref = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    reference.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens, sm,
                               window_left, softcap, ref)
    return out, ref


def _decode_case(ops, fmt, dtype, lens, hq, hkv, d, page_size, window_left=-1, softcap=0.0, q_exp=0):
    cache_dt = QUANT.get(fmt, dtype)
    p = random_paged(lens, page_size, hkv, d, cache_dt, model_dtype=dtype, device="cuda")
    q = (torch.randn(len(lens), hq, d, device="cuda") * 2.0 ** q_exp).to(dtype)
    return _decode_and_reference(ops, p, q, 1 / math.sqrt(d) * 2.0 ** -q_exp, window_left, softcap)


def _assert_close(out, ref, lens):
    # fp32 math either way; the output rounding to bf16/fp16 dominates. Allow 2x that rounding error.
    floor = rel_err(ref.to(out.dtype), ref)
    assert rel_err(out, ref) <= 2 * floor + 1e-5, (rel_err(out, ref), floor)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "same"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 6, 16])
def test_decode_matches_reference(decode_ops, fmt, d, group):
    lens = [1, 77, 1000, 0, 4100]
    out, ref = _decode_case(decode_ops, fmt, torch.bfloat16, lens, 2 * group, 2, d, 16)
    _assert_close(out, ref, lens)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (3, 3), (24, 6), (8, 8)])
@pytest.mark.parametrize("page_size", [1, 5, 16, 48])
def test_decode_kv_heads_per_warp(fmt, hq, hkv, page_size):
    """Two or three adjacent kv heads per warp (8-bit, head_dim 64: three at 9/3 and 3/3 heads, two at 24/6 and 8/8):
    each kv head's queries read their own columns and scales of the rows the warp copies, in tiles inside a page and
    across pages, with a window whose tiles start mid-page and a soft-cap."""
    ops = backend_ops("cuda-rows")
    lens = [1, 33, 700, 0, 3000]
    dtype = torch.float16 if page_size == 5 else torch.bfloat16
    for window_left, softcap in ((-1, 0.0), (300, 20.0)):
        out, ref = _decode_case(ops, fmt, dtype, lens, hq, hkv, 64, page_size, window_left, softcap)
        _assert_close(out, ref, lens)


@pytest.mark.parametrize("page_size", [1, 3, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_page_sizes_and_dtypes(decode_ops, page_size, dtype):
    lens = [513, 2, 3000]
    out, ref = _decode_case(decode_ops, "fp8_e4m3", dtype, lens, 8, 2, 128, page_size)
    _assert_close(out, ref, lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_short_contexts_of_unquantized_caches(dtype):
    """bf16/fp16 caches at head_dim 128 with few sequences of 2k-4k tokens, where the plan sizes the splits for one
    CTA per SM (32/8 heads: decode.cu's plan_tc_splits) or keeps two because one would leave SMs idle (42/7 heads,
    on an H200's 132 SMs)."""
    ops = backend_ops("cuda")
    for hq, hkv, lens in ((32, 8, [4096]), (32, 8, [3001, 2048]), (42, 7, [3072]), (42, 7, [1, 2999, 0])):
        out, ref = _decode_case(ops, "same", dtype, lens, hq, hkv, 128, 16)
        _assert_close(out, ref, lens)


@pytest.mark.parametrize("splits", [2, 4, 5, 16, 17, 64, 65, 256])
@pytest.mark.parametrize("fmt,hq,hkv,d,batch", [("q8_0", 8, 2, 128, 3), ("same", 8, 2, 256, 40),
                                                ("fp8_e4m3", 8, 2, 256, 3), ("q8_0", 9, 3, 64, 5)])
def test_decode_every_merge(fmt, hq, hkv, d, batch, splits):
    """Every merge of the splits, reached by pinning the split count (launch_decode_merge picks by parts and grid):
    a warp per query head (2-4 parts, and 5-16 where the one-pass kernel's grid exceeds a wave, as at batch 40 with
    8 query heads at head_dim 256 on an H200), the one-pass kernel (5-16 parts on small grids, and 17-64 over 32
    columns per CTA where those CTAs fit one per SM, as at batch 3 and 5 here), the two-pass kernel with 16, 32 or
    17 early loads (17 parts and up; from 65, by how many CTAs the grid holds), over sequences shorter than the split
    count (empty splits), one token and none."""
    from kvq.backends import pinned_cuda_kernel

    ops = backend_ops("cuda")  # skips where kvq._C is not the active backend, before the pin needs it
    lens = [0, 1, 3, 300, 2049][:batch] + torch.randint(0, 3000, (max(0, batch - 5),)).tolist()
    with pinned_cuda_kernel("set_decode_splits", str(splits)):
        out, ref = _decode_case(ops, fmt, torch.bfloat16, lens, hq, hkv, d, 16)
    _assert_close(out, ref, lens)


@pytest.mark.parametrize("window_left,softcap", [(0, 0.0), (100, 0.0), (-1, 30.0), (700, 5.0)])
def test_decode_window_and_softcap(decode_ops, window_left, softcap):
    lens = [1, 90, 2500]
    out, ref = _decode_case(decode_ops, "q8_0", torch.bfloat16, lens, 8, 2, 128, 16, window_left, softcap)
    _assert_close(out, ref, lens)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
@pytest.mark.parametrize("q_exp", [-40, -12, 12, 60])
def test_decode_query_magnitudes(decode_ops, fmt, q_exp):
    """bf16 queries far outside fp16's range: the tensor-core kernel multiplies each query row by a power of
    two before its fp16 products with the raw 8-bit keys; the result must match the reference as at unit scale."""
    lens = [300, 1000]
    out, ref = _decode_case(decode_ops, fmt, torch.bfloat16, lens, 8, 2, 128, 16, q_exp=q_exp)
    _assert_close(out, ref, lens)


def test_decode_propagates_non_finite_blocks(decode_ops):
    hkv, d = 2, 128
    p = random_paged([50, 60], 16, hkv, d, torch.int8, device="cuda")
    bad = torch.randn(1, hkv, d, dtype=torch.bfloat16, device="cuda")
    bad[0, 1, 3] = math.nan
    slot = p.block_table[0, 1].long() * 16 + 4  # token 20 of sequence 0
    decode_ops.store_kv(bad, bad, p.k_cache, p.v_cache, p.k_scale, p.v_scale, slot.view(1))
    q = torch.randn(2, 8, d, dtype=torch.bfloat16, device="cuda")
    out = poison_(torch.empty_like(q))
    decode_ops.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens, 0.1, -1, 0.0, out)
    assert torch.isnan(out[0, 4:]).all()  # the query heads of kv head 1 read the NaN block
    assert torch.isfinite(out[0, :4]).all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
def test_decode_infinite_value_scales_match_the_reference(decode_ops, fmt):
    """A finite block whose amax / M overflows fp16 stores an infinite scale, and its values dequantize to
    q * inf: +-inf, or NaN where q == 0. Which output columns are NaN, +inf or -inf must be exactly the
    reference's (a kernel that folded the scale into another product, or flushed it, would differ), and the
    rest as close as at any scale."""
    hkv, d = 2, 128
    p = random_paged([70, 300], 16, hkv, d, QUANT[fmt], device="cuda")
    for b, token, head, blk in ((0, 20, 1, 2), (0, 21, 1, 2), (1, 5, 0, 0), (1, 290, 1, 3)):
        row = torch.randn(1, hkv, d, dtype=torch.bfloat16, device="cuda")
        row[0, head, 32 * blk:32 * blk + 32] *= 1e8  # amax / 127 (or / 448) > 65504: the fp16 scale is inf
        row[0, head, 32 * blk + 1] = 0.0  # a zero code: 0 * inf is NaN
        slot = p.block_table[b, token // 16].long() * 16 + token % 16
        key = torch.randn(1, hkv, d, dtype=torch.bfloat16, device="cuda")
        decode_ops.store_kv(key, row, p.k_cache, p.v_cache, p.k_scale, p.v_scale, slot.view(1))
    assert torch.isinf(p.v_scale.float()).sum() == 4 and not torch.isinf(p.k_scale.float()).any()
    q = torch.randn(2, 8, d, dtype=torch.bfloat16, device="cuda")
    out, ref = _decode_and_reference(decode_ops, p, q, d ** -0.5)
    o = out.float()
    assert torch.isnan(ref).any() and torch.isposinf(ref).any() and torch.isneginf(ref).any()
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(o), test(ref)), test.__name__
    finite = torch.isfinite(ref)
    assert rel_err(o[finite], ref[finite]) <= 2 * rel_err(ref[finite].to(out.dtype), ref[finite]) + 1e-5


@pytest.mark.parametrize("group", [4, 16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
def test_decode_values_above_fp16_match_the_reference(decode_ops, fmt, d, group):
    """bf16 values far above fp16's range, with finite scales: the tensor-core kernel dequantizes values to fp16
    only in tiles whose value scales keep every product below 65504, and to bf16 in the others. Some tokens of kv
    head 1 hold such values (scales of 2^9 and more for q8_0, 2^7 for e4m3) among ordinary ones in their tiles;
    kv head 0 holds none. Head 0's outputs must match the reference as closely as at unit scale. Head 1's tiles with
    large values run P V on bf16 operands, whose error a few dominant tokens decide: twice that of a same-precision
    attention (the bound of the other decode tests) held on most draws and failed on some (2.2x), as two draws of
    the same roundings can. Its outputs are held instead to the worst case of those roundings (_bf16_pv_bound)."""
    hkv, lens = 2, [300, 1000]
    p = random_paged(lens, 16, hkv, d, QUANT[fmt], device="cuda")
    slots = torch.stack([p.block_table[b, t // 16].long() * 16 + t % 16
                         for b, t in ((0, 20), (0, 299), (1, 5), (1, 6), (1, 500), (1, 999))])
    value = torch.randn(len(slots), hkv, d, dtype=torch.bfloat16, device="cuda")
    value[:, 1] *= 1e5
    key = torch.randn(len(slots), hkv, d, dtype=torch.bfloat16, device="cuda")
    decode_ops.store_kv(key, value, p.k_cache, p.v_cache, p.k_scale, p.v_scale, slots)
    big = p.v_scale.view(-1, hkv, d // 32)[slots, 1].float()
    assert (big >= {"q8_0": 512, "fp8_e4m3": 128}[fmt]).all() and torch.isfinite(big).all()
    q = torch.randn(2, hkv * group, d, dtype=torch.bfloat16, device="cuda")
    out, ref = _decode_and_reference(decode_ops, p, q, d ** -0.5)
    # The large values reach kv head 1's outputs: weighted by probabilities of about 1/300-1/1000, they put its
    # largest output in the hundreds (unit-scale values give about 1; 1e3, the bound before, failed on some draws).
    assert ref[:, group:].abs().max() > 1e2
    assert torch.isfinite(out).all()
    o, r = out[:, :group], ref[:, :group]
    assert rel_err(o, r) <= 2 * rel_err(r.to(o.dtype), r) + 1e-5, rel_err(o, r)
    truth, _ = decode_truth(q, p, d ** -0.5, -1, 0.0)
    err = (out[:, group:].double() - truth[:, group:]).abs()
    bound = _bf16_pv_bound(q, p, d ** -0.5, truth)[:, group:]
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"kv head 1 {fmt} d{d}: an error {worst:.2f} times its bound (max abs error {err.max():.3e})"


def _bf16_pv_bound(q, p, sm_scale, truth):
    """Per output element of a decode over ``p``, the first-order worst case of an attention whose only roundings are
    P and V to bf16 (unit roundoff u = 2^-8) and the output to bf16: P's move the weighted sum and the softmax sum,
    u (sum_i p_i |v_i| + |o|); V's u sum_i p_i |v_i|; the output's u |o|; in all 2^-7 (sum_i p_i |v_i| + |o|), a
    quarter more for the fp32 sums and exponentials (far below that), plus the floor of every test. The scores
    carry no rounding there: the query reaches the tensor cores exactly in fp16 and the key scales are applied to
    fp32 dot products of exact codes. A wrong scale, token or tile moves an output by about p_i |v_i|, which for
    the large values is a good part of the sum."""
    weighted = torch.zeros_like(truth)
    for b, n in enumerate(p.seq_lens.tolist()):
        k = reference.gather_sequence(p.k_cache, p.k_scale, p.block_table[b], n)
        v = reference.gather_sequence(p.v_cache, p.v_scale, p.block_table[b], n)
        pos = torch.arange(n, device=q.device)
        weighted[b] = attend(q[b:b + 1], k, v.abs(), pos[-1:], pos, sm_scale, True, -1, 0.0)[0]
    return 1.25 * 2.0 ** -7 * (weighted + truth.abs()) + FLOOR


@pytest.mark.parametrize("sm_scale,softcap", [(math.inf, 0.0), (math.nan, 0.0), (0.1, math.inf)])
def test_direct_op_call_refuses_non_finite_scalars(ops, sm_scale, softcap):
    """A direct torch.ops.kvq call on CUDA tensors refuses non-finite scalars (the C++ adapter checks them too)."""
    p = random_paged([40], 16, 2, 64, torch.int8, device="cuda")
    q = torch.randn(1, 4, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="sm_scale|logit_softcap"):
        ops.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens,
                             sm_scale, -1, softcap, torch.empty_like(q))


def test_decode_guards_pages_out_of_range_with_checks_off(decode_ops):
    p = random_paged([40, 40], 16, 2, 64, torch.int8, device="cuda")
    table = p.block_table.clone()
    table[0, 1] = 10 ** 6
    table[1, 0] = -3
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16, device="cuda")
    out = poison_(torch.empty_like(q))
    kvq.set_index_checks(False)
    try:
        decode_ops.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, table, p.seq_lens, 0.1, -1, 0.0, out)
    finally:
        kvq.set_index_checks(True)
    # The tokens of a bad page are skipped and the rest attended: the same as a table without those pages
    # (attention does not depend on the keys' order). Sequence 0 keeps pages 0 and 2 (16 + 8 tokens), sequence 1
    # pages 1 and 2 (16 + 8).
    kept = torch.stack([p.block_table[0, [0, 2]], p.block_table[1, [1, 2]]])
    lens = torch.tensor([24, 24], dtype=torch.int32, device="cuda")
    ref = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    reference.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, kept, lens, 0.1, -1, 0.0, ref)
    _assert_close(out, ref, [24, 24])


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "same"])
def test_cuda_graph_replay_equals_eager(decode_ops, fmt):
    dtype, hq, hkv, d, page_size = torch.bfloat16, 8, 2, 128, 16
    cache_dt = QUANT.get(fmt, dtype)
    p = random_paged([300, 1200], page_size, hkv, d, cache_dt, device="cuda")
    key = torch.randn(2, hkv, d, dtype=dtype, device="cuda")
    value = torch.randn_like(key)
    q = torch.randn(2, hq, d, dtype=dtype, device="cuda")
    lens = p.seq_lens.clone()
    lens += 1
    slots = torch.stack([p.block_table[b, (lens[b] - 1) // page_size].long() * page_size + (lens[b] - 1) % page_size
                         for b in range(2)])
    out = torch.empty_like(q)
    caches = (p.k_cache, p.v_cache, p.k_scale, p.v_scale)
    snapshot = [None if c is None else c.clone() for c in caches]

    def step():
        decode_ops.store_kv(key, value, *caches, slots)
        decode_ops.decode_attention(q, *caches, p.block_table, lens, 0.1, -1, 0.0, out)

    step()  # warm up (and compile nothing lazily inside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        key.normal_()
        value.normal_()
        q.normal_()
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        got = [out.clone()] + [None if c is None else c.clone() for c in caches]
        assert not torch.isnan(got[0]).any()  # the replay wrote every element
        for c, s in zip(caches, snapshot):  # eager from the same starting cache
            if c is not None:
                c.copy_(s)
        poison_(out)
        step()
        torch.cuda.synchronize()
        want = [out] + list(caches)
        for g, w in zip(got, want):
            if w is not None:
                assert torch.equal(_bytes(g), _bytes(w))
        for c, s in zip(caches, snapshot):
            if c is not None:
                c.copy_(s)


def test_direct_op_calls_refuse_bad_metadata(ops):
    """torch.ops.kvq on CUDA tensors reaches the C++ adapters directly: they refuse, with a ValueError that names
    the problem, what would otherwise reach a kernel (overlapping pages or outputs, no query heads, tokens
    without a sequence, positions past the kernels' 32-bit arithmetic, one plane passed as both K and V)."""
    p = random_paged([40], 16, 2, 64, torch.int8, device="cuda")
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16, device="cuda")
    table, lens = p.block_table.expand(2, -1), p.seq_lens.expand(2)
    caches = (p.k_cache, p.v_cache, p.k_scale, p.v_scale)

    # Pages that overlap (a page stride of half a page): a store would overwrite other tokens.
    half = p.k_cache.as_strided(p.k_cache.shape, (p.k_cache.stride(0) // 2,) + p.k_cache.stride()[1:])
    key = torch.randn(3, 2, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="k_cache has a page stride of 1024 elements, less than a page"):
        ops.store_kv(key, key, half, p.v_cache, p.k_scale, p.v_scale, torch.arange(3, device="cuda"))

    # One plane passed as both K and V: the values would overwrite the keys.
    slots = torch.arange(3, device="cuda")
    with pytest.raises(ValueError, match="k_cache and v_cache are the same memory"):
        ops.store_kv(key, key, p.k_cache, p.k_cache, p.k_scale, p.v_scale, slots)
    with pytest.raises(ValueError, match="k_scale and v_scale are the same memory"):
        ops.store_kv(key, key, p.k_cache, p.v_cache, p.k_scale, p.k_scale, slots)

    # An output whose rows share memory.
    shared = torch.empty(1, 4, 64, dtype=torch.bfloat16, device="cuda").expand(2, 4, 64)
    with pytest.raises(ValueError, match="out has elements that share memory"):
        ops.decode_attention(q, *caches, table, lens, 0.1, -1, 0.0, shared)

    # A query with no heads.
    q0 = torch.empty(2, 0, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="query has 0 heads"):
        ops.decode_attention(q0, *caches, table, lens, 0.1, -1, 0.0, torch.empty_like(q0))

    # Extend: tokens but no sequence (cu_seqlens_q of one entry).
    qx = torch.randn(5, 4, 64, dtype=torch.bfloat16, device="cuda")
    kx = torch.randn(5, 2, 64, dtype=torch.bfloat16, device="cuda")
    none = torch.zeros(0, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cu_seqlens_q describes no sequence"):
        ops.extend_attention(qx, kx, kx, *caches, table[:0], none, torch.zeros(1, dtype=torch.int32,
                             device="cuda"), 0.1, True, -1, 0.0, torch.empty_like(qx))

    # A block table addressing more than 2^30 positions (max_pages x page_size).
    wide = torch.zeros(2, (1 << 30) // 16 + 1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="block_table addresses 1073741840 tokens"):
        ops.decode_attention(q, *caches, wide, lens, 0.1, -1, 0.0, torch.empty_like(q))

    # Messages name dequantize's own arguments and dtypes as Python spells them; scalars print in %g.
    with pytest.raises(ValueError, match="kvq.dequantize: scale has shape"):
        ops.dequantize(p.k_cache, p.k_scale[:, :8], torch.arange(3, device="cuda"), torch.bfloat16)
    f32 = torch.zeros(4, 16, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="cache has dtype torch.float32; expected torch.int8 or"):
        ops.dequantize(f32, None, torch.arange(3, device="cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="sm_scale must be positive and finite, got -1e-09"):
        ops.decode_attention(q, *caches, table, lens, -1e-9, -1, 0.0, torch.empty_like(q))


def test_decode_refuses_pages_of_2_gib(ops):
    """The decode kernels address a row inside its page in 32 bits: a page of 2 GiB or more (one page per long
    sequence) is refused before any kernel runs."""
    pages, page_size, hkv, d = 1, 131072, 64, 256  # 131072 x 64 x 256 int8 = 2^31 bytes
    cache = torch.empty(pages, page_size, hkv, d, dtype=torch.int8, device="cuda")
    scale = torch.empty(pages, page_size, hkv, d // 32, dtype=torch.float16, device="cuda")
    q = torch.randn(1, hkv, d, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    lens = torch.tensor([5], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="a page of k_cache holds 2147483648 bytes"):
        ops.decode_attention(q, cache, cache, scale, scale, table, lens, 0.1, -1, 0.0, torch.empty_like(q))
