"""What the Triton 8-bit decode's split loop compiles to, on any machine (no GPU needed).

Compiles ``_decode_split_sad`` (the kernel the rule launches for q8_0 and fp8_e4m3 caches) for an NVIDIA arch with
the launch options of one config, as Triton would at run time with 16-byte-aligned pointers and strides, and prints
its registers, stack and shared memory, the shared buffers its pipeliner allocated, the waits at the top of the
loop, the layout conversions left in the loop, and the loop's machine instructions by opcode (the loop being the
longest backward branch of the SASS). Uses the ``cuobjdump`` that ships with Triton's NVIDIA backend.

    python bench/triton_loop.py                       # 32/8 heads, head_dim 128, q8_0: the rule's launch on sm_90
    python bench/triton_loop.py --stages 3            # the same, double-buffered
    python bench/triton_loop.py --head-dim 256 --group 8 --kv-heads 2 --maxnreg 0
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("KVQ_NO_EXTENSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvq.triton_backend import decode  # noqa: E402
from kvq.triton_backend._common import FMT_E4M3, FMT_Q8_0  # noqa: E402


def compile_split(args):
    fn = decode._decode_split_sad
    cache = "*i8" if args.format == "q8_0" else "*u8"  # fp8 caches travel as bytes (as_kernel_arg)
    fmt = FMT_Q8_0 if args.format == "q8_0" else FMT_E4M3
    words, k_rows = decode._sad_loads(fmt, args.head_dim, args.warps, e4m3_cvt=True)  # as on sm_89 and newer
    types = dict(q_ptr=f"*{args.query}", kc_ptr=cache, vc_ptr=cache, ks_ptr="*i32", vs_ptr="*i32", bt_ptr="*i32",
                 len_ptr="*i32", acc_ptr="*fp32", ml_ptr="*fp32", qk_scale="fp32", softcap="fp32")
    consts = dict(PAGE_SIZE=args.page_size, HKV=args.kv_heads, G=args.group, GP=max(16, triton.next_power_of_2(args.group)),
                  D=args.head_dim, BLOCK_N=args.block_n, FMT=fmt, SOFTCAP=False, INTERP=False, E4M3_CVT=True,
                  PDL=True, WAIT=True, V_AFTER=False, V_WORDS=words, K_ROWS=k_rows)
    opts = dict(num_warps=args.warps, num_stages=args.stages)
    if args.maxnreg:
        opts["maxnreg"] = args.maxnreg
    return compile_kernel(fn, types, consts, ("sq_b", "sq_h", "sk_page", "sv_page", "sbt_b", "num_pages", "max_len"),
                          args.arch, opts)


def compile_kernel(fn, types: dict, consts: dict, aligned_ints, arch: int, opts: dict):
    """``fn`` compiled for sm_``arch``: ``consts`` its constexpr arguments, ``types`` its pointer and float ones
    (the rest int32), every pointer and the ints named in ``aligned_ints`` taken as multiples of 16, as Triton
    specializes them at run time."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    aligned = [n for n in names if sig[n].startswith("*") or n in aligned_ints]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def cuobjdump(cubin: bytes, *flags) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), *flags, f.name], capture_output=True, text=True, check=True).stdout


def loop_opcodes(sass: str) -> collections.Counter:
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    back = [(int(m.group(1), 16), a) for a, t in ins if (m := re.search(r"BRA\s+0x([0-9a-f]+)", t))
            and int(m.group(1), 16) < a]
    lo, hi = max(back, key=lambda r: r[1] - r[0])
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                               for a, t in ins if lo <= a <= hi)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4, help="query heads per kv head")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--format", choices=("q8_0", "fp8_e4m3"), default="q8_0")
    p.add_argument("--query", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--block-n", type=int, default=32)
    p.add_argument("--warps", type=int, default=1)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--maxnreg", type=int, default=decode._TWELVE_REGS, help="register cap; 0 for none")
    p.add_argument("--arch", type=int, default=90)
    return p


def analyse(args) -> dict:
    """The compiled kernel's resources, pipelined buffers, loop waits and conversions, and loop opcodes."""
    k = compile_split(args)
    ttgir = k.asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for"):]
    return dict(
        usage={n.lower(): int(v) for n, v in re.findall(r"(REG|STACK|SHARED):(\d+)", cuobjdump(k.asm["cubin"], "-res-usage"))},
        dynamic_shared=k.metadata.shared,
        buffers=collections.Counter(re.findall(r"local_alloc\s*: \(\) -> !ttg\.memdesc<([0-9x]+x\w+)", ttgir)),
        waits=[int(n) for n in re.findall(r"async_wait .*?\{num = (\d+)", loop)],
        conversions=loop.count("convert_layout"),
        loop=loop_opcodes(cuobjdump(k.asm["cubin"], "-sass")))


def main(argv=None):
    args = parser().parse_args(argv)
    r = analyse(args)
    print(f"triton {triton.__version__}, sm_{args.arch}: " + ", ".join(f"{n} {v}" for n, v in r["usage"].items())
          + f"; dynamic shared memory {r['dynamic_shared']} bytes")
    print("pipelined buffers:", ", ".join(f"{n} x {shape}" for shape, n in sorted(r["buffers"].items())))
    print("waits in the loop:", r["waits"][0] if r["waits"] else "none",
          "copy groups outstanding; layout conversions in the loop:", r["conversions"])
    print(f"loop: {sum(r['loop'].values())} instructions per {args.block_n}-token tile and warp")
    print("  " + ", ".join(f"{op} {n}" for op, n in r["loop"].most_common()))


if __name__ == "__main__":
    main()
