"""How much of the copy bandwidth a plain copy reaches when it moves only as many bytes as one decode call.

The benchmark states decode as a fraction of the bandwidth of a 2 GiB ``copy_``. A call at batch 1 with 128k
tokens moves 71-285 MB, where fixed costs (the launch, the first loads' latency, the last CTAs' tail) are a
larger share. This times ``dst.copy_(src)`` moving the same bytes (read + written) as each 8-bit decode shape of
the benchmark's headline set, and a read-only ``sum`` of them, the way the benchmark times decode (calls on
disjoint replicas in one CUDA graph, median of replays): ``python bench/copy_sizes.py [--out FILE.json]``.
``--cells bar`` times instead every decode shape of the full benchmark plan that the 85% bar counts (at least
``BAR_BW_TOKENS`` tokens in total), so each of its cells can be set beside what a copy of its bytes reaches.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvq import benchmark as kb  # noqa: E402

SHAPES = [(hq, hkv, d, b, t) for hq, hkv, d in ((32, 8, 128), (16, 2, 256))
          for b, t in ((1, 4096), (1, 32768), (1, 131072), (64, 4096))]


def bar_shapes() -> list:
    """The full plan's decode shapes of at least ``BAR_BW_TOKENS`` tokens in total (q8_0 and fp8_e4m3 read the
    same bytes, so one row serves both formats' cells)."""
    return [s for s in kb.make_plan(quick=False).decode if s[3] * s[4] >= kb.BAR_BW_TOKENS]


def time_bytes(nbytes: int, l2: int) -> dict:
    """Microseconds per copy of ``nbytes // 2`` bytes (``nbytes`` moved) and per read-only sum of ``nbytes``."""
    n = kb.rotation(nbytes, l2, 512)
    half = nbytes // 2 // 4 * 4
    src = torch.empty(n, half, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy = kb.time_calls([lambda r=r: dst[r].copy_(src[r]) for r in range(n)]).us
    dst = None
    full = torch.empty(n, nbytes // 4, dtype=torch.float32, device="cuda").normal_()
    read = kb.time_calls([lambda r=r: full[r].sum() for r in range(n)]).us
    return {"copy_us": copy, "sum_us": read}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--cells", choices=("headline", "bar"), default="headline",
                   help="the headline shapes (default) or every shape of the 85%% bar")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_sizes: needs a CUDA GPU", file=sys.stderr)
        return 2
    ref = kb.copy_bandwidth()
    bw, l2 = ref["bandwidth"], kb._l2_bytes()
    print(f"{torch.cuda.get_device_name()}: 2 GiB copy {bw / 1e9:.0f} GB/s (read + written)")
    rows = []
    for hq, hkv, d, batch, tokens in (bar_shapes() if args.cells == "bar" else SHAPES):
        nbytes = kb.decode_bytes("kvq", "q8_0", batch, tokens, hq, hkv, d)
        t = time_bytes(nbytes, l2)
        floor = kb.floor_us(nbytes, bw)
        row = dict(hq=hq, hkv=hkv, d=d, batch=batch, tokens=tokens, bytes=nbytes, floor_us=floor, **t,
                   copy_frac=floor / t["copy_us"], sum_frac=floor / t["sum_us"])
        rows.append(row)
        print(f"{hq}/{hkv} d{d} B{batch} {tokens:>6} tokens {nbytes / 1e6:7.1f} MB: floor {floor:6.1f} us, "
              f"copy {t['copy_us']:6.1f} us ({row['copy_frac']:.0%}), sum {t['sum_us']:6.1f} us "
              f"({row['sum_frac']:.0%})", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), argv=sys.argv[1:], copy=ref, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
