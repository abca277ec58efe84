"""Shared test helpers: random paged caches, poisoned outputs, and tolerances tied to same-precision math."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from kvq import backends, reference
from kvq.ops import new_cache

FORMATS = {"bf16": None, "fp16": None, "q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Where the Triton kernels run: compiled, on CUDA tensors, where there is a GPU; else in Triton's interpreter on
# CPU tensors (conftest sets TRITON_INTERPRET=1 on a machine without a GPU).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
CUDA_BACKENDS = ("cuda", "cuda-fma", "cuda-warp", "cuda-columns", "cuda-rows", "cuda-wide", "cuda-deep", "cuda-tall", "cuda-small", "cuda-split")


def device_of(backend: str) -> str:
    """The device a backend's cases run on. The CUDA kernels need CUDA tensors: ``torch.ops.kvq`` sends CPU
    tensors to the reference, so a "cuda" case on CPU tensors would compare the reference with itself."""
    if backend in CUDA_BACKENDS:
        return "cuda"
    if backend == "triton":
        return TRITON_DEVICE
    return "cpu"


def backend_params(names):
    """``names`` as pytest parameters, those that run on CUDA tensors marked ``gpu`` (skipped without a GPU)."""
    return [pytest.param(n, marks=pytest.mark.gpu) if device_of(n) == "cuda" else n for n in names]


def runs_triton(test):
    """Marks a test of the Triton kernels (on ``TRITON_DEVICE``) as a GPU test where they run on CUDA tensors."""
    return pytest.mark.gpu(test) if TRITON_DEVICE == "cuda" else test


def cache_dtype(fmt: str, model_dtype: torch.dtype) -> torch.dtype:
    return FORMATS[fmt] if FORMATS[fmt] is not None else model_dtype


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with a value no kernel would write, so unwritten elements show."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-77) if t.dtype == torch.int8 else t.fill_(0x5A)


def eager_then_replayed(call, inputs, replays: int, what: str) -> list:
    """Calls ``call(x, out)`` eagerly for each input, then captures the same calls in one CUDA graph (so they
    share whatever workspace the allocator gives the first) and replays it ``replays`` times with the outputs
    poisoned first: every replayed output must equal its eager one to the bit. Returns the eager outputs."""
    eager = [poison_(torch.empty_like(x)) for x in inputs]
    replayed = [poison_(torch.empty_like(x)) for x in inputs]
    for x, out in zip(inputs, eager):
        call(x, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, out in zip(inputs, replayed):
            call(x, out)
    for _ in range(replays):
        for out in replayed:
            poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        for i, (r, e) in enumerate(zip(replayed, eager)):
            assert torch.equal(r, e), f"{what}: call {i} of a replay differs from the eager call"
    return eager


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: Optional[torch.Tensor]
    v_scale: Optional[torch.Tensor]
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    k_src: list  # per sequence [L, Hkv, D] in the model dtype (what was stored)
    v_src: list


def random_paged(seq_lens, page_size, hkv, d, cache_dt, model_dtype=torch.bfloat16, device="cpu",
                 extra_pages=3, scale=1.0) -> Paged:
    """Random K/V for each sequence, stored (by the reference) into shuffled pages of a fresh cache."""
    seq_lens = list(seq_lens)
    pages_per = [max(1, -(-n // page_size)) for n in seq_lens]
    num_pages = sum(pages_per) + extra_pages
    max_pages = max(pages_per) + 1
    perm = torch.randperm(num_pages, device="cpu")
    block_table = torch.full((len(seq_lens), max_pages), 0, dtype=torch.int32)
    kc, ks = new_cache(num_pages, page_size, hkv, d, cache_dt, device)
    vc, vs = new_cache(num_pages, page_size, hkv, d, cache_dt, device)
    for t in (kc, vc, ks, vs):
        if t is not None:
            poison_(t)
    ksrc, vsrc, i = [], [], 0
    for b, n in enumerate(seq_lens):
        pages = perm[i:i + pages_per[b]]
        i += pages_per[b]
        block_table[b, :pages_per[b]] = pages.int()
        block_table[b, pages_per[b]:] = perm[-1].int()  # unused entries point at a real page
        k = (torch.randn(n, hkv, d, device=device) * scale).to(model_dtype)
        v = (torch.randn(n, hkv, d, device=device) * scale).to(model_dtype)
        pos = torch.arange(n, device=device)
        slots = (pages.to(device)[pos // page_size].long() * page_size + pos % page_size)
        reference.store_kv(k, v, kc, vc, ks, vs, slots)
        ksrc.append(k)
        vsrc.append(v)
    return Paged(kc, vc, ks, vs, block_table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                 ksrc, vsrc)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()


def backend_ops(name: str):
    """The four ops of one backend, called directly (so several backends can be compared in one process).

    ``reference`` and ``triton`` are Python modules; ``cuda`` is the compiled kernels behind ``torch.ops.kvq``
    (only when ``kvq._C`` is the active CUDA backend); ``cuda-fma`` the same with the FMA decode kernel;
    ``cuda-warp`` with the tensor-core decode kernel mapping one kv head per warp (the rule does so only for
    8-bit caches whose splits are long enough; where the kv heads do not divide into its warps, in CTAs of fewer
    warps: three at 9/3 heads, two at 16/2; a prime number of kv heads above four keeps one per CTA);
    ``cuda-columns`` with the warps of a CTA dividing head_dim, where that mode exists (head_dim 256, every cache
    format; elsewhere the rule); ``cuda-rows`` with two or three adjacent kv heads per warp, where that mode exists
    (8-bit caches at head_dim 64 with up to 8 query heads per kv head and an even number or a multiple of three kv
    heads; elsewhere the rule);
    ``cuda-wide`` / ``cuda-deep`` / ``cuda-tall`` / ``cuda-small`` with the extend kernel held to one CTA shape (the
    rule picks by estimated time, so small test shapes would otherwise only reach one); ``cuda-split`` with the keys
    of each extend row block split over three CTAs and merged (the rule splits only long prefixes).
    """
    if name == "reference":
        return reference
    if name == "triton":
        if not torch.cuda.is_available() and not INTERPRET:
            pytest.skip("triton needs a GPU or TRITON_INTERPRET=1")
        from kvq import triton_backend

        return triton_backend
    if name in CUDA_BACKENDS:
        if backends.selection().active != "cuda":
            pytest.skip(f"the cuda backend is not active: {backends.selection().reasons.get('cuda')}")
        if name == "cuda":
            return torch.ops.kvq
        if name == "cuda-fma":
            return _Pinned("decode_attention", "set_decode_kernel", "fma")
        if name == "cuda-warp":
            return _Pinned("decode_attention", "set_decode_heads", "warp")
        if name == "cuda-columns":
            return _Pinned("decode_attention", "set_decode_heads", "columns")
        if name == "cuda-rows":
            return _Pinned("decode_attention", "set_decode_heads", "rows")
        if name == "cuda-split":
            return _Pinned("extend_attention", "set_extend_splits", "3")
        return _Pinned("extend_attention", "set_extend_shape", name.split("-")[1])
    raise ValueError(name)


class _Pinned:
    """torch.ops.kvq with one op run under a pinned kernel choice of kvq._C (the FMA decode kernel, or one extend
    CTA shape): the rules pick by shape, and every kernel must be right for every shape."""

    def __init__(self, op: str, setter: str, choice: str):
        self.op, self.setter, self.choice = op, setter, choice

    def __getattr__(self, name):
        if name != self.op:
            return getattr(torch.ops.kvq, name)

        def call(*args, **kwargs):
            with backends.pinned_cuda_kernel(self.setter, self.choice):
                return getattr(torch.ops.kvq, name)(*args, **kwargs)
        return call



# ------------------------------------------------------------------------ attention truth and tolerance
# The flash-attention rule: the truth is attention in float64 over the *dequantized* cache (quantization is not
# counted as error); a same-precision baseline does what a tensor-core kernel does (q and the dequantized K/V
# cast to the query dtype, scores and softmax in fp32, P cast to the query dtype before P @ V, output rounded
# to the query dtype). A kernel passes when its max abs error to the truth is at most twice the baseline's plus
# a small floor (for outputs whose baseline error is ~0).
FLOOR = 1e-5


def attend(q, k, v, q_pos, k_pos, sm_scale, causal, window_left, softcap, dtype=None):
    """``q [n, Hq, D]`` over ``k, v [L, Hkv, D]``: float64 truth (dtype None) or the same-precision baseline."""
    hq, hkv = q.shape[1], k.shape[1]
    if dtype is None:
        q, k, v = q.double(), k.double(), v.double()
    else:
        q, k, v = (t.to(dtype).float() for t in (q, k, v))
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * sm_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    vis = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    if causal:
        vis &= k_pos[None, :] <= q_pos[:, None]
    if window_left >= 0:
        vis &= k_pos[None, :] >= q_pos[:, None] - window_left
    s = s.masked_fill(~vis, -math.inf)
    # A row that sees nothing gives 0; a NaN score (a NaN in the cache) stays NaN, as the kernels must keep it.
    p = torch.softmax(s, dim=-1).masked_fill(~vis.any(-1)[None, :, None], 0.0)
    if dtype is not None:
        p = p.to(dtype).float()
    o = torch.einsum("hnl,lhd->nhd", p, v)
    return o if dtype is None else o.to(dtype)


def assert_close_to_truth(out, truth, base, what):
    err = (out.double() - truth).abs().max().item()
    berr = (base.double() - truth).abs().max().item()
    assert err <= 2 * berr + FLOOR, f"{what}: max abs error {err:.3e} > 2 x baseline {berr:.3e} + {FLOOR}"


def decode_truth(q, p, sm_scale, window_left, softcap):
    """(float64 truth, same-precision baseline) of decode over ``p`` (k_cache, k_scale, v_cache, v_scale,
    block_table and seq_lens, as in :class:`Paged`)."""
    truth, base = torch.zeros(q.shape, dtype=torch.float64, device=q.device), torch.zeros_like(q)
    for b, n in enumerate(p.seq_lens.tolist()):
        if n == 0:
            continue
        k = reference.gather_sequence(p.k_cache, p.k_scale, p.block_table[b], n)
        v = reference.gather_sequence(p.v_cache, p.v_scale, p.block_table[b], n)
        pos = torch.arange(n, device=q.device)
        args = (q[b:b + 1], k, v, pos[-1:], pos, sm_scale, True, window_left, softcap)
        truth[b] = attend(*args)[0]
        base[b] = attend(*args, dtype=q.dtype)[0]
    return truth, base


def extend_truth(q, key, value, p, prefix, cu, sm_scale, causal, window_left, softcap):
    """(float64 truth, same-precision baseline) of extend; ``prefix`` and ``cu`` are lists of ints."""
    truth, base = torch.zeros(q.shape, dtype=torch.float64, device=q.device), torch.zeros_like(q)
    for b, n0 in enumerate(prefix):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        kn, vn = key[s:e].float(), value[s:e].float()
        if n0:
            k = torch.cat([reference.gather_sequence(p.k_cache, p.k_scale, p.block_table[b], n0), kn])
            v = torch.cat([reference.gather_sequence(p.v_cache, p.v_scale, p.block_table[b], n0), vn])
        else:
            k, v = kn, vn
        k_pos = torch.arange(n0 + e - s, device=q.device)
        args = (q[s:e], k, v, k_pos[n0:], k_pos, sm_scale, causal, window_left, softcap)
        truth[s:e] = attend(*args)
        base[s:e] = attend(*args, dtype=q.dtype)
    return truth, base
