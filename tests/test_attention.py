"""decode_attention and extend_attention: every backend against float64 truth, with a derived tolerance.

How the tolerance is derived (the flash-attention rule): the truth is the reference math done in float64
on the *dequantized* cache (so quantization is not counted as error here; see
``test_quantization_error_report`` for that). A same-precision PyTorch baseline does what a tensor-core
kernel does: q and the dequantized K/V cast to the query dtype, scores and softmax in fp32, P cast to the
query dtype before P @ V, output rounded to the query dtype. A kernel passes when its max abs error to the
truth is at most twice the baseline's plus a small floor (for outputs whose baseline error is ~0). Outputs
start as NaN so that any element a kernel forgets to write fails.
"""

import contextlib

import pytest
import torch

from common import (FORMATS, TRITON_DEVICE, assert_close_to_truth, attend, backend_ops, backend_params,
                    cache_dtype, decode_truth, device_of, eager_then_replayed, extend_truth, poison_, random_paged,
                    rel_err, runs_triton)

BACKENDS = ["triton", "cuda"]
# The CUDA decode has a tensor-core and an FMA kernel, and the tensor-core one maps kv heads to CTAs or to warps
# (or, at head_dim 256, a kv head to a CTA whose warps divide head_dim; at head_dim 64, 8-bit, kv heads to a warp).
DECODE_BACKENDS = BACKENDS + ["cuda-fma", "cuda-warp", "cuda-columns", "cuda-rows"]
# extend CTA shapes, key splits
EXTEND_BACKENDS = BACKENDS + ["cuda-wide", "cuda-deep", "cuda-tall", "cuda-small", "cuda-split"]


def _query(shape, dtype, device, strided):
    """A fresh query; ``strided`` gives a non-contiguous view (unit stride on head_dim only), ``"odd"`` one whose
    rows start at odd element offsets (not 16-byte aligned)."""
    if not strided:
        return torch.randn(shape, device=device).to(dtype)
    n, h, d = shape
    if strided == "odd":
        return torch.randn(n, h + 3, 2 * d + 1, device=device).to(dtype)[:, 1:h + 1, 1:d + 1]
    return torch.randn(n, h + 3, 2 * d, device=device).to(dtype)[:, 1:h + 1, :d]


def _device(backend, device):
    """The device of a case: the backend's own (common.device_of) unless given. Never CPU tensors for a backend
    that runs on CUDA ones: torch.ops.kvq would send them to the reference (or Triton could not read them)."""
    device = device_of(backend) if device is None else device
    assert device == "cuda" or device_of(backend) == "cpu", f"{backend} cannot run on {device} tensors"
    return device


def check_decode(backend, fmt, dtype, hq, hkv, d, page_size, lens, window_left=-1, softcap=0.0, strided=False,
                 device=None, q_exp=0, **config):
    """``q_exp``: the query is multiplied by 2^q_exp and sm_scale by 2^-q_exp (the same logits)."""
    device = _device(backend, device)
    ops = backend_ops(backend)
    p = random_paged(lens, page_size, hkv, d, cache_dtype(fmt, dtype), dtype, device=device)
    q = _query((len(lens), hq, d), dtype, device, strided) * 2.0 ** q_exp
    out = poison_(torch.empty(len(lens), hq, d, dtype=dtype, device=device))
    sm_scale = d ** -0.5 * 2.0 ** -q_exp
    ops.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens, sm_scale,
                         window_left, softcap, out, **config)
    truth, base = decode_truth(q, p, sm_scale, window_left, softcap)
    assert_close_to_truth(out, truth, base, f"decode {fmt} {dtype} lens={lens[:6]}")
    for b, n in enumerate(lens):
        if n == 0:
            assert bool((out[b] == 0).all()), "seq_len 0 must give a zero row"


