#!/usr/bin/env bash
# Run on a GPU host from the repository root, after bench/gpu/prepare.sh filled .gpu/ here and .gpu/
# travelled with the checkout (docs/gpu.md):
#
#     bash bench/gpu/run.sh tests kernels        # the CUDA tests, then the decode-kernel benchmark
#     bash bench/gpu/run.sh throughput           # engine vs transformers vs the compiled anchor
#     bash bench/gpu/run.sh depth                # the depth sweep on the GPU
#
# The host's image has torch, triton and transformers but lacks some of the project's packages and
# cannot install from an index (pip install -e . fails there too): the carried wheels go to
# /tmp/site, and the `depthserve` namespace is laid out as pyproject.toml maps it (kernels/, server/
# and clients/ as depthserve.kernels, .server, .clients) by a tree of links in /tmp/dsroot.
# Everything a stage writes lands in $OUT (default ./gpu-out): logs, JSON results.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

setup() {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/wheels/*.whl \
        || { echo "could not install the carried wheels (.gpu/wheels: run bench/gpu/prepare.sh here first)"; exit 1; }
    local root=/tmp/dsroot
    rm -rf "$root" && mkdir -p "$root/depthserve"
    for entry in depthserve/*; do ln -s "$PWD/$entry" "$root/depthserve/"; done
    for package in kernels server clients; do ln -s "$PWD/$package" "$root/depthserve/$package"; done
    export PYTHONPATH="$root:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    export DEPTHSERVE_TEST_TOKENIZER="$PWD/.gpu/tokenizer"  # the tests' SmolLM2 tokenizer (tests/conftest.py)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
}

keep_results() {  # the JSON a stage wrote under bench/results, into $OUT
    cp bench/results/"$1"-*.json "$OUT"/ 2>/dev/null || true
}

stage_tests() {
    "$PY" -m pytest -q -p no:cacheprovider --timeout 420 tests/test_cuda.py tests/test_kernels.py tests/test_saobp_kernels.py \
        tests/test_triton_engine.py tests/test_depth_triton.py \
        --junitxml="$OUT/tests-cuda.xml" 2>&1 | tee "$OUT/tests-cuda.log" | tail -25
}

stage_kernels() {
    "$PY" bench/kernels.py 2>&1 | tee "$OUT/kernels.log"
    keep_results kernels
}

smollm2_shaped() {  # SmolLM2-135M's shapes and vocabulary, random weights (the model's package stays behind)
    local out=/tmp/ckpt/$1-smollm2-shaped
    [ -f "$out/config.json" ] || "$PY" -m depthserve make-tiny --arch "$1" --like smollm2-135m-instruct \
        --tokenizer .gpu/tokenizer --out "$out" >/dev/null
    echo "$out"
}

stage_throughput() {
    "$PY" bench/throughput.py --model "$(smollm2_shaped llama)" --device cuda --dtype bfloat16 \
        --compiled --hf-compiled --anchor --batch-sizes "${BATCH_SIZES:-1,8,32,64,256}" --repeats 3 \
        2>&1 | tee "$OUT/throughput.log"
    keep_results throughput
}

stage_depth() {
    "$PY" bench/depth_sweep.py --device cuda --dtype bfloat16 --tokenizer .gpu/tokenizer --kv-cache-memory-gib 4 \
        --archs "${ARCHS:-itt,sgt,dreamer,put}" --decode-steps 64 ${DEPTH_ARGS:-} 2>&1 | tee "$OUT/depth.log"
    keep_results depth-sweep
}

setup
for stage in "$@"; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    "stage_$stage"
done
