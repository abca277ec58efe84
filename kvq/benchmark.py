"""``python -m kvq bench``: decode / extend / store timings against the peers, on one CUDA GPU.

Decode attention is memory bound, so every decode time is set against a floor: the bytes the
implementation must read (K, V and, for kvq's 8-bit formats, the fp16 scales) divided by the bandwidth of a
device-to-device ``copy_`` measured first in the same run. Peers: torch SDPA on a contiguous bf16 cache
(cuDNN and flash backends), the naive "dequantize the whole cache with plain torch ops, then SDPA" a user writes without kvq, and
FlashInfer (bf16, and fp8 with one scale per tensor) when ``import flashinfer`` works.

Method: every measured call reads inputs that are not in L2. Each configuration is replicated ``n``
times (disjoint pages of one pool, or disjoint slices of one contiguous tensor) so the replicas together
are at least 4x the L2 size, and the ``n`` calls are captured in one CUDA graph that is replayed
(falling back to eager launches, reported, where capture fails). The time of a call is the median over
replays, divided by ``n``. Writes JSON, Markdown and PNG plots into ``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from kvq import reference

GiB = 1 << 30
FORMATS = ("bf16", "q8_0", "fp8_e4m3")
QUANT = ("q8_0", "fp8_e4m3")
CACHE_DTYPES = {"bf16": torch.bfloat16, "q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
ELEM_BYTES = {"bf16": 2, "fp8": 1, "q8_0": 1, "fp8_e4m3": 1}
SCALE_BLOCK, SCALE_BYTES = 32, 2
HEADS = ((32, 8, 128), (16, 2, 256), (9, 3, 64))  # (num_q_heads, num_kv_heads, head_dim)
REPO = Path(__file__).resolve().parents[1]

# The bars a release must meet (see `evaluate_bars`).
BAR_SPEEDUP, BAR_SPEEDUP_CTX = 1.8, 32768
BAR_BW_FRAC, BAR_BW_TOKENS = 0.85, 131072
BAR_SMALL_CTX = (1024, 4096)
BAR_EXTEND_RATIO = 1.1
BAR_STORE_FRAC, BAR_STORE_TOKENS = 0.80, 65536
BAR_NAIVE = 20.0


# ------------------------------------------------------------------------------------ shapes (CLI)
@dataclass(frozen=True)
class Plan:
    decode: list  # (hq, hkv, d, batch, ctx)
    extend: list  # (hq, hkv, d, chunk, prefix)
    store: list  # (hq, hkv, d, tokens)
    flashinfer_dims: tuple


def make_plan(quick: bool, heads=None, batches=None, ctxs=None, fi_dims=None) -> Plan:
    """The shapes of a run. The full plan is trimmed to finish in a few minutes on an H200."""
    heads = list(heads or (HEADS[:1] if quick else HEADS))
    decode = []
    for h in heads:
        if batches or ctxs:
            decode += [(*h, b, c) for b in (batches or (1, 8, 64)) for c in (ctxs or (1024, 4096, 32768))]
        elif quick:
            decode += [(*h, 1, 1024), (*h, 1, 4096), (*h, 1, 32768), (*h, 1, 131072), (*h, 8, 32768),
                       (*h, 64, 8192)]
        else:
            ks = 1024
            decode += [(*h, 1, c * ks) for c in (1, 2, 4, 8, 32, 128, 256)]
            decode += [(*h, 8, c * ks) for c in (1, 8, 32, 128)]
            decode += [(*h, 64, c * ks) for c in (1, 4, 8, 32)] + ([(*h, 64, 128 * ks)] if h == HEADS[0] else [])
    if quick:
        extend = [(*heads[0], 512, 8192), (*heads[0], 2048, 0), (*heads[0], 2048, 32768)]
        store = [(*heads[0], 65536)]
    else:
        extend = [(*heads[0], c, p) for c in (512, 2048, 8192) for p in (0, 4096, 32768)]
        store = [(*h, n) for h in heads for n in (65536, 262144)]
    dims = tuple(fi_dims) if fi_dims else (128,)
    return Plan(decode, extend, store, dims)


# ------------------------------------------------------------------------- bytes and floors (pure)
def kv_bytes(tokens: int, num_kv_heads: int, head_dim: int, fmt: str) -> int:
    """Bytes of K and V (and their fp16 scales, for the 8-bit formats) for ``tokens`` tokens."""
    elems = tokens * num_kv_heads * head_dim
    scales = elems // SCALE_BLOCK * SCALE_BYTES if fmt in QUANT else 0
    return 2 * (elems * ELEM_BYTES[fmt] + scales)


def decode_bytes(impl: str, fmt: str, batch: int, ctx: int, hq: int, hkv: int, d: int,
                 gqa: str = "native") -> int:
    """Bytes one decode call must move through HBM (the query and output are negligible and left out).

    kvq / flashinfer: the paged K, V (+ scales) it reads. sdpa: its contiguous bf16 K, V, with the kv heads
    repeated to the query heads when the backend has no native GQA. naive: dequantize reads the 8-bit cache
    and writes bf16, then SDPA reads that bf16 copy.
    """
    tokens = batch * ctx
    if impl == "naive":
        return kv_bytes(tokens, hkv, d, fmt) + 2 * kv_bytes(tokens, hkv, d, "bf16")
    if impl.startswith("sdpa"):
        return kv_bytes(tokens, hq if gqa == "repeat" else hkv, d, "bf16")
    return kv_bytes(tokens, hkv, d, fmt)


def store_bytes(tokens: int, hkv: int, d: int, fmt: str) -> int:
    """Bytes ``store_kv`` moves: bf16 K and V read, values and scales written, the int64 slot mapping read."""
    return kv_bytes(tokens, hkv, d, "bf16") + kv_bytes(tokens, hkv, d, fmt) + 8 * tokens


def floor_us(nbytes: int, bandwidth: float) -> float:
    """The time to move ``nbytes`` at ``bandwidth`` bytes/s, in microseconds."""
    return nbytes / bandwidth * 1e6


def extend_flops(chunk: int, prefix: int, hq: int, d: int) -> int:
    """QK^T and PV flops of a causal chunk of ``chunk`` queries at offset ``prefix``."""
    keys = chunk * prefix + chunk * (chunk + 1) // 2
    return 4 * hq * d * keys


def rotation(bytes_per_call: int, l2_bytes: int, cap: int) -> int:
    """How many replicas of a call's inputs make a working set of at least 4x L2 (capped)."""
    return max(1, min(cap, math.ceil(4 * l2_bytes / max(1, bytes_per_call))))


