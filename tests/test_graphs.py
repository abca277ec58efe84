"""CUDA graphs, determinism and torch.compile, on the GPU, for each format and backend.

- store + decode captured once in a CUDA graph and replayed with new contents (keys, values, queries, slots,
  sequence lengths, block tables copied into the static tensors) give the eager results bit for bit;
- the same call twice writes the same bytes and the same outputs (store, decode, extend), and those outputs
  are as close to the float64 truth as the same math in the query dtype;
- ``torch.compile(fullgraph=True)`` (inductor) of a small attention layer matches eager bit for bit.
"""


import pytest
import torch

import kvq
from kvq import reference

from common import Paged, assert_close_to_truth, backend_ops, decode_truth, extend_truth, poison_

pytestmark = pytest.mark.gpu

FORMATS = {"bf16": torch.bfloat16, "q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
BACKENDS = ["triton", "cuda", "public"]  # public: the wrappers, through whichever backend is active
DEV = "cuda"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


class Public:
    """The public wrappers with the backend modules' positional signature."""

    @staticmethod
    def store_kv(*args):
        kvq.store_kv(*args)

    @staticmethod
    def decode_attention(q, kc, vc, ks, vs, bt, lens, sm_scale, window_left, softcap, out):
        kvq.decode_attention(q, kc, vc, ks, vs, bt, lens, sm_scale=sm_scale, window_left=window_left,
                             logit_softcap=softcap, out=out)

    @staticmethod
    def extend_attention(q, k, v, kc, vc, ks, vs, bt, prefix, cu, sm_scale, causal, window_left, softcap, out):
        kvq.extend_attention(q, k, v, kc, vc, ks, vs, bt, prefix, cu, sm_scale=sm_scale, causal=causal,
                             window_left=window_left, logit_softcap=softcap, out=out)


def ops_for(backend):
    return Public if backend == "public" else backend_ops(backend)


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def same_bits(a, b):
    return a is None and b is None or torch.equal(bits(a), bits(b))


class Pool:
    """A fully written paged cache on the GPU and the static inputs of one decode step of ``batch`` sequences."""

    def __init__(self, fmt, batch=3, hq=8, hkv=2, d=128, page_size=16, max_pages=8, model=torch.bfloat16):
        self.dev = DEV
        self.model, self.page_size, self.max_pages = model, page_size, max_pages
        self.hq, self.hkv, self.d = hq, hkv, d
        self.num_pages = batch * max_pages + 4
        cdt = FORMATS[fmt] if fmt != "bf16" else model
        self.kc, self.ks = kvq.new_cache(self.num_pages, page_size, hkv, d, cdt, self.dev)
        self.vc, self.vs = kvq.new_cache(self.num_pages, page_size, hkv, d, cdt, self.dev)
        n = self.num_pages * page_size
        everything = torch.arange(n, device=self.dev)
        reference.store_kv(self.randn(n, hkv, d), self.randn(n, hkv, d), self.kc, self.vc, self.ks, self.vs,
                           everything)
        self.key, self.value = self.randn(batch, hkv, d), self.randn(batch, hkv, d)
        self.query = self.randn(batch, hq, d)
        self.slots = torch.zeros(batch, dtype=torch.int64, device=self.dev)
        self.block_table = torch.zeros(batch, max_pages, dtype=torch.int32, device=self.dev)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=self.dev)
        self.out = poison_(torch.empty_like(self.query))
        self.batch = batch

    def randn(self, *shape):
        return torch.randn(*shape, device=self.dev).to(self.model)

    def caches(self):
        return [self.kc, self.vc, self.ks, self.vs]

    def new_step(self, lens):
        """New contents for the static tensors: the token at position lens[b] - 1 is stored, then decoded."""
        b = self.batch
        table = torch.randperm(self.num_pages, device=self.dev)[: b * self.max_pages].view(b, self.max_pages)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=self.dev)
        pos = (lens_t - 1).clamp(min=0).long()
        slots = table.gather(1, (pos // self.page_size)[:, None])[:, 0].long() * self.page_size + pos % self.page_size
        slots = torch.where(lens_t > 0, slots, torch.full_like(slots, -1))
        self.block_table.copy_(table.int())
        self.seq_lens.copy_(lens_t)
        self.slots.copy_(slots)
        self.key.copy_(self.randn(b, self.hkv, self.d))
        self.value.copy_(self.randn(b, self.hkv, self.d))
        self.query.copy_(self.randn(b, self.hq, self.d))

    def paged(self):
        """The cache and the decode metadata as a :class:`common.Paged`, for the truth helpers."""
        return Paged(self.kc, self.vc, self.ks, self.vs, self.block_table, self.seq_lens, [], [])

    def clone(self):
        c = object.__new__(Pool)
        c.__dict__.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})
        return c


