"""``python -m kvq plan``: how many tokens and sequences of a model's KV cache fit in a memory budget.

Counts match :class:`kvq.KVPool` exactly: the budget holds ``budget // page_bytes`` whole pages, tokens
that fit = pages * page_size, and a sequence of ``context`` tokens takes ``ceil(context / page_size)`` pages.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch

from .config import UNSUPPORTED_FAMILIES, add_kv_cache_dtype_argument, resolve_kv_cache_dtype
from .pool import kv_unit_bytes
from .spec import FLOAT_DTYPES, KVQuantSpec

PLAN_DTYPES = ("bf16", "fp16", "q8_0", "fp8_e4m3")
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class PlanError(ValueError):
    pass


def parse_size(text: str) -> int:
    """``"16GiB"`` -> bytes. Units B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB (powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS:
        raise PlanError(f"--memory {text!r} is not a size; write a number with a unit such as 16GiB, 24GB, "
                        "512MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    size = int(float(m.group(1)) * UNITS[unit])
    if size <= 0:
        raise PlanError(f"--memory {text!r} must be positive")
    return size


def _positive_int(cfg: dict, key: str, path: str) -> int:
    v = cfg[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise PlanError(f"{path}: {key} is {v!r}; it must be a positive integer")
    return v


def shape_from_config(path: str) -> dict:
    """num_layers, num_kv_heads, head_dim, pool_family and model dtype from a Hugging Face config.json."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        raise PlanError(f"cannot read --config {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"--config {path} is not valid JSON ({e}); pass a model's config.json") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"--config {path} holds a JSON {type(cfg).__name__}, not an object; pass a model's "
                        "config.json")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]  # multimodal configs keep the language model's shape here
    for key in ("num_hidden_layers", "num_attention_heads"):
        if cfg.get(key) is None:
            raise PlanError(f"{path}: the config has no {key!r}; it does not describe a decoder model kvq "
                            "can size (or pass --layers, --kv-heads and --head-dim instead)")
    layers = _positive_int(cfg, "num_hidden_layers", path)
    heads = _positive_int(cfg, "num_attention_heads", path)
    kv_heads = _positive_int(cfg, "num_key_value_heads", path) if cfg.get("num_key_value_heads") is not None \
        else heads
    if cfg.get("head_dim") is not None:
        head_dim = _positive_int(cfg, "head_dim", path)
    elif cfg.get("hidden_size") is not None:
        hidden = _positive_int(cfg, "hidden_size", path)
        if hidden % heads:
            raise PlanError(f"{path}: hidden_size {hidden} is not divisible by num_attention_heads {heads} and "
                            "there is no 'head_dim'; pass --head-dim")
        head_dim = hidden // heads
    else:
        raise PlanError(f"{path}: the config has neither 'head_dim' nor 'hidden_size'; pass --head-dim")
    family = "mla" if cfg.get("kv_lora_rank") is not None else "mha"
    model_dtype = _TORCH_DTYPES.get(str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))), torch.bfloat16)
    return dict(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, pool_family=family,
                model_dtype=model_dtype)


def plan(num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int, contexts=(8192,),
         dtypes=PLAN_DTYPES, page_size: int = 16, pool_family: str = "mha",
         model_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """One row per dtype: bytes/token, tokens and sequences that fit, and the ratio to bf16 (bytes per token).

    A dtype kvq cannot serve for this model gets a row with an ``error`` (the reason and the fix).
    """
    rows = []
    half = model_dtype if model_dtype in FLOAT_DTYPES else torch.bfloat16
    bf16 = kv_unit_bytes(num_layers, num_kv_heads, head_dim, KVQuantSpec.from_name("bf16"))
    for name in dtypes:
        # Each row as the model would be served: bf16/fp16 rows with a model of that dtype, the others with
        # the config's half-precision dtype (a float32 checkpoint is served in bf16).
        row_model = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name, half)
        # An unquantized cache can be read by any attention backend; only the 8-bit rows need kvq's. A pool
        # family kvq does not serve gets every row from kvq's rule: its per-head sizes would be wrong.
        backend = "kvq" if KVQuantSpec.from_name(name).quantized or pool_family in UNSUPPORTED_FAMILIES else "sdpa"
        try:
            spec = resolve_kv_cache_dtype(name, attention_backend=backend, head_dim=head_dim,
                                          pool_family=pool_family, model_dtype=row_model)
        except ValueError as e:
            rows.append({"dtype": name, "error": str(e)})
            continue
        unit = kv_unit_bytes(num_layers, num_kv_heads, head_dim, spec, row_model)
        pages = budget_bytes // (unit * page_size)
        rows.append({
            "dtype": spec.name, "bytes_per_token": unit, "pages": pages, "tokens": pages * page_size,
            "sequences": {str(c): pages // -(-c // page_size) for c in contexts},
            "ratio_to_bf16": bf16 / unit,
        })
    return rows


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvq plan", description="How many tokens and sequences of a "
                                "model's KV cache fit in a memory budget, per KV cache dtype.")
    src = p.add_argument_group("model shape (a config.json, or the three numbers)")
    src.add_argument("--config", help="a Hugging Face config.json")
    src.add_argument("--layers", type=int, help="num_hidden_layers")
    src.add_argument("--kv-heads", type=int, help="num_key_value_heads")
    src.add_argument("--head-dim", type=int, help="head_dim")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--memory", help="memory for the KV cache, e.g. 16GiB, 24GB, 512MiB")
    budget.add_argument("--gpu-fraction", type=float, help="fraction of the GPU's free memory, e.g. 0.9")
    p.add_argument("--context", type=int, nargs="+", default=[8192], help="context lengths (default 8192)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    add_kv_cache_dtype_argument(p, default=None, help="plan this dtype only (default: bf16, fp16, q8_0, fp8_e4m3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _budget(args) -> int:
    if args.memory is not None:
        return parse_size(args.memory)
    if not 0 < args.gpu_fraction <= 1:
        raise PlanError(f"--gpu-fraction {args.gpu_fraction} must be in (0, 1]")
    if not torch.cuda.is_available():
        raise PlanError("--gpu-fraction needs a CUDA GPU and none is visible; pass --memory (e.g. --memory 16GiB)")
    free, _ = torch.cuda.mem_get_info()
    return int(free * args.gpu_fraction)


def _shape(args) -> dict:
    flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    if args.config is not None:
        if any(v is not None for v in flags.values()):
            raise PlanError("pass either --config or --layers/--kv-heads/--head-dim, not both")
        return shape_from_config(args.config)
    missing = [k for k, v in flags.items() if v is None]
    if missing:
        raise PlanError(f"no model shape: pass --config config.json, or all of --layers, --kv-heads, --head-dim "
                        f"(missing {', '.join(missing)})")
    bad = [f"{k} {v}" for k, v in flags.items() if v < 1]
    if bad:
        raise PlanError(f"{', '.join(bad)}: must be positive")
    return dict(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim, pool_family="mha",
                model_dtype=torch.bfloat16)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def _print_table(shape, budget, args, rows) -> None:
    print(f"model: {shape['num_layers']} layers, {shape['num_kv_heads']} kv heads, head_dim {shape['head_dim']}"
          f"; budget {_fmt_bytes(budget)} ({budget} B); page size {args.page_size}")
    head = ["dtype", "bytes/token", "tokens"] + [f"seqs@{c}" for c in args.context] + ["vs bf16"]
    table = [head]
    notes = []
    for r in rows:
        if "error" in r:
            table.append([r["dtype"], "-", "-"] + ["-"] * len(args.context) + ["-"])
            notes.append(f"{r['dtype']}: {r['error']}")
            continue
        table.append([r["dtype"], f"{r['bytes_per_token']:,}", f"{r['tokens']:,}"]
                     + [f"{r['sequences'][str(c)]:,}" for c in args.context] + [f"{r['ratio_to_bf16']:.2f}x"])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        print("  ".join(cells))
    for n in notes:
        print(n)


def main(argv=None) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed its message; report the status instead of exiting
        return int(e.code or 0)
    try:
        if args.page_size < 1:
            raise PlanError(f"--page-size {args.page_size} must be positive")
        if any(c < 1 for c in args.context):
            raise PlanError(f"--context {args.context}: every context must be positive")
        shape = _shape(args)
        budget = _budget(args)
        dtypes = PLAN_DTYPES if args.kv_cache_dtype is None else (args.kv_cache_dtype,)
        rows = plan(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], budget, args.context, dtypes,
                    args.page_size, shape["pool_family"], shape["model_dtype"])
    except PlanError as e:
        print(f"python -m kvq plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {k: v for k, v in shape.items() if k != "model_dtype"}
        out.update(budget_bytes=budget, page_size=args.page_size, contexts=args.context, rows=rows)
        print(json.dumps(out, indent=2))
    else:
        _print_table(shape, budget, args, rows)
    if all("error" in r for r in rows):
        return 2
    return 0
