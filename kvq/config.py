"""``--kv-cache-dtype``: resolved once, at configuration time, to a :class:`KVQuantSpec` or a ValueError
that says what is wrong and how to fix it.
"""

from __future__ import annotations

import argparse

import torch

from .spec import _ALIASES, BLOCK, FLOAT_DTYPES, VALID_NAMES, KVQuantSpec

# Attention backends that read kvq's quantized pages: kvq itself (whichever of its backends serves the
# device) or one of its backends named directly.
QUANT_READERS = ("kvq", "cuda", "triton", "reference")
SUPPORTED_FAMILIES = ("mha", "gqa", "mqa")
UNSUPPORTED_FAMILIES = {
    "mla": "a compressed-latent (MLA) KV cache",
    "sparse_index": "a sparse-attention index cache",
}
HELP = ("KV cache storage: auto = the model dtype (unquantized); bf16/fp16 = unquantized; q8_0 = int8 with one "
        "fp16 scale per 32 elements (1.0625 bytes/element, 1.88x the tokens of bf16); fp8_e4m3 = float8 "
        "e4m3 with the same scales.")


def _reads_quantized(backend: str) -> bool:
    b = str(backend).strip().lower()
    return b in QUANT_READERS or b.startswith("kvq")


def resolve_kv_cache_dtype(name, *, attention_backend: str = "kvq", head_dim: int, pool_family: str = "mha",
                           model_dtype: torch.dtype = torch.bfloat16) -> KVQuantSpec:
    """The spec for ``--kv-cache-dtype name``; ``auto`` becomes the model dtype's (bf16 or fp16).

    Raises ValueError naming the problem and the fix: an unknown name, a quantized format with an attention
    backend that cannot read it, a head_dim kvq cannot store, a pool family kvq does not support yet, or an
    unquantized dtype that differs from the model's.
    """
    if isinstance(name, KVQuantSpec):
        spec = name
    else:
        key = str(name).strip().lower()
        key = _ALIASES.get(key, key)
        if key not in VALID_NAMES:
            raise ValueError(f"--kv-cache-dtype {name!r} is not a known KV cache dtype; valid values are "
                             f"{', '.join(VALID_NAMES)} (aliases: {', '.join(sorted(_ALIASES))})")
        spec = KVQuantSpec.from_name(key)
    flag = f"--kv-cache-dtype {spec.name}"
    family = str(pool_family).strip().lower()
    if family not in SUPPORTED_FAMILIES and family not in UNSUPPORTED_FAMILIES:
        raise ValueError(f"unknown KV pool family {pool_family!r}; known families are "
                         f"{', '.join(SUPPORTED_FAMILIES + tuple(UNSUPPORTED_FAMILIES))}")
    kvq_attention = _reads_quantized(attention_backend)
    if kvq_attention and family in UNSUPPORTED_FAMILIES:
        # kvq's pages hold per-head K/V; such a cache has another shape, whatever its dtype.
        raise ValueError(f"{flag} on {UNSUPPORTED_FAMILIES[family]} (pool family {family!r}) is not supported yet "
                         "by kvq's attention; use --kv-cache-dtype auto with the model's own attention backend "
                         "(e.g. --attention-backend sdpa)")

    if not spec.quantized:
        if spec.storage_dtype is None:
            if model_dtype not in FLOAT_DTYPES:
                if kvq_attention:
                    raise ValueError(f"{flag} means the model dtype, {model_dtype}, which kvq's attention "
                                     "cannot read; load the model in bfloat16 or float16")
                return spec
            spec = KVQuantSpec.from_cache_dtype(model_dtype)
        elif spec.storage_dtype != model_dtype:
            raise ValueError(f"{flag} stores K/V in {spec.storage_dtype} but the model computes in "
                             f"{model_dtype}; the unquantized cache must match the model dtype. Use "
                             "--kv-cache-dtype auto (the model dtype) or an 8-bit format (q8_0, fp8_e4m3)")
        if kvq_attention and (head_dim < 1 or head_dim % BLOCK):
            raise ValueError(f"head_dim {head_dim} is not a multiple of {BLOCK}, which kvq's attention needs; "
                             "pass another --attention-backend (e.g. sdpa) for this model")
        return spec

    if not kvq_attention:
        raise ValueError(f"{flag} needs an attention backend that reads quantized KV (kvq's cuda or triton, or "
                         f"its reference), but the resolved backend is {attention_backend!r}. Pass "
                         "--attention-backend kvq or drop --kv-cache-dtype.")
    if not isinstance(head_dim, int) or head_dim < 1 or head_dim % BLOCK:
        raise ValueError(f"{flag} needs head_dim to be a multiple of {BLOCK} (one fp16 scale per {BLOCK} "
                         f"elements), but this model's head_dim is {head_dim}; use --kv-cache-dtype auto")
    if model_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{flag} quantizes bf16/fp16 K/V, but the model computes in {model_dtype}; load the "
                         "model in bfloat16 or float16, or use --kv-cache-dtype auto")
    return spec


def _dtype_name(text: str) -> str:
    key = str(text).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in VALID_NAMES:
        raise argparse.ArgumentTypeError(f"unknown KV cache dtype {text!r}; choose from {', '.join(VALID_NAMES)}")
    return key


def add_kv_cache_dtype_argument(parser: argparse.ArgumentParser, default="auto", help: str = HELP):
    """Add ``--kv-cache-dtype`` (aliases such as ``int8`` or ``fp8`` are accepted and normalised)."""
    return parser.add_argument("--kv-cache-dtype", type=_dtype_name, choices=VALID_NAMES, default=default,
                               metavar="{" + ",".join(VALID_NAMES) + "}", help=help)