def step(ops, p: Pool, sm_scale=0.09, window_left=-1, softcap=0.0):
    ops.store_kv(p.key, p.value, p.kc, p.vc, p.ks, p.vs, p.slots)
    ops.decode_attention(p.query, p.kc, p.vc, p.ks, p.vs, p.block_table, p.seq_lens, sm_scale, window_left,
                         softcap, p.out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("window_left,softcap", [(-1, 0.0), (37, 30.0)])
def test_cuda_graph_replay_matches_eager(fmt, backend, window_left, softcap):
    ops = ops_for(backend)
    p = Pool(fmt)
    cap = p.max_pages * p.page_size
    p.new_step([cap, 17, 1])
    run = lambda pool: step(ops, pool, window_left=window_left, softcap=softcap)

    # Warm up on a side stream (Triton compiles on first launch, which must not happen during capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run(p)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(p)

    # Each replay sees new values, slots, lengths (longer and shorter than at capture, and 0) and tables.
    for lens in ([5, cap, 40], [cap, 1, 0], [100, 63, 64], [2, 2, cap - 1]):
        p.new_step(lens)
        eager = p.clone()
        poison_(p.out)
        poison_(eager.out)
        graph.replay()
        run(eager)
        sync()
        for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), p.caches(), eager.caches()):
            assert same_bits(a, b), f"{name} differs between graph replay and eager (lens {lens})"
        assert same_bits(p.out, eager.out), f"decode output differs between graph replay and eager (lens {lens})"
        assert not torch.isnan(p.out).any()
        zero = torch.tensor(lens, device=DEV) == 0
        assert (p.out[zero] == 0).all()


