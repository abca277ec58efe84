"""Triton kernels: the CUDA-tensor backend when kvq._C is not built (or KVQ_BACKEND=triton)."""

from .store import dequantize, store_kv
from .decode import decode_attention
from .extend import extend_attention

__all__ = ["decode_attention", "dequantize", "extend_attention", "store_kv"]
