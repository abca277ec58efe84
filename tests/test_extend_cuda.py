"""Parity of the CUDA extend (prefill) kernel with the reference.

The truth is float64 attention over the dequantized prefix and the exact new K/V. The tolerance is tied to
what the same math in the query dtype achieves (flash-attention's rule): a PyTorch baseline that casts q and
the dequantized K/V to the query dtype, computes scores and softmax in fp32 and casts P to the query dtype
before P @ V. Every sequence of a batch must satisfy err(kernel) <= 2 * err(baseline) + half an ulp of the
output dtype, so one wrong short sequence cannot hide behind long ones. Outputs are poisoned with NaN first.
"""

import math
from dataclasses import replace

import pytest
import torch

import kvq
from kvq import backends, reference

from common import attend, cache_dtype, eager_then_replayed, poison_, random_paged, rel_err

pytestmark = pytest.mark.gpu

DEV = "cuda"
# (prefix, new) per sequence: new-token counts around the 64-row tile and 64-key block edges, prefixes
# 0 and nonzero (ending inside and on page boundaries).
RAGGED = [(0, 1), (17, 2), (64, 31), (0, 32), (5, 33), (100, 63), (1, 64), (300, 65), (33, 130), (0, 0), (40, 3)]


@pytest.fixture(autouse=True, params=["auto", "wide", "deep", "tall", "small", "wide/3", "deep/2", "tall/4", "small/2"])
def _cuda_active(request):
    """Every test runs with the CTA shape and key splits picked by the rule, held to each of the four shapes, and
    with each shape's keys split over 2 to 4 CTAs and merged (the rule splits only long prefixes)."""
    if backends.selection().active != "cuda":
        pytest.skip(f"the cuda backend is not active: {backends.selection().reasons.get('cuda')}")
    shape, _, splits = request.param.partition("/")
    with backends.pinned_cuda_kernel("set_extend_shape", shape), \
            backends.pinned_cuda_kernel("set_extend_splits", splits or "auto"):
        yield


def make_case(seqs, hq, hkv, d, fmt, dtype, page_size, scale=1.0):
    prefix = [p for p, _ in seqs]
    new = [n for _, n in seqs]
    paged = random_paged(prefix, page_size, hkv, d, cache_dtype(fmt, dtype), model_dtype=dtype, device=DEV)
    total = sum(new)
    q = (torch.randn(total, hq, d, device=DEV) * scale).to(dtype)
    k = torch.randn(total, hkv, d, device=DEV).to(dtype)
    v = torch.randn(total, hkv, d, device=DEV).to(dtype)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    prefix_t = torch.tensor(prefix, dtype=torch.int32, device=DEV)
    return paged, q, k, v, cu, prefix_t


def check_against_truth(out, paged, q, k, v, cu, prefix_t, sm_scale, causal, window_left, softcap, nan_ok=False):
    """``nan_ok``: the cache holds non-finite values; the output must be NaN exactly where the truth is, and the
    rest is compared."""
    dtype = q.dtype
    floor = 0.5 * torch.finfo(dtype).eps
    if not nan_ok:
        assert not out.isnan().any(), "the kernel left NaN (unwritten or wrong) elements"
    worst = []
    for b in range(prefix_t.shape[0]):
        s, e, p = int(cu[b]), int(cu[b + 1]), int(prefix_t[b])
        if e == s:
            continue
        kp = reference.gather_sequence(paged.k_cache, paged.k_scale, paged.block_table[b], p)
        vp = reference.gather_sequence(paged.v_cache, paged.v_scale, paged.block_table[b], p)
        kk, vv = torch.cat([kp, k[s:e].float()]), torch.cat([vp, v[s:e].float()])
        k_pos = torch.arange(p + e - s, device=DEV)
        q_pos = k_pos[p:]
        args = (q[s:e], kk, vv, q_pos, k_pos, sm_scale, causal, window_left, softcap)
        truth = attend(*args)
        base = attend(*args, dtype=dtype)
        o = out[s:e]
        if nan_ok:
            assert torch.equal(o.isnan(), truth.isnan()), f"sequence {b}: NaN elements differ from the truth's"
            finite = truth.isfinite()
            o, truth, base = o[finite], truth[finite], base[finite]
        err, err_base = rel_err(o, truth), rel_err(base, truth)
        worst.append((err - 2 * err_base, b, err, err_base))
        assert err <= 2 * err_base + floor, (
            f"sequence {b} (prefix {p}, {e - s} new): kernel error {err:.3e} > 2 x baseline {err_base:.3e} + {floor:.1e}")
    return max(worst)


