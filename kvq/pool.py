"""A paged KV pool: per layer the K/V value planes and (for the 8-bit formats) their fp16 scale planes.

Layout (DESIGN.md): values ``[num_pages, page_size, num_kv_heads, head_dim]``, scales
``[num_pages, page_size, num_kv_heads, head_dim // 32]``. Token ``i`` of a sequence lives at slot
``pages[i // page_size] * page_size + i % page_size``. All layers share one page allocator, so a page id
means the same token range in every layer.

Sizing, exactly (per token, over all layers, K and V)::

    unit_bytes = 2 * num_layers * num_kv_heads * (head_dim * element_bytes + head_dim // 32 * 2)

which is ``2 * L * Hkv * D * 1.0625`` for q8_0/fp8_e4m3 and ``2 * L * Hkv * D * 2`` for bf16/fp16.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch import Tensor

from .config import resolve_kv_cache_dtype
from .ops import dequantize, new_cache, store_kv
from .spec import BLOCK, SCALE_DTYPE, KVQuantSpec

DTypeLike = Union[str, KVQuantSpec, torch.dtype]
_REBUILD_CHUNK = 1 << 16  # tokens moved per op call in rebuild(); bounds the temporary bf16 copy


class KVPoolFullError(RuntimeError):
    """The pool has too few free pages for a request; the pool is left unchanged."""


def resolve_spec(dtype: DTypeLike, model_dtype: torch.dtype) -> KVQuantSpec:
    """A format name, spec or cache dtype as a concrete spec (``auto`` becomes the model dtype's), by the rule of
    :func:`kvq.resolve_kv_cache_dtype` for kvq's attention: a pool that kvq cannot read fails here, not later."""
    if isinstance(dtype, torch.dtype):
        spec = KVQuantSpec.from_cache_dtype(dtype)
    elif isinstance(dtype, KVQuantSpec):
        spec = dtype
    else:
        spec = KVQuantSpec.from_name(dtype)
    # head_dim=BLOCK: the pool checks its own head_dim (_check_shape); this resolves the dtype only.
    return resolve_kv_cache_dtype(spec, attention_backend="kvq", head_dim=BLOCK, model_dtype=model_dtype)


def kv_unit_bytes(num_layers: int, num_kv_heads: int, head_dim: int, spec: KVQuantSpec,
                  model_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one token takes over all layers, K and V, scales included (an exact integer)."""
    per_head = head_dim * spec.cache_dtype(model_dtype).itemsize
    if spec.quantized:
        per_head += (head_dim // BLOCK) * SCALE_DTYPE.itemsize
    return 2 * num_layers * num_kv_heads * per_head


def _check_shape(num_layers, num_kv_heads, head_dim, page_size):
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("page_size", page_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"KVPool: {name} must be a positive int, got {v!r}")
    if head_dim % BLOCK:
        raise ValueError(f"KVPool: head_dim {head_dim} is not a multiple of {BLOCK}; kvq stores one scale per "
                         f"{BLOCK} elements of head_dim, so its pool needs head_dim in 64, 128, 256, ...")


def _check_count(where: str, name: str, n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{where}: {name} must be a non-negative int (a number of tokens), got {n!r}")


class KVPool:
    """Per-layer paged K/V planes in one kvq format, with a page allocator shared by all layers.

    ``kv_cost`` counts whole pages (what a sequence of that many tokens occupies here); ``unit_bytes() * n``
    is the exact per-token figure.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int = 16,
                 kv_cache_dtype: DTypeLike = "q8_0", model_dtype: torch.dtype = torch.bfloat16,
                 device: Union[str, torch.device] = "cpu"):
        _check_shape(num_layers, num_kv_heads, head_dim, page_size)
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise ValueError(f"KVPool: num_pages must be a positive int, got {num_pages!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size = page_size
        self.model_dtype = model_dtype
        self.device = torch.device(device)
        self.spec = resolve_spec(kv_cache_dtype, model_dtype)
        self._planes = self._allocate(self.spec, num_pages)
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack; pop() hands out low page ids first
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

    # ------------------------------------------------------------------------------------ sizing
    @classmethod
    def from_budget(cls, budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    page_size: int = 16, kv_cache_dtype: DTypeLike = "q8_0",
                    model_dtype: torch.dtype = torch.bfloat16, device: Union[str, torch.device] = "cpu"
                    ) -> "KVPool":
        """The largest pool whose planes (values and scales, all layers) fit in ``budget_bytes``."""
        _check_shape(num_layers, num_kv_heads, head_dim, page_size)
        spec = resolve_spec(kv_cache_dtype, model_dtype)
        page_bytes = kv_unit_bytes(num_layers, num_kv_heads, head_dim, spec, model_dtype) * page_size
        num_pages = int(budget_bytes) // page_bytes
        if num_pages < 1:
            raise ValueError(f"KVPool: a budget of {int(budget_bytes)} bytes holds no page: one page of "
                             f"{page_size} tokens in {spec.name} takes {page_bytes} bytes; raise the budget, "
                             "lower page_size or use an 8-bit kv_cache_dtype")
        return cls(num_layers, num_kv_heads, head_dim, num_pages, page_size, spec, model_dtype, device)

    @classmethod
    def from_free_memory(cls, fraction: float, num_layers: int, num_kv_heads: int, head_dim: int,
                         page_size: int = 16, kv_cache_dtype: DTypeLike = "q8_0",
                         model_dtype: torch.dtype = torch.bfloat16, device: Union[str, torch.device] = "cuda"
                         ) -> "KVPool":
        """A pool taking ``fraction`` of the GPU memory free now (``torch.cuda.mem_get_info``)."""
        if not 0 < fraction <= 1:
            raise ValueError(f"KVPool.from_free_memory: fraction must be in (0, 1], got {fraction}")
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"KVPool.from_free_memory needs a CUDA device (got {dev}"
                               f"{'' if torch.cuda.is_available() else ', and no GPU is visible'}); "
                               "size the pool with KVPool.from_budget(budget_bytes, ...) instead")
        free, _ = torch.cuda.mem_get_info(dev)
        return cls.from_budget(int(free * fraction), num_layers, num_kv_heads, head_dim, page_size,
                               kv_cache_dtype, model_dtype, dev)

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.spec.cache_dtype(self.model_dtype)

    def unit_bytes(self) -> int:
        """Bytes per token over all layers, K and V, scales included."""
        return kv_unit_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.spec, self.model_dtype)

    def page_bytes(self) -> int:
        return self.unit_bytes() * self.page_size

    def kv_cost(self, num_tokens: int) -> int:
        """Bytes that ``num_tokens`` tokens of one sequence occupy, counted in whole pages."""
        _check_count("KVPool.kv_cost", "num_tokens", num_tokens)
        return self._page_count(num_tokens) * self.page_bytes()

    def pages_for(self, num_tokens: int) -> int:
        """Pages that a sequence of ``num_tokens`` tokens occupies."""
        _check_count("KVPool.pages_for", "num_tokens", num_tokens)
        return self._page_count(num_tokens)

    def _page_count(self, num_tokens: int) -> int:  # for counts already checked
        return -(-num_tokens // self.page_size)

    def free_pages(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------------------------------ planes
    def k_cache(self, layer: int) -> Tensor:
        return self._plane(layer)[0]

    def v_cache(self, layer: int) -> Tensor:
        return self._plane(layer)[1]

    def k_scale(self, layer: int) -> Optional[Tensor]:
        return self._plane(layer)[2]

    def v_scale(self, layer: int) -> Optional[Tensor]:
        return self._plane(layer)[3]

    def _plane(self, layer: int):
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"KVPool: layer {layer} out of range; the pool has {self.num_layers} layers")
        return self._planes[layer]

    def _allocate(self, spec: KVQuantSpec, num_pages: int) -> list:
        # Zeroed, so a kernel that loads a whole page never meets NaN bit patterns in unused slots.
        dt = spec.cache_dtype(self.model_dtype)
        planes = []
        for _ in range(self.num_layers):
            kc, ks = new_cache(num_pages, self.page_size, self.num_kv_heads, self.head_dim, dt, self.device)
            vc, vs = new_cache(num_pages, self.page_size, self.num_kv_heads, self.head_dim, dt, self.device)
            planes.append(tuple(t if t is None else t.zero_() for t in (kc, vc, ks, vs)))
        return planes

    # ------------------------------------------------------------------------------------ allocator
    def new_sequence(self) -> int:
        seq = self._next_id
        self._next_id += 1
        self._pages[seq] = []
        self._lens[seq] = 0
        return seq

    def _seq(self, seq: int) -> list[int]:
        if seq not in self._pages:
            raise KeyError(f"KVPool: no live sequence {seq!r} (never created, or already freed)")
        return self._pages[seq]

    def append(self, seq: int, n: int) -> Tensor:
        """Reserve ``n`` more token slots for ``seq``; returns their slot_mapping, int64 ``[n]``."""
        pages = self._seq(seq)
        _check_count("KVPool.append", "n", n)
        start = self._lens[seq]
        needed = self._page_count(start + n) - len(pages)
        if needed > len(self._free):
            raise KVPoolFullError(
                f"KVPool: sequence {seq} needs {needed} more page(s) of {self.page_size} tokens to grow from "
                f"{start} to {start + n} tokens, but only {len(self._free)} of {self.num_pages} pages are free; "
                "free finished sequences, or rebuild() the pool larger or in an 8-bit format")
        for _ in range(needed):
            pages.append(self._free.pop())
        self._lens[seq] = start + n
        return self.slots(seq, start, start + n)

    def seq_len(self, seq: int) -> int:
        self._seq(seq)
        return self._lens[seq]

    def pages(self, seq: int) -> list[int]:
        return list(self._seq(seq))

    def sequences(self) -> list[int]:
        """Live sequence ids, oldest first."""
        return list(self._pages)

    def free(self, seq: int) -> None:
        pages = self._seq(seq)
        self._free.extend(reversed(pages))
        del self._pages[seq], self._lens[seq]

    def slots(self, seq: int, start: int = 0, end: Optional[int] = None) -> Tensor:
        """Slots of positions ``[start, end)`` of ``seq`` (already allocated), int64 on the pool's device."""
        pages = self._seq(seq)
        length = self._lens[seq]
        end = length if end is None else end
        if not 0 <= start <= end <= length:
            raise IndexError(f"KVPool.slots: positions [{start}, {end}) are not within sequence {seq}'s "
                             f"{length} allocated tokens")
        pos = torch.arange(start, end, dtype=torch.int64)
        table = torch.tensor(pages, dtype=torch.int64)
        return (table[pos // self.page_size] * self.page_size + pos % self.page_size).to(self.device)

    def block_table(self, seqs: Iterable[int]) -> Tensor:
        """int32 ``[len(seqs), max_pages]``; entries past a sequence's pages hold page 0 (valid, never read)."""
        rows = [self._seq(s) for s in seqs]
        width = max([len(r) for r in rows] + [1])
        padded = [r + [0] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int32).reshape(len(rows), width).to(self.device)

    def seq_lens(self, seqs: Iterable[int]) -> Tensor:
        lens = [self.seq_len(s) for s in seqs]
        return torch.tensor(lens, dtype=torch.int32).to(self.device)

    # ------------------------------------------------------------------------------------ rebuild
    def rebuild(self, dtype: Optional[DTypeLike] = None, num_pages: Optional[int] = None) -> None:
        """Move every live token into fresh planes of another format and/or size, compacting pages.

        In another format each token is dequantized (``kvq.dequantize``, to the new cache dtype when it is
        unquantized, else to the model dtype) and stored again (``kvq.store_kv``); in the same format its bytes
        and scales are copied unchanged. Sequence ids and lengths stay; pages are renumbered from 0 in sequence
        order, so block tables must be fetched again. If the new size cannot hold the live tokens, raises
        ValueError before touching anything.
        """
        spec = self.spec if dtype is None else resolve_spec(dtype, self.model_dtype)
        num_pages = self.num_pages if num_pages is None else num_pages
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise ValueError(f"KVPool.rebuild: num_pages must be a positive int, got {num_pages!r}")
        needed = sum(len(p) for p in self._pages.values())
        live_tokens = sum(self._lens.values())
        if needed > num_pages:
            raise ValueError(f"KVPool.rebuild: the {len(self._pages)} live sequences ({live_tokens} tokens) "
                             f"occupy {needed} pages of {self.page_size} tokens, but the new pool would have "
                             f"{num_pages}; free sequences first or ask for at least {needed} pages")
        planes = self._allocate(spec, num_pages)
        new_pages, src, dst, nxt = {}, [], [], 0
        for seq, pages in self._pages.items():
            new_pages[seq] = list(range(nxt, nxt + len(pages)))
            nxt += len(pages)
            src.append(self.slots(seq))
            pos = torch.arange(self._lens[seq], dtype=torch.int64, device=self.device)
            dst.append((new_pages[seq][0] if pages else 0) * self.page_size + pos)  # pages are consecutive
        src = torch.cat(src) if src else torch.zeros(0, dtype=torch.int64, device=self.device)
        dst = torch.cat(dst) if dst else torch.zeros(0, dtype=torch.int64, device=self.device)
        via = spec.cache_dtype(self.model_dtype) if not spec.quantized else self.model_dtype
        # Same format: move the stored bytes. Re-quantizing a dequantized value need not give the same bytes
        # back, so a resize through the model dtype would change the cache a little each time.
        same = spec == self.spec
        for old, new in zip(self._planes, planes):
            for i in range(0, src.numel(), _REBUILD_CHUNK):
                s, d = src[i:i + _REBUILD_CHUNK], dst[i:i + _REBUILD_CHUNK]
                if same:
                    for a, b in zip(old, new):
                        if a is not None:
                            _slot_rows(b)[d] = _slot_rows(a)[s]
                else:
                    (kc, vc, ks, vs), (nkc, nvc, nks, nvs) = old, new
                    store_kv(dequantize(kc, ks, s, via), dequantize(vc, vs, s, via), nkc, nvc, nks, nvs, d)
        # Everything is in place; only now does the pool change.
        self._planes, self.spec, self.num_pages, self._pages = planes, spec, num_pages, new_pages
        self._free = list(range(num_pages - 1, nxt - 1, -1))

    def __repr__(self) -> str:
        return (f"KVPool({self.spec.name}, layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, pages={self.num_pages}x{self.page_size}, free={self.free_pages()}, "
                f"{self.num_pages * self.page_bytes() / 2**20:.1f} MiB)")


def _slot_rows(plane: Tensor) -> Tensor:
    """A pool plane ``[num_pages, page_size, ...]`` as raw bytes, one row per slot (a view)."""
    return plane.view(torch.uint8).flatten(0, 1)