def extend_inputs(p: Pool, prefix, new):
    """Query/key/value of ``new[b]`` tokens after ``prefix[b]`` cached ones, over p's block table."""
    n = sum(new)
    cu = torch.tensor([0] + [sum(new[: b + 1]) for b in range(len(new))], dtype=torch.int32, device=DEV)
    return (p.randn(n, p.hq, p.d), p.randn(n, p.hkv, p.d), p.randn(n, p.hkv, p.d),
            torch.tensor(prefix, dtype=torch.int32, device=DEV), cu)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_same_call_twice_gives_the_same_bytes(fmt, backend):
    ops = backend_ops(backend)
    # Long sequences, so decode splits each one over many programs and merges the partials.
    p = Pool(fmt, batch=4, max_pages=200, page_size=16)
    cap = p.max_pages * p.page_size
    p.new_step([cap, 1, 1234, 2049])
    first, second = p.clone(), p.clone()
    for pool in (first, second):
        ops.store_kv(pool.key, pool.value, pool.kc, pool.vc, pool.ks, pool.vs, pool.slots)
    for a, b in zip(first.caches(), second.caches()):
        assert same_bits(a, b), "store wrote different bytes for the same call"
    outs = []
    for _ in range(2):
        out = poison_(torch.empty_like(p.query))
        ops.decode_attention(first.query, first.kc, first.vc, first.ks, first.vs, first.block_table,
                             first.seq_lens, 0.09, -1, 0.0, out)
        outs.append(out)
    assert same_bits(outs[0], outs[1]), "decode gave different outputs for the same call"
    assert not torch.isnan(outs[0]).any(), "decode left NaN (unwritten or wrong) elements"
    assert_close_to_truth(outs[0], *decode_truth(first.query, first.paged(), 0.09, -1, 0.0), f"decode {fmt}")
    prefix_l, new_l = [cap - 300, 0, 1000, 77], [300, 129, 1, 64]
    q, k, v, prefix, cu = extend_inputs(first, prefix_l, new_l)
    outs = []
    for _ in range(2):
        out = poison_(torch.empty_like(q))
        ops.extend_attention(q, k, v, first.kc, first.vc, first.ks, first.vs, first.block_table, prefix, cu, 0.09,
                             True, -1, 0.0, out)
        outs.append(out)
    assert same_bits(outs[0], outs[1]), "extend gave different outputs for the same call"
    assert not torch.isnan(outs[0]).any(), "extend left NaN (unwritten or wrong) elements"
    truth = extend_truth(q, k, v, first.paged(), prefix_l, cu.tolist(), 0.09, True, -1, 0.0)
    assert_close_to_truth(outs[0], *truth, f"extend {fmt}")


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_torch_compile_fullgraph_matches_eager(fmt, dynamic):
    # A small attention layer around the registered ops (the active backend); the arithmetic around them is
    # exact (powers of two), so compiled and eager agree to the bit.
    def layer(q, k, v, slots, kc, vc, ks, vs, bt, lens, qe, ke, ve, prefix, cu):
        kvq.store_kv(k * 2, v, kc, vc, ks, vs, slots)
        o = kvq.decode_attention(q * 0.5, kc, vc, ks, vs, bt, lens, sm_scale=0.09)
        e = kvq.extend_attention(qe, ke, ve, kc, vc, ks, vs, bt, prefix, cu, sm_scale=0.09, window_left=50)
        return o.float() * 4, e.float() * 2

    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
    p = Pool(fmt)
    cap = p.max_pages * p.page_size
    for lens in ([cap, 17, 1], [3, cap - 1, 64]):
        p.new_step(lens)
        ext = extend_inputs(p, [lens[0] - 1, 0, 5], [1, 9, 30])
        eager = p.clone()
        args = lambda pool: (pool.query, pool.key, pool.value, pool.slots, pool.kc, pool.vc, pool.ks, pool.vs,
                             pool.block_table, pool.seq_lens, *ext)
        got = compiled(*args(p))
        want = layer(*args(eager))
        sync()
        for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), p.caches(), eager.caches()):
            assert same_bits(a, b), f"{name} differs between compiled and eager"
        for g, w in zip(got, want):
            assert torch.equal(g, w), "compiled output differs from eager"
            assert not torch.isnan(g).any()


@pytest.mark.parametrize("case", ["head_dim 32", "head_dim 96", "gqa 32", "gqa 7"])
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_unusual_shapes_are_served_or_refused_clearly(case, op):
    # The contract allows any head_dim that is a multiple of 32 and any GQA group; a backend may refuse what
    # it does not implement, but with an error that names the reason, before anything runs, never with a
    # compiler error or a wrong answer.
    d = int(case.split()[1]) if case.startswith("head_dim") else 128
    g = int(case.split()[1]) if case.startswith("gqa") else 2
    hkv = 2
    p = Pool("q8_0", batch=2, hq=hkv * g, hkv=hkv, d=d)
    p.new_step([70, 9])
    step(reference, p)  # the new token is stored (by the reference) before attention reads it
    q, k, v, prefix, cu = extend_inputs(p, [60, 0], [5, 9])
    try:
        if op == "decode":
            got = kvq.decode_attention(p.query, p.kc, p.vc, p.ks, p.vs, p.block_table, p.seq_lens, sm_scale=0.1)
        else:
            got = kvq.extend_attention(q, k, v, p.kc, p.vc, p.ks, p.vs, p.block_table, prefix, cu, sm_scale=0.1)
        sync()
    except Exception as e:  # a refusal must say why, in the user's terms
        word = "head_dim" if case.startswith("head_dim") else "heads"
        assert isinstance(e, (ValueError, NotImplementedError)), f"{type(e).__name__}: {str(e)[:300]}"
        assert word in str(e), f"the refusal does not name the {word}: {e}"
        return
    # Served: as close to the float64 truth as the same math in the query dtype (common.assert_close_to_truth).
    if op == "decode":
        truth = decode_truth(p.query, p.paged(), 0.1, -1, 0.0)
    else:
        truth = extend_truth(q, k, v, p.paged(), [60, 0], cu.tolist(), 0.1, True, -1, 0.0)
    assert_close_to_truth(got, *truth, f"{op} {case}")
