"""Random valid and invalid calls to the public ops (a bounded, seeded fuzz loop).

Each iteration builds a valid call of one op (random format, shapes, page size, GQA group, views, zero-length
sequences, empty batches, garbage in unused block-table entries) and, most of the time, breaks exactly one
thing about it. A valid call must match the reference; an invalid one must raise ValueError naming the
offending argument before anything is written (every tensor passed in is byte-identical afterwards).

On a GPU the same loop runs on CUDA tensors through the active backend, and a second loop, with index checks
off, feeds out-of-range slots, pages and lengths straight to the kernels: they must not fault or write
outside their tensors (it runs in a child process, so a fault cannot take the test session down with it).

``python tests/test_fuzz.py --device cuda --unchecked`` runs the unchecked loop by hand.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

import kvq
from kvq import _checks, reference

from common import INTERPRET, poison_, random_paged, rel_err

OPS = ("store_kv", "decode_attention", "extend_attention", "dequantize")
FMTS = ("q8_0", "fp8_e4m3", "bf16", "fp16")
QUANT = {"q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
ATTN_HEAD_DIMS = (64, 128, 256)  # what every backend must serve; 32 and 96 are in test_unusual_shapes
STORE_HEAD_DIMS = (32, 64, 96, 128, 256)
MUTABLE = {"store_kv": ("k_cache", "v_cache", "k_scale", "v_scale"), "decode_attention": ("out",),
           "extend_attention": ("out",), "dequantize": ()}
WRAPPERS = {"store_kv": kvq.store_kv, "decode_attention": kvq.decode_attention,
            "extend_attention": kvq.extend_attention, "dequantize": kvq.dequantize}


@dataclass
class Call:
    op: str
    args: dict  # keyword arguments of the public wrapper
    meta: dict = field(default_factory=dict)  # shape facts the mutations need (pages, page_size, lengths)
    what: str = "valid"  # the one thing broken, or "valid"

    def tensors(self):
        return {k: v for k, v in self.args.items() if isinstance(v, torch.Tensor)}


# --------------------------------------------------------------------------------------------- helpers
def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (of its elements, in logical order)."""
    flat = t.detach().reshape(-1)
    return torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat).view(torch.uint8)