def run_case(seqs, hq=8, hkv=2, d=128, fmt="q8_0", dtype=torch.bfloat16, page_size=16, causal=True,
             window_left=-1, softcap=0.0, scale=1.0):
    paged, q, k, v, cu, prefix_t = make_case(seqs, hq, hkv, d, fmt, dtype, page_size, scale)
    sm_scale = 1.0 / math.sqrt(d)
    out = poison_(torch.empty_like(q))
    torch.ops.kvq.extend_attention(q, k, v, paged.k_cache, paged.v_cache, paged.k_scale, paged.v_scale,
                                   paged.block_table, prefix_t, cu, sm_scale, causal, window_left, softcap, out)
    return check_against_truth(out, paged, q, k, v, cu, prefix_t, sm_scale, causal, window_left, softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("fmt", ["same", "q8_0", "fp8_e4m3"])
def test_formats_head_dims(fmt, d, dtype):
    run_case(RAGGED, hq=8, hkv=2, d=d, fmt="bf16" if fmt == "same" else fmt, dtype=dtype)


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("fmt", ["bf16", "q8_0"])
def test_gqa_and_page_sizes(fmt, group, page_size):
    run_case(RAGGED, hq=2 * group, hkv=2, d=64, fmt=fmt, page_size=page_size)


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "fp8_e4m3"])
@pytest.mark.parametrize("causal,window_left,softcap", [
    (False, -1, 0.0), (True, 0, 0.0), (True, 20, 0.0), (True, 100, 0.0), (False, 50, 0.0),
    (True, -1, 30.0), (False, 37, 5.0)])
def test_masks_and_softcap(fmt, causal, window_left, softcap):
    run_case(RAGGED, hq=4, hkv=1, d=128, fmt=fmt, causal=causal, window_left=window_left, softcap=softcap,
             scale=4.0 if softcap else 1.0)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
@pytest.mark.parametrize("page_size,window_left", [(1, -1), (256, -1), (16, 40)])
def test_head_dim_256_pages_and_window(fmt, page_size, window_left):
    """The deep CTA at head_dim 256 loads 8-bit rows into registers rather than through the staging area of the
    other shapes: its row lookups across page sizes, and the tiles a window skips."""
    run_case(RAGGED, hq=4, hkv=2, d=256, fmt=fmt, page_size=page_size, window_left=window_left)


@pytest.mark.parametrize("fmt,group", [("q8_0", 16), ("fp8_e4m3", 4), ("fp16", 1)])
def test_long(fmt, group):
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    run_case([(2000, 700), (0, 1500), (777, 1)], hq=2 * group, hkv=2, d=128, fmt=fmt, dtype=dtype, page_size=32)
    run_case([(1500, 300)], hq=2 * group, hkv=2, d=128, fmt=fmt, dtype=dtype, page_size=16, window_left=256)


