"""The op schemas, fake implementations, wrappers and input checks (CPU)."""

import math

import pytest
import torch

import kvq
from kvq import reference
from kvq.ops import SCHEMAS

from common import poison_, random_paged


def store_args(fmt=torch.int8, t=9, hkv=2, d=64, page_size=16, pages=4, dtype=torch.bfloat16):
    kc, ks = kvq.new_cache(pages, page_size, hkv, d, fmt)
    vc, vs = kvq.new_cache(pages, page_size, hkv, d, fmt)
    for x in (kc, vc, ks, vs):
        if x is not None:
            poison_(x)
    key = torch.randn(t, hkv, d, dtype=dtype)
    value = torch.randn(t, hkv, d, dtype=dtype)
    slots = torch.randperm(pages * page_size)[:t]
    slots[0] = -1
    return [key, value, kc, vc, ks, vs, slots]


def decode_args(fmt=torch.int8, lens=(5, 40), hq=8, hkv=2, d=64, page_size=16):
    p = random_paged(lens, page_size, hkv, d, fmt)
    q = torch.randn(len(lens), hq, d, dtype=torch.bfloat16)
    return [q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens, 0.125, -1, 0.0,
            poison_(torch.empty_like(q))]


def extend_args(fmt=torch.int8, prefix=(0, 19), new=(3, 6), hq=4, hkv=2, d=64, page_size=8):
    p = random_paged([a + b for a, b in zip(prefix, new)], page_size, hkv, d, fmt)
    n = sum(new)
    q = torch.randn(n, hq, d, dtype=torch.bfloat16)
    k, v = torch.randn(n, hkv, d, dtype=torch.bfloat16), torch.randn(n, hkv, d, dtype=torch.bfloat16)
    cu = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32)
    return [q, k, v, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table,
            torch.tensor(prefix, dtype=torch.int32), cu, 0.125, True, -1, 0.0, poison_(torch.empty_like(q))]


def test_ops_exist_with_schemas():
    for name, schema in SCHEMAS.items():
        op = getattr(torch.ops.kvq, name).default
        assert str(op._schema).replace("kvq::", "") .startswith(name)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvq::{name}", "CPU")


