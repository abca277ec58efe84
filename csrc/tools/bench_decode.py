"""Quick decode timing on one GPU: batch 1, 32 query / 8 kv heads, head_dim 128, long contexts.

The shapes are timed as ``bench/run.py`` times them (``kvq.benchmark``): a pool of shuffled 16-token pages
replicated until the working set is several times L2, every call captured in one CUDA graph, the median
replay over the replicas; achieved bandwidth = bytes of K, V and scales read / time, against a device-to-device
copy in the same run. ``python csrc/tools/bench_decode.py [--tokens 32768 131072] [--formats ...] [--backends ...]``
"""

import argparse

import torch

import kvq
from kvq import backends
from kvq import benchmark as kb

B, HQ, HKV, D, PAGE = 1, 32, 8, 128, 16


def decode_fn(backend: str):
    if backend == "cuda":
        if backends.selection().active != "cuda":
            raise RuntimeError("the CUDA extension is not active; build it first")
        return torch.ops.kvq.decode_attention
    from kvq import triton_backend

    return triton_backend.decode_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--formats", nargs="+", default=["bf16", "q8_0", "fp8_e4m3"])
    p.add_argument("--backends", nargs="+", default=["cuda", "triton"])
    args = p.parse_args()
    copy = kb.copy_bandwidth()["bandwidth"]
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth (read + write) {copy / 1e9:.0f} GB/s")
    l2 = kb._l2_bytes()
    kvq.set_index_checks(False)  # time the kernels, not the host-side checks
    for n in args.tokens:
        for fmt in args.formats:
            nbytes = kb.kv_bytes(B * n, HKV, D, fmt)
            inputs = kb.decode_inputs(fmt, kb.rotation(nbytes, l2, 16), B, n, HQ, HKV, D, PAGE)
            for be in args.backends:
                try:
                    us = kb.time_calls(inputs.calls(decode_fn(be))).us
                except Exception as e:  # a quick check reports what it could not run and goes on
                    print(f"{be:6s} {fmt:8s} tokens={n:7d} not run: {type(e).__name__}: {e}")
                    continue
                bw = nbytes / (us * 1e-6)
                print(f"{be:6s} {fmt:8s} tokens={n:7d} {us:8.1f} us  {bw / 1e9:6.0f} GB/s  {bw / copy:6.1%} of copy")
            inputs = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
