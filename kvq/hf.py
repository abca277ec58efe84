"""Hugging Face transformers integration: a Llama-family model's attention runs through kvq, its KV cache
lives in a :class:`~kvq.pool.KVPool`.

It uses the library's two extension points and patches no model code:

- an attention function registered as ``"kvq"`` with ``transformers.AttentionInterface`` (select it with
  ``attn_implementation="kvq"`` or ``model.set_attn_implementation("kvq")``);
- :class:`KVQCache`, a ``transformers.Cache`` whose ``update`` writes the new K/V into the pool with
  :func:`kvq.store_kv` (quantizing for q8_0 / fp8_e4m3) and hands the attention function what it needs.

Per forward call with ``T`` new tokens per row: prefill and chunked prefill (``T > 1``) run
:func:`kvq.extend_attention` (the new tokens attend to their own exact K/V and to the ``prefix_lens`` tokens
already cached, read from the pages); generation (``T == 1``) runs :func:`kvq.decode_attention` over the
cache, the new token included. Every row of a batch is its own pool sequence; rows must not be padded
(kvq's attention takes no mask: each row's tokens are all real, and a mask that hides any is refused).

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=kvq.hf.register())
    cache = kvq.hf.KVQCache(model.config, "q8_0", max_tokens=4096)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
"""

from __future__ import annotations

import inspect
import math
from typing import Optional, Union

import torch
from torch import Tensor

from .ops import decode_attention, extend_attention, store_kv
from .pool import KVPool, KVPoolFullError

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("kvq.hf needs transformers (pip install transformers, or scripts/setup-eval.sh)") from e

ATTN_NAME = "kvq"
_STEP_ATTR = "_kvq_step"  # set on the key tensor that KVQCache.update returns; read by kvq_attention


def register() -> str:
    """Register kvq's attention with transformers (idempotent); returns the name to pass as attn_implementation."""
    AttentionInterface.register(ATTN_NAME, kvq_attention)
    # Without a mask function of its own, transformers would drop a padding mask before kvq could see it.
    AttentionMaskInterface.register(ATTN_NAME, kvq_mask)
    return ATTN_NAME