@pytest.mark.parametrize("fmt", [torch.int8, torch.float8_e4m3fn, torch.bfloat16])
def test_opcheck(fmt):
    utils = ("test_schema", "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    if fmt == torch.float8_e4m3fn:
        # opcheck's schema test does arithmetic on every argument, which torch lacks for fp8 on CPU; the
        # schemas are the same for every format and are checked on the int8 and bf16 cases.
        utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    check = lambda op, args: torch.library.opcheck(op, args, test_utils=utils)
    check(torch.ops.kvq.store_kv.default, store_args(fmt))
    check(torch.ops.kvq.decode_attention.default, decode_args(fmt))
    check(torch.ops.kvq.extend_attention.default, extend_args(fmt))
    a = store_args(fmt)
    kvq.store_kv(*a)
    written = a[6][a[6] >= 0]  # unwritten slots hold poison (NaN scales)
    check(torch.ops.kvq.dequantize.default, (a[2], a[4], written, torch.bfloat16))


def test_store_writes_only_mapped_slots():
    a = store_args()
    before = a[2].clone()
    kvq.store_kv(*a)
    slots = a[6]
    written = torch.zeros(a[2].shape[0] * a[2].shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = a[2].view(-1, *a[2].shape[2:])
    assert torch.equal(flat[~written], before.view_as(flat)[~written])
    q, s = reference.quantize(a[0][1:], torch.int8)
    assert torch.equal(flat[slots[1:]], q)


def test_wrappers_allocate_and_return_out():
    a = decode_args()
    out = kvq.decode_attention(*a[:7], sm_scale=0.125)
    assert out.shape == a[0].shape and torch.isfinite(out).all()
    e = extend_args()
    out = kvq.extend_attention(*e[:10])
    assert out.shape == e[0].shape and torch.isfinite(out).all()


def test_torch_compile_fullgraph():
    a = decode_args(lens=(30, 12))

    def layer(q, k_new, v_new, slots, kc, vc, ks, vs, bt, sl):
        kvq.store_kv(k_new, v_new, kc, vc, ks, vs, slots)
        return kvq.decode_attention(q, kc, vc, ks, vs, bt, sl, sm_scale=0.125) * 2

    q, kc, vc, ks, vs, bt, sl = a[:7]
    k_new = torch.randn(2, 2, 64, dtype=torch.bfloat16)
    v_new = torch.randn(2, 2, 64, dtype=torch.bfloat16)
    slots = (bt[:, 0].long() * 16 + 3)
    args = (q, k_new, v_new, slots, kc, vc, ks, vs, bt, sl)
    clones = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
    eager = layer(*args)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(*clones)
    assert torch.equal(eager, compiled)
    assert torch.equal(kc, clones[4]) and torch.equal(ks.view(torch.int16), clones[6].view(torch.int16))


def test_torch_compile_fullgraph_dynamic_shapes_on_meta():
    """Traced with symbolic sizes, the wrappers must not break the graph. Meta tensors take the path CUDA tensors
    take (the wrappers' own checks, then the op), so this runs without a GPU; they must also pass eagerly."""
    def layer(q, k_new, v_new, slots, kc, vc, ks, vs, bt, sl):
        kvq.store_kv(k_new, v_new, kc, vc, ks, vs, slots)
        return kvq.decode_attention(q, kc, vc, ks, vs, bt, sl, sm_scale=0.125) * 2

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="eager")
    for batch, tokens in ((2, 3), (5, 7)):
        a = decode_args(lens=tuple(range(9, 9 + batch)))
        k_new = torch.randn(tokens, 2, 64, dtype=torch.bfloat16)
        slots = torch.arange(tokens)
        args = [x.to("meta") for x in (a[0], k_new, k_new, slots, *a[1:7])]
        for fn in (compiled, layer):  # and eagerly: meta tensors have no memory, so no data pointer to compare
            out = fn(*args)
            assert out.device.type == "meta" and out.shape == a[0].shape


# ---------------------------------------------------------------------------------------- bad input
def _raises(fn, args, *words):
    with pytest.raises(ValueError) as e:
        fn(*args)
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


BAD_STORE = [
    ("wrong key dtype", lambda a: a.__setitem__(0, a[0].float()), ["key", "dtype"]),
    ("wrong key shape", lambda a: a.__setitem__(0, a[0][:, :1]), ["key", "shape"]),
    ("value/key count", lambda a: a.__setitem__(1, a[1][:-1]), ["value", "shape"]),
    ("head_dim 48", None, ["head_dim 48", "multiple of 32"]),
    ("slot out of range", lambda a: a[6].__setitem__(1, 10_000), ["slot_mapping", "valid slots"]),
    ("slot below -1", lambda a: a[6].__setitem__(1, -5), ["slot_mapping"]),
    ("slot count", lambda a: a.__setitem__(6, a[6][:-1]), ["slot_mapping", "entries"]),
    ("missing scale", lambda a: a.__setitem__(4, None), ["k_scale", "required"]),
    ("scale shape", lambda a: a.__setitem__(5, a[5][:, :, :, :1].contiguous()), ["v_scale", "shape"]),
    ("scale dtype", lambda a: a.__setitem__(4, a[4].float()), ["k_scale", "dtype"]),
    ("cache mismatch", lambda a: a.__setitem__(3, a[3][:2].contiguous()), ["same shape"]),
    ("slot dtype", lambda a: a.__setitem__(6, a[6].float()), ["slot_mapping", "dtype"]),
]


@pytest.mark.parametrize("case", BAD_STORE, ids=[c[0] for c in BAD_STORE])
def test_store_rejects_bad_input_before_writing(case):
    name, mutate, words = case
    if mutate is None:
        a = store_args(d=64)
        a[2] = torch.zeros(4, 16, 2, 48, dtype=torch.int8)
        a[3] = torch.zeros(4, 16, 2, 48, dtype=torch.int8)
    else:
        a = store_args()
        mutate(a)
    snapshot = [x.clone() if isinstance(x, torch.Tensor) else x for x in a[2:6]]
    _raises(kvq.store_kv, a, *words)
    _raises(torch.ops.kvq.store_kv, a, *words)  # the registered op checks too
    for x, y in zip(a[2:6], snapshot):
        if isinstance(x, torch.Tensor) and x.shape == y.shape:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), "a rejected call wrote to the cache"


def test_unquantized_cache_rejects_scales_and_dtype_mismatch():
    a = store_args(fmt=torch.bfloat16)
    a[4] = torch.zeros(4, 16, 2, 2, dtype=torch.float16)
    _raises(kvq.store_kv, a, "k_scale", "must be None")
    a = store_args(fmt=torch.bfloat16, dtype=torch.float16)
    _raises(kvq.store_kv, a, "key", "dtype")


def test_device_mismatch_is_reported():
    a = store_args()
    a[0] = a[0].to("meta")
    _raises(kvq.store_kv, a, "key", "meta")


