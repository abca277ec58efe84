"""The op schemas (defined once), their fake implementations, the Python wrappers and the registrations.

``torch.ops.kvq.*`` exists whether or not the extension is built. CPU tensors run the reference; CUDA
tensors run the backend chosen in :mod:`kvq.backends` (the compiled kernels register themselves from
``kvq._C`` with ``TORCH_LIBRARY_IMPL(kvq, CUDA, m)``; the Triton and reference backends register here).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import _checks, backends, reference
from .spec import FLOAT_DTYPES

SCHEMAS = {
    "store_kv": "store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor(c!)? k_scale, Tensor(d!)? v_scale, Tensor slot_mapping) -> ()",
    "decode_attention": "decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor? k_scale, "
    "Tensor? v_scale, Tensor block_table, Tensor seq_lens, float sm_scale, int window_left, "
    "float logit_softcap, Tensor(a!) out) -> ()",
    "extend_attention": "extend_attention(Tensor query, Tensor key, Tensor value, Tensor k_cache, "
    "Tensor v_cache, Tensor? k_scale, Tensor? v_scale, Tensor block_table, Tensor prefix_lens, "
    "Tensor cu_seqlens_q, float sm_scale, bool causal, int window_left, float logit_softcap, "
    "Tensor(a!) out) -> ()",
    "dequantize": "dequantize(Tensor cache, Tensor? scale, Tensor slot_mapping, ScalarType dtype) -> Tensor",
}
CHECKS = {
    "store_kv": _checks.check_store,
    "decode_attention": _checks.check_decode,
    "extend_attention": _checks.check_extend,
    "dequantize": _checks.check_dequantize,
}

_lib = torch.library.Library("kvq", "DEF")
for _schema in SCHEMAS.values():
    _lib.define(_schema, tags=(torch.Tag.needs_fixed_stride_order,))


# ---------------------------------------------------------------------------------------- fake (meta)
@torch.library.register_fake("kvq::store_kv")
def _(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    return None


@torch.library.register_fake("kvq::decode_attention")
def _(query, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, sm_scale, window_left,
      logit_softcap, out):
    return None


@torch.library.register_fake("kvq::extend_attention")
def _(query, key, value, k_cache, v_cache, k_scale, v_scale, block_table, prefix_lens, cu_seqlens_q,
      sm_scale, causal, window_left, logit_softcap, out):
    return None


@torch.library.register_fake("kvq::dequantize")
def _(cache, scale, slot_mapping, dtype):
    return cache.new_empty((slot_mapping.shape[0], cache.shape[2], cache.shape[3]), dtype=dtype)


# ------------------------------------------------------------------------------------ registrations
def _checked(name: str, impl):
    def run(*args):
        CHECKS[name](*args)
        return impl(*args)

    run.__name__ = f"{name}_{getattr(impl, '__module__', 'impl')}"
    return run


def _unavailable(message: str):
    def run(*args):
        raise RuntimeError(message)

    return run


def _python_backend(name: str):
    if name == "reference":
        return reference
    from . import triton_backend

    return triton_backend


for _name in SCHEMAS:
    _lib.impl(_name, _checked(_name, getattr(reference, _name)), "CPU")

_sel = backends.selection()
if _sel.active is None:
    for _name in SCHEMAS:
        _lib.impl(_name, _unavailable(_sel.error), "CUDA")
elif _sel.active == "cuda":
    backends.extension()  # importing kvq._C registers its CUDA kernels
else:
    _mod = _python_backend(_sel.active)
    for _name in SCHEMAS:
        _lib.impl(_name, _checked(_name, getattr(_mod, _name)), "CUDA")
_CUDA_OP_CHECKS = _sel.active is not None and _sel.active != "cuda"


def _check(name: str, *args) -> None:
    """The Python checks of op ``name``, once per wrapper call. torch.ops.kvq.* runs them itself where the
    implementation it dispatches to is Python: CPU tensors (the reference), or CUDA tensors under the Triton or
    reference backend. The compiled kernels check shapes in C++, so in front of them (and of a missing
    backend) the wrapper runs them first, index checks included. Not while torch.compile traces the wrapper: the
    registered op checks its inputs itself each time it runs (in C++, or the Python implementation's checks),
    and a check traced with symbolic sizes could break the graph."""
    if torch.compiler.is_compiling():
        return
    devices = {a.device.type for a in args if isinstance(a, Tensor)}
    if devices <= {"cpu"} or (_CUDA_OP_CHECKS and devices <= {"cpu", "cuda"}):
        return
    CHECKS[name](*args)


def _check_query(name: str, query) -> None:
    """The query, before a wrapper sizes its defaults from it (not while traced, as in :func:`_check`)."""
    if not torch.compiler.is_compiling():
        _checks.check_tensor(name, "query", query, 3, FLOAT_DTYPES)


# ------------------------------------------------------------------------------------------ wrappers
def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Optional[Tensor],
             v_scale: Optional[Tensor], slot_mapping: Tensor) -> None:
    """Quantize (or copy) new K/V rows into the paged cache, in place.

    key, value:      [num_tokens, num_kv_heads, head_dim] bf16/fp16
    k_cache/v_cache: [num_pages, page_size, num_kv_heads, head_dim] int8 | float8_e4m3fn | bf16 | fp16
    k_scale/v_scale: [num_pages, page_size, num_kv_heads, head_dim // 32] fp16, None when unquantized
    slot_mapping:    [num_tokens] int64, slot = page * page_size + offset, -1 skips the token
    Reference: :func:`kvq.reference.store_kv`.
    """
    _check("store_kv", key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    torch.ops.kvq.store_kv(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)


def decode_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Optional[Tensor],
                     v_scale: Optional[Tensor], block_table: Tensor, seq_lens: Tensor, *,
                     sm_scale: Optional[float] = None, window_left: int = -1, logit_softcap: float = 0.0,
                     out: Optional[Tensor] = None) -> Tensor:
    """``out[b, h] = softmax(sm_scale * q[b, h] . K_b^T) V_b`` over the ``seq_lens[b]`` cached tokens.

    query:       [batch, num_q_heads, head_dim] bf16/fp16 (the token at position seq_lens[b] - 1,
                 already stored in the cache)
    block_table: [batch, max_pages] int32;  seq_lens: [batch] int32 (0 gives a zero output row)
    sm_scale defaults to 1/sqrt(head_dim); window_left = -1 means no window; logit_softcap = 0 means none.
    Returns out, [batch, num_q_heads, head_dim] in the query dtype. Reference: fp32 attention over the
    dequantized cache (:func:`kvq.reference.decode_attention`).
    """
    _check_query("decode_attention", query)
    sm_scale = 1.0 / math.sqrt(query.shape[-1]) if sm_scale is None else float(sm_scale)
    out = torch.empty_like(query, memory_format=torch.contiguous_format) if out is None else out
    args = (query, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, sm_scale, int(window_left),
            float(logit_softcap), out)
    _check("decode_attention", *args)
    torch.ops.kvq.decode_attention(*args)
    return out


def extend_attention(query: Tensor, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                     k_scale: Optional[Tensor], v_scale: Optional[Tensor], block_table: Tensor,
                     prefix_lens: Tensor, cu_seqlens_q: Tensor, *, sm_scale: Optional[float] = None,
                     causal: bool = True, window_left: int = -1, logit_softcap: float = 0.0,
                     out: Optional[Tensor] = None) -> Tensor:
    """New tokens attend to their cached prefix (quantized pages) and to their own exact K/V.

    query, key, value: [total_new_tokens, num_q_heads | num_kv_heads, head_dim], sequences packed by
                       cu_seqlens_q [batch + 1] int32
    prefix_lens:       [batch] int32, tokens already in the cache for each sequence (0 = prefill)
    Token i of sequence b sits at position prefix_lens[b] + i; causal keeps keys at positions <= its own.
    Reference: :func:`kvq.reference.extend_attention`.
    """
    _check_query("extend_attention", query)
    sm_scale = 1.0 / math.sqrt(query.shape[-1]) if sm_scale is None else float(sm_scale)
    out = torch.empty_like(query, memory_format=torch.contiguous_format) if out is None else out
    args = (query, key, value, k_cache, v_cache, k_scale, v_scale, block_table, prefix_lens, cu_seqlens_q,
            sm_scale, bool(causal), int(window_left), float(logit_softcap), out)
    _check("extend_attention", *args)
    torch.ops.kvq.extend_attention(*args)
    return out


def dequantize(cache: Tensor, scale: Optional[Tensor], slot_mapping: Tensor,
               dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Gather cached tokens back to ``dtype``: ``[num_tokens, num_kv_heads, head_dim]`` (slot -1 gives 0)."""
    _check("dequantize", cache, scale, slot_mapping, dtype)
    return torch.ops.kvq.dequantize(cache, scale, slot_mapping, dtype)


def new_cache(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              device=None) -> tuple[Tensor, Optional[Tensor]]:
    """Allocate one value plane and its scale plane (None when unquantized), uninitialised."""
    values = torch.empty(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    if dtype in (torch.int8, torch.float8_e4m3fn):
        scale = torch.empty(num_pages, page_size, num_kv_heads, head_dim // 32, dtype=torch.float16,
                            device=device)
        return values, scale
    return values, None
