"""KV cache storage formats.

A format is named once (``"q8_0"``, ``"fp8_e4m3"``, ``"bf16"``, ``"fp16"``, ``"auto"``) and resolved to a
:class:`KVQuantSpec` that says how one element is stored. The cache tensor's dtype identifies the format at
run time: int8 is q8_0, float8_e4m3fn is fp8_e4m3, bf16/fp16 is unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

BLOCK = 32  # elements of head_dim that share one fp16 scale
SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class KVQuantSpec:
    name: str
    storage_dtype: Optional[torch.dtype]  # None for "auto": the model dtype
    max_magnitude: Optional[float]  # M in d = amax / M; None when unquantized
    block: int = BLOCK

    @property
    def quantized(self) -> bool:
        return self.max_magnitude is not None

    @property
    def bytes_per_element(self) -> float:
        """Storage bytes per element, scales included (1.0625 for the 8-bit formats)."""
        if self.quantized:
            return 1.0 + SCALE_DTYPE.itemsize / self.block
        return 2.0

    def cache_dtype(self, model_dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
        """The dtype of the value planes when the model computes in ``model_dtype``."""
        return self.storage_dtype if self.storage_dtype is not None else model_dtype

    @staticmethod
    def from_name(name: str) -> "KVQuantSpec":
        key = str(name).strip().lower()
        key = _ALIASES.get(key, key)
        if key not in SPECS:
            raise ValueError(
                f"unknown KV cache dtype {name!r}; valid names are {', '.join(VALID_NAMES)}"
            )
        return SPECS[key]

    @staticmethod
    def from_cache_dtype(dtype: torch.dtype) -> "KVQuantSpec":
        for spec in SPECS.values():
            if spec.storage_dtype == dtype:
                return spec
        raise ValueError(
            f"a KV cache of dtype {dtype} is not a kvq format; use int8 (q8_0), float8_e4m3fn "
            "(fp8_e4m3), bfloat16 or float16"
        )


SPECS = {
    "auto": KVQuantSpec("auto", None, None),
    "bf16": KVQuantSpec("bf16", torch.bfloat16, None),
    "fp16": KVQuantSpec("fp16", torch.float16, None),
    "q8_0": KVQuantSpec("q8_0", torch.int8, 127.0),
    "fp8_e4m3": KVQuantSpec("fp8_e4m3", torch.float8_e4m3fn, 448.0),
}
VALID_NAMES = tuple(SPECS)
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "fp8": "fp8_e4m3", "int8": "q8_0"}

QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
FLOAT_DTYPES = (torch.bfloat16, torch.float16)
