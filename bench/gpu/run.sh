#!/usr/bin/env bash
# The GPU stages, run on a GPU host from the repository root (docs/gpu.md lists the device calls,
# each with its command and time limit):
#
#     bash bench/gpu/run.sh kernels tests-kernels    # the decode-kernel benchmark, then the kernel tests
#     bash bench/gpu/run.sh tests-engines            # the engine on CUDA: CPU parity, CUDA graphs, Triton backend
#     bash bench/gpu/run.sh serve throughput         # the server answers on CUDA; then engine vs transformers
#                                                    # vs the compiled anchor at BATCH_SIZES (1,64)
#     bash bench/gpu/run.sh depth                    # the depth sweep
#     DRY_RUN=1 bash bench/gpu/run.sh tests kernels serve throughput depth
#                                                    # on any machine, no CUDA: every stage's set-up and
#                                                    # imports (tests collected, not run)
#
# It needs .gpu/, filled by bench/gpu/prepare.sh on a machine with a package index. .gpu/ is
# git-ignored: a device call takes it along only when it names it, carry [".gpu"].
#
# The host's image lacks some of the project's packages and has no package index, so the project is
# not pip-installed there: the carried wheels go to $GPU_WORK/site, and $GPU_WORK/root/depthserve is
# the namespace as pyproject.toml maps it (links to depthserve/*, and to kernels/, server/ and clients/
# as depthserve.kernels, .server, .clients). The checkout's own depthserve/ lacks those three, so it
# must never come first on sys.path: Python runs with PYTHONSAFEPATH=1 (no script directory or
# current directory prepended), and pytest runs in a process that has imported the tree's depthserve
# before pytest puts the checkout on sys.path for the `tests` package.
#
# A stage stops at its first failing step and the run stops at the first failed stage (a dry run,
# and a run with KEEP_GOING=1, goes on to the next stage and fails at the end). STAGE_BUDGETS caps
# stages in seconds ("kernels:80 throughput:200"), inside RUN_BUDGET_S, so that one slow stage
# cannot take a call's whole time from the stages after it. What a stage writes lands in $OUT (default ./gpu-out):
# run.log, <stage>.log, JUnit XML, and the result JSON this run wrote under bench/results. Every
# command is interrupted (SIGINT: pytest and the benchmarks then write what they have) when the run
# reaches RUN_BUDGET_S seconds, inside the device tool's 600 s per call.
#
# Settings (environment): OUT, PYTHON (python3), BATCH_SIZES (1,64), ARCHS (itt,sgt,dreamer,put),
# DEPTH_ARGS, KERNELS_ARGS, PYTEST_ARGS (e.g. -k 'llama or sgt'), RUN_BUDGET_S (570),
# STAGE_BUDGETS, KEEP_GOING, THROUGHPUT_SYSTEMS (--compiled --compiled-one-step --hf-compiled --anchor), REPEATS (3),
# PROFILE_BATCH_SIZES (1,64),
# GPU_WORK (/tmp/depthserve-gpu), KIT (.gpu), DRY_RUN.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
KIT=$(realpath -m "${KIT:-.gpu}")
OUT=$(realpath -m "${OUT:-$REPO/gpu-out}")
DRY_RUN=${DRY_RUN:-0}
RUN_BUDGET_S=${RUN_BUDGET_S:-570}
STAGE_END=$RUN_BUDGET_S  # set per stage by run_stage from STAGE_BUDGETS
KERNEL_TESTS=(tests/test_cuda.py::test_paged_decode_kernel_in_half_precision_matches_fp32
              tests/test_cuda.py::test_varlen_prefill_and_saobp_kernels_in_half_precision_match_fp32
              tests/test_cuda.py::test_flash_attends_chunks_that_start_their_sequences_in_half_precision
              tests/test_kernels.py tests/test_saobp_kernels.py)
