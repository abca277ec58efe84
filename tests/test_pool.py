"""KVPool: sizing by hand, the page allocator under random traffic, and rebuild between formats."""

import random

import pytest
import torch

import kvq
from kvq import reference
from kvq.pool import KVPool, KVPoolFullError

# (num_layers, num_kv_heads, head_dim)
SHAPES = {
    "llama3-8b": (32, 8, 128),
    "qwen3-d256-kv4": (28, 4, 256),
    "qwen3-d256-kv2": (24, 2, 256),
    "smollm2-135m": (30, 3, 64),
}


def plane_bytes(pool):
    total = 0
    for layer in range(pool.num_layers):
        for t in (pool.k_cache(layer), pool.v_cache(layer), pool.k_scale(layer), pool.v_scale(layer)):
            total += 0 if t is None else t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["bf16", "q8_0", "fp8_e4m3"])
def test_unit_bytes_by_hand(shape, dtype):
    layers, hkv, d = SHAPES[shape]
    pool = KVPool(layers, hkv, d, num_pages=2, page_size=16, kv_cache_dtype=dtype)
    # K and V, every layer: d elements of 1 byte + d/32 fp16 scales, or d elements of 2 bytes
    per_head = d + d // 32 * 2 if dtype != "bf16" else 2 * d
    assert pool.unit_bytes() == 2 * layers * hkv * per_head
    assert pool.page_bytes() == 16 * pool.unit_bytes()
    assert plane_bytes(pool) == 2 * pool.page_bytes()  # the formula is what is allocated
    if dtype != "bf16":
        assert pool.unit_bytes() == 2 * layers * hkv * d * 1.0625
        assert pool.k_scale(0).shape == (2, 16, hkv, d // 32) and pool.k_scale(0).dtype == torch.float16
    else:
        assert pool.k_scale(0) is None and pool.v_scale(layers - 1) is None


def test_llama3_8b_numbers():
    pool = KVPool(32, 8, 128, num_pages=1, kv_cache_dtype="q8_0")
    assert pool.unit_bytes() == 69632
    assert pool.cache_dtype == torch.int8 and pool.spec.name == "q8_0"
    assert KVPool(32, 8, 128, 1, kv_cache_dtype="bf16").unit_bytes() == 131072
    assert KVPool(32, 8, 128, 1, kv_cache_dtype="fp8_e4m3").k_cache(31).dtype == torch.float8_e4m3fn


def test_kv_cost_counts_whole_pages():
    pool = KVPool(30, 3, 64, num_pages=4, page_size=16, kv_cache_dtype="q8_0")
    page = pool.page_bytes()
    assert [pool.kv_cost(n) for n in (0, 1, 16, 17, 33)] == [0, page, page, 2 * page, 3 * page]


@pytest.mark.parametrize("shape", ["llama3-8b", "smollm2-135m"])
def test_from_budget(shape):
    layers, hkv, d = SHAPES[shape]
    page = 2 * layers * hkv * d * 1.0625 * 8
    pool = KVPool.from_budget(int(5 * page + page - 1), layers, hkv, d, page_size=8, kv_cache_dtype="q8_0")
    assert pool.num_pages == 5 and pool.free_pages() == 5
    assert plane_bytes(pool) <= 6 * page - 1
    with pytest.raises(ValueError, match="holds no page"):
        KVPool.from_budget(int(page) - 1, layers, hkv, d, page_size=8, kv_cache_dtype="q8_0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_from_free_memory_needs_cuda():
    with pytest.raises(RuntimeError, match="from_budget"):
        KVPool.from_free_memory(0.5, 2, 2, 64, device="cpu")


def test_auto_and_bad_shapes():
    pool = KVPool(2, 2, 64, 3, kv_cache_dtype="auto", model_dtype=torch.float16)
    assert pool.cache_dtype == torch.float16 and pool.spec.name == "fp16" and pool.k_scale(1) is None
    with pytest.raises(ValueError, match="multiple of 32"):
        KVPool(2, 2, 80, 3)
    with pytest.raises(ValueError, match="num_pages"):
        KVPool(2, 2, 64, 0)
    with pytest.raises(ValueError, match="valid names"):
        KVPool(2, 2, 64, 3, kv_cache_dtype="q4")
    with pytest.raises(IndexError, match="2 layers"):
        pool.k_cache(2)


def check_invariants(pool):
    live = {s: pool.pages(s) for s in pool.sequences()}
    owned = [p for pages in live.values() for p in pages]
    free = pool._free
    assert len(set(owned)) == len(owned), "a page belongs to two sequences"
    assert not set(owned) & set(free), "a live page is on the free list"
    assert sorted(owned + free) == list(range(pool.num_pages)), "a page leaked"
    for s, pages in live.items():
        assert len(pages) == pool.pages_for(pool.seq_len(s))
    seqs = list(live)
    if seqs:
        table, lens = pool.block_table(seqs), pool.seq_lens(seqs)
        assert table.dtype == torch.int32 and lens.dtype == torch.int32
        assert lens.tolist() == [pool.seq_len(s) for s in seqs]
        for i, s in enumerate(seqs):
            n = len(live[s])
            assert table[i, :n].tolist() == live[s]
            assert (table[i, n:] == 0).all()


def test_allocator_random_traffic():
    rng = random.Random(0)
    page_size, hkv, d = 4, 2, 32
    pool = KVPool(1, hkv, d, num_pages=40, page_size=page_size, kv_cache_dtype="bf16")
    data = {}  # seq -> [len, hkv, d] bf16 written through the slots append returned
    for step in range(400):
        seqs = pool.sequences()
        r = rng.random()
        if r < 0.15 or not seqs:
            s = pool.new_sequence()
            data[s] = torch.empty(0, hkv, d, dtype=torch.bfloat16)
        elif r < 0.3:
            s = rng.choice(seqs)
            pool.free(s)
            del data[s]
        else:
            s = rng.choice(seqs)
            n = rng.randint(0, 9)
            before = (pool.free_pages(), pool.seq_len(s), pool.pages(s))
            try:
                slots = pool.append(s, n)
            except KVPoolFullError as e:
                need = pool.pages_for(before[1] + n) - len(before[2])
                assert f"needs {need} more page" in str(e) and f"only {before[0]} of 40 pages are free" in str(e)
                assert (pool.free_pages(), pool.seq_len(s), pool.pages(s)) == before
                continue
            assert slots.dtype == torch.int64 and slots.shape == (n,)
            assert torch.equal(slots, pool.slots(s, before[1], before[1] + n))
            k = torch.randn(n, hkv, d).to(torch.bfloat16)
            kvq.store_kv(k, -k, pool.k_cache(0), pool.v_cache(0), None, None, slots)
            data[s] = torch.cat([data[s], k])
        check_invariants(pool)
    # Every live sequence still reads back exactly what was written: no page was shared or reused early.
    seqs = pool.sequences()
    assert seqs, "the traffic left no live sequence to check"
    table = pool.block_table(seqs)
    for i, s in enumerate(seqs):
        got = reference.gather_sequence(pool.k_cache(0), None, table[i], pool.seq_len(s))
        assert torch.equal(got, data[s].float())
        got_v = kvq.dequantize(pool.v_cache(0), None, pool.slots(s), torch.bfloat16)
        assert torch.equal(got_v, -data[s])
    for s in seqs:
        pool.free(s)
    assert pool.free_pages() == 40


def test_allocator_errors():
    pool = KVPool(1, 1, 32, num_pages=3, page_size=4, kv_cache_dtype="bf16")
    s = pool.new_sequence()
    pool.append(s, 5)
    with pytest.raises(KVPoolFullError, match="needs 2 more page.*only 1 of 3 pages are free"):
        pool.append(s, 8)
    assert pool.seq_len(s) == 5 and pool.free_pages() == 1
    with pytest.raises(IndexError, match=r"\[3, 7\)"):
        pool.slots(s, 3, 7)
    pool.free(s)
    with pytest.raises(KeyError, match="no live sequence"):
        pool.append(s, 1)
    with pytest.raises(KeyError, match="no live sequence"):
        pool.free(s)
    assert pool.block_table([]).shape == (0, 1)


# ------------------------------------------------------------------------------------------- rebuild
def blocks(x):
    return x.float().unflatten(-1, (-1, 32))


def q8_bound(x):
    """|x - x'| for q8_0: d/2 per element, the fp16 rounding of d (127 d 2^-11), and a bf16 hop (2^-8 |x|)."""
    xb = blocks(x)
    d = xb.abs().amax(-1, keepdim=True) / 127
    return (d / 2 + 127 * d * 2**-11 + xb.abs() * 2**-8 + 1e-30).flatten(-2)


def fp8_bound(x):
    """e4m3 keeps 3 mantissa bits (relative 2^-4 of x / d); subnormals below 2^-6 d have a fixed step."""
    xb = blocks(x)
    d = xb.abs().amax(-1, keepdim=True) / 448
    return (xb.abs() * (2**-4 + 2**-11 + 2**-8) + d * 2**-9 + 1e-30).flatten(-2)


def read_all(pool):
    """Per live sequence, per layer, K and V in fp32, read through the block table."""
    seqs = pool.sequences()
    table = pool.block_table(seqs)
    out = {}
    for i, s in enumerate(seqs):
        n = pool.seq_len(s)
        out[s] = [(reference.gather_sequence(pool.k_cache(l), pool.k_scale(l), table[i], n),
                   reference.gather_sequence(pool.v_cache(l), pool.v_scale(l), table[i], n))
                  for l in range(pool.num_layers)]
    return out


def fill(pool, lengths, seed=0):
    """Sequences of random K/V, appended in interleaved chunks with some freed, so pages are scattered."""
    g = torch.Generator().manual_seed(seed)
    seqs = [pool.new_sequence() for _ in lengths]
    extra = [pool.new_sequence() for _ in range(2)]
    left = dict(zip(seqs, lengths))
    while any(left.values()):
        for s in seqs + extra:
            n = min(left.get(s, 3), 7)
            if s in left:
                left[s] -= n
            slots = pool.append(s, n)
            for l in range(pool.num_layers):
                shape = (n, pool.num_kv_heads, pool.head_dim)
                k = (torch.randn(shape, generator=g) * 3).to(pool.device, torch.bfloat16)
                v = torch.randn(shape, generator=g).to(pool.device, torch.bfloat16)
                kvq.store_kv(k, v, pool.k_cache(l), pool.v_cache(l), pool.k_scale(l), pool.v_scale(l), slots)
    for s in extra:
        pool.free(s)
    return seqs


def assert_close_to(before, after, bound):
    assert before.keys() == after.keys()
    for s in before:
        for (k0, v0), (k1, v1) in zip(before[s], after[s]):
            for x0, x1 in ((k0, k1), (v0, v1)):
                assert x0.shape == x1.shape
                err = (x1 - x0).abs()
                assert bool((err <= bound(x0)).all()), f"seq {s}: max error {err.max().item():.3g}"


@pytest.mark.parametrize("head_dim", [64, 256])
def test_rebuild_round_trip(head_dim):
    pool = KVPool(2, 2, head_dim, num_pages=24, page_size=4, kv_cache_dtype="bf16")
    fill(pool, [9, 1, 17, 4])
    orig = read_all(pool)
    lens = {s: pool.seq_len(s) for s in pool.sequences()}

    pool.rebuild("q8_0")
    assert pool.cache_dtype == torch.int8 and pool.k_scale(1).dtype == torch.float16
    q8 = read_all(pool)
    assert_close_to(orig, q8, q8_bound)
    # not a copy that kept bf16 values: q8_0 must have moved most of them
    assert any(not torch.equal(orig[s][0][0], q8[s][0][0]) for s in orig)

    pool.rebuild("fp8_e4m3")
    assert pool.cache_dtype == torch.float8_e4m3fn
    f8 = read_all(pool)
    assert_close_to(q8, f8, fp8_bound)

    pool.rebuild("bf16")
    assert pool.cache_dtype == torch.bfloat16 and pool.k_scale(0) is None
    back = read_all(pool)
    assert_close_to(f8, back, lambda x: x.abs() * 2**-8 + 1e-30)
    assert {s: pool.seq_len(s) for s in pool.sequences()} == lens
    # pages were compacted: the live sequences hold pages 0..n-1 and the rest is free
    used = sum(len(pool.pages(s)) for s in pool.sequences())
    assert sorted(p for s in pool.sequences() for p in pool.pages(s)) == list(range(used))
    assert pool.free_pages() == 24 - used
    check_invariants(pool)


def test_rebuild_resize_and_keep_allocating():
    pool = KVPool(1, 2, 64, num_pages=30, page_size=4, kv_cache_dtype="q8_0")
    fill(pool, [10, 6], seed=1)
    before = read_all(pool)
    used = pool.num_pages - pool.free_pages()
    pool.rebuild(num_pages=used)  # same format: the bytes survive exactly
    assert pool.num_pages == used and pool.free_pages() == 0
    assert_close_to(before, read_all(pool), lambda x: torch.zeros_like(x))
    pool.rebuild(num_pages=used + 5)
    s = pool.new_sequence()
    slots = pool.append(s, 20)
    assert slots.min().item() >= used * 4  # new pages come from the free tail, not from live sequences
    check_invariants(pool)


def test_rebuild_that_cannot_fit_changes_nothing():
    pool = KVPool(2, 2, 64, num_pages=20, page_size=4, kv_cache_dtype="q8_0")
    seqs = fill(pool, [13, 5], seed=2)
    used = pool.num_pages - pool.free_pages()
    planes = [(pool.k_cache(l), pool.v_cache(l), pool.k_scale(l), pool.v_scale(l)) for l in range(2)]
    copies = [tuple(t.clone() for t in p) for p in planes]
    table, lens = pool.block_table(seqs), pool.seq_lens(seqs)
    free = pool.free_pages()
    with pytest.raises(ValueError, match=rf"occupy {used} pages.*would have {used - 1}.*at least {used} pages"):
        pool.rebuild("fp8_e4m3", num_pages=used - 1)
    assert pool.spec.name == "q8_0" and pool.num_pages == 20 and pool.free_pages() == free
    assert torch.equal(pool.block_table(seqs), table) and torch.equal(pool.seq_lens(seqs), lens)
    for l, (p, c) in enumerate(zip(planes, copies)):
        now = (pool.k_cache(l), pool.v_cache(l), pool.k_scale(l), pool.v_scale(l))
        for t_now, t_was, t_copy in zip(now, p, c):
            assert t_now is t_was and torch.equal(t_now.view(torch.uint8), t_copy.view(torch.uint8))
    with pytest.raises(ValueError, match="valid names"):
        pool.rebuild("q3_k")
    assert pool.spec.name == "q8_0"


def test_pool_feeds_decode_attention():
    """The pool's planes, block table and lengths are what the attention op takes, as they are."""
    pool = KVPool(1, 2, 64, num_pages=16, page_size=4, kv_cache_dtype="q8_0")
    seqs = fill(pool, [11, 3, 6], seed=3)
    data = read_all(pool)
    q = torch.randn(len(seqs), 4, 64).to(torch.bfloat16)
    out = kvq.decode_attention(q, pool.k_cache(0), pool.v_cache(0), pool.k_scale(0), pool.v_scale(0),
                               pool.block_table(seqs), pool.seq_lens(seqs))
    for i, s in enumerate(seqs):
        k, v = data[s][0]
        n = k.shape[0]
        pos = torch.arange(n)
        want = reference.attend(q[i:i + 1], k, v, pos[-1:], pos, 64**-0.5, True, -1, 0.0)
        torch.testing.assert_close(out[i].float(), want[0], atol=1e-2, rtol=1e-2)


def plane_bytes_of(pool):
    return [t.view(torch.uint8).cpu() for l in range(pool.num_layers)
            for t in (pool.k_cache(l), pool.v_cache(l), pool.k_scale(l), pool.v_scale(l)) if t is not None]


@pytest.mark.gpu
def test_gpu_pool_matches_cpu_bytes():
    """The same traffic and rebuilds on a CUDA pool leave the same bytes as on the CPU reference."""
    pools = [KVPool(2, 2, 128, num_pages=24, page_size=4, kv_cache_dtype="bf16", device=dev)
             for dev in ("cpu", "cuda")]
    for p in pools:
        fill(p, [9, 1, 17, 4], seed=4)
    for fmt in ("q8_0", "fp8_e4m3", "bf16"):
        for p in pools:
            p.rebuild(fmt)
        for a, b in zip(plane_bytes_of(pools[0]), plane_bytes_of(pools[1])):
            assert torch.equal(a, b), f"CPU and CUDA pools differ after rebuild to {fmt}"
        seqs = pools[1].sequences()
        assert pools[1].block_table(seqs).is_cuda and torch.equal(pools[0].block_table(seqs),
                                                                  pools[1].block_table(seqs).cpu())


@pytest.mark.gpu
def test_from_free_memory_on_gpu():
    free, _ = torch.cuda.mem_get_info()
    pool = KVPool.from_free_memory(0.001, 4, 2, 128, kv_cache_dtype="q8_0")
    budget = int(free * 0.001)
    assert pool.k_cache(0).is_cuda and pool.k_cache(0).dtype == torch.int8
    # free memory may move a little between the two reads
    assert 0.99 * budget - pool.page_bytes() < pool.num_pages * pool.page_bytes() <= 1.01 * budget
    assert plane_bytes(pool) == pool.num_pages * pool.page_bytes()


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "bf16"])
def test_rebuild_in_the_same_format_keeps_the_bytes(fmt):
    """A resize moves each token's stored bytes and scales as they are (re-quantizing a dequantized value need
    not give them back: for fp16 K/V in a bf16-model pool most would change)."""
    pool = KVPool(2, 2, 64, num_pages=12, page_size=4, kv_cache_dtype=fmt, model_dtype=torch.bfloat16)
    kdt = torch.bfloat16 if fmt == "bf16" else torch.float16  # fp16 K/V: their 8-bit bytes do not survive bf16
    seqs = [pool.new_sequence() for _ in range(3)]
    for s in seqs:
        n = int(torch.randint(1, 13, ()))
        slots = pool.append(s, n)
        for l in range(2):
            k, v = ((torch.randn(n, 2, 64) * 5).to(kdt) for _ in range(2))
            kvq.store_kv(k, v, pool.k_cache(l), pool.v_cache(l), pool.k_scale(l), pool.v_scale(l), slots)
    pool.free(seqs[1])  # leaves a hole, so the rebuild moves tokens to other slots

    def stored(p):
        out = []
        for s in p.sequences():
            slot = p.slots(s)
            for l in range(2):
                for t in (p.k_cache(l), p.v_cache(l), p.k_scale(l), p.v_scale(l)):
                    if t is not None:
                        out.append(t.view(torch.uint8).flatten(0, 1)[slot].clone())
        return out

    before = stored(pool)
    used = pool.num_pages - pool.free_pages()
    for size in (used, used + int(torch.randint(1, 9, ())), 12):
        pool.rebuild(num_pages=size)
        assert pool.num_pages == size
        after = stored(pool)
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    check_invariants(pool)


