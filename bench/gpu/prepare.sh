#!/usr/bin/env bash
# Run here (a machine with pip's index), before a session on a GPU host: fills .gpu/ (git-ignored)
# with what that host lacks and bench/gpu/run.sh installs there: wheels of the Python packages its
# image does not hold (docs/gpu.md), for its Python 3.12, and SmolLM2's tokenizer (the model's
# 93 MB package is too large to carry; checkpoints are built there with random weights of
# SmolLM2's shapes and this vocabulary). About 7 MB in all.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.gpu
PY=${PYTHON:-.venv/bin/python}
rm -rf "$KIT" && mkdir -p "$KIT/wheels"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$KIT/wheels" gguf fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
"$PY" - "$KIT/tokenizer" <<'PY'
import sys

from depthserve.tiny import load_default_tokenizer

tokenizer = load_default_tokenizer()
assert len(tokenizer) > 1000, "SmolLM2's package is not installed here (make install)"
tokenizer.save_pretrained(sys.argv[1])
PY
du -sh "$KIT"