# Small cases: each backend runs them on its own device (common.device_of): Triton in the interpreter on CPU
# tensors without a GPU (compiled, on CUDA tensors, with one), the CUDA kernels on CUDA tensors only (GPU tests).
DECODE_SMALL = [  # (format, dtype, Hq, Hkv, head_dim, page_size, seq_lens, window_left, softcap, strided query)
    ("q8_0", torch.bfloat16, 4, 1, 64, 16, [1, 2, 31, 32, 33, 0], -1, 0.0, False),
    ("fp8_e4m3", torch.float16, 8, 2, 128, 1, [17, 40], -1, 0.0, True),
    ("bf16", torch.bfloat16, 16, 1, 64, 16, [33, 48], 20, 0.0, False),
    ("fp16", torch.float16, 2, 2, 256, 7, [15, 29], -1, 30.0, True),
    ("q8_0", torch.float16, 16, 1, 256, 256, [70], 5, 0.0, False),
    ("fp8_e4m3", torch.bfloat16, 8, 1, 128, 16, [64, 65, 1], -1, 50.0, False),
    ("q8_0", torch.bfloat16, 1, 1, 128, 1, [37], 0, 0.0, "odd"),
    ("fp8_e4m3", torch.bfloat16, 4, 4, 256, 16, [32, 16], 16, 20.0, False),
]


def _ids(case):
    return "-".join(str(x).replace("torch.", "").replace(" ", "") for x in case)


@pytest.mark.parametrize("backend", backend_params(DECODE_BACKENDS))
@pytest.mark.parametrize("case", DECODE_SMALL, ids=_ids)
def test_decode(backend, case):
    check_decode(backend, *case, device=device_of(backend))


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
@pytest.mark.parametrize("q_exp", [-40, 20, 60])
def test_query_magnitudes_outside_fp16(backend, fmt, q_exp):
    """bf16 queries far above fp16's range and far below its normal range. Over an 8-bit cache the dot
    products run in fp16 (the codes are exact there), so each query row is multiplied by a power of two before
    its fp16 rounding and the scores are multiplied back: the result must match as at unit scale."""
    device = device_of(backend)
    check_decode(backend, fmt, torch.bfloat16, 8, 2, 128, 16, [70, 33], q_exp=q_exp, device=device)
    check_extend(backend, fmt, torch.bfloat16, 8, 2, 64, 16, [40, 0], [17, 9], q_exp=q_exp, device=device)


@runs_triton
@pytest.mark.parametrize("fmt", ["q8_0", "bf16"])
def test_triton_decode_many_splits(fmt, monkeypatch):
    """More splits than the merge combines in one step, several of them empty: the merge's running maximum
    across steps."""
    from kvq.triton_backend import decode

    monkeypatch.setattr(decode, "_MERGE_CHUNK", 16)
    check_decode("triton", fmt, torch.bfloat16, 4, 2, 256, 16, [1200, 5, 0], config=(16, 40, 4, 1),
                 device=TRITON_DEVICE)


@runs_triton
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("fmt, dtype", [("q8_0", torch.bfloat16), ("fp8_e4m3", torch.float16)])
def test_triton_decode_modes(fmt, dtype, mode):
    """The 8-bit paths that a ``config`` selects instead of the default (scale after the dot for the keys):
    dequantize-then-dot (0) and the scale after the dot for the values as well (1)."""
    check_decode("triton", fmt, dtype, 8, 2, 128, 16, [70, 33, 1], window_left=40, config=(16, 3, 4, 1, mode),
                 device=TRITON_DEVICE)


@runs_triton
@pytest.mark.parametrize("fmt, dtype, window, cap", [("q8_0", torch.bfloat16, -1, 0.0),
                                                     ("fp8_e4m3", torch.float16, 200, 0.0),
                                                     ("q8_0", torch.float16, -1, 30.0),
                                                     ("fp8_e4m3", torch.bfloat16, -1, 0.0)])
def test_triton_decode_one_warp_d256(fmt, dtype, window, cap):
    """One-warp programs at head_dim 256, which the rule picks only for large grids: forced on small ones, with
    splits that end inside pages and tiles, one sequence shorter than a tile and one that is empty."""
    check_decode("triton", fmt, dtype, 16, 2, 256, 16, [700, 333, 17, 0], window, cap, config=(32, 5, 1, 2),
                 device=TRITON_DEVICE)


def _triton_rule(batch, hq, hkv, d, tokens, fmt, dtype):
    """The Triton decode's launch rule (``_config``) for a CUDA query and cache of these shapes."""
    from kvq.triton_backend import decode

    q = torch.empty(batch, hq, d, device="cuda", dtype=dtype)
    return decode._config(q, torch.empty(1, 16, hkv, d, device="cuda", dtype=FORMATS[fmt]), tokens)