def test_token_counts_are_checked():
    pool = KVPool(1, 1, 32, num_pages=2, page_size=int(torch.randint(1, 9, ())), kv_cache_dtype="q8_0")
    n = int(torch.randint(1, 100, ()))
    assert pool.pages_for(n) == -(-n // pool.page_size) and pool.kv_cost(n) == pool.pages_for(n) * pool.page_bytes()
    for bad in (-n, n + 0.5, float(n), True, str(n), None):
        for fn in (pool.pages_for, pool.kv_cost):
            with pytest.raises(ValueError, match="non-negative int"):
                fn(bad)


def test_unquantized_pool_must_be_the_model_dtype():
    model, other = [(torch.bfloat16, "fp16"), (torch.float16, "bf16")][int(torch.randint(0, 2, ()))]
    with pytest.raises(ValueError, match="unquantized cache must match the model dtype"):
        KVPool(1, 2, 64, 4, kv_cache_dtype=other, model_dtype=model)
    with pytest.raises(ValueError, match="unquantized cache must match the model dtype"):
        KVPool.from_budget(2**20, 1, 2, 64, kv_cache_dtype=other, model_dtype=model)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        KVPool(1, 2, 64, 4, kv_cache_dtype="q8_0", model_dtype=torch.float32)
    pool = KVPool(1, 2, 64, 4, kv_cache_dtype="q8_0", model_dtype=model)
    with pytest.raises(ValueError, match="unquantized cache must match the model dtype"):
        pool.rebuild(other)
    assert pool.spec.name == "q8_0"
    pool.rebuild("auto")
    assert pool.cache_dtype == model