ENGINE_TESTS=(tests/test_cuda.py::test_engine_on_cuda_generates_the_cpu_engines_tokens_in_fp32
              tests/test_cuda.py::test_cuda_graphs_equal_the_eager_engine_on_a_mixed_depth_batch_with_preemption
              "tests/test_steps_ahead.py::test_steps_ahead_equal_one_step_at_a_time_with_stops_inside_them_and_preemption[cuda]"
              "tests/test_steps_ahead.py::test_steps_ahead_on_a_depth_model_with_mixed_depth[cuda]"
              tests/test_triton_engine.py tests/test_depth_triton.py)
# Imports the tree's depthserve first: pytest's rootdir insertion then cannot shadow it. Leaves with
# os._exit once pytest has written its report: inductor's exit handler waits up to 300 s for its
# compile workers, which on the H100 host kept a passed run alive until the stage's time ran out.
PYTEST_WITH_TREE='import os, sys, depthserve, pytest; status = pytest.main(sys.argv[1:]); sys.stdout.flush(); sys.stderr.flush(); os._exit(int(status))'

dry() { [ "$DRY_RUN" = 1 ]; }
say() { echo "$*" | tee -a "$OUT/run.log"; }
fail() { say "run.sh: $*"; exit 1; }

limited() {  # COMMAND...: runs it within what is left of RUN_BUDGET_S and of the stage's budget
    local left=$((RUN_BUDGET_S - SECONDS - 15)) stage_left=$((STAGE_END - SECONDS))
    ((stage_left < left)) && left=$stage_left
    if ((left <= 0)); then
        echo "run.sh: no time left (RUN_BUDGET_S=$RUN_BUDGET_S, STAGE_BUDGETS=${STAGE_BUDGETS:-}) for: $*"
        return 124
    fi
    timeout --signal=INT --kill-after=10 "$left" "$@"
}

require_kit() {
    [ -d "$KIT/wheels" ] && [ -f "$KIT/tokenizer/tokenizer.json" ] && [ -f "$KIT/python-version" ] || fail \
        "$KIT is missing or incomplete. It is git-ignored, so it travels only when the device call names it:" \
        "carry [\".gpu\"]; fill it first with bash bench/gpu/prepare.sh on a machine with a package index."
}

python_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }

host_python() {  # the interpreter the stages run: the host's python3, or in a dry run a stand-in for it
    if [ -n "${PYTHON:-}" ] || ! dry; then
        echo "${PYTHON:-python3}"
    else  # this machine's environment less every distribution the host lacks (bench/gpu/host-packages.txt)
        "$LOCAL_PY" bench/gpu/kit.py host-python "$GPU_WORK/host"
    fi
}