def page_strided(t: torch.Tensor) -> torch.Tensor:
    """The same contents in a view whose pages are twice as far apart (dense within a page: valid)."""
    big = torch.empty((2 * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    poison_(big)
    view = big[::2]
    view.copy_(t)
    return view


def row_strided(t: torch.Tensor) -> torch.Tensor:
    """The same contents in a view with a padded leading stride (unit stride on the last dim: valid)."""
    big = torch.empty((t.shape[0], 2 * t.shape[1]) + tuple(t.shape[2:]), dtype=t.dtype, device=t.device)
    view = big[:, : t.shape[1]]
    view.copy_(t)
    return view


def spaced(t: torch.Tensor) -> torch.Tensor:
    """A 1-D index tensor as a stride-2 view (the checks accept it; CUDA adapters call .contiguous())."""
    big = torch.empty(2 * t.shape[0], dtype=t.dtype, device=t.device).fill_(-7)
    view = big[::2]
    view.copy_(t)
    return view


def model_dtype(fmt, rng):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(fmt) or rng.choice([torch.bfloat16, torch.float16])


def cache_dtype(fmt, model):
    return QUANT.get(fmt, model)


def heads(rng, attention):
    hkv = rng.choice([1, 2, 4] if attention else [1, 2, 3, 4])
    return hkv * rng.choice([1, 2, 4, 8]), hkv


# --------------------------------------------------------------------------------------- valid builders
def build(op, rng: random.Random, device) -> Call:
    fmt = rng.choice(FMTS)
    model = model_dtype(fmt, rng)
    cdt = cache_dtype(fmt, model)
    page_size = rng.choice([1, 3, 16])
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    randn = lambda *s: torch.randn(*s, generator=gen).to(model).to(device)
    if op in ("store_kv", "dequantize"):
        hq, hkv = heads(rng, False)
        d = rng.choice(STORE_HEAD_DIMS)
        pages = rng.randint(1, 5)
        nslots = pages * page_size
        caches = [kvq.new_cache(pages, page_size, hkv, d, cdt, device) for _ in range(2)]
        (kc, ks), (vc, vs) = caches
        for t in (kc, vc, ks, vs):
            if t is not None:
                poison_(t)
        if op == "dequantize":
            # Fill every slot, then gather a random selection (repeats and -1 allowed).
            everything = torch.arange(nslots, device=device)
            reference.store_kv(randn(nslots, hkv, d), randn(nslots, hkv, d), kc, vc, ks, vs, everything)
            n = rng.choice([0, 1, 4, 9])
            slots = torch.randint(-1, nslots, (n,), generator=gen).to(device)
            slots = slots.int() if rng.random() < 0.3 else slots
            if n and rng.random() < 0.2:
                slots = spaced(slots)
            cache, scale = (kc, ks) if rng.random() < 0.5 else (vc, vs)
            if rng.random() < 0.2:
                cache = page_strided(cache)
            args = dict(cache=cache, scale=scale, slot_mapping=slots, dtype=rng.choice([torch.bfloat16, torch.float16]))
            return Call(op, args, dict(pages=pages, page_size=page_size, hkv=hkv, d=d))
        t = rng.choice([0, 1, 2, 5, 9])
        t = min(t, nslots)
        key, value = randn(t, hkv, d) * rng.choice([1.0, 30.0]), randn(t, hkv, d)
        if t and rng.random() < 0.2:
            key, value = row_strided(key.transpose(0, 1)).transpose(0, 1), row_strided(value)
        slots = torch.randperm(nslots, generator=gen)[:t]
        slots[torch.rand(t, generator=gen) < 0.2] = -1
        slots = slots.to(device)
        slots = slots.int() if rng.random() < 0.3 else slots
        if t and rng.random() < 0.2:
            slots = spaced(slots)
        if rng.random() < 0.2:
            kc, vc = page_strided(kc), page_strided(vc)
        args = dict(key=key, value=value, k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, slot_mapping=slots)
        return Call(op, args, dict(pages=pages, page_size=page_size, hkv=hkv, d=d))

    hq, hkv = heads(rng, True)
    d = rng.choice(ATTN_HEAD_DIMS)
    batch = rng.choice([0, 1, 1, 2, 3])
    choose_len = lambda: rng.choice([0, 1, 2, 7, 16, 17, 40, 100])
    if op == "decode_attention":
        lens = [choose_len() for _ in range(batch)]
        new = None
    else:
        prefix = [choose_len() for _ in range(batch)]
        new = [rng.choice([0, 1, 3, 9, 20]) for _ in range(batch)]
        lens = [a + b for a, b in zip(prefix, new)]
    p = random_paged(lens or [1], page_size, hkv, d, cdt, model, device, extra_pages=2,
                     scale=rng.choice([0.5, 1.0, 4.0]))
    bt = p.block_table[:batch]
    used = [max(1, -(-n // page_size)) for n in lens]
    if batch and rng.random() < 0.4:
        # Entries past a sequence's pages are never read: garbage there is valid.
        bt = bt.clone()
        for b in range(batch):
            bt[b, used[b]:] = rng.choice([-1, 10**6, -(2**31)])
    if batch and rng.random() < 0.2:
        bt = row_strided(bt)
    kc, vc = (page_strided(p.k_cache), page_strided(p.v_cache)) if rng.random() < 0.2 else (p.k_cache, p.v_cache)
    scalars = dict(sm_scale=rng.choice([None, 0.05, 0.3]), window_left=rng.choice([-1, -1, 0, 5, 30]),
                   logit_softcap=rng.choice([0.0, 0.0, 20.0]))
    meta = dict(pages=p.k_cache.shape[0], page_size=page_size, hkv=hkv, d=d, lens=lens, used=used)
    if op == "decode_attention":
        q = randn(batch, hq, d)
        if batch and rng.random() < 0.2:
            q = row_strided(q.transpose(0, 1)).transpose(0, 1)
        seq_lens = p.seq_lens[:batch]
        if batch and rng.random() < 0.15:
            seq_lens = spaced(seq_lens)
        args = dict(query=q, k_cache=kc, v_cache=vc, k_scale=p.k_scale, v_scale=p.v_scale, block_table=bt,
                    seq_lens=seq_lens, **scalars)
    else:
        n = sum(new)
        k_new = torch.cat([p.k_src[b][prefix[b]:] for b in range(batch)]) if batch else randn(0, hkv, d)
        v_new = torch.cat([p.v_src[b][prefix[b]:] for b in range(batch)]) if batch else randn(0, hkv, d)
        cu = torch.tensor([0] + [sum(new[: b + 1]) for b in range(batch)], dtype=torch.int32, device=device)
        q = randn(n, hq, d)
        args = dict(query=q, key=k_new, value=v_new, k_cache=kc, v_cache=vc, k_scale=p.k_scale,
                    v_scale=p.v_scale, block_table=bt,
                    prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=device), cu_seqlens_q=cu,
                    causal=rng.random() < 0.8, **scalars)
        meta.update(prefix=prefix, new=new, n=n)
    if rng.random() < 0.5:
        out = torch.empty_like(q)
        if q.shape[0] and rng.random() < 0.3:
            out = row_strided(out.transpose(0, 1)).transpose(0, 1)
        args["out"] = poison_(out)
    return Call(op, args, meta)


# ------------------------------------------------------------------------------------------ mutations
# Each takes (call, rng) and breaks one thing, returning the words the error must contain, or None when it
# does not apply to this call (another is drawn).
def _set(call, name, value):
    call.args[name] = value


def m_dtype(call, rng):
    bad = {"key": torch.float32, "query": torch.float32, "slot_mapping": torch.float32,
           "block_table": torch.int64, "seq_lens": torch.int64, "prefix_lens": torch.int64,
           "cu_seqlens_q": torch.int64, "out": torch.float32, "k_scale": torch.float32,
           "v_scale": torch.bfloat16, "scale": torch.float32, "k_cache": torch.float32, "cache": torch.int32}
    names = [n for n in bad if isinstance(call.args.get(n), torch.Tensor)]
    if call.op == "store_kv":
        names.append("value")
    name = rng.choice(names)
    t = call.args[name]
    if name == "value":  # value must match key's dtype exactly
        _set(call, name, t.to(torch.float16 if t.dtype == torch.bfloat16 else torch.bfloat16))
    else:
        _set(call, name, t.to(bad[name]))
    return [name, "dtype"]


def m_meta(call, rng):
    names = [n for n, t in call.tensors().items() if n not in ("k_cache", "cache")]
    name = rng.choice(names)
    dev = "cpu" if call.args[name].is_cuda and rng.random() < 0.5 else "meta"
    _set(call, name, call.args[name].to(dev))
    return [name, dev]


def m_shape(call, rng):
    a, op = call.args, call.op
    options = {
        "store_kv": ["key", "value", "slot_mapping", "ndim", "k_scale"],
        "dequantize": ["slot_mapping_2d", "scale"],
        "decode_attention": ["query_d", "block_table", "seq_lens", "ndim", "out", "k_scale"],
        "extend_attention": ["query_d", "key", "value", "block_table", "prefix_lens", "cu_seqlens_q", "out"],
    }[op]
    choice = rng.choice(options)
    if choice == "key":
        k = a["key"]
        _set(call, "key", k[:, :-1] if k.shape[1] > 1 else torch.cat([k, k], 1))
        return ["key", "shape"]
    if choice == "value":
        v = a["value"]
        _set(call, "value", torch.cat([v, v[:1] if v.shape[0] else v.new_zeros(1, *v.shape[1:])]))
        return ["value", "shape"]
    if choice == "slot_mapping":
        s = a["slot_mapping"]
        _set(call, "slot_mapping", torch.cat([s, s.new_full((1,), -1)]))
        return ["slot_mapping", "entries"]
    if choice == "slot_mapping_2d":
        _set(call, "slot_mapping", a["slot_mapping"][None])
        return ["slot_mapping", "dims"]
    if choice == "ndim":
        name = "key" if op == "store_kv" else "query"
        _set(call, name, a[name][None])
        return [name, "dims"]
    if choice in ("k_scale", "scale"):
        s = a[choice]
        if s is None:
            return None
        _set(call, choice, s[:-1].contiguous() if s.shape[0] > 1 else torch.cat([s, s]))
        return [choice, "shape"]
    if choice == "query_d":
        _set(call, "query", a["query"][..., :-32])
        return ["head_dim"]
    if choice == "out":
        q = a["query"]
        _set(call, "out", torch.empty(q.shape[0] + 1, *q.shape[1:], dtype=q.dtype, device=q.device))
        return ["out", "shape"]
    if choice == "block_table":
        bt = a["block_table"]
        _set(call, "block_table", torch.cat([bt, bt.new_zeros(1, bt.shape[1])]))
        return ["block_table", "one row per"]
    if choice in ("seq_lens", "prefix_lens"):
        s = a[choice]
        _set(call, choice, torch.cat([s, s.new_zeros(1)]))
        return [choice]
    if choice == "cu_seqlens_q":
        _set(call, "cu_seqlens_q", a["cu_seqlens_q"][:-1])
        return ["cu_seqlens_q"]
    raise AssertionError(choice)


def _replace_caches(call, make):
    names = ("cache",) if call.op == "dequantize" else ("k_cache", "v_cache")
    for n in names:
        _set(call, n, make(call.args[n]))
    return names


def m_head_dim_48(call, rng):
    def make(c):
        return torch.zeros(*c.shape[:3], 48, dtype=c.dtype, device=c.device)

    _replace_caches(call, make)
    for n in ("k_scale", "v_scale", "scale"):
        if call.args.get(n) is not None:
            s = call.args[n]
            _set(call, n, torch.zeros(*s.shape[:3], 1, dtype=s.dtype, device=s.device))
    return ["head_dim 48", "multiple of 32"]


def m_gqa(call, rng):
    if call.op not in ("decode_attention", "extend_attention") or call.meta["hkv"] == 1:
        return None
    q = call.args["query"]
    _set(call, "query", torch.randn(q.shape[0], q.shape[1] + 1, q.shape[2], device=q.device).to(q.dtype))
    call.args.pop("out", None)
    return ["query", "heads", "multiple"]


def m_zero_heads(call, rng):
    if call.op not in ("decode_attention", "extend_attention"):
        return None
    q = call.args["query"]
    _set(call, "query", q[:, :0])
    call.args.pop("out", None)
    return ["query", "heads"]


def m_slot_range(call, rng):
    if call.op not in ("store_kv", "dequantize") or not call.args["slot_mapping"].shape[0]:
        return None
    s = call.args["slot_mapping"].clone()
    nslots = call.meta["pages"] * call.meta["page_size"]
    s[rng.randrange(s.shape[0])] = rng.choice([nslots, nslots + 1, 10**9, -2, -(2**31)])
    _set(call, "slot_mapping", s)
    return ["slot_mapping", "valid slots"]


def m_bad_page(call, rng):
    if call.op not in ("decode_attention", "extend_attention"):
        return None
    lens = call.meta["lens"] if call.op == "decode_attention" else call.meta["prefix"]
    rows = [b for b, n in enumerate(lens) if n > 0]
    if not rows:
        return None
    b = rng.choice(rows)
    col = rng.randrange(-(-lens[b] // call.meta["page_size"]))
    bt = call.args["block_table"].clone()
    bt[b, col] = rng.choice([call.meta["pages"], call.meta["pages"] + 5, 2**31 - 1, -1, -(2**31)])
    _set(call, "block_table", bt)
    return ["block_table", "page"]


def m_len_range(call, rng):
    if call.op not in ("decode_attention", "extend_attention") or not call.meta["lens"]:
        return None
    name = "seq_lens" if call.op == "decode_attention" else "prefix_lens"
    s = call.args[name].clone()
    cap = call.args["block_table"].shape[1] * call.meta["page_size"]
    s[rng.randrange(s.shape[0])] = rng.choice([cap + 1, 10**6, -1, -(2**31)])
    _set(call, name, s)
    return [name]


def m_cu_seqlens(call, rng):
    if call.op != "extend_attention" or not call.meta["new"]:
        return None
    cu = call.args["cu_seqlens_q"].clone()
    kind = rng.choice(["start", "end", "decrease"])
    if kind == "start":
        cu[0] = rng.choice([1, -1])
    elif kind == "end":
        cu[-1] += rng.choice([1, -1]) if cu[-1] > 0 else 1
    else:
        if cu.shape[0] < 3:
            cu[-1] += 1
        else:
            cu[1] = cu[-1] + 1
    _set(call, "cu_seqlens_q", cu)
    return ["cu_seqlens_q"]


def m_scale_pair(call, rng):
    a = call.args
    quant = (a.get("k_cache", a.get("cache")).dtype in QUANT.values())
    if call.op == "dequantize":
        if quant:
            _set(call, "scale", None)
            return ["scale", "required"]
        c = a["cache"]
        _set(call, "scale", torch.ones(*c.shape[:3], c.shape[3] // 32, dtype=torch.float16, device=c.device))
        return ["scale", "None"]
    kind = rng.choice(["missing", "pages", "v_dtype", "v_pages"])
    if kind == "missing" and quant:
        name = rng.choice(["k_scale", "v_scale"])
        _set(call, name, None)
        return [name, "required"]
    if kind == "missing" or (kind == "pages" and not quant):
        c = a["k_cache"]
        _set(call, "v_scale", torch.ones(*c.shape[:3], c.shape[3] // 32, dtype=torch.float16, device=c.device))
        return ["v_scale", "None"] if not quant else None
    if kind == "pages":
        s = a["k_scale"]
        _set(call, "k_scale", torch.cat([s, s[:1]]))
        return ["k_scale", "shape"]
    if kind == "v_dtype":
        v = a["v_cache"]
        other = {torch.int8: torch.float8_e4m3fn, torch.float8_e4m3fn: torch.int8,
                 torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}[v.dtype]
        _set(call, "v_cache", torch.zeros(v.shape, dtype=other, device=v.device))
        return ["v_cache", "same shape and dtype"]
    v = a["v_cache"]
    _set(call, "v_cache", torch.zeros((v.shape[0] + 1,) + tuple(v.shape[1:]), dtype=v.dtype, device=v.device))
    return ["v_cache", "same shape"]


def m_cache_layout(call, rng):
    name = "cache" if call.op == "dequantize" else rng.choice(["k_cache", "v_cache"])
    c = call.args[name]
    kind = rng.choice(["head_dim_slice", "heads_transposed"])
    if kind == "head_dim_slice":
        big = torch.zeros(*c.shape[:3], 2 * c.shape[3], dtype=c.dtype, device=c.device)
        view = big[..., : c.shape[3]]
    else:
        if c.shape[1] == 1 and c.shape[2] == 1:
            return None
        view = torch.zeros(c.shape[0], c.shape[2], c.shape[1], c.shape[3], dtype=c.dtype,
                           device=c.device).transpose(1, 2)
    _set(call, name, view)
    return [name, "contiguous"]


def m_overlap(call, rng):
    """A plane whose pages overlap, or an out whose rows or heads share memory: a write would clobber itself."""
    names = [n for n in ("cache", "k_cache", "v_cache") if n in call.args and call.args[n].shape[0] > 1]
    q = call.args.get("query")
    if call.op in ("decode_attention", "extend_attention") and q.numel() and (q.shape[0] > 1 or q.shape[1] > 1):
        names.append("out")
    if not names:
        return None
    name = rng.choice(names)
    if name == "out":
        n, h, d = q.shape
        strides = (0, d, 1) if n > 1 and (h == 1 or rng.random() < 0.5) else (h * d, rng.choice([0, 32, d - 32]), 1)
        _set(call, "out", torch.zeros(n * h * d, dtype=q.dtype, device=q.device).as_strided(q.shape, strides))
        return ["out", "overlap"]
    c = call.args[name]
    page = c[0].numel()
    stride0 = rng.choice([0, 1, page // 2, page - 1])
    _set(call, name, torch.zeros(c.numel(), dtype=c.dtype, device=c.device).as_strided(
        c.shape, (stride0,) + c.stride()[1:]))
    return [name, "pages overlap"]


def m_scale_layout(call, rng):
    name = "scale" if call.op == "dequantize" else rng.choice(["k_scale", "v_scale"])
    s = call.args.get(name)
    if s is None or s.shape[0] < 2:
        return None
    _set(call, name, page_strided(s))  # pages apart: the scale planes must be dense
    return [name, "contiguous"]


def m_unit_stride(call, rng):
    names = {"store_kv": ["key", "value"], "decode_attention": ["query", "out", "block_table"],
             "extend_attention": ["query", "key", "value", "out", "block_table"], "dequantize": []}[call.op]
    names = [n for n in names if isinstance(call.args.get(n), torch.Tensor) and call.args[n].shape[-1] > 1]
    if not names:
        return None
    name = rng.choice(names)
    t = call.args[name]
    big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = big[..., ::2]
    view.copy_(t)
    _set(call, name, view)
    return [name, "stride"]


def m_scalar(call, rng):
    if call.op not in ("decode_attention", "extend_attention"):
        return None
    name, value = rng.choice([("sm_scale", 0.0), ("sm_scale", -0.1), ("sm_scale", math.nan), ("sm_scale", math.inf),
                              ("window_left", -2), ("logit_softcap", -1.0), ("logit_softcap", math.nan),
                              ("logit_softcap", math.inf)])
    _set(call, name, value)
    return [name]


def m_none(call, rng):
    required = {"store_kv": ["key", "value", "k_cache", "slot_mapping"],
                "decode_attention": ["query", "k_cache", "block_table", "seq_lens"],
                "extend_attention": ["query", "key", "k_cache", "block_table", "prefix_lens", "cu_seqlens_q"],
                "dequantize": ["cache", "slot_mapping"]}[call.op]
    name = rng.choice(required)
    _set(call, name, None)
    return [name, "torch.Tensor"]


def m_empty_cache(call, rng):
    def make(c):
        return torch.zeros(0, *c.shape[1:], dtype=c.dtype, device=c.device)

    _replace_caches(call, make)
    for n in ("k_scale", "v_scale", "scale"):
        if call.args.get(n) is not None:
            s = call.args[n]
            _set(call, n, torch.zeros(0, *s.shape[1:], dtype=s.dtype, device=s.device))
    return ["empty dimension"]


def m_model_dtype(call, rng):
    a = call.args
    cache = a.get("k_cache", a.get("cache"))
    if call.op == "dequantize":
        _set(call, "dtype", rng.choice([torch.float32, torch.int8]))
        return ["dtype"]
    if cache.dtype in QUANT.values():
        return None
    other = torch.float16 if cache.dtype == torch.bfloat16 else torch.bfloat16
    name = "key" if call.op == "store_kv" else "query"
    _set(call, name, a[name].to(other))
    if call.op == "store_kv":
        _set(call, "value", a["value"].to(other))
    else:
        call.args.pop("out", None)
        if call.op == "extend_attention":
            _set(call, "key", a["key"].to(other))
            _set(call, "value", a["value"].to(other))
    return [name, "dtype" if call.op == "store_kv" else "unquantized"]


MUTATIONS = {
    "dtype": m_dtype, "device": m_meta, "shape": m_shape, "head_dim 48": m_head_dim_48, "gqa": m_gqa,
    "zero query heads": m_zero_heads, "slot out of range": m_slot_range, "bad page": m_bad_page,
    "length beyond table": m_len_range, "cu_seqlens_q": m_cu_seqlens, "cache/scale pair": m_scale_pair,
    "cache layout": m_cache_layout, "scale layout": m_scale_layout, "unit stride": m_unit_stride,
    "scalar": m_scalar, "None": m_none, "empty cache": m_empty_cache, "model dtype": m_model_dtype,
    "overlap": m_overlap,
}
INDEX_MUTATIONS = ("slot out of range", "bad page", "length beyond table", "cu_seqlens_q")


def draw_call(rng, device, invalid_share=0.6, mutations=MUTATIONS, pending=None) -> tuple[Call, list]:
    """A valid call, or (with probability ``invalid_share``) one with a drawn kind of breakage: uniformly, or with
    ``pending`` (a list the caller keeps) from shuffled rounds of every kind, so that each kind comes up once per
    len(mutations) broken calls and a loop of a few hundred calls cannot miss one by chance."""
    if rng.random() >= invalid_share:
        return build(rng.choice(OPS), rng, device), []
    if pending is None:
        name = rng.choice(sorted(mutations))
    else:
        if not pending:
            pending.extend(rng.sample(sorted(mutations), len(mutations)))
        name = pending.pop()
    while True:  # some kinds need a particular op or shape: draw calls until one applies
        call = build(rng.choice(OPS), rng, device)
        words = mutations[name](call, rng)
        if words is not None:
            call.what = name
            return call, words


# ------------------------------------------------------------------------------------------- checking
def positional(call: Call) -> tuple:
    """The schema's argument tuple of a (valid) call, defaults filled in as the wrapper does."""
    a = dict(call.args)
    if call.op in ("decode_attention", "extend_attention"):
        q = a["query"]
        a["sm_scale"] = 1.0 / math.sqrt(q.shape[-1]) if a.get("sm_scale") is None else a["sm_scale"]
        a.setdefault("window_left", -1)
        a.setdefault("logit_softcap", 0.0)
        a.setdefault("causal", True)
    order = {
        "store_kv": ("key", "value", "k_cache", "v_cache", "k_scale", "v_scale", "slot_mapping"),
        "decode_attention": ("query", "k_cache", "v_cache", "k_scale", "v_scale", "block_table", "seq_lens",
                             "sm_scale", "window_left", "logit_softcap", "out"),
        "extend_attention": ("query", "key", "value", "k_cache", "v_cache", "k_scale", "v_scale", "block_table",
                             "prefix_lens", "cu_seqlens_q", "sm_scale", "causal", "window_left",
                             "logit_softcap", "out"),
        "dequantize": ("cache", "scale", "slot_mapping", "dtype"),
    }[call.op]
    return tuple(a.get(k) for k in order)


def expected(call: Call):
    """What the reference gives for a valid call (on copies: the call's own tensors stay untouched)."""
    args = list(positional(call))
    if call.op == "store_kv":
        args[2:6] = [None if t is None else t.clone() for t in args[2:6]]
        reference.store_kv(*args)
        return args[2:6]
    if call.op == "dequantize":
        return reference.dequantize(*args)
    out = torch.full_like(args[0], math.nan, memory_format=torch.contiguous_format)
    args[-1] = out
    getattr(reference, call.op)(*args)
    return out


def segments(call):
    """Row ranges of the output that belong to one sequence each."""
    if call.op == "decode_attention":
        return [(b, b + 1) for b in range(call.args["query"].shape[0])]
    cu = call.args["cu_seqlens_q"].tolist()
    return [(cu[b], cu[b + 1]) for b in range(len(cu) - 1) if cu[b + 1] > cu[b]]


def compare(call, got, want, exact):
    if call.op == "store_kv":
        for name, g, w in zip(("k_cache", "v_cache", "k_scale", "v_scale"), got, want):
            if w is not None:
                assert torch.equal(raw(g), raw(w)), f"{name} bytes differ from the reference"
        return
    if call.op == "dequantize":
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        return
    assert got.shape == want.shape and got.dtype == want.dtype
    if exact:
        assert torch.equal(got, want), "output differs from the reference"
        return
    for lo, hi in segments(call):
        g, w = got[lo:hi].float(), want[lo:hi].float()
        assert torch.isfinite(g).all(), f"rows {lo}:{hi} are not finite"
        if (w == 0).all():
            assert (g == 0).all(), f"rows {lo}:{hi} should be zero (nothing to attend to)"
        else:
            # The kernels round P to the query dtype before P @ V, as on tensor cores; the reference keeps fp32.
            assert rel_err(g, w) < 2e-2, f"rows {lo}:{hi}: relative error {rel_err(g, w):.3g}"


def run_call(call: Call, words, exact: bool, direct=None):
    """Run one call through the public wrapper (or ``direct``, a backend module, after the checks)."""
    snapshot = {n: raw(t).clone() for n, t in call.tensors().items() if t.device.type != "meta"}
    want = expected(call) if not words else None
    try:
        if direct is None:
            result = WRAPPERS[call.op](**call.args)
        else:
            args = positional(call)
            if call.op in ("decode_attention", "extend_attention") and args[-1] is None:
                args = args[:-1] + (torch.empty_like(args[0], memory_format=torch.contiguous_format),)
            _checks_for(call.op)(*args)
            result = getattr(direct, call.op)(*args)
            if call.op in ("decode_attention", "extend_attention"):
                result = args[-1]
    except ValueError as e:
        msg = str(e)
        assert words, f"a valid {call.op} call was rejected: {msg}"
        assert msg.startswith(f"kvq.{call.op}: "), msg
        missing = [w for w in words if w not in msg]
        assert not missing, f"{call.op} / {call.what}: {missing} not in {msg!r}"
        for n, before in snapshot.items():
            assert torch.equal(raw(call.args[n]), before), f"{call.op} / {call.what}: {n} was written"
        return
    assert not words, f"{call.op} accepted an invalid call ({call.what}; expected an error naming {words})"
    if call.op == "store_kv":
        got = [call.args[n] for n in ("k_cache", "v_cache", "k_scale", "v_scale")]
    else:
        got = result
        if call.args.get("out") is not None:
            assert result is call.args["out"]
    compare(call, got, want, exact)
    for n, before in snapshot.items():
        if n not in MUTABLE[call.op]:
            assert torch.equal(raw(call.args[n]), before), f"{call.op} wrote to its input {n}"


def _checks_for(op):
    return {"store_kv": _checks.check_store, "decode_attention": _checks.check_decode,
            "extend_attention": _checks.check_extend, "dequantize": _checks.check_dequantize}[op]


def describe(call: Call) -> str:
    parts = []
    for k, v in call.args.items():
        if isinstance(v, torch.Tensor):
            layout = "" if v.is_contiguous() else f" strides {tuple(v.stride())}"
            parts.append(f"{k} {list(v.shape)} {str(v.dtype).replace('torch.', '')}{layout}")
        else:
            parts.append(f"{k}={v}")
    return ", ".join(parts)


def fuzz(iterations, seed, device, exact, direct=None, invalid_share=0.6):
    rng = random.Random(seed)
    tally, broken, failures, pending = Counter(), Counter(), {}, []
    for i in range(iterations):
        call, words = draw_call(rng, device, invalid_share, pending=pending)
        try:
            run_call(call, words, exact, direct)
        except Exception as e:  # an assertion, or an error other than ValueError
            # Keep going: one run then lists every kind of failure (the first of each kind).
            failures.setdefault((call.op, call.what), f"iteration {i} (seed {seed}), {call.op} / {call.what}: "
                                f"{type(e).__name__}: {str(e)[:400]}\n    call: {describe(call)}")
        tally[(call.op, "invalid" if words else "valid")] += 1
        broken[call.what] += 1
    valid = sum(v for (op, kind), v in tally.items() if kind == "valid")
    invalid = sum(v for (op, kind), v in tally.items() if kind == "invalid")
    print(f"\nfuzz on {device} (loop seed {seed}): {iterations} calls, {valid} valid, {invalid} invalid")
    for op in OPS:
        print(f"  {op:17s} valid {tally[(op, 'valid')]:4d}  invalid {tally[(op, 'invalid')]:4d}")
    print("  broken: " + ", ".join(f"{k} {v}" for k, v in sorted(broken.items()) if k != "valid"))
    assert not failures, f"{len(failures)} kinds of failure:\n" + "\n".join(failures.values())
    return tally, broken


def loop_seed():
    """A seed for the loop's own choices, from torch's generator (seeded per test by conftest from
    KVQ_TEST_SEED): fresh on every run, replayed by the same KVQ_TEST_SEED."""
    return int(torch.randint(0, 2**31 - 1, ()).item())


# ---------------------------------------------------------------------------------------------- CPU
def test_fuzz_public_ops_on_cpu():
    tally, broken = fuzz(int(os.environ.get("KVQ_FUZZ_ITERS", "300")), loop_seed(), "cpu", exact=True)
    # The loop must have exercised each op both ways, and every kind of breakage.
    for op in OPS:
        assert tally[(op, "valid")] and tally[(op, "invalid")], op
    assert set(MUTATIONS) <= set(broken), set(MUTATIONS) - set(broken)


def test_empty_batch_and_zero_length_sequences():
    # A batch of 0 returns an empty output; a zero-length decode sequence gives a zero row; a sequence with
    # no new tokens in extend takes no rows; an empty store or gather writes or returns nothing.
    p = random_paged([0, 9, 0], 4, 2, 64, torch.int8)
    q = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    out = kvq.decode_attention(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, p.seq_lens)
    assert (out[0] == 0).all() and (out[2] == 0).all() and torch.isfinite(out[1]).all() and (out[1] != 0).any()
    out = kvq.decode_attention(q[:0], p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table[:0],
                               p.seq_lens[:0])
    assert out.shape == (0, 4, 64)
    empty = torch.zeros(0, dtype=torch.int32)
    out = kvq.extend_attention(q[:0], q[:0, :2], q[:0, :2], p.k_cache, p.v_cache, p.k_scale, p.v_scale,
                               p.block_table[:0], empty, torch.zeros(1, dtype=torch.int32))
    assert out.shape == (0, 4, 64)
    kn = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    prefix, cu = torch.tensor([0, 9, 0], dtype=torch.int32), torch.tensor([0, 0, 3, 3], dtype=torch.int32)
    out = kvq.extend_attention(q, kn, kn, p.k_cache, p.v_cache, p.k_scale, p.v_scale, p.block_table, prefix, cu)
    assert torch.isfinite(out).all()
    before = [raw(t).clone() for t in (p.k_cache, p.k_scale)]
    kvq.store_kv(kn[:0], kn[:0], p.k_cache, p.v_cache, p.k_scale, p.v_scale, torch.zeros(0, dtype=torch.int64))
    assert all(torch.equal(raw(t), b) for t, b in zip((p.k_cache, p.k_scale), before))
    assert kvq.dequantize(p.k_cache, p.k_scale, torch.zeros(0, dtype=torch.int64)).shape == (0, 2, 64)


@pytest.mark.skipif(not INTERPRET, reason="the Triton interpreter case is for machines without a GPU")
def test_fuzz_valid_calls_through_triton_interpreter():
    # The Triton kernels, on CPU tensors in Triton's interpreter, on the loop's valid calls: views, garbage
    # in unused block-table entries, zero-length sequences, empty batches. Few calls: the interpreter is slow.
    from kvq import triton_backend

    fuzz(int(os.environ.get("KVQ_FUZZ_TRITON_ITERS", "24")), loop_seed(), "cpu", exact=False,
         direct=triton_backend, invalid_share=0.0)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_strided_index_tensors_are_read_by_their_strides(op, backend):
    # The checks accept 1-D index tensors with any stride (slot_mapping, seq_lens, prefix_lens,
    # cu_seqlens_q); a backend must read them by their strides or make them contiguous. The gaps hold other
    # valid values (a contiguous read would use them and give a different, in-range answer).
    from common import backend_ops

    ops = backend_ops(backend)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(5)
    while True:
        call = build(op, rng, device)
        index = [n for n in ("slot_mapping", "seq_lens", "prefix_lens", "cu_seqlens_q") if n in call.args]
        if op == "store_kv":
            n = call.args["slot_mapping"].shape[0]
            nslots = call.meta["pages"] * call.meta["page_size"]
            call.args["slot_mapping"] = torch.randperm(nslots)[:n].to(device)  # no skips: every misread shows
        views, tells = {}, True
        for name in index:
            t = call.args[name].contiguous()
            big = torch.stack([t, t], 1).reshape(-1)  # a contiguous read sees t0, t0, t1, t1, ...
            views[name] = big[::2]
            tells &= not torch.equal(big[: t.shape[0]], t)
        if tells:
            call.args.update(views)
            break
    run_call(call, [], exact=False, direct=ops)


# ---------------------------------------------------------------------------------------------- GPU
def gpu_iterations(default_cuda, default_triton):
    # Triton compiles each new (shape, format) combination on first use, the compiled extension does not.
    triton = kvq.backends.selection().active == "triton"
    return int(os.environ.get("KVQ_FUZZ_GPU_ITERS", default_triton if triton else default_cuda))


@pytest.mark.gpu
def test_fuzz_public_ops_on_gpu():
    fuzz(gpu_iterations(300, 60), loop_seed(), "cuda", exact=False)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_unchecked_indices_do_not_fault():
    if kvq.backends.selection().active == "reference":
        pytest.skip("the reference backend indexes with torch, which asserts on the device")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--device", "cuda", "--unchecked",
                           "--iterations", str(gpu_iterations(200, 60)), "--seed", str(loop_seed())],
                          capture_output=True, text=True, env=env, timeout=900)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, f"the unchecked loop failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "no fault" in proc.stdout


def unchecked_loop(iterations, seed, device):
    """Index checks off: out-of-range slots, pages, lengths and cu_seqlens_q go straight to the kernels.

    The results are unspecified; what is checked is that nothing faults (each call is synchronized) and
    nothing is written outside the call's tensors: a sentinel cache allocated before the loop keeps its
    bytes, and a known-good decode on it still matches the reference afterwards.
    """
    rng = random.Random(seed)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sentinel = random_paged([37, 5], 16, 2, 128, torch.int8, torch.bfloat16, device)
    sq = torch.randn(2, 8, 128, device=device).to(torch.bfloat16)
    s_args = (sq, sentinel.k_cache, sentinel.v_cache, sentinel.k_scale, sentinel.v_scale, sentinel.block_table,
              sentinel.seq_lens)
    s_bytes = [raw(t).cpu() for t in s_args[1:5]]
    s_want = kvq.decode_attention(*s_args)
    s_ref = torch.empty_like(sq)
    reference.decode_attention(*s_args, 1 / math.sqrt(128), -1, 0.0, s_ref)
    assert rel_err(s_want.float(), s_ref.float()) < 2e-2, "the known-good call is wrong before the loop"
    sync()
    kvq.set_index_checks(False)
    tried = Counter()
    try:
        for i in range(iterations):
            call, words = draw_call(rng, device, 1.0, {n: MUTATIONS[n] for n in INDEX_MUTATIONS})
            if not words:
                continue
            desc = f"iteration {i}: {call.op} / {call.what}"
            try:
                WRAPPERS[call.op](**call.args)
                sync()
            except Exception as e:
                index_check = isinstance(e, ValueError) and any(
                    w in str(e) for w in ("holds values", "holds page", "must start at 0"))
                print(f"FAULT {desc}: {type(e).__name__}: {e}\n    call: {describe(call)}"
                      + ("\n    (an index check ran although index checks are off)" if index_check else ""))
                raise
            tried[call.what] += 1
    finally:
        kvq.set_index_checks(True)
    sync()
    for name, t, before in zip(("k_cache", "v_cache", "k_scale", "v_scale"), s_args[1:5], s_bytes):
        assert torch.equal(raw(t).cpu(), before), f"the sentinel {name} was written by an out-of-range call"
    again = kvq.decode_attention(*s_args)
    assert torch.equal(again, s_want), "a known-good call changed after the unchecked loop"
    print(f"unchecked loop on {device}: {sum(tried.values())} calls with bad indices ({dict(tried)}); no fault")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--unchecked", action="store_true", help="index checks off, bad indices only")
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.unchecked and a.device == "cpu":
        ap.error("--unchecked needs a GPU: on CPU the index checks always run")
    torch.manual_seed(a.seed)
    if a.unchecked:
        unchecked_loop(a.iterations, a.seed, a.device)
    else:
        fuzz(a.iterations, a.seed, a.device, exact=a.device == "cpu")


if __name__ == "__main__":
    main()
