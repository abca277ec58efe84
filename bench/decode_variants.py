"""Triton decode: bf16 vs q8_0 vs fp8_e4m3, each 8-bit format with dequantize-then-dot and scale-after-dot
(for keys and values, or for keys only).

    PYTHONPATH=. python bench/decode_variants.py [--out results.json] [--no-extra]

Method as in kvq.benchmark: each shape is replicated until the working set is at least 4x L2, the calls over
all replicas are captured in one CUDA graph, and a replay's time / replicas is one sample (median). The floor is
(bytes of K, V and scales read) / (bandwidth of a device-to-device ``copy_``, read + write bytes), measured first.
Unless ``--no-extra``, the scale-after-dot variants are also timed with a few alternative BLOCK_N / split settings
at B=1 128k and B=8 32k (marked ``*``).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import triton

from kvq import benchmark as kb
from kvq.triton_backend import decode as tdec

PAGE = 16
FORMATS = {"bf16": torch.bfloat16, "q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
# (batch, tokens, query heads, kv heads, head_dim)
CASES = [(1, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (1, 131072, 32, 8, 128), (8, 32768, 32, 8, 128),
         (1, 32768, 16, 2, 256), (1, 32768, 9, 3, 64)]
EXTRA_CASES = {(1, 131072, 32, 8, 128), (8, 32768, 32, 8, 128)}
# kvq.triton_backend.decode._SCALE_AFTER_DOT values: 0 dequantize-then-dot, 1 scales after the dots for keys
# and values, 2 for keys only.
MODES = [(0, "dequant"), (1, "sad-kv"), (2, "sad-k")]


def variants(fmt, case, extra):
    """(label, config, is_default): configs are the wrapper's ``config`` override."""
    batch, length, hq, hkv, d = case
    q = torch.empty(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.empty(1, PAGE, hkv, d, device="cuda", dtype=FORMATS[fmt])
    max_len = math.ceil(length / PAGE) * PAGE
    if fmt == "bf16":
        return [("plain", tuple(tdec._config(q, kc, max_len))[:4], True)]
    out = []
    for mode, name in MODES:
        *cfg, reg = tdec._config(q, kc, max_len, tdec._uses_sad(mode, tdec.cache_format(kc), d))
        cfg = tuple(cfg)
        out.append((name, cfg + (mode, reg), True))
        if extra and mode:
            bn, sp, w, st = cfg
            alts = [(bn, 2 * sp, w, st), (bn, max(1, sp // 2), w, st)]  # splits are a runtime argument: no compile
            if fmt == "q8_0":
                alts += [(32, sp, w, st), (128, sp, w, 2)]
            for a in alts:
                a = (a[0], min(a[1], triton.cdiv(max_len, a[0]))) + a[2:]
                if a != cfg:
                    out.append((name, a + (mode, reg if a[0] == bn and a[2:] == (w, st) else None), False))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-extra", action="store_true", help="time the default settings only")
    ap.add_argument("--budget-s", type=float, default=80.0, help="skip the extra settings after this many seconds")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    bw = kb.copy_bandwidth()["bandwidth"]
    l2 = kb._l2_bytes()
    print(f"{dev}; triton {triton.__version__}, torch {torch.__version__}; default scale-after-dot "
          f"{tdec._SCALE_AFTER_DOT}")
    print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    # Every default setting first; the alternative settings then, while the time budget lasts.
    for extra in (False, True):
        for case in (CASES if not extra else [c for c in CASES if c in EXTRA_CASES]):
            if extra and (args.no_extra or time.time() - t0 > args.budget_s):
                break
            batch, length, hq, hkv, d = case
            for fmt in FORMATS:
                todo = [(n, c) for n, c, default in variants(fmt, case, extra) if default != extra]
                if not todo:
                    continue
                nbytes = kb.kv_bytes(batch * length, hkv, d, fmt)
                data = kb.decode_inputs(fmt, kb.rotation(nbytes, l2, 64), batch, length, hq, hkv, d, PAGE)
                floor_us = nbytes / bw * 1e6
                for name, cfg in todo:
                    if extra and time.time() - t0 > args.budget_s:
                        break
                    try:
                        us = kb.time_calls(data.calls(lambda *a, cfg=cfg: tdec.decode_attention(*a, config=cfg))).us
                    except Exception as e:  # a setting that does not compile or fit is reported, not fatal
                        print(f"  {fmt} {name} cfg={cfg}: failed: {type(e).__name__}: {e}", flush=True)
                        continue
                    rows.append(dict(batch=batch, length=length, hq=hq, hkv=hkv, d=d, fmt=fmt, variant=name,
                                     config=list(cfg[:4]), default=not extra, us=us, floor_us=floor_us,
                                     frac=floor_us / us))
                    print(f"B={batch} L={length:6d} {hq:2d}/{hkv} d{d:3d} {fmt:8s} {name:8s}{'*' if extra else ' '}"
                          f"cfg={cfg[:4]}: {us:8.1f} us  floor {floor_us:7.1f} us  {100 * floor_us / us:5.1f}%",
                          flush=True)
                del data
                torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=dev, copy_bw=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