def test_strided_inputs_and_output():
    seqs = [(40, 70), (0, 5), (129, 64)]
    hq, hkv, d = 8, 2, 128
    paged, q, k, v, cu, prefix_t = make_case(seqs, hq, hkv, d, "q8_0", torch.bfloat16, 16)
    qkv = torch.randn(q.shape[0], hq + 2 * hkv, d, device=DEV, dtype=torch.bfloat16)  # a fused projection
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    big = poison_(torch.empty(q.shape[0], hq + 3, d, device=DEV, dtype=torch.bfloat16))
    out = big[:, 1:hq + 1]
    torch.ops.kvq.extend_attention(q, k, v, paged.k_cache, paged.v_cache, paged.k_scale, paged.v_scale,
                                   paged.block_table, prefix_t, cu, 0.1, True, -1, 0.0, out)
    check_against_truth(out, paged, q, k, v, cu, prefix_t, 0.1, True, -1, 0.0)
    assert big[:, 0].isnan().all() and big[:, hq + 1:].isnan().all(), "wrote outside out's view"


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("d", [64, 256])
def test_nan_scale_propagates(fmt, which, d):
    seqs = [(50, 20), (30, 10)]
    paged, q, k, v, cu, prefix_t = make_case(seqs, 4, 2, d, fmt, torch.bfloat16, 16)
    page = int(paged.block_table[0, 1])  # tokens 16..31 of sequence 0, visible to all its rows
    (paged.k_scale if which == "k" else paged.v_scale)[page, 3, 1, 0] = math.nan
    args = (q, k, v, paged.k_cache, paged.v_cache, paged.k_scale, paged.v_scale, paged.block_table, prefix_t, cu,
            0.125, True, -1, 0.0)
    out = poison_(torch.empty_like(q))
    torch.ops.kvq.extend_attention(*args, out)
    ref = torch.empty_like(q, dtype=torch.float32)
    reference.extend_attention(*args, ref)
    assert ref[:20, 2:].isnan().any() and not ref[:20, :2].isnan().any() and not ref[20:].isnan().any()
    assert torch.equal(out.isnan(), ref.isnan())
    # Every element the NaN does not reach was written, and is right.
    check_against_truth(out, paged, q, k, v, cu, prefix_t, 0.125, True, -1, 0.0, nan_ok=True)


def test_cuda_graph_replay_with_new_lengths():
    """The grid depends on shapes only: one captured launch serves other splits of the same token count."""
    hq, hkv, d = 8, 2, 128
    paged, q, k, v, cu, prefix_t = make_case([(100, 40), (30, 60), (0, 28)], hq, hkv, d, "q8_0", torch.bfloat16, 16)
    out = poison_(torch.empty_like(q))
    args = lambda: (q, k, v, paged.k_cache, paged.v_cache, paged.k_scale, paged.v_scale, paged.block_table,
                    prefix_t, cu, 0.1, True, -1, 0.0, out)
    torch.ops.kvq.extend_attention(*args())  # warm up (attribute setting, module load) outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.kvq.extend_attention(*args())
    # Prefixes stay within the tokens random_paged wrote (the rest of the cache is poison).
    for new, pre in (([40, 60, 28], [100, 30, 0]), ([1, 126, 1], [99, 0, 0]), ([128, 0, 0], [7, 3, 0])):
        cu.copy_(torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32))
        prefix_t.copy_(torch.tensor(pre, dtype=torch.int32))
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        check_against_truth(out, paged, q, k, v, cu, prefix_t, 0.1, True, -1, 0.0)


@pytest.mark.parametrize("fmt", ["q8_0", "bf16"])
def test_dependent_launches(fmt):
    """On compute capability 9.0 and newer the kernel is launched as a programmatic dependent of the kernel before
    it (it waits before any global access) and the merge of split keys as one of the kernel. Eight calls captured
    in one CUDA graph share one workspace and one output buffer each, so a kernel that read or wrote before the
    previous call finished would corrupt that call's partials or read stale inputs. Outputs equal those of plain
    stream order to the bit, eager and over replays."""
    paged, q, k, v, cu, prefix_t = make_case([(1500, 40), (30, 60), (0, 28)], 8, 2, 128, fmt, torch.bfloat16, 16)
    qs = [torch.randn_like(q) for _ in range(8)]

    def call(x, out):
        torch.ops.kvq.extend_attention(x, k, v, paged.k_cache, paged.v_cache, paged.k_scale, paged.v_scale,
                                       paged.block_table, prefix_t, cu, 0.1, True, -1, 0.0, out)
    got = {}
    for mode in ("off", "merge", "auto"):
        with backends.pinned_cuda_kernel("set_extend_pdl", mode):
            got[mode] = eager_then_replayed(call, qs, 5, mode)
    for mode in ("merge", "auto"):
        for i, (a, b) in enumerate(zip(got[mode], got["off"])):
            assert torch.equal(a, b), f"{mode}: call {i} differs from plain stream order"
    check_against_truth(got["auto"][0], paged, qs[0], k, v, cu, prefix_t, 0.1, True, -1, 0.0)


