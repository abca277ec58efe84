#!/usr/bin/env bash
# Sets kvq up on a fresh machine: torch (a CUDA build, so kvq._C compiles wherever nvcc is present), the test
# tools, and kvq itself in editable mode. With --eval it also installs what `python -m kvq eval` needs.
# TORCH_CUDA_ARCH_LIST picks the GPU archs of kvq._C (default 8.9;9.0;12.0); KVQ_TORCH overrides the torch pin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q "${KVQ_TORCH:-torch==2.14.1}" ninja
"$PY" -m pip install -q --no-build-isolation -e ".[test]"
if [[ " $* " == *" --eval "* ]]; then
  PYTHON="$PY" bash scripts/setup-eval.sh
fi
"$PY" -m kvq info
