"""Decode time when other work runs between calls, as a model's layers run between two attention calls.

The benchmark times calls back to back on rotating replicas of their inputs, so no call finds its cache in L2. What
a call leaves in L2 for the next one still differs from a model, where a layer's weights stream through L2 between
two attention calls. A kernel change that decides what stays in L2 (a cache policy, say) is judged here in three
regimes, per decode shape and format of this checkout's build:

- ``rotate``: the benchmark's own timing (``kvq.benchmark.time_calls``);
- ``read``: a read-only sum of 128 MiB before every call, as a layer's weights;
- ``write``: a fill of 128 MiB before every call, which leaves L2 full of dirty lines.

For the last two, ``kvq.benchmark.time_calls`` times (scrub, call) pairs over the replicas and the scrubs alone; a
call's time is that of a pair less that of a scrub. Compare builds by running this in each, alternating:
``python bench/between_calls.py [--out FILE.json]``.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvq import benchmark as kb  # noqa: E402

FORMATS = ("q8_0", "fp8_e4m3", "bf16")
# (batch, context, q heads, kv heads, head_dim): the headline shapes and a few between them.
CASES = [(1, 131072, 32, 8, 128), (64, 4096, 32, 8, 128), (8, 32768, 32, 8, 128), (1, 32768, 32, 8, 128),
         (1, 4096, 32, 8, 128), (1, 262144, 32, 8, 128),
         (1, 131072, 16, 2, 256), (64, 4096, 16, 2, 256), (8, 32768, 16, 2, 256), (1, 4096, 16, 2, 256),
         (1, 131072, 9, 3, 64), (64, 4096, 9, 3, 64)]
SCRUB_BYTES = 128 << 20
PAGE_SIZE = 16


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("between_calls: needs a CUDA GPU", file=sys.stderr)
        return 2
    import kvq

    bw, l2, digest = kb.copy_bandwidth()["bandwidth"], kb._l2_bytes(), kvq.backends.source_digest()
    print(f"{torch.cuda.get_device_name()}: 2 GiB copy {bw / 1e9:.0f} GB/s; kvq {digest}")
    scrub = torch.empty(SCRUB_BYTES, dtype=torch.uint8, device="cuda")
    flat, total = scrub.view(torch.float32), torch.empty((), device="cuda")
    scrubs = {"read": lambda: torch.sum(flat, dim=0, out=total), "write": lambda: scrub.fill_(1)}
    dec = torch.ops.kvq.decode_attention
    rows = []
    for batch, ctx, hq, hkv, d in CASES:
        for fmt in FORMATS:
            nbytes = kb.kv_bytes(batch * ctx, hkv, d, fmt)
            data = kb.decode_inputs(fmt, kb.rotation(nbytes, l2, 64), batch, ctx, hq, hkv, d, PAGE_SIZE)
            calls = data.calls(dec)
            n = len(calls)
            row = dict(batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d, fmt=fmt, replicas=n, floor_us=nbytes / bw * 1e6,
                       rotate=kb.time_calls(calls).us)
            for name, f in scrubs.items():
                alone = kb.time_calls([f] * n).us
                pair = kb.time_calls([g for c in calls for g in (f, c)]).us  # per scrub or call: half a pair
                row[name], row[name + "_scrub"] = 2 * pair - alone, alone
            rows.append(row)
            print(f"{hq}/{hkv} d{d} B{batch} {ctx:>6} {fmt:8s}: rotate {row['rotate']:7.2f}  read {row['read']:7.2f}  "
                  f"write {row['write']:7.2f} us", flush=True)
            del data, calls
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_bw=bw,
                                                  digest=digest, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