def add_decode_ratios(rows: list) -> None:
    """Per decode shape: the speed-up of each kvq 8-bit row over the fastest bf16 peer (sdpa, flashinfer)."""
    best = {}
    for r in rows:
        if r["op"] == "decode" and r["fmt"] == "bf16" and r["kind"] == "peer" and r.get("us"):
            k = _shape_key(r)
            best[k] = min(best.get(k, math.inf), r["us"])
    for r in rows:
        if r["op"] == "decode" and r["kind"] == "kvq" and r["fmt"] in QUANT and r.get("us"):
            b = best.get(_shape_key(r))
            r["speedup_vs_best_bf16_peer"] = None if b is None else b / r["us"]


def _shape_key(r):
    return (r["hq"], r["hkv"], r["d"], r["batch"], r["ctx"])


# ---------------------------------------------------------------------------------------- bars (pure)
def _bar(name, values, ok, fmt_value, where):
    """values: list of (value, description). Met when every value passes ``ok``; None when nothing qualifies."""
    if not values:
        return {"name": name, "met": None, "detail": "not measured (no qualifying rows)"}
    failing = [(v, w) for v, w in values if not ok(v)]
    worst = min(values, key=lambda x: x[0]) if where == "min" else max(values, key=lambda x: x[0])
    detail = f"{len(values) - len(failing)}/{len(values)} pass; worst {fmt_value(worst[0])} at {worst[1]}"
    return {"name": name, "met": not failing, "detail": detail}


def _desc(r):
    return f"{r['hq']}/{r['hkv']} d{r['d']} B={r['batch']} ctx={r['ctx']} {r['fmt']}"


def evaluate_bars(rows: list, backends: list) -> list:
    """The release bars, per kvq backend, from result rows (see the module's BAR_* constants)."""
    bars = []
    dec = [r for r in rows if r["op"] == "decode" and r.get("us")]
    for be in backends:
        impl = f"kvq-{be}"
        q8 = [r for r in dec if r["impl"] == impl and r["fmt"] in QUANT]
        vals = [(r["speedup_vs_best_bf16_peer"], _desc(r)) for r in q8
                if r["ctx"] >= BAR_SPEEDUP_CTX and r.get("speedup_vs_best_bf16_peer")]
        bars.append(_bar(f"{impl}: 8-bit decode >= {BAR_SPEEDUP}x the best bf16 peer at ctx >= {BAR_SPEEDUP_CTX}",
                         vals, lambda v: v >= BAR_SPEEDUP, lambda v: f"{v:.2f}x", "min"))
        vals = [(r["frac"], _desc(r)) for r in q8 if r["batch"] * r["ctx"] >= BAR_BW_TOKENS]
        bars.append(_bar(f"{impl}: 8-bit decode >= {BAR_BW_FRAC:.0%} of copy bandwidth at >= {BAR_BW_TOKENS} "
                         "total tokens", vals, lambda v: v >= BAR_BW_FRAC, lambda v: f"{v:.1%}", "min"))
        bf = {_shape_key(r): r["us"] for r in dec if r["impl"] == impl and r["fmt"] == "bf16"}
        vals = [(r["us"] / bf[_shape_key(r)], _desc(r)) for r in q8 if r["batch"] == 1
                and BAR_SMALL_CTX[0] <= r["ctx"] <= BAR_SMALL_CTX[1] and _shape_key(r) in bf]
        bars.append(_bar(f"{impl}: batch 1, ctx {BAR_SMALL_CTX[0]}-{BAR_SMALL_CTX[1]}: 8-bit decode no slower "
                         "than kvq bf16 (time ratio <= 1.00)", vals, lambda v: v <= 1.0,
                         lambda v: f"{v:.3f}x", "max"))
        ext = [r for r in rows if r["op"] == "extend" and r["impl"] == impl and r.get("us") and r["prefix"] > 0]
        bfe = {(r["hq"], r["d"], r["chunk"], r["prefix"]): r["us"] for r in ext if r["fmt"] == "bf16"}
        vals = [(r["us"] / bfe[k], f"chunk={r['chunk']} prefix={r['prefix']} {r['fmt']}") for r in ext
                if r["fmt"] in QUANT and (k := (r["hq"], r["d"], r["chunk"], r["prefix"])) in bfe]
        bars.append(_bar(f"{impl}: extend over an 8-bit prefix <= {BAR_EXTEND_RATIO}x the bf16 prefix", vals,
                         lambda v: v <= BAR_EXTEND_RATIO, lambda v: f"{v:.3f}x", "max"))
        vals = [(r["frac"], f"{r['hkv']}x{r['d']} tokens={r['tokens']} {r['fmt']}") for r in rows
                if r["op"] == "store" and r["impl"] == impl and r.get("us") and r["fmt"] in QUANT
                and r["tokens"] >= BAR_STORE_TOKENS]
        bars.append(_bar(f"{impl}: 8-bit store >= {BAR_STORE_FRAC:.0%} of copy bandwidth", vals,
                         lambda v: v >= BAR_STORE_FRAC, lambda v: f"{v:.1%}", "min"))
        kv = {(_shape_key(r), r["fmt"]): r["us"] for r in q8}
        vals = [(r["us"] / kv[(_shape_key(r), r["fmt"])], _desc(r)) for r in dec
                if r["kind"] == "naive" and r.get("backend") == be and (_shape_key(r), r["fmt"]) in kv]
        bars.append(_bar(f"{impl}: 8-bit decode >= {BAR_NAIVE:.0f}x faster than dequantize-then-SDPA", vals,
                         lambda v: v >= BAR_NAIVE, lambda v: f"{v:.1f}x", "min"))
    return bars


