"""store_kv and dequantize: every backend writes the same bytes as the reference (values and scales).

Caches start poisoned, so a slot the op must not touch (slot -1, or simply not in the mapping) still holds
its poison afterwards; comparing the whole planes with the reference's checks that too.
"""

import contextlib
import math

import pytest
import torch

from kvq import reference
from kvq.ops import new_cache

from common import TRITON_DEVICE, backend_ops, backend_params, cache_dtype, device_of, poison_, runs_triton

BACKENDS = ["triton", "cuda"]
QUANT = {"q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _bits(t):
    return None if t is None else t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


def _poison_planes(*planes):
    """Poison value and scale planes (bytewise for 8-bit ones); None (an unquantized cache's scales) is skipped."""
    for t in planes:
        if t is not None:
            poison_(t.view(torch.uint8) if t.element_size() == 1 else t)


def _poisoned(num_pages, page_size, hkv, d, dt, device):
    c, s = new_cache(num_pages, page_size, hkv, d, dt, device)
    _poison_planes(c, s)
    return c, s


def _store_both(ops, key, value, slots, num_pages, page_size, dt):
    """Run the backend and the reference on identical poisoned caches; return both (kc, vc, ks, vs)."""
    hkv, d = key.shape[1:]
    outs = []
    for impl in (ops, reference):
        kc, ks = _poisoned(num_pages, page_size, hkv, d, dt, key.device)
        vc, vs = _poisoned(num_pages, page_size, hkv, d, dt, key.device)
        impl.store_kv(key, value, kc, vc, ks, vs, slots)
        outs.append((kc, vc, ks, vs))
    return outs


def _assert_same_bytes(got, want):
    for name, g, w in zip(("k_cache", "v_cache", "k_scale", "v_scale"), got, want):
        if w is None:
            assert g is None
            continue
        gb, wb = _bits(g), _bits(w)
        bad = (gb != wb).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}: " \
            f"got {gb[tuple(bad[0])].item():#x}, reference {wb[tuple(bad[0])].item():#x}"


def _slots(num_tokens, num_pages, page_size, device, skip_every=5):
    slots = torch.randperm(num_pages * page_size)[:num_tokens]
    slots[::skip_every] = -1
    return slots.to(device)


def check_store(backend, num_tokens, page_size, hkv, d, model_dtype, fmt, device=None, strided=False):
    """``device``: the backend's own (common.device_of) unless given; never CPU tensors for a backend that runs
    on CUDA ones (torch.ops.kvq would send them to the reference, and Triton could not read them)."""
    device = device_of(backend) if device is None else device
    assert device == "cuda" or device_of(backend) == "cpu", f"{backend} cannot run on {device} tensors"
    ops = backend_ops(backend)
    dt = cache_dtype(fmt, model_dtype)
    num_pages = -(-num_tokens // page_size) + 2
    shape = (num_tokens, hkv, 2 * d if strided else d)
    key = (torch.randn(shape, device=device) * 4).to(model_dtype)[..., :d]
    value = torch.randn(shape, device=device).to(model_dtype)[..., :d]
    slots = _slots(num_tokens, num_pages, page_size, device)
    got, want = _store_both(ops, key, value, slots, num_pages, page_size, dt)
    _assert_same_bytes(got, want)
    # the poison in slots nobody wrote is still there
    free = torch.ones(num_pages * page_size, dtype=torch.bool)
    free[slots[slots >= 0].cpu()] = False
    assert bool(free.any())
    flat = got[0].flatten(0, 1)[free.to(device)]
    if got[0].element_size() == 1:
        assert bool((flat.view(torch.uint8) == 0x5A).all())
    else:
        assert bool(flat.isnan().all())
    # dequantize gathers the same values (NaN where the reference has NaN)
    back = ops.dequantize(got[0], got[2], slots, model_dtype)
    ref = reference.dequantize(want[0], want[2], slots, model_dtype)
    torch.testing.assert_close(back, ref, rtol=0, atol=0, equal_nan=True)
    assert bool((back[slots < 0] == 0).all())


# Small cases: each backend runs them on its own device (common.device_of): Triton in the interpreter on CPU
# tensors without a GPU (compiled, on CUDA tensors, with one), the CUDA kernels on CUDA tensors only (GPU tests).
SMALL_CASES = [  # (tokens, page_size, kv heads, head_dim, model dtype, format)
    (9, 1, 1, 64, torch.bfloat16, "q8_0"),
    (11, 16, 2, 128, torch.float16, "q8_0"),
    (7, 64, 8, 64, torch.bfloat16, "fp8_e4m3"),
    (10, 16, 1, 256, torch.float16, "fp8_e4m3"),
    (6, 1, 2, 256, torch.bfloat16, "fp8_e4m3"),
    (5, 16, 8, 128, torch.bfloat16, "q8_0"),
    (6, 16, 2, 96, torch.bfloat16, "q8_0"),  # a head_dim that is a multiple of 32 but not a power of two
    (8, 16, 2, 128, torch.bfloat16, "bf16"),
    (5, 16, 1, 128, torch.float16, "fp16"),  # head_dim 128 copies go by 16 blocks a warp: the last warp's partial
    (13, 3, 3, 128, torch.bfloat16, "bf16"),  # ... and a warp's blocks spread over tokens on different pages
    (8, 1, 8, 64, torch.float16, "fp16"),
    (70, 16, 3, 64, torch.float16, "q8_0"),  # several token blocks per launch, the last one partial
    (3, 16, 12, 384, torch.bfloat16, "fp8_e4m3"),  # a token's rows split over programs, a head across the cut
]


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_store_matches_reference(backend, case):
    check_store(backend, *case)


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
@pytest.mark.parametrize("fmt,d", [("q8_0", 64), ("bf16", 128)])
def test_store_strided_rows(backend, fmt, d):
    """key/value may be views with a row stride larger than head_dim."""
    check_store(backend, 7, 16, 2, d, torch.bfloat16, fmt, strided=True)


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
def test_store_single_token(backend, fmt):
    ops = backend_ops(backend)
    device = device_of(backend)
    key = torch.randn(1, 3, 64, device=device).to(torch.bfloat16)
    got, want = _store_both(ops, key, -key, torch.tensor([37], device=device), 4, 16, QUANT[fmt])
    _assert_same_bytes(got, want)


def test_store_triton_grid_takes_64_bit_indices_past_int32():
    """The Triton store and gather index blocks by one flat (token, block) counter: the grid covers every block
    exactly, and 64-bit counters are asked for whenever a program's counter could pass 2^31 - 1 (and not for
    ordinary sizes, which keep the cheaper 32-bit arithmetic)."""
    from kvq.triton_backend.store import _BLOCKS, _launch
    for t, nbt in ((1, 6), (1000, 6), (262144, 32), (2 ** 31 // 6 - 100, 6), (2 ** 26 - 1, 32), (2 ** 26, 32),
                   (2 ** 31 // 6 + 1, 6), (2 ** 33, 8)):
        (programs,), wide = _launch(t, nbt)
        assert (programs - 1) * _BLOCKS < t * nbt <= programs * _BLOCKS
        if programs * _BLOCKS - 1 > 2 ** 31 - 1:
            assert wide, (t, nbt)
        if t * nbt <= 2 ** 30:
            assert not wide, (t, nbt)


@runs_triton
def test_store_triton_skips_out_of_range_slots():
    """The Triton kernels run without index checks: a slot outside the cache is skipped like -1."""
    ops = backend_ops("triton")
    key = torch.randn(20, 3, 64, device=TRITON_DEVICE).to(torch.bfloat16)
    slots = torch.randperm(3 * 16)[:20]
    bad, good = slots.clone(), slots.clone()
    bad[[1, 9, 19]] = torch.tensor([3 * 16, 10 ** 9, -5])
    good[[1, 9, 19]] = -1
    bad, good = bad.to(TRITON_DEVICE), good.to(TRITON_DEVICE)
    (kc, ks), (vc, vs) = (_poisoned(3, 16, 3, 64, torch.int8, TRITON_DEVICE) for _ in range(2))
    ops.store_kv(key, -key, kc, vc, ks, vs, bad)
    want = _store_both(reference, key, -key, good, 3, 16, torch.int8)[1]
    _assert_same_bytes((kc, vc, ks, vs), want)


def _special_rows(model_dtype, fmt, tiny=True):
    """Hand-built blocks whose rounding is decided by a tie or one ulp, plus non-finite and tiny blocks.

    Each row is one 32-element block (head_dim 32 * 8 blocks per token). Returns (x [8, 1, 256], expected
    value codes for a few (block, element) positions, as the format defines them). ``tiny=False`` leaves out
    the block whose d is below the smallest normal float: on a GPU the Triton store then takes its short path
    (every d normal, zero or non-finite), with it the exact one.
    """
    m = 127.0 if fmt == "q8_0" else 448.0
    x = torch.randn(8, 32, dtype=torch.float64)
    expect = {}
    # block 0: amax = M, so d = 1 and y = x exactly: ties and their neighbours
    x[0, 0] = m
    if fmt == "q8_0":
        ties = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5]
        codes = [1, 2, 3, -1, -2, -3, 127, -127]  # half away from zero
    else:
        ulp = 2.0 ** -7 if model_dtype == torch.bfloat16 else 2.0 ** -10
        ties = [1.0625, 1.1875, 2.5 * 2 ** -9, 3.5 * 2 ** -9, 1.0625 + ulp, 1.0625 - ulp, -1.1875, -0.0]
        codes = [0x38, 0x3A, 0x02, 0x04, 0x39, 0x38, 0xBA, 0x80]  # nearest even; sign kept, -0 -> 0x80
    x[0, 1:1 + len(ties)] = torch.tensor(ties, dtype=torch.float64)
    for i, c in enumerate(codes):
        expect[(0, 1 + i)] = c & 0xFF
    # block 1: an inf; block 2: a NaN -> canonical NaN scale, zero values
    x[1, 3] = math.inf
    x[2, 7] = math.nan
    # block 3: amax so small the fp16 scale is subnormal
    x[3] *= 3e-4
    # block 4: (bf16 only: fp16 cannot hold it) amax so small that 1/d overflows in fp32; zeros stay 0
    if model_dtype == torch.bfloat16 and tiny:
        x[4] *= 1e-38
        x[4, 5:9] = 0.0
    # block 5: -inf; block 6: all zeros (d = 0); block 7: large values near the dtype's range
    x[5, 0] = -math.inf
    x[6] = 0.0
    x[7] *= 1e4 if model_dtype == torch.float16 else 1e30
    return x.to(model_dtype).reshape(1, 1, 256).expand(3, 1, 256).contiguous(), expect


# Every backend on CUDA tensors (GPU tests), with and without the tiny block; Triton also in the interpreter on
# CPU tensors where there is no GPU.
_TIES_RUNS = [pytest.param(b, "cuda", tiny, marks=pytest.mark.gpu) for b in BACKENDS for tiny in (True, False)]
if TRITON_DEVICE == "cpu":
    _TIES_RUNS.insert(0, pytest.param("triton", "cpu", True))


@pytest.mark.parametrize("backend,device,tiny", _TIES_RUNS)
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
def test_store_ties_and_non_finite(backend, fmt, model_dtype, device, tiny):
    ops = backend_ops(backend)
    key, expect = _special_rows(model_dtype, fmt, tiny)
    key = key.to(device)
    value = -key
    slots = torch.tensor([5, -1, 2], device=device)
    got, want = _store_both(ops, key, value, slots, 3, 4, QUANT[fmt])
    _assert_same_bytes(got, want)
    kc, ks = got[0], got[2]
    codes = kc.view(torch.uint8)[1, 1, 0].view(8, 32)  # slot 5 = page 1, offset 1
    for (blk, el), c in expect.items():
        got_code = codes[blk, el].item()
        assert got_code == c, f"block {blk} element {el}: code {got_code:#x}, want {c:#x}"
    sbits = ks.view(torch.int16)[1, 1, 0]
    assert sbits[1].item() == 0x7E00 and sbits[2].item() == 0x7E00 and sbits[5].item() == 0x7E00
    assert bool((codes[1] == 0).all() and (codes[2] == 0).all())
    assert 0 < ks[1, 1, 0, 3].item() < 6.1e-5  # a subnormal fp16 scale
    assert ks[1, 1, 0, 6].item() == 0 and bool((codes[6] == 0).all())
    if model_dtype == torch.bfloat16 and tiny:
        assert bool((codes[4, 5:9] == 0).all())
    back = ops.dequantize(kc, ks, torch.tensor([5], device=device), model_dtype)
    assert bool(back[0, 0, 32:96].isnan().all()) and not bool(back[0, 0, :32].isnan().any())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "plain"])
def test_store_large_gpu(backend, fmt, model_dtype, d):
    fmt = {"plain": "bf16" if model_dtype == torch.bfloat16 else "fp16"}.get(fmt, fmt)
    check_store(backend, 65536 + 17, 16, 8 if d < 256 else 2, d, model_dtype, fmt, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "bf16"])
def test_store_waits_for_the_kernel_before_it(backend, fmt, monkeypatch):
    """Where the GPU can (compute capability 9.0 and newer) both stores are launched as programmatic dependents of
    the kernel before them, so that they are scheduled while that kernel's last CTAs run. They must still read their
    keys and values only once that kernel has written them: a CUDA graph of eight rounds, each copying new rows into
    the same key and value buffers and storing them to its own slots, writes every round's rows, with the bytes of
    plain stream order and of the reference, over several replays."""
    from kvq.backends import pinned_cuda_kernel
    from kvq.triton_backend import store as triton_store

    ops = backend_ops(backend)

    def launches(mode):
        if backend == "cuda":
            return pinned_cuda_kernel("set_store_pdl", mode)
        monkeypatch.setattr(triton_store, "_PDL", mode == "auto")
        return contextlib.nullcontext()

    dt = cache_dtype(fmt, torch.bfloat16)
    rounds, n, hkv, d, page_size, num_pages = 8, 4096, 8, 128, 16, 2100
    keys = [(torch.randn(n, hkv, d, device="cuda") * 4).to(torch.bfloat16) for _ in range(rounds)]
    values = [torch.randn(n, hkv, d, device="cuda").to(torch.bfloat16) for _ in range(rounds)]
    slots = torch.randperm(num_pages * page_size, device="cuda")[: rounds * n].view(rounds, n)
    key, value = torch.empty_like(keys[0]), torch.empty_like(values[0])

    (kc, ks), (vc, vs) = (_poisoned(num_pages, page_size, hkv, d, dt, "cuda") for _ in range(2))
    want = (kc, vc, ks, vs)
    for i in range(rounds):
        reference.store_kv(keys[i], values[i], *want, slots[i])
    for mode in ("off", "auto"):
        with launches(mode):
            kc, ks = _poisoned(num_pages, page_size, hkv, d, dt, "cuda")
            vc, vs = _poisoned(num_pages, page_size, hkv, d, dt, "cuda")
            ops.store_kv(key, value, kc, vc, ks, vs, slots[0])  # compiles (Triton) outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(rounds):
                    key.copy_(keys[i])
                    value.copy_(values[i])
                    ops.store_kv(key, value, kc, vc, ks, vs, slots[i])
            for _ in range(3):
                _poison_planes(kc, vc, ks, vs)
                graph.replay()
                torch.cuda.synchronize()
                _assert_same_bytes((kc, vc, ks, vs), want)
