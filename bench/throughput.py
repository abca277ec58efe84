"""Decode throughput at real model shapes under one KV memory budget: bf16 vs q8_0 vs fp8_e4m3.

For each model shape and KV dtype, a pool is sized from the SAME budget (``KVPool.from_budget``); as many
sequences of ``--context + --steps`` tokens as fit are decoded together, ``--steps`` steps, and the
aggregate tokens/s is reported, with single-stream tokens/s and the per-step time at bf16's batch (same work
for every dtype). The model is a minimal stack of ``--layers`` decoder layers with random bf16 weights:
RMSNorm, fused QKV projection, kvq.store_kv + kvq.decode_attention (no RoPE: it does not change the cost),
output projection, SwiGLU MLP. Each decode step runs as one CUDA graph when it can be captured (the JSON
says whether it was, and why not). Caches are filled with random K/V through kvq.store_kv first.

    python bench/throughput.py                 # full run on a CUDA GPU
    python bench/throughput.py --quick         # < 1 minute
    python bench/throughput.py --device cpu --quick   # tiny shapes on the reference path (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvq  # noqa: E402
from kvq.plan import parse_size  # noqa: E402
from kvq.pool import KVPool, kv_unit_bytes, resolve_spec  # noqa: E402

# name: hidden, q heads, kv heads, head_dim, MLP intermediate
SHAPES = {
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336),
    "hd256-gqa": dict(hidden=3584, heads=16, kv_heads=8, head_dim=256, ffn=14336),  # Gemma-2-9B-like
    "tiny": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512),
}
DTYPES = ("bf16", "q8_0", "fp8_e4m3")


class Stack:
    """``layers`` decoder layers with random weights, decoding from a kvq pool."""

    def __init__(self, shape: dict, layers: int, pool: KVPool, device, dtype=torch.bfloat16, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        h, nq, nkv, d, f = (shape[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn"))
        self.h, self.nq, self.nkv, self.d, self.pool = h, nq, nkv, d, pool

        def w(rows, cols):  # scaled so activations stay O(1) through the stack
            return (torch.randn(rows, cols, generator=g) / math.sqrt(cols)).to(device, dtype)

        self.layers = [dict(qkv=w((nq + 2 * nkv) * d, h), o=w(h, nq * d), gate=w(f, h), up=w(f, h), down=w(h, f),
                            n1=torch.ones(h, device=device, dtype=dtype), n2=torch.ones(h, device=device, dtype=dtype))
                       for _ in range(layers)]

    def step(self, x, slot_mapping, block_table, seq_lens):
        """One decode step for ``x`` ``[B, hidden]``: its K/V go to ``slot_mapping``, attention reads ``seq_lens``."""
        b, p = x.shape[0], self.pool
        for i, L in enumerate(self.layers):
            y = F.rms_norm(x, (self.h,), L["n1"])
            q, k, v = (y @ L["qkv"].t()).split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
            q = q.reshape(b, self.nq, self.d).contiguous()
            k, v = k.reshape(b, self.nkv, self.d).contiguous(), v.reshape(b, self.nkv, self.d).contiguous()
            kvq.store_kv(k, v, p.k_cache(i), p.v_cache(i), p.k_scale(i), p.v_scale(i), slot_mapping)
            a = kvq.decode_attention(q, p.k_cache(i), p.v_cache(i), p.k_scale(i),
                                     p.v_scale(i), block_table, seq_lens)
            x = x + a.reshape(b, -1) @ L["o"].t()
            y = F.rms_norm(x, (self.h,), L["n2"])
            x = x + (F.silu(y @ L["gate"].t()) * (y @ L["up"].t())) @ L["down"].t()
        return x


def fill_pool(pool: KVPool, device, chunk_tokens: int = 1 << 15, seed: int = 1) -> None:
    """Every slot of every layer gets random K/V (stored, i.e. quantized, by kvq.store_kv)."""
    g = torch.Generator(device=device).manual_seed(seed)
    slots = pool.num_pages * pool.page_size
    for i in range(pool.num_layers):
        for s in range(0, slots, chunk_tokens):
            n = min(chunk_tokens, slots - s)
            kv = torch.randn(2, n, pool.num_kv_heads, pool.head_dim, generator=g, device=device,
                             dtype=pool.model_dtype)
            sm = torch.arange(s, s + n, device=device, dtype=torch.int64)
            kvq.store_kv(kv[0], kv[1], pool.k_cache(i), pool.v_cache(i), pool.k_scale(i), pool.v_scale(i), sm)


class Decoder:
    """``batch`` sequences of ``context + steps`` tokens (pages reserved up front); step i writes position
    ``context + i`` and attends over ``context + i + 1`` tokens. Optionally one CUDA graph per step."""

    def __init__(self, stack: Stack, batch: int, context: int, steps: int, device, graphs: bool):
        pool = stack.pool
        self.stack, self.steps, self.context = stack, steps, context
        self.seqs = [pool.new_sequence() for _ in range(batch)]
        slots = torch.stack([pool.append(s, context + steps) for s in self.seqs])  # [B, context + steps]
        self.all_slots = slots[:, context:].t().contiguous().to(device)  # [steps, B]
        self.block_table = pool.block_table(self.seqs).to(device)
        self.slot_mapping = self.all_slots[0].clone()
        self.seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=device)
        self.x = torch.randn(batch, stack.h, device=device, dtype=pool.model_dtype)
        self.graph, self.graph_error = None, None
        if graphs:
            try:
                self._capture()
            except Exception as e:  # reported in the JSON as graph_error; the eager path is timed instead
                self.graph, self.graph_error = None, f"{type(e).__name__}: {e}"[:300]

    def _set(self, i: int) -> None:
        self.slot_mapping.copy_(self.all_slots[i % self.steps])
        self.seq_lens.fill_(self.context + 1 + i % self.steps)

    def _eager(self):
        return self.stack.step(self.x, self.slot_mapping, self.block_table, self.seq_lens)

    def _capture(self) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._eager()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._eager()

    def run(self, i: int) -> None:
        self._set(i)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._eager()

    def free(self) -> None:
        for s in self.seqs:
            self.stack.pool.free(s)


def time_steps(dec: Decoder, device, warmup: int, iters: int) -> float:
    """Median seconds per decode step."""
    for i in range(warmup):
        dec.run(i)
    times = []
    cuda = torch.device(device).type == "cuda"
    for i in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dec.run(i)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            dec.run(i)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_shape(name: str, shape: dict, args, device, budget: int) -> dict:
    out = dict(shape=name, **shape, layers=args.layers, budget_bytes=budget, context=args.context,
               steps=args.steps, dtypes={})
    span = args.context + args.steps
    batches = {}
    for d in args.dtypes:
        # Same arithmetic as KVPool.from_budget, without allocating the pool yet.
        unit = kv_unit_bytes(args.layers, shape["kv_heads"], shape["head_dim"], resolve_spec(d, torch.bfloat16))
        pages = budget // (unit * args.page_size)
        fits = pages // -(-span // args.page_size)
        batches[d] = min(fits, args.max_batch) if args.max_batch else fits
        out["dtypes"][d] = dict(unit_bytes=unit, pool_tokens=pages * args.page_size, sequences_fit=fits,
                                pool_bytes=pages * unit * args.page_size)
    same_b = batches.get("bf16", min(batches.values()))
    for d in args.dtypes:
        r = out["dtypes"][d]
        if batches[d] < 1:
            r["error"] = f"not one sequence of {span} tokens fits in the budget"
            continue
        pool = KVPool.from_budget(budget, args.layers, shape["kv_heads"], shape["head_dim"], args.page_size, d,
                                  torch.bfloat16, device)
        fill_pool(pool, device)
        stack = Stack(shape, args.layers, pool, device)
        for label, b in (("max", batches[d]), ("same", min(same_b, batches[d])), ("single", 1)):
            if label == "same" and b == batches[d]:
                r["same_batch"] = dict(r["max_batch"], note="equal to max_batch")
                continue
            dec = Decoder(stack, b, args.context, args.steps, device, graphs=args.graphs)
            t = time_steps(dec, device, args.warmup, args.iters)
            res = dict(batch=b, step_ms=1e3 * t, tokens_per_s=b / t, cuda_graph=dec.graph is not None)
            if dec.graph_error:
                res["graph_error"] = dec.graph_error
            dec.free()
            del dec  # its CUDA graph holds memory and the pool
            r[f"{label}_batch" if label != "single" else "single_stream"] = res
            print(f"  {name:<10} {d:<9} {label:<6} batch {b:>5}: {1e3 * t:8.3f} ms/step, "
                  f"{b / t:10.1f} tok/s{'' if res['cuda_graph'] else ' (eager)'}", file=sys.stderr, flush=True)
        del stack, pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = out["dtypes"].get("bf16", {}).get("max_batch")
    for d, r in out["dtypes"].items():
        if base and "max_batch" in r:
            r["throughput_vs_bf16"] = r["max_batch"]["tokens_per_s"] / base["tokens_per_s"]
            r["sequences_vs_bf16"] = r["sequences_fit"] / out["dtypes"]["bf16"]["sequences_fit"]
    return out


def print_summary(res: dict) -> None:
    """A short table on stderr; the JSON on stdout has everything."""
    err = sys.stderr
    print(f"\n{res['device']}, kvq backend {res['backend']}, KV budget {res['budget']} (same for every dtype)",
          file=err)
    print(f"{'shape':<10} {'dtype':<9} {'B/token':>8} {'seqs fit':>8} {'tok/s @max':>11} {'vs bf16':>7} "
          f"{'ms/step @same B':>16} {'1-stream tok/s':>14} graph", file=err)
    for m in res["models"]:
        for d, r in m["dtypes"].items():
            if "max_batch" not in r:
                print(f"{m['shape']:<10} {d:<9} {r.get('error', '-')}", file=err)
                continue
            same = r.get("same_batch", r["max_batch"])
            print(f"{m['shape']:<10} {d:<9} {r['unit_bytes']:>8} {r['sequences_fit']:>8} "
                  f"{r['max_batch']['tokens_per_s']:>11.0f} {r.get('throughput_vs_bf16', float('nan')):>6.2f}x "
                  f"{same['step_ms']:>10.3f} (B={same['batch']}) {r['single_stream']['tokens_per_s']:>14.1f} "
                  f"{'yes' if r['max_batch']['cuda_graph'] else 'no'}", file=err)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small budget, few steps: under a minute on a GPU")
    p.add_argument("--models", help=f"comma list of {', '.join(SHAPES)} (default: llama3-8b,hd256-gqa on "
                   "CUDA, tiny on CPU)")
    p.add_argument("--layers", type=int, help="decoder layers (default 4; 2 on CPU)")
    p.add_argument("--budget", help="KV memory budget shared by every dtype (default 16GiB; 2GiB with --quick)")
    p.add_argument("--context", type=int, help="tokens already cached per sequence (default 2048)")
    p.add_argument("--steps", type=int, help="decode steps per sequence (distinct positions timed)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=0, help="cap on concurrent sequences (0: all that fit)")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--warmup", type=int)
    p.add_argument("--iters", type=int)
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="time eager steps, no CUDA graphs")
    p.add_argument("--json", default=None, help="write results here (default: stdout only)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU is visible")
    cpu = device.type == "cpu"
    args.graphs = args.graphs and not cpu
    if cpu:
        torch.set_num_threads(1)  # the reference path: many small ops, where intra-op threads only add waits
    if cpu:
        defaults = dict(models="tiny", layers=2, budget="1MiB", context=32, steps=2, warmup=1, iters=2)
    elif args.quick:
        defaults = dict(models="llama3-8b,hd256-gqa", layers=4, budget="2GiB", context=1024, steps=16, warmup=3,
                        iters=10)
    else:
        defaults = dict(models="llama3-8b,hd256-gqa", layers=4, budget="16GiB", context=2048, steps=64,
                        warmup=5, iters=30)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    budget = parse_size(args.budget)
    kvq.set_index_checks(False)  # they read indices on the host each call; the inputs here are built valid
    info = kvq.backends.info()
    res = dict(device=torch.cuda.get_device_name(device) if not cpu else "cpu",
               backend="reference (CPU)" if cpu else info["backend"], torch=torch.__version__,
               budget=args.budget, quick=args.quick, models=[])
    t0 = time.time()
    with torch.inference_mode():
        for name in args.models.split(","):
            if name not in SHAPES:
                p.error(f"unknown model shape {name!r}; choose from {', '.join(SHAPES)}")
            res["models"].append(bench_shape(name, SHAPES[name], args, device, budget))
    res["wall_s"] = time.time() - t0
    print_summary(res)
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
