"""Which backend serves CUDA tensors, and why the others do not.

``cuda`` (the compiled ``kvq._C``) is preferred, then ``triton``, then ``reference`` (plain PyTorch).
``KVQ_BACKEND=cuda|triton|reference`` forces one; forcing one that cannot run is an error at the first op
call (and in ``python -m kvq info``), never a silent fallback. CPU tensors always use the reference.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

NAMES = ("cuda", "triton", "reference")


@dataclass
class Selection:
    active: Optional[str]  # None when the forced backend cannot run
    forced: Optional[str]
    reasons: dict = field(default_factory=dict)  # backend -> why it is not usable (absent when usable)
    error: Optional[str] = None


def _gpu_arch() -> Optional[tuple[int, int]]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


@functools.lru_cache(maxsize=None)
def extension() -> tuple[Optional[object], Optional[str]]:
    """Import ``kvq._C`` (which registers the CUDA kernels); returns (module, None) or (None, reason)."""
    if importlib.util.find_spec("kvq._C") is None:
        return None, ("kvq._C is not built (no nvcc or no CUDA build of torch when kvq was installed; "
                      "reinstall with `pip install --no-build-isolation -e .` on a machine with both)")
    try:
        return importlib.import_module("kvq._C"), None
    except (ImportError, OSError) as e:
        return None, f"kvq._C failed to load: {e}"


def compiled_archs() -> list[str]:
    mod, _ = extension()
    return mod.cuda_archs().split(";") if mod is not None else []


def _cuda_reason() -> Optional[str]:
    if importlib.util.find_spec("kvq._C") is None:
        return extension()[1]
    arch = _gpu_arch()
    if arch is None:
        return "no CUDA GPU is visible to torch"
    mod, reason = extension()
    if mod is None:
        return reason
    have = compiled_archs()
    mine = f"{arch[0]}.{arch[1]}"
    if not any(a.split("+")[0] == mine for a in have):
        return (f"kvq._C was compiled for sm {';'.join(have)} but this GPU is sm_{arch[0]}{arch[1]}; rebuild "
                f"with TORCH_CUDA_ARCH_LIST={mine}")
    return None


def _triton_reason() -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    if _gpu_arch() is None:
        return "no CUDA GPU is visible to torch"
    if _gpu_arch() < (8, 0):
        return f"triton kernels need sm_80 or newer, this GPU is sm_{''.join(map(str, _gpu_arch()))}"
    return None


def _availability() -> dict:
    reasons = {}
    for name, probe in (("cuda", _cuda_reason), ("triton", _triton_reason)):
        r = probe()
        if r is not None:
            reasons[name] = r
    return reasons


def _select_from(forced: Optional[str], reasons: dict) -> Selection:
    if forced is not None:
        if forced not in NAMES:
            return Selection(None, forced, reasons, f"KVQ_BACKEND={forced!r} is not a backend; use one of "
                             f"{', '.join(NAMES)}, or unset it")
        if forced in reasons:
            return Selection(None, forced, reasons, f"KVQ_BACKEND={forced} was asked for but cannot run: "
                             f"{reasons[forced]}. Unset KVQ_BACKEND to choose automatically.")
        return Selection(forced, forced, reasons)
    for name in NAMES:
        if name not in reasons:
            return Selection(name, None, reasons)
    raise AssertionError("the reference backend is always available")


@functools.lru_cache(maxsize=None)
def selection() -> Selection:
    forced = os.environ.get("KVQ_BACKEND") or None
    return _select_from(forced.strip().lower() if forced else None, _availability())


def available() -> list[str]:
    """Backends that can run here (CUDA tensors); the reference is always among them."""
    reasons = selection().reasons
    return [n for n in NAMES if n not in reasons]


def source_digest(root: Optional[Path] = None) -> str:
    """The first 12 hex digits of a SHA-256 over kvq's sources as they are on disk, each with its path: the
    package's ``.py`` files and, in a checkout, ``csrc/`` and ``setup.py``. It names the code that ran where git
    cannot (a copied tree, uncommitted changes): a benchmark records it, and ``python -m kvq info`` prints it
    for a checkout to compare."""
    root = Path(__file__).resolve().parents[1] if root is None else Path(root)
    files = [f for f in (root / "kvq").rglob("*.py") if "__pycache__" not in f.parts]
    if (root / "csrc").is_dir():
        files += [f for f in (root / "csrc").rglob("*") if f.suffix in (".cu", ".cuh", ".cpp", ".h", ".py")]
        files += [root / "setup.py"] if (root / "setup.py").is_file() else []
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def info() -> dict:
    sel = selection()
    arch = _gpu_arch()
    out = {
        "backend": sel.active,
        "forced": sel.forced,
        "error": sel.error,
        "unavailable": dict(sel.reasons),
        "gpu": torch.cuda.get_device_name() if arch else None,
        "gpu_arch": f"sm_{arch[0]}{arch[1]}" if arch else None,
        "compiled_archs": compiled_archs(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": None,
        "source": source_digest(),
    }
    if importlib.util.find_spec("triton") is not None:
        import triton

        out["triton"] = triton.__version__
    return out


@contextlib.contextmanager
def pinned_cuda_kernel(setter: str, choice: str):
    """Hold one kernel choice of ``kvq._C`` for the block and restore the previous one after it: ``setter`` is
    ``"set_decode_kernel"`` ("auto", "fma", "tc"), ``"set_decode_heads"`` ("auto", "cta", "warp", "columns", "rows":
    kv heads of the tensor-core decode per CTA or per warp, at head_dim 256 per CTA of warps dividing the columns, or
    for 8-bit caches at head_dim 64 two or three per warp),
    ``"set_decode_pdl"`` ("auto", "merge", "off": the decode split kernel and merge, the merge alone, or neither,
    launched as programmatic dependents where the device can), ``"set_decode_splits"`` ("auto", "1" to "256": ranges
    of each sequence, combined by a merge), ``"set_extend_shape"`` ("auto", "wide", "deep",
    "tall", "small"), ``"set_extend_splits"`` ("auto", "1" to "4": key ranges per extend row block, merged after),
    ``"set_extend_pdl"`` ("auto", "merge", "off", as for decode) or ``"set_store_pdl"`` ("auto", "off": the store
    launched as a programmatic dependent of the kernel before it where the device can, or not). For tests and
    benchmarks, which must reach every kernel whatever shape the rules would pick by."""
    from kvq import _C

    prev = getattr(_C, setter)(choice)
    try:
        yield
    finally:
        getattr(_C, setter)(prev)
