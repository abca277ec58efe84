#!/usr/bin/env bash
# Build kvq._C for this GPU, then: GPU tests of the extension, memcheck of store/decode, a decode timing.
# Usage: csrc/tools/gpu_check.sh [outdir]    (TORCH_CUDA_ARCH_LIST defaults to this GPU's arch)
set -o pipefail
out=${1:-.}
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python -c "import torch;print('%d.%d' % torch.cuda.get_device_capability())")}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
start=$(date +%s)
KVQ_PTXAS_VERBOSE=1 MAX_JOBS=${MAX_JOBS:-16} timeout 260 python -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - start )) s (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
grep -E "error" "$out/build.log" | head -20
python -c "import kvq, kvq._C, torch; print('archs', kvq._C.cuda_archs(), kvq.backends.info()['backend'], torch._C._dispatch_has_kernel_for_dispatch_key('kvq::store_kv', 'CUDA'))" || exit 1
timeout 100 python -m pytest -q -p no:cacheprovider tests/test_extension.py tests/test_cuda.py 2>&1 | tail -25
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python csrc/tools/memcheck_smoke.py 2>&1 | tail -15
echo "memcheck rc=$?"
timeout 60 python csrc/tools/bench_decode.py 2>&1 | tail -20
ls tests/test_store.py tests/test_attention.py >/dev/null 2>&1 && \
  timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/test_store.py tests/test_attention.py -k cuda 2>&1 | tail -15
