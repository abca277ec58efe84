"""kvq: an 8-bit paged KV cache (q8_0, fp8_e4m3) with attention that reads it directly.

Public API: the ops (:func:`store_kv`, :func:`decode_attention`, :func:`extend_attention`,
:func:`dequantize`), the formats (:class:`KVQuantSpec`), and :mod:`kvq.backends` for which backend runs.
"""

from . import backends, reference
from ._checks import set_index_checks
from .ops import decode_attention, dequantize, extend_attention, new_cache, store_kv
from .spec import BLOCK, VALID_NAMES, KVQuantSpec
from .config import resolve_kv_cache_dtype
from .pool import KVPool

__version__ = "0.1.0"

__all__ = [
    "BLOCK", "KVPool", "KVQuantSpec", "VALID_NAMES", "backends", "decode_attention", "dequantize",
    "extend_attention", "new_cache", "reference", "resolve_kv_cache_dtype", "set_index_checks", "store_kv",
]
