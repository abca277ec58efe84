"""Input checks for every op, raised before any kernel runs.

Two kinds: metadata checks (dtype, shape, device, head_dim) that never touch tensor contents, and index
checks (slots, pages, lengths in range) that read tensor contents. On a GPU the latter need a host read, so
they are skipped while a CUDA graph is being captured or a graph is traced by torch.compile, and can be
turned off with ``kvq.set_index_checks(False)`` or ``KVQ_CHECK_INDICES=0``. On CPU they cost no sync and always
run. Kernels guard their own memory accesses either way.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from .spec import BLOCK, FLOAT_DTYPES, QUANT_DTYPES, SCALE_DTYPE

_index_checks = os.environ.get("KVQ_CHECK_INDICES", "1") not in ("0", "false", "False")
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def set_index_checks(enabled: bool) -> None:
    """Turn the checks that read index tensors on a GPU (a host sync) on or off; on CPU they always run."""
    global _index_checks
    _index_checks = bool(enabled)


def index_checks_enabled(*tensors: Tensor) -> bool:
    if torch.compiler.is_compiling() or any(t.device.type == "meta" for t in tensors):
        return False
    if all(t.device.type == "cpu" for t in tensors):
        return True  # reading a CPU tensor needs no sync, so the switch (a GPU speed knob) does not apply
    if not _index_checks:
        return False
    return not (any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing())


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"kvq.{op}: {msg}")


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _expect(op, cond, msg):
    if not cond:
        _fail(op, msg)


def _may_overlap(t: Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: sorted by stride, each dim must step past all that the
    smaller-stride dims span. Padded, sliced and permuted layouts pass; an expanded (stride 0) one does not.
    torch._debug_has_internal_overlap cannot decide the partial overlaps that as_strided can make."""
    span = 1
    for stride, size in sorted((t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] > 1):
        if stride < span:
            return True
        span += stride * (size - 1)
    return False


def check_writable(op: str, name: str, t: Tensor) -> None:
    """An op writes every element of ``t`` once; elements sharing memory would overwrite each other."""
    _expect(op, t.numel() == 0 or not _may_overlap(t),
            f"{name} has elements that overlap in memory (shape {_shape(t)}, strides {list(t.stride())}), so "
            "writes to it would overwrite each other; pass a tensor from torch.empty (or .contiguous()), not an "
            "expanded or as_strided view")