install_wheels() {  # the carried wheels into $GPU_WORK/site
    local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
    local kit_python; kit_python=$(cat "$KIT/python-version")
    if [ "$kit_python" = "$(python_version "$PY")" ]; then
        "${pip[@]}" --target "$GPU_WORK/site" "$KIT"/wheels/*.whl
        return
    fi
    dry || { echo "the kit's wheels are for Python $kit_python, this python3 is $(python_version "$PY")"; return 1; }
    # A dry run on another Python: the wheels must install for the host's, and the imports run with this
    # machine's builds of the same distributions.
    "${pip[@]}" --target "$GPU_WORK/site-host" --python-version "$kit_python" --implementation cp \
        --only-binary=:all: --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 "$KIT"/wheels/*.whl || return 1
    echo "dry run: the kit's wheels install for Python $kit_python; importing with this machine's builds of them"
    local names; names=$(cd "$KIT/wheels" && ls -- *.whl | cut -d- -f1)
    # shellcheck disable=SC2086  # one wheel name a word
    "$LOCAL_PY" bench/gpu/kit.py repack --dest "$GPU_WORK/local-wheels" $names >/dev/null &&
        "${pip[@]}" --target "$GPU_WORK/site" "$GPU_WORK"/local-wheels/*.whl
}

link_tree() {  # $GPU_WORK/root/depthserve: the namespace as pyproject.toml's package-dir maps it
    local tree=$GPU_WORK/root/depthserve entry
    rm -rf "$GPU_WORK/root" && mkdir -p "$tree"
    for entry in depthserve/*; do ln -s "$REPO/$entry" "$tree/"; done
    for entry in kernels server clients; do ln -s "$REPO/$entry" "$tree/$entry"; done
}

describe_device() {
    if dry; then
        echo "dry run on $(uname -n): no CUDA device is used"
    else
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    fi
}

check_imports() {  # from the checkout, as every stage runs: the versions, and the tree's depthserve, complete
    "$PY" - "$GPU_WORK/root" "$DRY_RUN" <<'PY'
import sys

import torch, transformers, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__)
import depthserve, depthserve.kernels.dispatch, depthserve.tools.cli
assert depthserve.__path__[0].startswith(sys.argv[1]), f"depthserve from {depthserve.__path__}, not the link tree"
print("depthserve from", depthserve.__path__[0])
try:  # the server needs only the carried wheels: a failure fails a dry run, not a GPU run's stages
    import depthserve.server.app
    print("depthserve.server imports")
except Exception as error:
    print(f"run.sh: depthserve.server does not import with the kit's wheels ({type(error).__name__}: {error});"
          " bench/gpu/prepare.sh carries what it needs")
    sys.exit(1 if sys.argv[2] == "1" else 0)
PY
}

setup() {
    require_kit
    if dry; then
        LOCAL_PY=${LOCAL_PYTHON:-$REPO/.venv/bin/python}
        if [ -z "${GPU_WORK:-}" ]; then
            GPU_WORK=$(mktemp -d /tmp/depthserve-gpu-dry.XXXXXX)
            trap 'rm -rf "$GPU_WORK"' EXIT
        fi
    fi
    GPU_WORK=$(realpath -m "${GPU_WORK:-/tmp/depthserve-gpu}")
    rm -rf "$GPU_WORK/site" "$GPU_WORK/site-host" "$GPU_WORK/local-wheels"
    PY=$(host_python) || fail "could not build the dry run's stand-in for the host's python3"
    install_wheels 2>&1 | tee -a "$OUT/run.log" || fail "could not install the carried wheels ($KIT/wheels)"
    link_tree || fail "could not lay out the depthserve namespace in $GPU_WORK/root"
    export PYTHONPATH="$GPU_WORK/root:$GPU_WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
    export DEPTHSERVE_TEST_TOKENIZER="$KIT/tokenizer"  # the tests' SmolLM2 tokenizer (tests/conftest.py)
    # The CPU engines beside the GPU ones (the tests' fp32 references) run torch's CPU ops: building the
    # native CPU kernels would spend device time (and, in a dry run, rebuild this machine's copy for
    # another interpreter).
    export DEPTHSERVE_NO_NATIVE_KERNELS=1
    # Compile caches outside the carried kit (a carried folder is replaced on each call), git-ignored,
    # so the next call on a warm machine reuses them.
    local cache; if dry; then cache=$GPU_WORK/cache; else cache=$REPO/gpu-out/compile-cache; fi
    export TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton"
    describe_device 2>&1 | tee -a "$OUT/run.log" || fail "no GPU visible (nvidia-smi)"
    check_imports 2>&1 | tee -a "$OUT/run.log" || fail "the import checks above failed"
}

has_pytest_timeout() { "$PY" -c "import pytest_timeout" 2>/dev/null; }

run_pytest() {  # NAME TEST...: the tests natively on the GPU (a dry run collects them), log and JUnit XML into $OUT
    local name=$1; shift
    local extra=()
    eval "extra=(${PYTEST_ARGS:-})"  # shell words, so that -k 'a or b' stays one expression
    local args=(-q -p no:cacheprovider -rfEs "$@" "${extra[@]}")
    if dry; then
        args+=(--collect-only)
    else
        args+=(--junitxml="$OUT/$name.xml")
        if has_pytest_timeout; then args+=(--timeout 420); fi
    fi
    local status=0
    limited "$PY" -c "$PYTEST_WITH_TREE" "${args[@]}" > "$OUT/$name.log" 2>&1 || status=$?
    if dry && ((status == 0)); then tail -n 1 "$OUT/$name.log"; else tail -n 40 "$OUT/$name.log"; fi
    return $status
}

bench_imports() {  # SCRIPT [--optional MODULE]...: the script's arguments parse and every module it imports loads
    "$PY" bench/gpu/kit.py imports "$@"
}

smollm2_shaped() {  # ARCH: a checkpoint of SmolLM2-135M's shapes and vocabulary, random weights (built once)
    local out=$GPU_WORK/ckpt/$1-smollm2-shaped
    if [ ! -f "$out/config.json" ]; then
        rm -rf "$out.partial"
        limited "$PY" -m depthserve make-tiny --arch "$1" --like smollm2-135m-instruct --tokenizer "$KIT/tokenizer" \
            --out "$out.partial" >&2 || return 1
        mv "$out.partial" "$out"
    fi
    echo "$out"
}

stage_tests() { run_pytest tests "${KERNEL_TESTS[@]}" "${ENGINE_TESTS[@]}"; }
stage_tests_kernels() { run_pytest tests-kernels "${KERNEL_TESTS[@]}"; }
stage_tests_engines() { run_pytest tests-engines "${ENGINE_TESTS[@]}"; }

stage_kernels() {  # the decode kernel's sweep, then prefill attention: the engine's Triton kernel against the field's
    if dry; then bench_imports bench/kernels.py --optional xformers; return; fi
    # shellcheck disable=SC2086  # KERNELS_ARGS: several arguments
    limited "$PY" bench/kernels.py ${KERNELS_ARGS:-} 2>&1 | tee "$OUT/kernels.log"
    # SmolLM2's attention shape, 64 fresh prompts of 128 tokens (the prefill the throughput stage
    # measures), then 64 chunks of 128 after 1,024 cached keys (a chunked or prefix-cached prompt)
    local prefix
    for prefix in 0 1024; do
        limited "$PY" bench/kernels.py --prefill --shapes 9/3/64 --batch 64 --chunk 128 --prefix "$prefix" 2>&1 \
            | tee -a "$OUT/kernels.log"
    done
}

stage_throughput() {
    local model
    model=$(smollm2_shaped llama)
    if dry; then bench_imports bench/throughput.py --optional llama_cpp; return; fi
    # shellcheck disable=SC2086  # THROUGHPUT_SYSTEMS: several arguments
    limited "$PY" bench/throughput.py --model "$model" --device cuda --dtype bfloat16 \
        ${THROUGHPUT_SYSTEMS:---compiled --compiled-one-step --hf-compiled --anchor} --batch-sizes "${BATCH_SIZES:-1,64}" \
        --repeats "${REPEATS:-3}" 2>&1 | tee "$OUT/throughput.log"
}

stage_profile() {  # where a decode step's and the prefill's time goes: launches, GPU busy share, top kernels (engine vs anchor)
    local model
    model=$(smollm2_shaped llama)
    if dry; then bench_imports bench/profile_decode.py; return; fi
    limited "$PY" bench/profile_decode.py --model "$model" --device cuda --dtype bfloat16 \
        --batch-sizes "${PROFILE_BATCH_SIZES:-1,64}" 2>&1 | tee "$OUT/profile.log"
}

stage_serve() {  # the server on the GPU (eager: start-up stays short): starts, answers a completion, stops
    local model server
    model=$(smollm2_shaped llama)
    if dry; then "$PY" -m depthserve serve --help >/dev/null; return; fi
    "$PY" -m depthserve serve --model "$model" --device cuda --enforce-eager --port "${SERVE_PORT:-8765}" \
        --log-level info > "$OUT/serve.log" 2>&1 &
    server=$!
    # the stage's status is the client's: stopping the server (143 from its wait) must not replace it
    trap 'status=$?; kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || :; exit $status' EXIT
    limited "$PY" - "${SERVE_PORT:-8765}" "$server" <<'PY' 2>&1 | tee "$OUT/serve-client.log"
import http.client, json, os, sys, time, urllib.request

base, server = f"http://127.0.0.1:{sys.argv[1]}", int(sys.argv[2])
while True:
    try:
        os.kill(server, 0)
    except ProcessLookupError:
        sys.exit("the server exited during start-up (serve.log)")
    try:
        if urllib.request.urlopen(f"{base}/health", timeout=5).status == 200:
            break
    except (OSError, http.client.HTTPException):  # refused, reset, a 503 or a read timed out while it starts
        time.sleep(2)
model = json.load(urllib.request.urlopen(f"{base}/v1/models"))["data"][0]["id"]
body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8}).encode()
request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=60))
print(f"completion of {model}: {reply['choices'][0]['text']!r}, usage {reply.get('usage')}")
PY
}

stage_depth() {
    if dry; then bench_imports bench/depth_sweep.py; return; fi
    # shellcheck disable=SC2086  # DEPTH_ARGS: several arguments
    limited "$PY" bench/depth_sweep.py --device cuda --dtype bfloat16 --tokenizer "$KIT/tokenizer" \
        --kv-cache-memory-gib 4 --archs "${ARCHS:-itt,sgt,dreamer,put}" --decode-steps 64 ${DEPTH_ARGS:-} \
        2>&1 | tee "$OUT/depth.log"
}

result_prefix() {  # STAGE: the name its result files start with under bench/results (none for tests)
    case $1 in
        kernels) echo kernels ;;
        throughput) echo throughput ;;
        profile) echo decode-profile ;;
        depth) echo depth-sweep ;;
    esac
}

keep_results() {  # STAGE STAMP: the result JSON the stage wrote (newer than STAMP) into $OUT
    local prefix; prefix=$(result_prefix "$1")
    [ -n "$prefix" ] || return 0
    find bench/results -maxdepth 1 -name "$prefix-*.json" -newer "$2" -exec cp {} "$OUT"/ \; -print
}

stage_budget() {  # STAGE: its seconds in STAGE_BUDGETS ("kernels:80 throughput:200"), 0 where none
    local entry
    for entry in ${STAGE_BUDGETS:-}; do
        [ "${entry%%:*}" = "$1" ] && { echo "${entry#*:}"; return; }
    done
    echo 0
}

run_stage() {  # STAGE: in a subshell with errexit, so its first failing step ends it
    # (errexit is void in a condition or a && / || list, hence no caller tests this call directly)
    local stage=$1 stamp=$GPU_WORK/started-$1 status budget
    touch "$stamp"
    budget=$(stage_budget "$stage")
    STAGE_END=$((budget ? SECONDS + budget : RUN_BUDGET_S))
    say "=== $stage ($(date -u +%H:%M:%S), ${SECONDS}s into the run)"
    (set -e; "stage_${stage//-/_}")
    status=$?
    keep_results "$stage" "$stamp" | sed 's/^/kept /'
    return $status
}

main() {
    (($# > 0)) || { sed -n '2,12p' "$0"; exit 2; }
    local stage status failed=()
    mkdir -p "$OUT" && : > "$OUT/run.log"
    for stage in "$@"; do
        declare -F "stage_${stage//-/_}" >/dev/null ||
            fail "unknown stage '$stage' (tests, tests-kernels, tests-engines, kernels, serve, throughput, profile, depth)"
    done
    setup
    for stage in "$@"; do
        run_stage "$stage"
        status=$?
        if ((status == 0)); then
            say "=== $stage passed (${SECONDS}s into the run)"
            continue
        fi
        say "=== $stage FAILED with exit status $status (${SECONDS}s into the run): its log is in $OUT"
        failed+=("$stage")
        dry || [ "${KEEP_GOING:-0}" = 1 ] || break
    done
    if ((${#failed[@]})); then
        say "run.sh: failed: ${failed[*]}" && exit 1
    fi
    say "run.sh: every stage passed: $*"
}

main "$@"
