"""The SM clock and the power drawn while the CUDA decode runs long 8-bit and bf16 shapes back to back.

A decode that reads an 8-bit cache at full bandwidth also converts every element it reads, so it draws more power
than the bf16 decode of the same shape, which only streams. On an H200 (700 W limit) the long 8-bit decodes reach
the power cap and the SM clock drops below its 1980 MHz maximum. This times the formats of each shape alternated in
three rounds, each timing (as the benchmark times a call: out of L2, CUDA graphs, median) after one second of
back-to-back replays of the same calls, while ``nvidia-smi`` samples the SM clock, the power drawn, the GPU
temperature and the active clock-event reasons (0x4: the software power cap) every 50 ms; each row gets the medians
of the samples inside its timing window. With ``--idle S`` each of those timings is preceded by one taken the
benchmark's way (``time_calls``' own budget of replays, about 40 ms) after S seconds of an idle GPU, before the power
drawn has reached the cap, and the samples come every 20 ms (the power reading is an average that such short windows
do not move). ``python bench/power_clocks.py [--idle S] [--out FILE.json]`` on a CUDA GPU with kvq._C built.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvq  # noqa: E402
from kvq import benchmark as kb  # noqa: E402

# (q heads, kv heads, head_dim, batch, tokens per sequence)
SHAPES = [(9, 3, 64, 64, 32768), (9, 3, 64, 8, 131072), (9, 3, 64, 64, 8192), (32, 8, 128, 64, 4096),
          (32, 8, 128, 1, 131072)]
FORMATS = ("q8_0", "fp8_e4m3", "bf16")
QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def smi_samples(path: Path) -> list:
    """(unix time, SM MHz, watts, reasons, degrees C) of each line nvidia-smi wrote."""
    out = []
    for line in path.read_text().splitlines():
        parts = [x.strip() for x in line.split(",")]
        try:
            day, frac = parts[0].split(".")
            ts = time.mktime(time.strptime(day, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
            out.append((ts, float(parts[1]), float(parts[2]), parts[4], float(parts[3])))
        except (ValueError, IndexError):  # a header or a field the driver cannot report
            pass
    return out


def run(args, log_path: Path) -> tuple:
    """Times every row while nvidia-smi logs to ``log_path``; returns the rows and the log's samples."""
    with open(log_path, "w") as log:
        period = "20" if args.idle else "50"  # ms; timings after idle last about 40 ms
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", period],
                               stdout=log, stderr=subprocess.STDOUT)
        l2 = kb._l2_bytes()
        rows = []
        time.sleep(1.0)
        for hq, hkv, d, b, ctx in SHAPES:
            inputs = {}
            for fmt in FORMATS:
                n = kb.rotation(kb.decode_bytes("kvq", fmt, b, ctx, hq, hkv, d), l2, 16)
                inputs[fmt] = kb.decode_inputs(fmt, n, b, ctx, hq, hkv, d, 16)
            for rnd in range(args.rounds):
                for fmt in FORMATS:
                    calls = inputs[fmt].calls(torch.ops.kvq.decode_attention)
                    shape = dict(hq=hq, hkv=hkv, d=d, batch=b, ctx=ctx, fmt=fmt, round=rnd)
                    if args.idle:
                        torch.cuda.synchronize()
                        time.sleep(args.idle)
                        t0 = time.time()
                        t = kb.time_calls(calls)
                        rows.append(dict(shape, state="after idle", us=t.us, t0=t0, t1=time.time()))
                    kb.time_calls(calls, budget_s=1.0, max_reps=100000)  # to a steady clock
                    t0 = time.time()
                    t = kb.time_calls(calls, budget_s=0.3, max_reps=100000)
                    rows.append(dict(shape, state="sustained", us=t.us, t0=t0, t1=time.time()))
            inputs = None
            torch.cuda.empty_cache()
        time.sleep(0.5)
        smi.terminate()
        smi.wait()
    return rows, smi_samples(log_path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="write the rows here as JSON")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle", type=float, default=0.0,
                   help="seconds of idle GPU before an extra timing of every row (default 0: none)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("power_clocks: needs a CUDA GPU", file=sys.stderr)
        return 2
    kvq.set_index_checks(False)
    with tempfile.TemporaryDirectory() as tmp:
        rows, samples = run(args, Path(tmp) / "smi.csv")
    for r in rows:
        s = [x for x in samples if r["t0"] <= x[0] <= r["t1"]]
        r["sm_mhz"] = statistics.median(x[1] for x in s) if s else None
        r["watts"] = statistics.median(x[2] for x in s) if s else None
        r["temp_c"] = statistics.median(x[4] for x in s) if s else None
        r["clocks_event_reasons"] = sorted({x[3] for x in s})
        r["smi_samples"] = len(s)
        print(f"{r['hq']}/{r['hkv']} d{r['d']} B{r['batch']} {r['ctx'] // 1024}k {r['fmt']:9s} r{r['round']} "
              f"{r['state']:10s} "
              f"{r['us']:8.2f} us  SM {r['sm_mhz']} MHz  {r['watts']} W  {r['temp_c']} C  {r['clocks_event_reasons']}")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "argv": sys.argv[1:], "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