@pytest.mark.parametrize("d", [64, 256])
def test_bad_pages_are_not_dereferenced(d):
    """With index checks off, pages outside the cache read as zeros instead of faulting (the kernel loads zero
    values and zero scales for them: keys that score 0 and add nothing to the output), and the rest is attended."""
    paged, q, k, v, cu, prefix_t = make_case([(64, 8)], 4, 2, d, "q8_0", torch.bfloat16, 16)
    num_pages = paged.k_cache.shape[0]
    # The expected result: the same cache with one more page of zeros, and the bad entries pointing at it.
    zero_page = lambda t: torch.cat([t, torch.zeros_like(t[:1])])
    expect = replace(paged, k_cache=zero_page(paged.k_cache), v_cache=zero_page(paged.v_cache),
                     k_scale=zero_page(paged.k_scale), v_scale=zero_page(paged.v_scale),
                     block_table=paged.block_table.clone())
    expect.block_table[0, 1:3] = num_pages
    paged.block_table[0, 1] = -3
    paged.block_table[0, 2] = num_pages + 1000
    out = poison_(torch.empty_like(q))
    kvq.set_index_checks(False)
    try:
        torch.ops.kvq.extend_attention(q, k, v, paged.k_cache, paged.v_cache, paged.k_scale, paged.v_scale,
                                       paged.block_table, prefix_t, cu, 0.125, True, -1, 0.0, out)
        torch.cuda.synchronize()
    finally:
        kvq.set_index_checks(True)
    assert out.isfinite().all()
    check_against_truth(out, expect, q, k, v, cu, prefix_t, 0.125, True, -1, 0.0)


def test_wrapper_matches_op():
    paged, q, k, v, cu, prefix_t = make_case([(20, 9), (0, 3)], 4, 2, 64, "fp8_e4m3", torch.float16, 8)
    out = kvq.extend_attention(q, k, v, paged.k_cache, paged.v_cache, paged.k_scale, paged.v_scale,
                               paged.block_table, prefix_t, cu)
    check_against_truth(out, paged, q, k, v, cu, prefix_t, 1 / 8, True, -1, 0.0)


def test_more_row_blocks_than_one_launch_holds():
    """66,000 one-token sequences make more row blocks than a grid's y dimension holds (65,535), so the launcher
    covers them in several launches. Every output must be written, and sequences from the start, the end and a
    random sample (which spans both launches) must match the truth."""
    batch, hq, hkv, d, page_size = 66_000, 2, 1, 64, 16
    pool = random_paged([3 * page_size] * 8, page_size, hkv, d, torch.int8, device=DEV)  # 8 sequences' pages
    table = pool.block_table[torch.randint(0, 8, (batch,), device=DEV)]
    prefix_t = torch.randint(0, 3 * page_size + 1, (batch,), dtype=torch.int32, device=DEV)
    paged = replace(pool, block_table=table)
    q = torch.randn(batch, hq, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(batch, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(batch, hkv, d, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    out = poison_(torch.empty_like(q))
    torch.ops.kvq.extend_attention(q, k, v, paged.k_cache, paged.v_cache, paged.k_scale, paged.v_scale, table,
                                   prefix_t, cu, 0.125, True, -1, 0.0, out)
    assert not out.isnan().any(), "the kernel left NaN (unwritten or wrong) elements"
    pick = torch.cat([torch.arange(64), torch.arange(batch - 64, batch), torch.randperm(batch)[:128]]).to(DEV)
    sub = replace(paged, block_table=table[pick])
    check_against_truth(out[pick], sub, q[pick], k[pick], v[pick], cu[:pick.numel() + 1], prefix_t[pick], 0.125,
                        True, -1, 0.0)