def check_tensor(op: str, name: str, t, ndim: int, dtypes, device: Optional[torch.device] = None) -> None:
    _expect(op, isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _expect(op, t.dim() == ndim, f"{name} must have {ndim} dims, got shape {_shape(t)}")
    _expect(op, t.dtype in dtypes,
            f"{name} has dtype {t.dtype}; expected {' or '.join(str(d) for d in dtypes)}")
    if device is not None:
        _expect(op, t.device == device,
                f"{name} is on {t.device} but the cache is on {device}; move it with .to({str(device)!r})")


def check_cache(op: str, k_cache, v_cache, k_scale, v_scale) -> tuple[int, int, int, int]:
    """Validate a K/V cache pair and its scale planes; returns (num_pages, page_size, Hkv, D)."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, c, 4, QUANT_DTYPES + FLOAT_DTYPES)
    dev = k_cache.device
    _expect(op, v_cache.device == dev, f"v_cache is on {v_cache.device} but k_cache is on {dev}")
    _expect(op, k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype,
            f"k_cache {_shape(k_cache)} {k_cache.dtype} and v_cache {_shape(v_cache)} {v_cache.dtype} "
            "must have the same shape and dtype")
    num_pages, page_size, hkv, d = k_cache.shape
    _expect(op, d % BLOCK == 0, f"head_dim {d} is not a multiple of {BLOCK}; kvq stores one scale per "
            f"{BLOCK} elements, so pad head_dim or use a model with head_dim in {SUPPORTED_HEAD_DIMS}")
    _expect(op, page_size >= 1 and hkv >= 1 and num_pages >= 1 and d >= 1,
            f"cache shape {_shape(k_cache)} has an empty dimension")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_pages(op, name, c)
    quantized = k_cache.dtype in QUANT_DTYPES
    want = (num_pages, page_size, hkv, d // BLOCK)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not quantized:
            _expect(op, s is None, f"{name} must be None for an unquantized {k_cache.dtype} cache")
            continue
        _expect(op, s is not None, f"{name} is required for a {k_cache.dtype} cache (one fp16 scale per "
                f"{BLOCK} elements, shape {list(want)})")
        check_tensor(op, name, s, 4, (SCALE_DTYPE,), dev)
        _expect(op, tuple(s.shape) == want, f"{name} has shape {_shape(s)}; for a cache of shape "
                f"{_shape(k_cache)} it must be {list(want)}")
        _expect(op, s.is_contiguous(), f"{name} must be contiguous; call .contiguous()")
    return num_pages, page_size, hkv, d


def _check_pages(op, name, c):
    """Dense within a page; pages may be padded apart but never overlap (a store would overwrite other tokens).
    The scale planes need no such check: they must be contiguous."""
    num_pages, page_size, hkv, d = c.shape
    _expect(op, c.stride(-1) == 1 and c.stride(-2) == d and c.stride(1) == hkv * d,
            f"{name} must be contiguous within a page ([page_size, num_kv_heads, head_dim] dense); "
            "allocate it with torch.empty or call .contiguous()")
    page = page_size * hkv * d
    _expect(op, num_pages == 1 or c.stride(0) >= page,
            f"{name} pages overlap: its page stride is {c.stride(0)} elements but one page holds {page} "
            f"([page_size, num_kv_heads, head_dim] = [{page_size}, {hkv}, {d}]), so a store would overwrite "
            "other pages; allocate it with torch.empty or call .contiguous() (padding between pages is allowed)")


def _check_rows(op, name, t, n, hkv, d, dtypes, dev, *, allow_strided=True):
    check_tensor(op, name, t, 3, dtypes, dev)
    _expect(op, t.shape[1:] == (hkv, d) if n is None else tuple(t.shape) == (n, hkv, d),
            f"{name} has shape {_shape(t)}; expected [{'num_tokens' if n is None else n}, {hkv}, {d}]")
    _expect(op, t.stride(-1) == 1, f"{name} must have a unit stride on head_dim; call .contiguous()")


def check_store(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    op = "store_kv"
    num_pages, page_size, hkv, d = check_cache(op, k_cache, v_cache, k_scale, v_scale)
    # The store writes K and V (and their scales) to separate planes: one plane passed as both loses K.
    for a, b, what in ((k_cache, v_cache, "k_cache and v_cache"), (k_scale, v_scale, "k_scale and v_scale")):
        _expect(op, a is None or a.is_meta or a.data_ptr() != b.data_ptr(),  # meta tensors: no memory, pointer 0
                f"{what} are the same memory, so the values would overwrite the keys; pass separate tensors "
                "(e.g. two kvq.new_cache calls)")
    dev = k_cache.device
    in_dtypes = FLOAT_DTYPES if k_cache.dtype in QUANT_DTYPES else (k_cache.dtype,)
    _check_rows(op, "key", key, None, hkv, d, in_dtypes, dev)
    _check_rows(op, "value", value, key.shape[0], hkv, d, (key.dtype,), dev)
    check_tensor(op, "slot_mapping", slot_mapping, 1, (torch.int64, torch.int32), dev)
    _expect(op, slot_mapping.shape[0] == key.shape[0],
            f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")
    if index_checks_enabled(slot_mapping) and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        _expect(op, lo >= -1 and hi < num_pages * page_size,
                f"slot_mapping holds values in [{lo}, {hi}] but the cache has {num_pages * page_size} slots "
                f"({num_pages} pages x {page_size}); valid slots are 0..{num_pages * page_size - 1}, or -1 to skip")


def _check_table(op, block_table, lens, name, num_pages, page_size, batch, dev):
    check_tensor(op, "block_table", block_table, 2, (torch.int32,), dev)
    check_tensor(op, name, lens, 1, (torch.int32,), dev)
    _expect(op, block_table.shape[0] == batch and lens.shape[0] == batch,
            f"block_table {_shape(block_table)} and {name} {_shape(lens)} must have one row per "
            f"sequence ({batch})")
    _expect(op, block_table.stride(-1) == 1, "block_table must have a unit stride on its last dim")
    if index_checks_enabled(block_table, lens) and batch:
        max_len = block_table.shape[1] * page_size
        lo, hi = int(lens.min()), int(lens.max())
        _expect(op, lo >= 0 and hi <= max_len,
                f"{name} holds values in [{lo}, {hi}] but block_table has {block_table.shape[1]} pages of "
                f"{page_size} tokens per sequence (at most {max_len}); grow block_table or fix {name}")
        used = (torch.arange(block_table.shape[1], device=dev)[None, :] * page_size) < lens[:, None].long()
        if bool(used.any()):
            pages = block_table[used]
            plo, phi = int(pages.min()), int(pages.max())
            _expect(op, plo >= 0 and phi < num_pages,
                    f"block_table holds page {plo if plo < 0 else phi} within {name}, but the cache has "
                    f"{num_pages} pages (valid 0..{num_pages - 1})")


def _check_query_out(op, query, out, hkv, d, dev):
    check_tensor(op, "query", query, 3, FLOAT_DTYPES, dev)
    hq = query.shape[1]
    _expect(op, query.shape[-1] == d, f"query head_dim {query.shape[-1]} differs from the cache's {d}")
    _expect(op, query.stride(-1) == 1, "query must have a unit stride on head_dim; call .contiguous()")
    _expect(op, hq >= 1, f"query has shape {_shape(query)}: no heads")
    _expect(op, hq % hkv == 0, f"query has {hq} heads, not a multiple of the cache's {hkv} kv heads (GQA "
            "needs num_q_heads % num_kv_heads == 0)")
    check_tensor(op, "out", out, 3, (query.dtype,), dev)
    _expect(op, out.shape == query.shape, f"out has shape {_shape(out)}; it must match query {_shape(query)}")
    _expect(op, out.stride(-1) == 1, "out must have a unit stride on head_dim")
    check_writable(op, "out", out)


def check_decode(query, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, sm_scale,
                 window_left, logit_softcap, out) -> None:
    op = "decode_attention"
    num_pages, page_size, hkv, d = check_cache(op, k_cache, v_cache, k_scale, v_scale)
    dev = k_cache.device
    _check_query_out(op, query, out, hkv, d, dev)
    _check_scalars(op, k_cache, query, sm_scale, window_left, logit_softcap)
    _check_table(op, block_table, seq_lens, "seq_lens", num_pages, page_size, query.shape[0], dev)


def check_extend(query, key, value, k_cache, v_cache, k_scale, v_scale, block_table, prefix_lens,
                 cu_seqlens_q, sm_scale, causal, window_left, logit_softcap, out) -> None:
    op = "extend_attention"
    num_pages, page_size, hkv, d = check_cache(op, k_cache, v_cache, k_scale, v_scale)
    dev = k_cache.device
    _check_query_out(op, query, out, hkv, d, dev)
    _check_scalars(op, k_cache, query, sm_scale, window_left, logit_softcap)
    n = query.shape[0]
    _check_rows(op, "key", key, n, hkv, d, (query.dtype,), dev)
    _check_rows(op, "value", value, n, hkv, d, (query.dtype,), dev)
    check_tensor(op, "prefix_lens", prefix_lens, 1, (torch.int32,), dev)
    batch = prefix_lens.shape[0]
    check_tensor(op, "cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), dev)
    _expect(op, cu_seqlens_q.shape[0] == batch + 1,
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries and prefix_lens {batch}; cu_seqlens_q must have "
            f"one more (batch + 1)")
    _check_table(op, block_table, prefix_lens, "prefix_lens", num_pages, page_size, batch, dev)
    if index_checks_enabled(cu_seqlens_q):
        cu = cu_seqlens_q.cpu()
        _expect(op, int(cu[0]) == 0 and int(cu[-1]) == n and bool((cu[1:] >= cu[:-1]).all()),
                f"cu_seqlens_q must start at 0, never decrease and end at the number of query tokens ({n}); "
                f"got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")


def _check_scalars(op, cache, query, sm_scale, window_left, logit_softcap):
    _expect(op, 0 < sm_scale < math.inf, f"sm_scale must be positive and finite, got {sm_scale}")
    _expect(op, window_left >= -1, f"window_left must be -1 (no window) or >= 0, got {window_left}")
    _expect(op, 0 <= logit_softcap < math.inf,
            f"logit_softcap must be 0 (none) or positive and finite, got {logit_softcap}")
    if cache.dtype in FLOAT_DTYPES:
        _expect(op, query.dtype == cache.dtype, f"query is {query.dtype} but the unquantized cache is "
                f"{cache.dtype}; they must match")


def check_dequantize(cache, scale, slot_mapping, dtype) -> None:
    op = "dequantize"
    check_tensor(op, "cache", cache, 4, QUANT_DTYPES + FLOAT_DTYPES)
    num_pages, page_size, hkv, d = cache.shape
    _expect(op, d % BLOCK == 0, f"head_dim {d} is not a multiple of {BLOCK}")
    _expect(op, min(cache.shape) >= 1, f"cache shape {_shape(cache)} has an empty dimension")
    _check_pages(op, "cache", cache)
    if cache.dtype in QUANT_DTYPES:
        _expect(op, scale is not None, f"scale is required for a {cache.dtype} cache")
        check_tensor(op, "scale", scale, 4, (SCALE_DTYPE,), cache.device)
        _expect(op, tuple(scale.shape) == (num_pages, page_size, hkv, d // BLOCK),
                f"scale has shape {_shape(scale)}; expected {[num_pages, page_size, hkv, d // BLOCK]}")
        _expect(op, scale.is_contiguous(), "scale must be contiguous; call .contiguous()")
    else:
        _expect(op, scale is None, f"scale must be None for an unquantized {cache.dtype} cache")
    _expect(op, dtype in FLOAT_DTYPES, f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    check_tensor(op, "slot_mapping", slot_mapping, 1, (torch.int64, torch.int32), cache.device)
    if index_checks_enabled(slot_mapping) and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        _expect(op, lo >= -1 and hi < num_pages * page_size,
                f"slot_mapping holds values in [{lo}, {hi}]; valid slots are 0..{num_pages * page_size - 1} or -1")