BAD_DECODE = [
    ("gqa", lambda a: a.__setitem__(0, a[0][:, :3]), ["heads", "multiple"]),
    ("out shape", lambda a: a.__setitem__(10, a[10][:, :4]), ["out", "shape"]),
    ("out dtype", lambda a: a.__setitem__(10, a[10].float()), ["out", "dtype"]),
    ("seq_lens beyond table", lambda a: a[6].__setitem__(0, 10_000), ["seq_lens", "block_table"]),
    ("negative seq_len", lambda a: a[6].__setitem__(0, -1), ["seq_lens"]),
    ("page out of range", lambda a: a[5].__setitem__((1, 0), 999), ["block_table", "page"]),
    ("table dtype", lambda a: a.__setitem__(5, a[5].long()), ["block_table", "dtype"]),
    ("batch mismatch", lambda a: a.__setitem__(6, a[6][:1]), ["seq_lens", "one row per"]),
    ("query head_dim", lambda a: a.__setitem__(0, a[0][..., :32]), ["head_dim"]),
    ("sm_scale", lambda a: a.__setitem__(7, -1.0), ["sm_scale"]),
    ("window", lambda a: a.__setitem__(8, -2), ["window_left"]),
    ("softcap", lambda a: a.__setitem__(9, -1.0), ["logit_softcap"]),
    ("query dtype", lambda a: a.__setitem__(0, a[0].float()), ["query", "dtype"]),
]


@pytest.mark.parametrize("case", BAD_DECODE, ids=[c[0] for c in BAD_DECODE])
def test_decode_rejects_bad_input(case):
    name, mutate, words = case
    a = decode_args()
    mutate(a)
    _raises(torch.ops.kvq.decode_attention, a, *words)


def test_extend_rejects_bad_cu_seqlens_and_prefix():
    e = extend_args()
    e[9] = torch.tensor([0, 5, 4], dtype=torch.int32)
    _raises(torch.ops.kvq.extend_attention, e, "cu_seqlens_q")
    e = extend_args()
    e[8] = torch.tensor([0, 10_000], dtype=torch.int32)
    _raises(torch.ops.kvq.extend_attention, e, "prefix_lens")
    e = extend_args()
    e[1] = e[1][:-1]
    _raises(torch.ops.kvq.extend_attention, e, "key", "shape")