@pytest.mark.gpu
def test_triton_decode_one_warp_d256_rule():
    """The launch rule at head_dim 256: one-warp programs where the grid holds at least six per SM of at least six
    tiles (16/2 heads, batch 64 with 4k tokens), two-warp ones where the split cap leaves fewer (batch 1 with
    128k); and the one-warp launch it picks against the truth."""
    def config(batch, tokens, fmt="q8_0"):
        return _triton_rule(batch, 16, 2, 256, tokens, fmt, torch.bfloat16)

    assert config(64, 4096)[2] == 1 and config(64, 4096, "fp8_e4m3")[2] == 1
    assert config(1, 131072)[2] == 2 and config(64, 1024)[2] == 2
    check_decode("triton", "q8_0", torch.bfloat16, 16, 2, 256, 16, [4096] * 63 + [3001], device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, dtype", [("q8_0", torch.bfloat16), ("fp8_e4m3", torch.float16)])
def test_triton_decode_twelve_per_sm_rule(fmt, dtype):
    """At head_dim 128 the rule caps one-warp programs' registers where twelve then fit an SM, and only there: not
    for a grid of two programs per SM (8/1 heads, batch 1 with 128k tokens). The capped launch it picks (32/8 heads,
    batch 2 with 40k and 33k tokens: many tiles per program), against the truth."""
    from kvq.triton_backend import decode

    def config(batch, hq, hkv, tokens):
        return _triton_rule(batch, hq, hkv, 128, tokens, fmt, dtype)

    twelve = decode._twelve_per_sm(torch.cuda.current_device())
    block_n, splits, warps, stages, maxnreg = config(2, 32, 8, 40000)
    assert (warps, maxnreg) == (1, decode._TWELVE_REGS if twelve else None)
    assert 40000 >= 4 * splits * block_n  # four tiles or more per program
    assert config(1, 8, 1, 131072)[3:] == (3, None)
    check_decode("triton", fmt, dtype, 32, 8, 128, 16, [40000, 33333], device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, dtype", [("q8_0", torch.bfloat16), ("fp8_e4m3", torch.float16)])
def test_triton_decode_one_tile_stages_rule(fmt, dtype):
    """One-warp programs of a single tile run two pipeline stages, programs of more tiles three (9/3 heads at
    head_dim 64, batch 1: 2k tokens in 64 splits of one 32-token tile; 8 sequences of 1k in 22 splits of two);
    the single-tile launch against the truth."""
    def config(batch, tokens):
        return _triton_rule(batch, 9, 3, 64, tokens, fmt, dtype)

    block_n, splits, warps, stages, _ = config(1, 2048)
    assert (warps, stages) == (1, 2) and splits * block_n >= 2048
    block_n, splits, warps, stages, _ = config(8, 1024)
    assert (warps, stages) == (1, 3) and splits * block_n < 1024
    check_decode("triton", fmt, dtype, 9, 3, 64, 16, [2048], device="cuda")


@runs_triton
@pytest.mark.parametrize("fmt, dtype", [("q8_0", torch.bfloat16), ("fp8_e4m3", torch.float16)])
def test_triton_decode_head_dim_32(fmt, dtype):
    """One scale per row: the scale-after-dot kernel reads scales in pairs, so this runs dequantize-then-dot."""
    from kvq.triton_backend import _common, decode

    assert not decode._uses_sad(decode._SCALE_AFTER_DOT, _common.FMT_Q8_0 if fmt == "q8_0" else _common.FMT_E4M3, 32)
    check_decode("triton", fmt, dtype, 4, 2, 32, 16, [40, 3, 17], device=TRITON_DEVICE)


# GPU: every format x head_dim, with GQA ratio / page size / window / soft-cap rotating over the cases.
_COMBOS = [(1, 1, -1, 0.0), (4, 16, -1, 0.0), (8, 256, 1000, 0.0), (16, 16, -1, 30.0), (4, 256, -1, 0.0),
           (8, 1, 100, 20.0)]
_GPU_LENS = [1, 2, 31, 32, 33, 255, 256, 257, 1000, 4097, 20000]


def _gpu_decode_cases():
    cases = []
    for fmt in FORMATS:
        plain = torch.float16 if fmt == "fp16" else torch.bfloat16
        dtypes = (torch.bfloat16, torch.float16) if FORMATS[fmt] is not None else (plain,)
        for d in (64, 128, 256):
            for dt in dtypes:
                cases.append((fmt, dt, d, *_COMBOS[len(cases) % len(_COMBOS)]))
    return cases


DECODE_GPU = _gpu_decode_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("case", DECODE_GPU, ids=_ids)
def test_decode_gpu(backend, case):
    fmt, dt, d, g, page, window, cap = case
    hkv = 2 if d == 256 else 4
    strided = {4: True, 8: "odd"}.get(g, False)  # "odd": the CUDA kernel's 16-byte query loads need a copy
    check_decode(backend, fmt, dt, g * hkv, hkv, d, page, _GPU_LENS, window, cap, strided=strided, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", [(32, 8, 128, [131072, 70001]), (9, 3, 64, [131072, 70001]), (32, 8, 128, [120001]),
                                  (16, 2, 256, [65536])], ids=["32-8-d128", "9-3-d64", "32-8-d128-one", "16-2-d256-one"])
def test_decode_long_gpu(backend, fmt, case):
    """Long sequences: on a 132-SM GPU the CUDA rule gives the 8-bit cases at 32/8 heads one kv head per warp
    (a warp walks over 48 tiles), the unquantized ones a CTA per head; Triton runs one-warp programs that read
    the 8-bit values as words (at head_dim 256 two-warp programs, words for q8_0). A single sequence makes over
    64 splits whose merge takes 32 columns per CTA."""
    dt = torch.float16 if fmt == "fp16" else torch.bfloat16
    hq, hkv, d, lens = case
    check_decode(backend, fmt, dt, hq, hkv, d, 16, lens, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_short_gpu(backend, fmt, d):
    """Short contexts only (max 4k tokens): the launch shapes chosen for them (one-tile splits, and Triton's
    32-token tiles on four warps at head_dim 256) are not the ones of the long cases above."""
    hkv = 2 if d == 256 else 8
    lens = [4096, 1, 33, 1000, 4000, 2049] if d == 256 else [1024, 17, 1000, 512]
    for b in (1, len(lens)):
        check_decode(backend, fmt, torch.bfloat16, 8 * hkv, hkv, d, 16, lens[:b], device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("fmt", ["q8_0", "bf16"])
def test_decode_many_parts_gpu(backend, fmt):
    """One kv head over two long sequences: about 200 splits per sequence, so the merge combines hundreds of
    parts per head, dozens per thread group."""
    check_decode(backend, fmt, torch.bfloat16, 8, 1, 128, 16, [32768, 30001], device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("fmt", ["q8_0", "bf16"])
@pytest.mark.parametrize("batch", [48, 100])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 4, 64)], ids=["32-8-d128", "16-4-d64"])
def test_decode_large_batch_gpu(backend, fmt, batch, heads):
    """Many (sequence, kv head) pairs: one split each, or, past the GPU's slots, a few splits that fill whole
    waves; the merge then combines few parts per head. On a 132-SM GPU the CUDA rule gives bf16 at 32/8 heads
    one kv head per warp without splits, and bf16 at d64 with 48 x 4 pairs two splits."""
    hq, hkv, d = heads
    lens = torch.randint(1, 9000, (batch,)).tolist()
    lens[0] = 9000
    check_decode(backend, fmt, torch.bfloat16, hq, hkv, d, 16, lens, device="cuda")


def check_extend(backend, fmt, dtype, hq, hkv, d, page_size, prefix, new, causal=True, window_left=-1,
                 softcap=0.0, strided=False, device=None, q_exp=0, **triton_kw):
    device = _device(backend, device)
    ops = backend_ops(backend)
    p = random_paged(prefix, page_size, hkv, d, cache_dtype(fmt, dtype), dtype, device=device)
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    total = cu[-1]
    q = _query((total, hq, d), dtype, device, strided) * 2.0 ** q_exp
    key = _query((total, hkv, d), dtype, device, strided)
    value = _query((total, hkv, d), dtype, device, False)
    out = poison_(torch.empty(total, hq, d, dtype=dtype, device=device))
    sm_scale = d ** -0.5 * 2.0 ** -q_exp
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    ops.extend_attention(q, key, value, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens,
                         cu_t, sm_scale, causal, window_left, softcap, out, **triton_kw)
    truth, base = extend_truth(q, key, value, p, prefix, cu, sm_scale, causal, window_left, softcap)
    assert_close_to_truth(out, truth, base, f"extend {fmt} {dtype} prefix={prefix[:6]} new={new[:6]}")


# Small cases, run like DECODE_SMALL.
EXTEND_SMALL = [  # (format, dtype, Hq, Hkv, head_dim, page, prefix_lens, new_lens, causal, window, softcap, strided)
    ("q8_0", torch.bfloat16, 4, 1, 64, 16, [0, 33, 17, 5], [20, 1, 0, 40], True, -1, 0.0, False),
    ("fp8_e4m3", torch.float16, 8, 2, 128, 1, [5, 40], [33, 2], True, 10, 0.0, True),
    ("bf16", torch.bfloat16, 4, 4, 256, 7, [50], [17], False, -1, 30.0, False),
    ("fp16", torch.float16, 2, 1, 64, 16, [0, 0], [33, 16], True, 3, 0.0, True),  # prefill
    ("q8_0", torch.float16, 16, 1, 128, 256, [31, 0], [2, 32], False, 7, 0.0, False),
    ("fp8_e4m3", torch.bfloat16, 8, 1, 64, 16, [32], [31], True, -1, 20.0, False),
    # GQA ratios with an odd factor: 3 (one query head per Triton program) and 24 (eight per program)
    ("q8_0", torch.bfloat16, 9, 3, 64, 16, [40, 0, 7], [23, 50, 1], True, -1, 0.0, False),
    ("fp8_e4m3", torch.float16, 24, 1, 64, 8, [19], [21], True, 9, 0.0, True),
]


@pytest.mark.parametrize("backend", backend_params(EXTEND_BACKENDS))
@pytest.mark.parametrize("case", EXTEND_SMALL, ids=_ids)
def test_extend(backend, case):
    check_extend(backend, *case, device=device_of(backend))


@runs_triton
@pytest.mark.parametrize("gp", [1, 2, 8])
def test_triton_extend_heads_per_program(gp):
    """The rows of a Triton extend program hold ``gp`` query heads of one kv head times their tokens; every
    packing the rule may pick gives the same attention."""
    check_extend("triton", "q8_0", torch.bfloat16, 16, 2, 64, 16, [30, 0], [21, 40], True, 12,
                 heads_per_program=gp, device=TRITON_DEVICE)


EXTEND_GPU = [(fmt, d, i % 3 != 2, *_COMBOS[i % len(_COMBOS)])  # (format, head_dim, causal, combo)
              for i, (fmt, d) in enumerate((f, d) for f in FORMATS for d in (64, 128, 256))]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", EXTEND_BACKENDS)
@pytest.mark.parametrize("case", EXTEND_GPU, ids=_ids)
def test_extend_gpu(backend, case):
    fmt, d, causal, g, page, window, cap = case
    dt = torch.float16 if fmt == "fp16" else torch.bfloat16
    hkv = 2
    check_extend(backend, fmt, dt, g * hkv, hkv, d, page, [0, 1000, 4096, 37, 0], [512, 1, 300, 64, 2000],
                 causal, window, cap, strided=g == 4, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", EXTEND_BACKENDS)
@pytest.mark.parametrize("fmt", ["q8_0", "bf16"])
@pytest.mark.parametrize("heads", [(12, 4, 128), (48, 2, 64), (6, 2, 256)], ids=["12-4-d128", "48-2-d64", "6-2-d256"])
def test_extend_uneven_gqa_gpu(backend, fmt, heads):
    """GQA ratios with an odd factor (3, 24), of which a Triton program packs the power of two into its rows."""
    hq, hkv, d = heads
    check_extend(backend, fmt, torch.bfloat16, hq, hkv, d, 16, [0, 700, 3000], [300, 77, 129], True, -1, 0.0,
                 device="cuda")


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_quantization_error_report(backend):
    """How far attention over the 8-bit cache is from attention over the bf16 K/V that was stored.

    Unlike the parity tests this counts the quantization itself: the truth is float64 attention over
    ``Paged.k_src``/``v_src`` (fp16, so that rounding the output adds little to what is measured). Printed
    per format (run with ``-s``); the bounds are what q8_0 (about 8 bits per element, error ~ 1/254 of the
    block max) and e4m3 (3 mantissa bits, error ~ 1/16 relative) allow on Gaussian data, and e4m3 must be the
    coarser of the two.
    """
    ops = backend_ops(backend)
    device = device_of(backend)
    lens, hq, hkv, d = [200, 63], 8, 2, 128
    errs = {}
    for fmt in ("q8_0", "fp8_e4m3"):
        torch.manual_seed(1234)  # the same K/V and query for both formats
        p = random_paged(lens, 16, hkv, d, FORMATS[fmt], torch.float16, device=device)
        q = torch.randn(len(lens), hq, d, device=device).to(torch.float16)
        out = poison_(torch.empty_like(q))
        ops.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens, d ** -0.5,
                             -1, 0.0, out)
        truth = torch.stack([
            attend(q[b:b + 1], p.k_src[b], p.v_src[b], torch.tensor([n - 1], device=device),
                    torch.arange(n, device=device), d ** -0.5, True, -1, 0.0)[0]
            for b, n in enumerate(lens)])
        errs[fmt] = rel_err(out, truth)
        print(f"\nquantization error of decode attention, {fmt}: relative L2 {errs[fmt]:.2e}")
    assert 0 < errs["q8_0"] < 1e-2
    assert errs["q8_0"] < errs["fp8_e4m3"] < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_decode_cuda_graph(backend):
    """Captured once, replayed with new lengths and a new query: no host sync, no size read from data."""
    ops = backend_ops(backend)
    p = random_paged([300, 5000], 16, 2, 128, torch.int8, torch.bfloat16, device="cuda")
    q = torch.randn(2, 8, 128, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)

    def call():
        ops.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens,
                             128 ** -0.5, -1, 0.0, out)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    p.seq_lens.copy_(torch.tensor([299, 4001], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    truth, base = decode_truth(q, p, 128 ** -0.5, -1, 0.0)
    assert_close_to_truth(out, truth, base, "decode replayed from a CUDA graph")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("fmt", ["q8_0", "bf16"])
def test_decode_dependent_launches_gpu(backend, fmt, monkeypatch):
    """Where the GPU can (compute capability 9.0 and newer), the backends launch the decode merge as a
    programmatic dependent of the split kernel (Triton at batch 1 only), to start while the last splits run, and
    the split kernel as one of the kernel before it (here the previous call's merge, which lets it be scheduled
    at once). The merge must still read every partial only once written, and a split must not touch memory before
    the kernel before it is done: eight calls captured in one CUDA graph reuse one workspace, so a split writing
    it early would corrupt the partials the previous merge reads. The output equals, to the bit, that of plain
    stream order, eager and over many replays, for part counts that reach each CUDA merge kernel (4-16 parts, up
    to 64, and a few hundred) and for one split (no merge)."""
    from kvq.backends import pinned_cuda_kernel
    from kvq.triton_backend import decode as triton_decode

    ops = backend_ops(backend)

    def launches(mode):
        if backend == "cuda":
            return pinned_cuda_kernel("set_decode_pdl", mode)
        monkeypatch.setattr(triton_decode, "_PDL", mode != "off")
        monkeypatch.setattr(triton_decode, "_SPLIT_PDL", mode == "auto")
        return contextlib.nullcontext()

    for lens, hq, hkv in (([1000], 16, 2), ([70001], 32, 8), ([8000, 3], 32, 8), ([32768, 30001], 8, 1),
                          ([40] * 200, 32, 8)):
        p = random_paged(lens, 16, hkv, 128, cache_dtype(fmt, torch.bfloat16), device="cuda")
        qs = [torch.randn(len(lens), hq, 128, device="cuda").to(torch.bfloat16) for _ in range(8)]

        def call(q, out):
            ops.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens,
                                 128 ** -0.5, -1, 0.0, out)
        got = {}
        for mode in ("off", "merge", "auto"):
            with launches(mode):
                got[mode] = eager_then_replayed(call, qs, 20, f"{mode} ({lens[:2]})")
        for mode in ("merge", "auto"):
            for i, (a, b) in enumerate(zip(got[mode], got["off"])):
                assert torch.equal(a, b), f"{mode}: call {i} differs from plain stream order ({lens[:2]}, {hq}/{hkv})"
        for q, out in zip(qs[:2], got["auto"]):
            truth, base = decode_truth(q, p, 128 ** -0.5, -1, 0.0)
            assert_close_to_truth(out, truth, base, "decode with dependent launches")


@runs_triton
def test_attention_rejects_unsupported_head_dim():
    """head_dim 96 is a valid cache (a multiple of 32) but not one the Triton attention kernels compile for."""
    ops = backend_ops("triton")
    p = random_paged([5], 16, 1, 96, torch.int8, device=TRITON_DEVICE)
    q = torch.randn(1, 2, 96, device=TRITON_DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        ops.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens, 0.1, -1,
                             0.0, torch.empty_like(q))