# -------------------------------------------------------------------------------- Markdown (pure)
def markdown_table(headers: list, rows: list) -> str:
    """A GitHub Markdown table; numbers right-aligned, ``None`` shown as ``-``."""
    cells = [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max([len(str(h))] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(_looks_numeric(r[i]) for r in cells) and cells != [] for i in range(len(headers))]
    line = lambda vals: "| " + " | ".join(v.rjust(w) if n else v.ljust(w)  # noqa: E731
                                          for v, w, n in zip(vals, widths, numeric)) + " |"
    sep = "|" + "|".join(("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric)) + "|"
    return "\n".join([line([str(h) for h in headers]), sep] + [line(r) for r in cells])


def _looks_numeric(s: str) -> bool:
    s = s.split(" ")[0].rstrip("x%")
    try:
        float(s)
        return True
    except ValueError:
        return s == "-"


def _fmt_us(us):
    return None if us is None else (f"{us:.1f}" if us < 1000 else f"{us:.0f}")


def _ctx(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def decode_table(rows: list) -> str:
    """One line per decode shape; a cell is ``µs (fraction of its floor[, speed-up over the best bf16 peer])``."""
    dec = [r for r in rows if r["op"] == "decode"]
    impls = list(dict.fromkeys(f"{r['impl']} {r['fmt']}" for r in dec))
    shapes = list(dict.fromkeys(_shape_key(r) for r in dec))
    by = {(_shape_key(r), f"{r['impl']} {r['fmt']}"): r for r in dec}
    out = []
    for s in shapes:
        line = [f"{s[0]}/{s[1]} d{s[2]}", s[3], _ctx(s[4])]
        for name in impls:
            r = by.get((s, name))
            if r is None or not r.get("us"):
                line.append(None if r is None else "skip")
                continue
            cell = f"{_fmt_us(r['us'])} ({r['frac']:.0%}"
            if r.get("speedup_vs_best_bf16_peer"):
                cell += f", {r['speedup_vs_best_bf16_peer']:.2f}x"
            line.append(cell + ")")
        out.append(line)
    return markdown_table(["heads", "B", "ctx"] + impls, out)


def extend_table(rows: list) -> str:
    ext = [r for r in rows if r["op"] == "extend"]
    impls = list(dict.fromkeys(f"{r['impl']} {r['fmt']}" for r in ext))
    shapes = list(dict.fromkeys((r["hq"], r["hkv"], r["d"], r["chunk"], r["prefix"]) for r in ext))
    by = {((r["hq"], r["hkv"], r["d"], r["chunk"], r["prefix"]), f"{r['impl']} {r['fmt']}"): r for r in ext}
    out = []
    for s in shapes:
        line = [f"{s[0]}/{s[1]} d{s[2]}", s[3], _ctx(s[4]) if s[4] else "0"]
        for name in impls:
            r = by.get((s, name))
            line.append(None if r is None else ("skip" if not r.get("us") else
                                                f"{_fmt_us(r['us'])} ({r['tflops']:.0f} TF/s)"))
        out.append(line)
    return markdown_table(["heads", "chunk", "prefix"] + impls, out)


def store_table(rows: list) -> str:
    st = [r for r in rows if r["op"] == "store"]
    out = [[f"{r['hkv']}x d{r['d']}", r["tokens"], f"{r['impl']} {r['fmt']}", _fmt_us(r.get("us")),
            None if not r.get("us") else f"{r['gbps']:.0f}", None if not r.get("us") else f"{r['frac']:.0%}",
            r.get("note")] for r in st]
    return markdown_table(["kv heads", "tokens", "impl", "us", "GB/s", "of copy", "note"], out)


def bars_text(bars: list) -> str:
    lines = []
    for b in bars:
        state = {True: "MET    ", False: "NOT MET", None: "n/a    "}[b["met"]]
        lines.append(f"- [{state}] {b['name']}: {b['detail']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ environment
def _run(cmd) -> Optional[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    from kvq import backends

    props = torch.cuda.get_device_properties(0)
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": props.name,
        "sm": f"sm_{props.major}{props.minor}",
        "gpu_memory_gib": round(props.total_memory / GiB, 1),
        "sms": props.multi_processor_count,
        "l2_mib": round(_l2_bytes() / (1 << 20), 1),
        "nvidia_smi": None,
        "cuda_driver_api": _driver_api(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
        "triton": None,
        "python": sys.version.split()[0],
        "kvq_commit": None,
        "kvq_backends": backends.info(),
    }
    if shutil.which("nvidia-smi"):
        env["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,"
                                  "power.limit", "--format=csv,noheader"])
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if (REPO / ".git").exists():
        head = _run(["git", "-C", str(REPO), "rev-parse", "HEAD"])
        dirty = _run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
        env["kvq_commit"] = None if head is None else head + ("+dirty" if dirty else "")
    return env


def _cudnn_version() -> Optional[int]:
    try:
        return torch.backends.cudnn.version()
    except (RuntimeError, ValueError):  # a torch without a usable cuDNN: the cuDNN peer reports its own error
        return None


def _driver_api() -> Optional[str]:
    """The CUDA version the installed driver supports (cuDriverGetVersion), e.g. "13.0"."""
    try:
        import ctypes

        v = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return None


def _l2_bytes() -> int:
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "L2_cache_size", 0) or 60 << 20)


# ------------------------------------------------------------------------------------------ timing
@dataclass
class Timing:
    us: float  # median microseconds per call
    graph: bool
    first_call_s: float  # the first (compiling) call, wall time
    note: Optional[str] = None


def time_calls(calls: list, use_graph: bool = True, budget_s: float = 0.04, max_reps: int = 100) -> Timing:
    """Median time of one call from ``calls`` (each reads its own replica of the inputs).

    All calls are captured into one CUDA graph and replayed; a replay's time (CUDA events) divided by
    ``len(calls)`` is one sample. Where capture fails the calls are launched eagerly and that is reported.
    """
    t0 = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    note = None
    run = None
    if use_graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for c in calls:
                    c()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for c in calls:
                    c()
            run = g.replay
        except Exception as e:  # capture is not supported by every peer: measure eagerly and say so
            torch.cuda.synchronize()
            note = f"eager (graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]})"
            run = None
    if run is None:
        def run():
            for c in calls:
                c()
    run()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    run()
    e.record()
    e.synchronize()
    once = s.elapsed_time(e) / 1e3
    reps = int(min(max_reps, max(5, budget_s / max(once, 1e-7))))
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in evs:
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    med = statistics.median(a.elapsed_time(b) for a, b in evs) * 1e3 / len(calls)
    return Timing(med, use_graph and note is None, first, note)


def copy_bandwidth(nbytes: int = 2 * GiB) -> dict:
    """Bytes read + written per second by a device-to-device ``copy_`` of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = time_calls([lambda: dst.copy_(src)], use_graph=False, budget_s=0.5, max_reps=30)
    # For reference only: a read-only stream (a sum) beats a copy, so kernels that only read can exceed 100%.
    flat = src.view(torch.float32)
    r = time_calls([lambda: flat.sum(dtype=torch.float32)], use_graph=False, budget_s=0.3, max_reps=30)
    src = dst = flat = None  # free before the benchmarks allocate
    torch.cuda.empty_cache()
    return {"bytes": 2 * nbytes, "us": t.us, "bandwidth": 2 * nbytes / (t.us * 1e-6),
            "read_bandwidth": nbytes / (r.us * 1e-6)}


# ----------------------------------------------------------------------------------- input builders
def _fill_(t: torch.Tensor) -> torch.Tensor:
    """Random contents (never zeros) in 256 MiB pieces, so a large pool needs no large temporary."""
    flat = t.view(-1)
    step = max(1, (256 << 20) // t.element_size())
    for i in range(0, flat.numel(), step):
        part = flat[i:i + step]
        if t.dtype == torch.int8:
            part.random_(-127, 128)
        elif t.dtype == torch.float8_e4m3fn:
            part.copy_(torch.randn(part.shape, device=t.device, dtype=torch.bfloat16))
        elif t.dtype == torch.float16:  # scales: the magnitude of amax/127 for unit-variance data
            part.uniform_(0.01, 0.03)
        else:
            part.normal_()
    return t


@dataclass
class Pool:
    k: torch.Tensor
    v: torch.Tensor
    ks: Optional[torch.Tensor]
    vs: Optional[torch.Tensor]
    tables: list  # one [batch, pages_per_seq] int32 block table per replica


def paged_pool(fmt: str, replicas: int, batch: int, tokens: int, hkv: int, d: int, page_size: int) -> Pool:
    """A pool holding ``replicas`` x ``batch`` sequences of ``tokens`` tokens on shuffled pages."""
    from kvq.ops import new_cache

    pps = max(1, -(-tokens // page_size))
    pages = replicas * batch * pps
    k, ks = new_cache(pages, page_size, hkv, d, CACHE_DTYPES[fmt], "cuda")
    v, vs = new_cache(pages, page_size, hkv, d, CACHE_DTYPES[fmt], "cuda")
    for t in (k, v, ks, vs):
        if t is not None:
            _fill_(t)
    perm = torch.randperm(pages, device="cuda", dtype=torch.int64).to(torch.int32)
    tables = [perm[r * batch * pps:(r + 1) * batch * pps].view(batch, pps) for r in range(replicas)]
    return Pool(k, v, ks, vs, tables)


@dataclass
class DecodeInputs:
    """A decode shape over ``replicas`` copies of its pool: one bf16 query per replica, one output."""
    pool: Pool
    queries: list
    lens: torch.Tensor
    out: torch.Tensor
    sm_scale: float

    def calls(self, decode: Callable) -> list:
        """One call of ``decode`` (the positional signature of ``torch.ops.kvq.decode_attention``) per replica."""
        p = self.pool
        return [lambda r=r: decode(self.queries[r], p.k, p.v, p.ks, p.vs, p.tables[r], self.lens, self.sm_scale, -1,
                                   0.0, self.out) for r in range(len(p.tables))]


def decode_inputs(fmt: str, replicas: int, batch: int, ctx: int, hq: int, hkv: int, d: int,
                  page_size: int) -> DecodeInputs:
    """``batch`` sequences of ``ctx`` tokens in a ``paged_pool`` of ``replicas`` copies, and their queries."""
    pool = paged_pool(fmt, replicas, batch, ctx, hkv, d, page_size)
    queries = [torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(replicas)]
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    return DecodeInputs(pool, queries, lens, out, 1.0 / math.sqrt(d))


def _fits(nbytes: int, margin: float = 0.85) -> tuple[bool, str]:
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return nbytes < margin * free, f"needs {nbytes / GiB:.1f} GiB, {free / GiB:.1f} GiB free"


# ---------------------------------------------------------------------------------------- peers
class Peers:
    """What this machine can compare against: SDPA backends (with how they do GQA) and FlashInfer."""

    def __init__(self, use_flashinfer: bool):
        from torch.nn.attention import SDPBackend

        self.sdpa = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}
        self.gqa = {}  # (name, hq, hkv, d) -> "native" | "repeat" | reason it cannot run
        self.fi = None
        self.fi_note = "flashinfer disabled (--no-flashinfer)"
        self.fi_workspace = None
        self.chunk_mode, self.chunk_note = None, "not checked"  # how sdpa-flash runs a chunk at an offset
        if use_flashinfer:
            try:
                t0 = time.perf_counter()
                import flashinfer

                self.fi = flashinfer
                self.fi_note = f"flashinfer {flashinfer.__version__} (import {time.perf_counter() - t0:.1f} s)"
            except Exception as e:  # optional peer: any import failure means "not available here"
                self.fi_note = (f"flashinfer skipped: import failed ({type(e).__name__}: {str(e)[:160]}); "
                                "put it on PYTHONPATH to compare (see the README)")

    def sdpa_mode(self, name, hq, hkv, d) -> str:
        """Run a tiny decode to learn whether the backend takes GQA natively or needs K/V repeated."""
        key = (name, hq, hkv, d)
        if key not in self.gqa:
            q = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, hkv, 64, d, device="cuda", dtype=torch.bfloat16)
            errors = []
            for mode in ("native", "repeat"):
                try:
                    sdpa(self.sdpa[name], q, k, k, mode, hq // hkv)
                    torch.cuda.synchronize()
                    self.gqa[key] = mode
                    break
                except RuntimeError as e:
                    errors.append(f"{mode}: {str(e).splitlines()[0][:100]}")
            else:
                self.gqa[key] = "cannot run: " + "; ".join(errors)
        return self.gqa[key]

    def workspace(self):
        if self.fi_workspace is None:
            self.fi_workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        return self.fi_workspace


def sdpa(backend, q, k, v, mode, group, causal=False):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        if mode == "native":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)
        if group > 1 and k.shape[1] != q.shape[1]:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


# ---------------------------------------------------------------------------------------- the runner
class Bench:
    def __init__(self, args, plan: Plan, kvq_backends: dict, peers: Peers, bw: float):
        self.args, self.plan, self.kvq, self.peers, self.bw = args, plan, kvq_backends, peers, bw
        self.l2 = _l2_bytes()
        self.rows: list = []
        self.notes: list = []
        self.first_calls: dict = {}  # variant -> seconds of its first call (JIT/compile included)
        self.graphs = not args.no_graphs

    def _time(self, variant: str, calls: list) -> Timing:
        t = time_calls(calls, use_graph=self.graphs)
        if variant not in self.first_calls:
            self.first_calls[variant] = round(t.first_call_s, 2)
        return t

    def _record(self, row: dict, fn: Callable) -> None:
        """Measure ``fn() -> (Timing, extra fields)``; a failure is a row with the reason, never a crash."""
        try:
            t, extra = fn()
            row.update(extra)
            row.update(us=t.us, graph=t.graph, note=t.note)
            if row.get("bytes"):  # achieved bandwidth, and its fraction of the copy (= floor / time)
                row.update(gbps=row["bytes"] / (t.us * 1e-6) / 1e9, frac=row["floor_us"] / t.us)
        except torch.cuda.OutOfMemoryError:
            row.update(us=None, note="out of memory")
        except SkipCase as e:
            row.update(us=None, note=str(e))
        except Exception as e:  # report and go on: one broken peer must not lose the whole run
            row.update(us=None, note=f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        if row.get("note"):
            self.notes.append(f"{row['op']} {row['impl']} {row['fmt']} {_row_shape(row)}: {row['note']}")
        self.rows.append(row)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------- decode
    def decode(self, hq, hkv, d, batch, ctx):
        ps = self.args.page_size
        base = dict(op="decode", hq=hq, hkv=hkv, d=d, batch=batch, ctx=ctx)
        for fmt in FORMATS:
            nbytes = kv_bytes(batch * ctx, hkv, d, fmt)
            n = rotation(nbytes, self.l2, 512)
            ok, why = _fits(n * nbytes)
            if not ok:
                for impl in self._impls_for(fmt, d):
                    self._skip(dict(base, impl=impl, fmt=fmt, kind=_kind(impl), backend=_backend(impl)),
                               f"does not fit ({why})")
                continue
            inputs = decode_inputs(fmt, n, batch, ctx, hq, hkv, d, ps)
            pool, qs = inputs.pool, inputs.queries
            for be, ops in self.kvq.items():
                impl = f"kvq-{be}"

                def run(ops=ops):
                    return self._time(f"{impl} decode {fmt} {hq}/{hkv}/d{d}", inputs.calls(ops.decode_attention)), {}
                self._record(self._row(base, impl, fmt, nbytes, n), run)
            if fmt in QUANT and batch * ctx <= self.args.naive_max_tokens and self.kvq:
                self._naive(base, fmt, pool, n, batch, ctx, hq, hkv, d, ps)
            if d in self.plan.flashinfer_dims and fmt in ("bf16", "fp8_e4m3"):
                self._flashinfer(base, fmt, pool, qs, n, batch, ctx, hq, hkv, d, ps)
            elif fmt in ("bf16", "fp8_e4m3"):
                self.notes.append(f"flashinfer {fmt} d{d}: not run (head_dim not in --flashinfer-dims)"
                                  if self.peers.fi else self.peers.fi_note)
            inputs = pool = qs = None  # free this format's pool before the next one is allocated
            torch.cuda.empty_cache()
            if fmt == "bf16":
                for name in self.peers.sdpa:
                    self._sdpa_decode(base, name, batch, ctx, hq, hkv, d)

    def _impls_for(self, fmt, d):
        impls = [f"kvq-{be}" for be in self.kvq]
        if fmt == "bf16":
            impls += list(self.peers.sdpa)
        if self.peers.fi and d in self.plan.flashinfer_dims and fmt in ("bf16", "fp8_e4m3"):
            impls.append("flashinfer")
        return impls

    def _row(self, base, impl, fmt, nbytes, n):
        return dict(base, impl=impl, fmt=fmt, kind=_kind(impl), backend=_backend(impl), bytes=nbytes,
                    floor_us=floor_us(nbytes, self.bw), replicas=n)

    def _skip(self, row, why):
        row.update(us=None, note=why)
        self.rows.append(row)
        self.notes.append(f"{row['op']} {row['impl']} {row['fmt']} {_row_shape(row)}: {why}")

    def _sdpa_decode(self, base, name, batch, ctx, hq, hkv, d):
        mode = self.peers.sdpa_mode(name, hq, hkv, d)
        row = dict(base, impl=name, fmt="bf16", kind="peer", backend=None)
        if mode.startswith("cannot"):
            return self._skip(row, mode)
        heads = hkv if mode == "native" else hq
        nbytes = decode_bytes(name, "bf16", batch, ctx, hq, hkv, d, mode)
        n = rotation(nbytes, self.l2, 512)
        ok, why = _fits(n * nbytes)
        if not ok:
            return self._skip(row, f"does not fit ({why})")
        row.update(bytes=nbytes, floor_us=floor_us(nbytes, self.bw), replicas=n, gqa=mode)

        def run():
            k = _fill_(torch.empty(n * batch, heads, ctx, d, device="cuda", dtype=torch.bfloat16))
            v = _fill_(torch.empty_like(k))
            qs = [torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
            g = hq // hkv
            calls = [lambda r=r: sdpa(self.peers.sdpa[name], qs[r], k[r * batch:(r + 1) * batch],
                                      v[r * batch:(r + 1) * batch], mode, g) for r in range(n)]
            return self._time(f"{name} decode {hq}/{hkv}/d{d}", calls), {}
        self._record(row, run)

    def _naive(self, base, fmt, pool, n, batch, ctx, hq, hkv, d, ps):
        be, ops = next(iter(self.kvq.items()))
        nbytes = decode_bytes("naive", fmt, batch, ctx, hq, hkv, d)
        row = dict(base, impl="naive", fmt=fmt, kind="naive", backend=be, bytes=nbytes,
                   floor_us=floor_us(nbytes, self.bw), replicas=n)
        offs = torch.arange(ps, device="cuda", dtype=torch.int64)
        slots = [(t.long()[:, :, None] * ps + offs).flatten(1)[:, :ctx].reshape(-1) for t in pool.tables]
        qs = [torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        flash = self.peers.sdpa["sdpa-flash"]
        mode = self.peers.sdpa_mode("sdpa-flash", hq, hkv, d)
        mode = "repeat" if mode.startswith("cannot") else mode  # repeat: what a user without GQA support writes

        def call(r):
            # What a user writes without kvq: gather the pages and dequantize with plain torch ops.
            k = reference.dequantize(pool.k, pool.ks, slots[r], torch.bfloat16).view(batch, ctx, hkv, d).transpose(1, 2)
            v = reference.dequantize(pool.v, pool.vs, slots[r], torch.bfloat16).view(batch, ctx, hkv, d).transpose(1, 2)
            return sdpa(flash, qs[r], k, v, mode, hq // hkv)

        def run():
            ok, why = _fits(kv_bytes(batch * ctx, hkv, d, "bf16"))  # the dequantized K and V
            if not ok:
                raise SkipCase(f"does not fit ({why})")
            return self._time(f"naive {fmt} {hq}/{hkv}/d{d}", [lambda r=r: call(r) for r in range(n)]), {}
        self._record(row, run)

    def _flashinfer(self, base, fmt, pool, qs, n, batch, ctx, hq, hkv, d, ps):
        fi_fmt = "bf16" if fmt == "bf16" else "fp8"  # one scale per tensor: no scale plane to read
        row = self._row(base, "flashinfer", fi_fmt, kv_bytes(batch * ctx, hkv, d, fi_fmt), n)
        row.update(kind="peer" if fmt == "bf16" else "peer-8bit")
        if self.peers.fi is None:
            return self._skip(row, self.peers.fi_note)
        fi = self.peers.fi
        kv_dtype = CACHE_DTYPES[fmt]

        def run():
            pps = pool.tables[0].shape[1]
            indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * pps
            last = torch.full((batch,), ctx - (pps - 1) * ps, device="cuda", dtype=torch.int32)
            indices = [t.reshape(-1).contiguous() for t in pool.tables]
            w = fi.BatchDecodeWithPagedKVCacheWrapper(self.peers.workspace(), "NHD", backend="fa2")
            t0 = time.perf_counter()
            w.plan(indptr, indices[0], last, hq, hkv, d, ps, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
                   pos_encoding_mode="NONE")
            plan_s = time.perf_counter() - t0
            variant = f"flashinfer decode {fmt} d{d}"
            if variant not in self.first_calls:
                self.first_calls[variant + " (plan+JIT)"] = round(plan_s, 2)
            out = torch.empty(batch, hq, d, device="cuda", dtype=torch.bfloat16)
            scale = {} if fmt == "bf16" else {"k_scale": 1.0, "v_scale": 1.0}

            def call(r):
                # The plan depends on the lengths only, which all replicas share; each replica brings its
                # own page list.
                w._paged_kv_indices_buf = indices[r]
                w.run(qs[r], (pool.k, pool.v), out=out, **scale)
            return self._time(variant, [lambda r=r: call(r) for r in range(n)]), {}
        self._record(row, run)

    # ------------------------------------------------------------------------------------- extend
    def extend(self, hq, hkv, d, chunk, prefix):
        ps = self.args.page_size
        base = dict(op="extend", hq=hq, hkv=hkv, d=d, chunk=chunk, prefix=prefix,
                    flops=extend_flops(chunk, prefix, hq, d))
        sm = 1.0 / math.sqrt(d)
        new = lambda: torch.randn(chunk, hkv, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        for fmt in FORMATS:
            ws = kv_bytes(prefix, hkv, d, fmt) + kv_bytes(chunk, hkv, d, "bf16") * 2
            n = rotation(ws, self.l2, 16)
            pool = paged_pool(fmt, n, 1, max(prefix, 1), hkv, d, ps)
            qs = [torch.randn(chunk, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
            ks, vs = [new() for _ in range(n)], [new() for _ in range(n)]
            out = torch.empty(chunk, hq, d, device="cuda", dtype=torch.bfloat16)
            plens = torch.tensor([prefix], dtype=torch.int32, device="cuda")
            cu = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
            for be, ops in self.kvq.items():
                impl = f"kvq-{be}"

                def run(ops=ops):
                    calls = [lambda r=r: ops.extend_attention(qs[r], ks[r], vs[r], pool.k, pool.v, pool.ks, pool.vs,
                                                              pool.tables[r], plens, cu, sm, True, -1, 0.0, out)
                             for r in range(n)]
                    return self._time(f"{impl} extend {fmt} {hq}/{hkv}/d{d}", calls), {}
                self._record(dict(base, impl=impl, fmt=fmt, kind="kvq", backend=be, replicas=n), run)
            pool = qs = ks = vs = None
        self._sdpa_extend(base, hq, hkv, d, chunk, prefix)
        for r in self.rows:
            if r["op"] == "extend" and r.get("us") and "tflops" not in r:
                r["tflops"] = r["flops"] / (r["us"] * 1e-6) / 1e12

    def _sdpa_extend(self, base, hq, hkv, d, chunk, prefix):
        row = dict(base, impl="sdpa-flash", fmt="bf16", kind="peer", backend=None)
        mode = self.peers.chunk_mode
        if mode is None:
            return self._skip(row, self.peers.chunk_note)
        row["gqa"] = mode

        def run():
            total = prefix + chunk
            heads = hkv if mode == "native" else hq
            n = rotation(kv_bytes(total, heads, d, "bf16"), self.l2, 16)
            k = _fill_(torch.empty(n, heads, total, d, device="cuda", dtype=torch.bfloat16))
            v = _fill_(torch.empty_like(k))
            qs = [torch.randn(1, hq, chunk, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
            calls = [lambda r=r: chunk_attention(qs[r], k[r:r + 1], v[r:r + 1]) for r in range(n)]
            return self._time(f"sdpa-flash extend {hq}/{hkv}/d{d}", calls), {"replicas": n}
        self._record(row, run)

    # -------------------------------------------------------------------------------------- store
    def store(self, hq, hkv, d, tokens):
        ps = self.args.page_size
        base = dict(op="store", hq=hq, hkv=hkv, d=d, tokens=tokens)
        for fmt in FORMATS:
            nbytes = store_bytes(tokens, hkv, d, fmt)
            n = rotation(nbytes, self.l2, 16)
            pool = paged_pool(fmt, 1, 1, n * tokens, hkv, d, ps)
            offs = torch.arange(ps, device="cuda", dtype=torch.int64)
            slots = (pool.tables[0].long()[0, :, None] * ps + offs).reshape(-1)[:n * tokens]
            slot_r = [slots[r * tokens:(r + 1) * tokens] for r in range(n)]
            ks = [torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
            vs = [torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
            for be, ops in self.kvq.items():
                impl = f"kvq-{be}"

                def run(ops=ops):
                    calls = [lambda r=r: ops.store_kv(ks[r], vs[r], pool.k, pool.v, pool.ks, pool.vs, slot_r[r])
                             for r in range(n)]
                    return self._time(f"{impl} store {fmt} {hkv}/d{d}", calls), {}
                self._record(dict(base, impl=impl, fmt=fmt, kind="kvq", backend=be, bytes=nbytes,
                                  floor_us=floor_us(nbytes, self.bw), replicas=n), run)
            pool = ks = vs = None


class SkipCase(Exception):
    """A case that cannot run on this machine (memory), reported in its row."""


def chunk_attention(q, k, v):
    """Flash attention of a chunk of queries at the end of ``k``/``v`` (the chunk sits at offset
    ``k_len - q_len``): ``[1, heads, len, head_dim]`` each.

    FlashAttention-2 aligns its causal mask to the bottom-right corner when ``q_len < k_len`` (what
    ``torch.nn.attention.bias.causal_lower_right`` dispatches to), which is what a chunk at an offset needs;
    ``F.scaled_dot_product_attention(is_causal=True)`` aligns it to the top-left and would be wrong.
    :func:`check_chunk_attention` verifies this against an explicit boolean mask at start-up.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False,
                                                               scale=1.0 / math.sqrt(q.shape[-1]))[0]


def check_chunk_attention() -> tuple[Optional[str], str]:
    """Whether :func:`chunk_attention` is right with GQA native ("native"), only with K/V repeated ("repeat"),
    or cannot run (None); checked on a small case against fp32 SDPA with a lower-right boolean mask."""
    import torch.nn.functional as F

    q = torch.randn(1, 8, 48, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 208, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.arange(208, device="cuda")[None, :] <= torch.arange(160, 208, device="cuda")[:, None]
    kr, vr = (t.repeat_interleave(4, 1) for t in (k, v))
    want = F.scaled_dot_product_attention(q.float(), kr.float(), vr.float(), attn_mask=mask)
    notes = []
    for mode, (kk, vv) in (("native", (k, v)), ("repeat", (kr, vr))):
        try:
            err = (chunk_attention(q, kk, vv).float() - want).abs().max().item()
        except RuntimeError as e:
            notes.append(f"{mode} GQA cannot run ({str(e).splitlines()[0][:120]})")
            continue
        if err < 2e-2:
            return mode, (f"sdpa-flash extend: flash kernel, bottom-right causal, GQA {mode}; checked against a "
                          f"boolean mask (max |diff| {err:.1e})" + (f"; {notes[0]}" if notes else ""))
        notes.append(f"{mode} GQA disagrees with a lower-right boolean mask (max |diff| {err:.1e})")
    return None, "sdpa-flash extend skipped: " + "; ".join(notes)


def _kind(impl):
    return "kvq" if impl.startswith("kvq") else ("naive" if impl == "naive" else "peer")


def _backend(impl):
    return impl[4:] if impl.startswith("kvq-") else None


def _row_shape(r):
    if r["op"] == "decode":
        return f"{r['hq']}/{r['hkv']} d{r['d']} B={r['batch']} ctx={r['ctx']}"
    if r["op"] == "extend":
        return f"{r['hq']}/{r['hkv']} d{r['d']} chunk={r['chunk']} prefix={r['prefix']}"
    return f"{r['hkv']}x d{r['d']} tokens={r['tokens']}"


def kvq_backends(requested: Optional[list]) -> tuple[dict, list]:
    """The kvq backends to time: name -> object with the four ops in schema order; and notes."""
    from kvq import backends

    sel = backends.selection()
    found, notes = {}, []
    for name in requested or ("cuda", "triton"):
        if name == "cuda":
            if sel.active == "cuda":
                found[name] = torch.ops.kvq
                continue
            why = sel.reasons.get("cuda") or f"the active backend is {sel.active} (KVQ_BACKEND={sel.forced})"
        elif name == "triton":
            why = sel.reasons.get("triton")
            if why is None:
                try:
                    from kvq import triton_backend

                    found[name] = triton_backend
                    continue
                except ImportError as e:
                    why = f"kvq.triton_backend failed to import: {e}"
        else:
            raise SystemExit(f"--backends: unknown backend {name!r}; use cuda and/or triton")
        if requested:
            raise SystemExit(f"--backends {name}: cannot run here: {why}")
        notes.append(f"kvq backend {name} not timed: {why}")
    return found, notes


# -------------------------------------------------------------------------------------------- plots
def plots(rows: list, out: Path, bw: float) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install matplotlib)"]
    dec = [r for r in rows if r["op"] == "decode" and r.get("us")]
    heads = list(dict.fromkeys((r["hq"], r["hkv"], r["d"]) for r in dec))
    batches = sorted({r["batch"] for r in dec})
    if not dec:
        return ["plots skipped: no decode rows"]
    written = []
    for what, fname, ylabel in (("us", "decode_latency.png", "median latency (us)"),
                                ("bw", "decode_bandwidth.png", "achieved bandwidth (GB/s)")):
        fig, axes = plt.subplots(len(heads), len(batches), figsize=(5 * len(batches), 3.8 * len(heads)),
                                 squeeze=False)
        for i, h in enumerate(heads):
            for j, b in enumerate(batches):
                ax = axes[i][j]
                sel = [r for r in dec if (r["hq"], r["hkv"], r["d"]) == h and r["batch"] == b]
                for name in dict.fromkeys(f"{r['impl']} {r['fmt']}" for r in sel):
                    pts = sorted((r["ctx"], r["us"] if what == "us" else r["bytes"] / (r["us"] * 1e-6) / 1e9)
                                 for r in sel if f"{r['impl']} {r['fmt']}" == name)
                    style = "-" if name.startswith("kvq") else "--"
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=name)
                if what == "bw":
                    ax.axhline(bw / 1e9, color="k", lw=0.8, ls=":", label="copy bandwidth")
                ax.set_xscale("log", base=2)
                if what == "us":
                    ax.set_yscale("log")
                ax.set_title(f"{h[0]}/{h[1]} heads, d{h[2]}, batch {b}", fontsize=9)
                ax.set_xlabel("context length (tokens)")
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(fname)
    return written


# --------------------------------------------------------------------------------------------- main
def _csv(kind):
    def parse(s):
        try:
            return [kind(x) for x in s.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    return parse


def _heads(s):
    try:
        return tuple(int(x) for x in s.split("/"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r}: expected num_q_heads/num_kv_heads/head_dim, e.g. 32/8/128 ({e})")


def _tokens(s):
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


EPILOG = """\
FlashInfer is compared when `import flashinfer` works (pip install flashinfer-python, or put an unpacked
site folder on PYTHONPATH and set FLASHINFER_WORKSPACE_BASE to a writable folder for its JIT cache). Its
first use of each variant compiles for 15-30 s; that time is reported apart and is not in any timing.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvq bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("--quick", action="store_true", help="a handful of shapes (about a minute on an H200)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out", help="output folder (default: %(default)s)")
    p.add_argument("--ops", type=_csv(str), default=["decode", "extend", "store"],
                   help="comma list of decode,extend,store (default: all)")
    p.add_argument("--backends", type=_csv(str), default=None,
                   help="kvq backends to time, comma list of cuda,triton (default: every one that can run)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page of kvq's paged caches (default 16)")
    p.add_argument("--heads", type=_csv(_heads), default=None,
                   help="head configs q/kv/dim, e.g. 32/8/128,16/2/256 (default: 32/8/128,16/2/256,9/3/64)")
    p.add_argument("--batch", type=_csv(int), default=None, help="decode batch sizes, e.g. 1,8,64")
    p.add_argument("--ctx", type=_csv(_tokens), default=None, help="decode context lengths, e.g. 1k,32k,128k")
    p.add_argument("--no-flashinfer", action="store_true", help="do not compare against FlashInfer")
    p.add_argument("--flashinfer-dims", type=_csv(int), default=None,
                   help="head dims to run FlashInfer at (each is a 15-30 s JIT compile per dtype; default 128)")
    p.add_argument("--naive-max-tokens", type=_tokens, default=1 << 20,
                   help="time the dequantize-then-SDPA path up to this many batch*ctx tokens (default 1024k)")
    p.add_argument("--no-graphs", action="store_true", help="launch eagerly instead of replaying CUDA graphs")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    bad = [o for o in args.ops if o not in ("decode", "extend", "store")]
    if bad:
        print(f"--ops: unknown {','.join(bad)}; use decode,extend,store", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("python -m kvq bench needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False; "
              f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}). Run it on a machine with an "
              "NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        return 2
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    import kvq

    kvq.set_index_checks(False)  # the index checks read GPU tensors on the host: not part of a kernel's time
    start = time.perf_counter()
    plan = make_plan(args.quick, args.heads, args.batch, args.ctx, args.flashinfer_dims)
    env = environment()
    kvq_b, notes = kvq_backends(args.backends)
    if not kvq_b:
        notes.append("no kvq backend can run: only the peers are timed")
    print(f"kvq bench on {env['gpu']} ({env['sm']}), torch {env['torch']}, triton {env['triton']}; kvq backends: "
          f"{', '.join(kvq_b) or 'none'}", file=sys.stderr)
    copy = copy_bandwidth()
    bw = copy["bandwidth"]
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s (read-only: {copy['read_bandwidth'] / 1e9:.0f} GB/s)",
          file=sys.stderr)
    peers = Peers(not args.no_flashinfer)
    if "extend" in args.ops:
        peers.chunk_mode, peers.chunk_note = check_chunk_attention()
        notes.append(peers.chunk_note)
    notes.append(peers.fi_note)
    bench = Bench(args, plan, kvq_b, peers, bw)
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "bench.partial.json"  # rows so far, should the run be interrupted
    tasks = [(op, s) for op in ("decode", "extend", "store") if op in args.ops for s in getattr(plan, op)]
    bar = tqdm(tasks, desc="kvq bench", unit="shape") if tqdm else tasks
    for i, (op, shape) in enumerate(bar):
        if tqdm is None:
            print(f"[{i + 1}/{len(tasks)}] {op} {shape}", file=sys.stderr)
        else:
            bar.set_postfix_str(f"{op} {shape}")
        getattr(bench, op)(*shape)
        partial.write_text(json.dumps({"env": env, "copy": copy, "rows": bench.rows}, default=str))
    add_decode_ratios(bench.rows)
    bars = evaluate_bars(bench.rows, list(kvq_b))
    notes += bench.notes
    for p in peers.gqa.items():
        notes.append(f"{p[0][0]} at {p[0][1]}/{p[0][2]} d{p[0][3]}: GQA {p[1]}")
    written = plots(bench.rows, args.out, bw)
    elapsed = time.perf_counter() - start
    result = {"env": env, "argv": list(argv) if argv is not None else sys.argv[1:], "copy": copy,
              "first_call_s": bench.first_calls, "rows": bench.rows, "bars": bars, "notes": notes,
              "elapsed_s": round(elapsed, 1), "bars_thresholds": _thresholds()}
    (args.out / "bench.json").write_text(json.dumps(result, indent=1, default=str))
    partial.unlink(missing_ok=True)
    md = report_markdown(env, copy, bench.rows, bars, notes, bench.first_calls, elapsed, written)
    (args.out / "bench.md").write_text(md)
    print(f"\nwrote {args.out / 'bench.json'}, {args.out / 'bench.md'}"
          + "".join(f", {args.out / w}" for w in written if w.endswith(".png")), file=sys.stderr)
    print(md)
    return 0


def _thresholds():
    return {k: v for k, v in globals().items() if k.startswith("BAR_")}


def report_markdown(env, copy, rows, bars, notes, first_calls, elapsed, written) -> str:
    info = env["kvq_backends"]
    lines = [
        "# kvq benchmark", "",
        f"- GPU: {env['gpu']} ({env['sm']}, {env['gpu_memory_gib']} GiB, {env['sms']} SMs, L2 {env['l2_mib']} MiB)",
        f"- driver: {env['nvidia_smi'] or 'nvidia-smi not found'}; CUDA driver API {env.get('cuda_driver_api')}",
        f"- torch {env['torch']} (CUDA {env['torch_cuda']}, cuDNN {env['cudnn']}), triton {env['triton']}, "
        f"python {env['python']}",
        f"- kvq commit: {env['kvq_commit'] or 'not a git checkout'}; source digest: {info.get('source', '-')} "
        f"(`python -m kvq info` prints a checkout's); active backend: {info['backend']}; "
        f"unavailable: {info['unavailable'] or 'none'}",
        f"- copy bandwidth (device-to-device copy_ of {copy['bytes'] / 2 / GiB:.0f} GiB, read + written): "
        f"**{copy['bandwidth'] / 1e9:.0f} GB/s** (the ceiling for every floor; a read-only sum reaches "
        f"{copy.get('read_bandwidth', 0) / 1e9:.0f} GB/s, so a kernel that only reads can pass 100%)",
        f"- {env['date_utc']} UTC, {elapsed:.0f} s", "",
        "## Decode", "",
        "Cell: median µs per call (fraction of the floor reached = floor / time, where floor = bytes read / copy "
        "bandwidth[, speed-up over the fastest bf16 peer at that shape for kvq 8-bit]). Heads are q/kv.", "",
        decode_table(rows), "",
        "## Extend (chunked prefill, batch 1, causal)", "",
        "Cell: median µs (TFLOP/s of QK^T + PV). sdpa-flash attends over the concatenated bf16 prefix + chunk "
        "with a bottom-right causal mask.", "",
        extend_table(rows), "",
        "## Store", "",
        "Bytes moved = bf16 K/V read + values and scales written + slot mapping read.", "",
        store_table(rows), "",
        "## Bars", "", bars_text(bars), "",
        "## First calls (JIT / compile, seconds; not in any timing)", "",
        ", ".join(f"{k}: {v}" for k, v in first_calls.items() if v >= 0.5) or "none over 0.5 s", "",
        "## Notes", "",
    ]
    lines += [f"- {n}" for n in dict.fromkeys(notes)]
    lines += [f"- {w}" for w in written if not w.endswith(".png")]
    return "\n".join(lines) + "\n"
