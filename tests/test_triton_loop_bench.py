"""bench/triton_loop.py compiles the Triton 8-bit decode's split kernel for sm_90 without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "triton_loop.py"


@pytest.mark.parametrize("argv, key_tile", [([], "1x32x128xi8"),  # one-warp, head_dim 128: whole key rows
                                            (["--warps", "4", "--maxnreg", "0"], "1x32x32xi8"),  # 32-byte blocks
                                            (["--head-dim", "64", "--group", "3", "--kv-heads", "3", "--stages",
                                              "3", "--maxnreg", "0"], "2x32x32xi8")])
def test_compiles_the_split_loop_and_names_its_key_tiles(argv, key_tile):
    # A compiled kernel, not the interpreter's (which the CPU tests set), is what the tool reads.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("triton ") and "sm_90: reg " in lines[0], r.stdout
    assert lines[1].startswith("pipelined buffers:") and key_tile in lines[1], r.stdout
    loop = dict(item.split() for item in lines[4].strip().split(", "))
    # The loop holds the dots and the pipelined copies of the next tile.
    assert int(loop["HMMA"]) > 0 and int(loop["LDGSTS"]) > 0, r.stdout


EXTEND_DOTS = BENCH.parent / "triton_extend_dots.py"


@pytest.mark.parametrize("arch, dot, absent", [("90", "HGMMA", "HMMA"), ("89", "HMMA", "HGMMA")])
def test_extend_dots_are_wgmma_on_sm90_only(arch, dot, absent):
    # The README's account of the plain prefills rests on this: Triton's extend dots are Hopper's wgmma on sm_90 (which
    # the CUDA kernels do not use) and mma.sync on sm_89.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(EXTEND_DOTS), "--arch", arch], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = r.stdout.splitlines()[1:]
    assert len(rows) == 16, r.stdout  # eight configs, bf16 and q8_0 caches
    for row in rows:
        counts = dict(item.split() for item in row.split(": ", 1)[1].split(", "))
        assert int(counts[dot]) > 0 and int(counts[absent]) == 0, row
