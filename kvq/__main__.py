"""``python -m kvq {info,demo,plan,eval,bench}``."""

from __future__ import annotations

import argparse
import sys


def _info(argv) -> int:
    argparse.ArgumentParser(prog="python -m kvq info", description="Which backend serves kvq's ops, and why.").parse_args(argv)
    from kvq import backends

    i = backends.info()
    print(f"kvq backend (CUDA tensors): {i['backend'] or 'none'}" + (" (forced by KVQ_BACKEND)" if i["forced"] else ""))
    if i["error"]:
        print(f"  error: {i['error']}")
    print("  CPU tensors: reference (plain PyTorch)")
    for name in backends.NAMES:
        why = i["unavailable"].get(name)
        print(f"  {name:<9} {'available' if why is None else 'unavailable: ' + why}")
    print(f"GPU: {i['gpu'] or 'none'}" + (f" ({i['gpu_arch']})" if i["gpu_arch"] else ""))
    print(f"kvq._C compiled for: {', '.join('sm_' + a.replace('.', '') for a in i['compiled_archs']) or '-'}")
    print(f"torch {i['torch']} (CUDA {i['torch_cuda'] or 'none'}), triton {i['triton'] or 'not installed'}")
    print(f"kvq source digest: {i['source']} (benchmark results record it)")
    return 0 if i["error"] is None else 1


def _demo(argv) -> int:
    from kvq.demo import main

    return main(argv)


def _plan(argv) -> int:
    from kvq.plan import main

    return main(argv)


def _eval(argv) -> int:
    from kvq.eval import main

    return main(argv)


def _bench(argv) -> int:
    from kvq.benchmark import main

    return main(argv)


COMMANDS = {"info": _info, "demo": _demo, "plan": _plan, "eval": _eval, "bench": _bench}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m kvq {" + ",".join(COMMANDS) + "} [options]")
        print("  info   which backend runs, the GPU, the compiled archs, versions")
        print("  demo   store a random KV cache in each format, attend, report bytes and error")
        print("  plan   how many tokens / sequences fit in a memory budget, per KV dtype")
        print("  eval   end-to-end quality on a real model (perplexity, KL, needle), per KV dtype")
        print("  bench  decode/extend/store benchmarks against the peers (CUDA GPU)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
