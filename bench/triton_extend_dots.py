"""Which tensor-core instructions the Triton extend's dots compile to, on any machine (no GPU needed).

Compiles ``_extend_kernel`` for an NVIDIA arch with every launch config its ``_config`` can choose (the benchmark's
head layouts, a bf16 cache and a q8_0 one) and counts the dot instructions in the machine code: ``HGMMA`` (Hopper's
warpgroup ``wgmma``, which the CUDA kernels do not use: they are held to the instructions sm_89, sm_90 and sm_120
share) and ``HMMA`` (``mma.sync``). Uses the ``cuobjdump`` that ships with Triton's NVIDIA backend.

    python bench/triton_extend_dots.py             # sm_90
    python bench/triton_extend_dots.py --arch 89
"""

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("KVQ_NO_EXTENSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402

from kvq.triton_backend import extend  # noqa: E402
from kvq.triton_backend._common import FMT_PLAIN, FMT_Q8_0  # noqa: E402
from triton_loop import compile_kernel, cuobjdump  # noqa: E402

# (q heads, kv heads, head_dim, (BLOCK_M, BLOCK_N, num_warps, num_stages)): every config extend._config returns.
CASES = [(32, 8, 128, (128, 32, 4, 3)), (32, 8, 128, (128, 64, 4, 2)), (32, 8, 128, (64, 64, 4, 3)),
         (32, 8, 128, (64, 64, 4, 2)), (16, 2, 256, (64, 32, 4, 2)), (16, 2, 256, (64, 64, 8, 2)),
         (9, 3, 64, (64, 64, 4, 3)), (9, 3, 64, (64, 64, 4, 2))]
STRIDES = ("sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "skc_page", "svc_page", "sbt_b", "so_t", "so_h")


def compile_extend(hq, hkv, d, cfg, fmt, arch):
    g = hq // hkv
    cache = "*bf16" if fmt == FMT_PLAIN else "*i8"
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", kc_ptr=cache, vc_ptr=cache, ks_ptr="*fp16",
                 vs_ptr="*fp16", bt_ptr="*i32", prefix_ptr="*i32", cu_ptr="*i32", out_ptr="*bf16", qk_scale="fp32",
                 softcap="fp32")
    consts = dict(PAGE_SIZE=16, HKV=hkv, G=g, GP=extend._heads_per_program(g, cfg[0]), D=d, BLOCK_M=cfg[0],
                  BLOCK_N=cfg[1], FMT=fmt, CAUSAL=True, SOFTCAP=False, INTERP=False, E4M3_CVT=True)
    return compile_kernel(extend._extend_kernel, types, consts, STRIDES, arch,
                          dict(num_warps=cfg[2], num_stages=cfg[3]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90)
    args = p.parse_args(argv)
    print(f"triton {triton.__version__}, sm_{args.arch}: dot instructions in the SASS of _extend_kernel")
    for hq, hkv, d, cfg in CASES:
        for fmt, name in ((FMT_PLAIN, "bf16"), (FMT_Q8_0, "q8_0")):
            sass = cuobjdump(compile_extend(hq, hkv, d, cfg, fmt, args.arch).asm["cubin"], "-sass")
            print(f"{hq}/{hkv} d{d} {name:5s} config {cfg}: HGMMA {len(re.findall(r'HGMMA', sass))}, "
                  f"HMMA {len(re.findall(r' HMMA', sass))}")


if __name__ == "__main__":
    main()