def test_index_checks_always_run_on_cpu():
    """The switch saves a host sync on GPU; on CPU there is none to save, so the checks stay on (DESIGN.md)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvq import _checks

    a = decode_args()
    a[6][int(torch.randint(0, 2, ()))] = int(torch.randint(41, 10_000, ()))
    s = store_args()
    s[6][1] = -int(torch.randint(2, 100, ()))
    kvq.set_index_checks(False)
    try:
        _raises(kvq.decode_attention, a[:7], "seq_lens", "block_table")
        _raises(torch.ops.kvq.decode_attention, a, "seq_lens", "block_table")
        _raises(kvq.store_kv, s, "slot_mapping")
        with FakeTensorMode():
            gpu = torch.empty(3, dtype=torch.int32, device="cuda")  # no GPU needed: a fake tensor
        assert not _checks.index_checks_enabled(gpu), "the switch must still turn the GPU checks off"
        assert _checks.index_checks_enabled(a[6])
    finally:
        kvq.set_index_checks(True)
    _raises(_checks.check_decode, a, "seq_lens")


def _pages_overlapping(c, stride0):
    """The same shape as cache plane ``c`` with its pages ``stride0`` elements apart (dense within a page)."""
    return torch.zeros(c.numel(), dtype=c.dtype).as_strided(c.shape, (stride0,) + c.stride()[1:])


@pytest.mark.parametrize("fmt", [torch.int8, torch.float8_e4m3fn, torch.bfloat16])
def test_overlapping_pages_are_refused(fmt):
    a = store_args(fmt)
    page = a[2][0].numel()
    stride0 = int(torch.randint(0, page, ()))  # 0 (expanded) up to one element short of a page
    name = ["k_cache", "v_cache"][int(torch.randint(0, 2, ()))]
    i = 2 if name == "k_cache" else 3
    a[i] = _pages_overlapping(a[i], stride0)
    before = [x.clone() for x in a[2:6] if x is not None]
    for fn in (kvq.store_kv, torch.ops.kvq.store_kv):
        _raises(fn, a, name, "pages overlap", f"page stride is {stride0}", str(page))
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in
               zip([x for x in a[2:6] if x is not None], before)), "a refused store wrote"
    d = decode_args(fmt)
    d[1] = _pages_overlapping(d[1], stride0 % d[1][0].numel())
    _raises(kvq.decode_attention, d[:7], "k_cache", "pages overlap")
    _raises(kvq.dequantize, (d[1], d[3], torch.tensor([0]), torch.bfloat16), "cache", "pages overlap")
    # A single page has no other page to overlap, and padding between pages is fine: both store as usual.
    a = store_args(fmt, pages=1)
    a[2] = a[2].as_strided(a[2].shape, (0,) + a[2].stride()[1:])
    kvq.store_kv(*a)
    a = store_args(fmt)
    want = [x.clone() if x is not None else None for x in a[2:6]]
    reference.store_kv(*a[:2], *want, a[6])
    pad = int(torch.randint(1, 64, ()))
    padded = torch.zeros(4 * (page + pad), dtype=a[2].dtype).as_strided(a[2].shape, (page + pad,) + a[2].stride()[1:])
    padded.copy_(a[2])
    a[2] = padded
    kvq.store_kv(*a)
    assert torch.equal(a[2].view(torch.uint8), want[0].view(torch.uint8))


def _overlapping_out(q):
    """An ``out`` like ``q`` whose rows (or heads) share memory."""
    if q.shape[0] > 1 and bool(torch.randint(0, 2, ())):
        return torch.empty(1, *q.shape[1:], dtype=q.dtype).expand(q.shape)
    n, h, d = q.shape
    return torch.empty(n * h * d, dtype=q.dtype).as_strided(q.shape, (h * d, d // 2, 1))  # heads half overlap


def test_overlapping_out_is_refused():
    a = decode_args()
    a[10] = _overlapping_out(a[0])
    _raises(torch.ops.kvq.decode_attention, a, "out", "overlap")
    with pytest.raises(ValueError, match="out has elements that overlap"):
        kvq.decode_attention(*a[:7], out=a[10])
    e = extend_args()
    e[14] = _overlapping_out(e[0])
    _raises(torch.ops.kvq.extend_attention, e, "out", "overlap")
    # Padded and permuted outputs share no memory: they are written like a fresh one.
    a = decode_args()
    want = torch.empty_like(a[0])
    reference.decode_attention(*a[:10], want)
    n, h, d = a[0].shape
    a[10] = torch.full((h, n + 3, d), math.nan, dtype=a[0].dtype)[:, :n].transpose(0, 1)
    torch.ops.kvq.decode_attention(*a)
    assert torch.equal(a[10], want)


def test_triton_attention_head_dims_match_the_message():
    from kvq.triton_backend._common import check_head_dim

    for d in (32, 64, 128, 256):
        check_head_dim("decode_attention", d)
    other = [16, 512, 1024, 2048, 8][int(torch.randint(0, 5, ()))]  # powers of two it was never tested at
    with pytest.raises(ValueError) as e:
        check_head_dim("extend_attention", other)
    assert f"got {other}" in str(e.value) and "head_dim 32, 64, 128, 256," in str(e.value)


def test_non_contiguous_query_view_is_accepted():
    a = decode_args()
    big = torch.randn(a[0].shape[0], a[0].shape[1] * 2, a[0].shape[2], dtype=torch.bfloat16)
    a[0] = big[:, ::2]
    assert not a[0].is_contiguous()
    torch.ops.kvq.decode_attention(*a)
    want = torch.empty_like(a[10])
    reference.decode_attention(a[0].contiguous(), *a[1:10], want)
    assert torch.equal(a[10], want)
    assert not math.isnan(a[10].float().sum().item())


def test_each_wrapper_checks_its_inputs_once(monkeypatch):
    """On CPU, torch.ops.kvq.* checks inside the op; the wrapper must not check a second time (each pass of the
    index checks reads the indices)."""
    from kvq import ops

    calls = {}
    for name, check in list(ops.CHECKS.items()):
        def counted(*args, _name=name, _check=check):
            calls[_name] = calls.get(_name, 0) + 1
            return _check(*args)

        monkeypatch.setitem(ops.CHECKS, name, counted)
    kvq.store_kv(*store_args())
    a = decode_args()
    kvq.decode_attention(*a[:7], sm_scale=a[7], out=a[10])
    e = extend_args()
    kvq.extend_attention(*e[:10], sm_scale=e[10], out=e[14])
    d = decode_args()
    kvq.dequantize(d[1], d[3], torch.tensor([0, 3, -1]), torch.bfloat16)
    assert calls == {"store_kv": 1, "decode_attention": 1, "extend_attention": 1, "dequantize": 1}
    bad = decode_args()
    bad[6][0] = 10_000
    with pytest.raises(ValueError, match="seq_lens"):
        kvq.decode_attention(*bad[:7], sm_scale=bad[7], out=bad[10])


@pytest.mark.parametrize("fmt", [torch.int8, torch.float8_e4m3fn, torch.bfloat16])
def test_one_plane_passed_as_both_k_and_v_is_refused(fmt):
    """store_kv writes K and V to separate planes; one tensor passed as both would lose the keys."""
    a = store_args(fmt)
    a[3] = a[2]
    _raises(kvq.store_kv, a, "k_cache and v_cache are the same memory")
    if fmt != torch.bfloat16:
        a = store_args(fmt)
        a[5] = a[4]
        _raises(kvq.store_kv, a, "k_scale and v_scale are the same memory")