def model_shape(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a decoder config (or of its text config)."""
    cfg = _text_config(config)
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or num_heads, head_dim


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def cache_kwarg(model) -> str:
    """The name under which this transformers version's model forward takes the cache."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _Step:
    """What one forward call needs in every layer: where its tokens go and what each row sees."""

    def __init__(self, slot_mapping, block_table, seq_lens, prefix_lens, cu_seqlens_q):
        self.slot_mapping = slot_mapping  # [B * T] int64
        self.block_table = block_table  # [B, max_pages] int32
        self.seq_lens = seq_lens  # [B] int32, new tokens included (decode)
        self.prefix_lens = prefix_lens  # [B] int32, tokens cached before this call (extend)
        self.cu_seqlens_q = cu_seqlens_q  # [B + 1] int32
        self.checked_mask = None  # the 4D mask already found to hide nothing beyond causal, if one was given


class KVQLayer(CacheLayerMixin):
    """One model layer's view of the shared pool (transformers asks layers for lengths and properties)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "KVQCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass

    def offload(self):
        raise NotImplementedError("KVQCache does not offload; its pool stays on its device")

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("KVQCache does not support beam search (reorder_cache); use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError("KVQCache cannot crop (assisted generation); rebuild the cache instead")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("KVQCache does not support num_return_sequences > 1 / beam expansion")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("KVQCache does not support selecting batch rows")


class KVQCache(Cache):
    """A transformers ``Cache`` whose K/V live in a kvq :class:`KVPool` (one pool sequence per batch row).

    kv_cache_dtype: ``bf16``, ``fp16``, ``q8_0``, ``fp8_e4m3`` or ``auto`` (the model dtype).
    Size the pool with ``max_tokens`` (tokens over all rows; pages are rounded up per row), ``num_pages``,
    ``budget_bytes``, or pass a ready ``pool`` (its shape must match the model's).
    ``model_dtype`` is the dtype the model computes in (bf16 or fp16); it defaults to ``config.dtype``.
    """

    def __init__(self, config, kv_cache_dtype: str = "q8_0", *, max_tokens: Optional[int] = None,
                 num_pages: Optional[int] = None, budget_bytes: Optional[int] = None, batch_size: int = 1,
                 page_size: int = 16, model_dtype: Optional[torch.dtype] = None,
                 device: Union[str, torch.device, None] = None, pool: Optional[KVPool] = None):
        num_layers, num_kv_heads, head_dim = model_shape(config)
        impl = getattr(_text_config(config), "_attn_implementation", None)
        if isinstance(impl, str) and impl != ATTN_NAME:
            raise ValueError(_not_kvq(f"the model's config selects attention {impl!r}"))
        if pool is None:
            model_dtype = model_dtype or _config_dtype(config)
            device = device if device is not None else "cpu"
            if budget_bytes is not None:
                pool = KVPool.from_budget(int(budget_bytes), num_layers, num_kv_heads, head_dim, page_size,
                                          kv_cache_dtype, model_dtype, device)
            else:
                if num_pages is None:
                    if max_tokens is None:
                        raise ValueError("KVQCache: give max_tokens, num_pages, budget_bytes or pool to size the cache")
                    per_row = -(-int(max_tokens) // max(1, batch_size))
                    num_pages = max(1, batch_size) * -(-per_row // page_size)
                pool = KVPool(num_layers, num_kv_heads, head_dim, int(num_pages), page_size, kv_cache_dtype,
                              model_dtype, device)
        elif (pool.num_layers, pool.num_kv_heads, pool.head_dim) != (num_layers, num_kv_heads, head_dim):
            raise ValueError(f"KVQCache: the pool holds {pool.num_layers} layers x {pool.num_kv_heads} kv heads x "
                             f"head_dim {pool.head_dim}, the model needs {num_layers} x {num_kv_heads} x {head_dim}")
        self.pool = pool
        self.seqs: list[int] = []
        self._step: Optional[_Step] = None
        self._unread: Optional[int] = None  # a layer whose new K/V kvq's attention has not read yet
        super().__init__(layers=[KVQLayer(self, i) for i in range(num_layers)])

    @property
    def spec(self):
        return self.pool.spec

    # transformers calls update(key, value, layer_idx[, cache_kwargs]) once per layer, layer 0 first.
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Store the new ``[B, Hkv, T, D]`` K/V of one layer; the slots are reserved once per call, at layer 0."""
        b, hkv, t, d = key_states.shape
        if self._unread is not None:
            # Another attention read only the new tokens it was handed, not the cached ones: wrong logits.
            raise ValueError(_not_kvq(f"layer {self._unread}'s K/V went to an attention other than kvq's"))
        if layer_idx == 0:
            self._step = self._reserve(b, t, key_states.device)
        step = self._step
        if step is None or step.slot_mapping.shape[0] != b * t:
            raise RuntimeError(f"KVQCache: layer {layer_idx} got {b}x{t} new tokens but this forward call "
                               "reserved a different number at layer 0; every layer must see the same tokens")
        k = key_states.transpose(1, 2).reshape(b * t, hkv, d)
        v = value_states.transpose(1, 2).reshape(b * t, hkv, d)
        p = self.pool
        store_kv(k, v, p.k_cache(layer_idx), p.v_cache(layer_idx), p.k_scale(layer_idx), p.v_scale(layer_idx),
                 step.slot_mapping)
        setattr(key_states, _STEP_ATTR, (self, layer_idx, step))
        self._unread = layer_idx
        return key_states, value_states

    def _reserve(self, b: int, t: int, device) -> _Step:
        if self.seqs and len(self.seqs) != b:
            raise ValueError(f"KVQCache holds {len(self.seqs)} sequences but the input has batch {b}; "
                             "use one cache per batch (or reset() it)")
        p = self.pool
        # All rows' pages are counted before any row grows, so a call that does not fit changes nothing.
        lens = [p.seq_len(s) for s in self.seqs] or [0] * b
        needed = sum(p.pages_for(n + t) - p.pages_for(n) for n in lens)
        if needed > p.free_pages():
            raise KVPoolFullError(
                f"KVQCache: {b} row(s) of {t} new tokens need {needed} more page(s) of {p.page_size} tokens, but "
                f"only {p.free_pages()} of {p.num_pages} pages are free; nothing was stored. Size the cache "
                "larger (max_tokens, num_pages or budget_bytes), or free or reset() other caches on this pool")
        if not self.seqs:
            self.seqs = [p.new_sequence() for _ in range(b)]
        slots = torch.cat([p.append(s, t) for s in self.seqs])
        dev = torch.device(device)
        prefix = torch.tensor(lens, dtype=torch.int32, device=dev)
        return _Step(slots.to(dev), p.block_table(self.seqs).to(dev), prefix + t, prefix,
                     torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=dev))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.pool.seq_len(self.seqs[0]) if self.seqs else 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    def reset(self) -> None:
        """Free this cache's sequences; the next forward starts new ones."""
        for s in self.seqs:
            self.pool.free(s)
        self.seqs, self._step, self._unread = [], None, None

    def free(self) -> None:
        self.reset()

    def kv_bytes(self) -> int:
        """Bytes the cached tokens take in the pool (exact per-token figure, scales included)."""
        return self.pool.unit_bytes() * sum(self.pool.seq_len(s) for s in self.seqs)


def _not_kvq(what: str) -> str:
    return (f"KVQCache works only with kvq's attention, but {what}; any other attention reads just the new "
            "tokens' K/V that the cache hands back and gives wrong logits. Load the model with "
            "attn_implementation=kvq.hf.register() (\"kvq\") or call model.set_attn_implementation(\"kvq\"), "
            "then create a new KVQCache")


_PADDED = ("kvq's attention takes no attention mask: every key of every row must be a real token, but {what} "
           "hides some. Padded batches are not supported; run sequences of different lengths as separate calls "
           "(batch 1, or rows of equal length), each with its own KVQCache, and pass no padding")


def kvq_mask(attention_mask=None, kv_length=None, kv_offset: int = 0, **kwargs):
    """transformers' mask hook for ``"kvq"``, called once per forward with the 2D padding mask ``[B, kv]``: kvq
    applies the causal mask itself, so this only refuses a mask that hides a key, and returns None."""
    if attention_mask is not None:
        # One host read per forward call, and only when a mask is passed (generate passes an all-ones one).
        end = None if kv_length is None else kv_offset + kv_length
        seen = attention_mask[:, kv_offset:end]
        if (kv_length is not None and seen.shape[-1] < kv_length) or not bool(seen.all()):
            rows = (~seen).any(-1).nonzero().flatten().tolist()
            raise ValueError(_PADDED.format(what=f"attention_mask (rows {rows or 'all'})"))
    return None


def _check_mask(mask: Tensor, step: _Step, t: int) -> None:
    """A mask that reaches kvq's attention (transformers passes a 4D one through as it is, bool or additive
    float) may hide nothing that the causal mask shows. Read once per forward call."""
    if mask is step.checked_mask:
        return
    bad = ValueError(_PADDED.format(what=f"the {mask.dim()}D attention_mask of shape {list(mask.shape)}"))
    if mask.dim() != 4 or mask.shape[-2] != t:
        raise bad
    seen = mask if mask.dtype == torch.bool else mask == 0
    dev = mask.device
    pos = step.prefix_lens.to(dev).long().view(-1, 1, 1, 1) + torch.arange(t, device=dev).view(-1, 1)
    if bool((torch.arange(mask.shape[-1], device=dev) <= pos).logical_and(~seen).any()):  # [B, H, T, kv]
        raise bad
    step.checked_mask = mask


def _config_dtype(config) -> torch.dtype:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    return getattr(torch, dt) if isinstance(dt, str) else dt


def kvq_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                  dropout: float = 0.0, sliding_window=None, softcap=None, **kwargs):
    """The ``"kvq"`` attention: ``query`` ``[B, Hq, T, D]``, ``key``/``value`` ``[B, Hkv, T, D]`` (this call's
    tokens, already stored by :class:`KVQCache`). Returns ``([B, T, Hq, D], None)``, the layout transformers
    expects from an attention function."""
    handoff = getattr(key, _STEP_ATTR, None)
    if handoff is None:
        raise ValueError("attn_implementation='kvq' needs its KV cache: pass past_key_values=kvq.hf.KVQCache(...) "
                         "(use_cache=True); without a cache kvq has nowhere to keep K/V")
    cache, layer, step = handoff
    cache._unread = None
    if dropout:
        raise ValueError("kvq attention has no dropout; call model.eval() (it is for inference)")
    b, hq, t, d = query.shape
    if attention_mask is not None:
        _check_mask(attention_mask, step, t)
    p = cache.pool
    q = query.transpose(1, 2).reshape(b * t, hq, d)
    sm_scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    window_left = -1 if sliding_window is None else int(sliding_window) - 1
    softcap = float(softcap or 0.0)
    planes = (p.k_cache(layer), p.v_cache(layer), p.k_scale(layer), p.v_scale(layer))
    if t == 1:
        out = decode_attention(q, *planes, step.block_table, step.seq_lens, sm_scale=sm_scale,
                               window_left=window_left, logit_softcap=softcap)
    else:
        hkv = key.shape[1]
        k = key.transpose(1, 2).reshape(b * t, hkv, d)
        v = value.transpose(1, 2).reshape(b * t, hkv, d)
        out = extend_attention(q, k, v, *planes, step.block_table, step.prefix_lens, step.cu_seqlens_q,
                               sm_scale=sm_scale, causal=True, window_left=window_left, logit_softcap=softcap)
    return out.view(b, t, hq, d), None


register()
