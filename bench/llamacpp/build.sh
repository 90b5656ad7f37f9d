#!/usr/bin/env bash
# Builds the llama.cpp baselines from source, tuned to this CPU (GGML_NATIVE=ON: -march=native,
# so AVX-512 / VNNI / BF16 / AMX where the CPU has them):
#   bindings  llama-cpp-python, compiled by pip into the venv: bench/throughput.py --llamacpp
#   server    llama-server from the llama.cpp sources vendored in the same llama-cpp-python sdist:
#             bench/serving.py --llama-server
# Both come from one sdist, so the bindings and the server run the same llama.cpp commit.
# Several minutes each on 2 cores; not part of `make install` or `make test` (CI never builds it).
#
#   bench/llamacpp/build.sh [bindings|server|all]     (make llamacpp runs `all`)
#
# Environment: PYTHON (default .venv/bin/python), LLAMA_CPP_PYTHON_VERSION, JOBS (default nproc),
# NICE (default 15: the build yields the CPU to whatever else runs on the machine), CC / CXX (the
# compilers; default cc / c++), AMX (auto, on or off; see amx_flags).
set -euo pipefail

cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-$(nproc)}
NICE=${NICE:-15}
OUT=bench/llamacpp/build  # git-ignored
SDIST=$OUT/llama_cpp_python-$VERSION.tar.gz
SOURCES=$OUT/src/llama_cpp_python-$VERSION
SERVER_BUILD=$OUT/server
part=${1:-all}
CC=${CC:-cc}
CXX=${CXX:-c++}
export CC CXX

# -march=native turns on AMX where the CPU has it, and ggml then multiplies quantized weights with
# AMX tiles. Debian 12's GCC 12 declares _tile_loadconfig (an inline asm) as reading only 8 of the
# 64 bytes of the tile configuration, so the optimizer drops the stores that fill in its rows and
# columns, and the first AMX matmul faults (SIGSEGV in ggml_backend_amx_mul_mat). With such a
# compiler AMX is turned off (the -mno- flags go before -march=native on the command line, and GCC
# lets them win over it); ggml's AVX-512 kernels do the work instead. A compiler without that
# declaration (newer GCC use a builtin; or CC=clang CXX=clang++) keeps AMX.
amx_flags() {
    local header
    header=$("$CXX" -print-file-name=include/amxtileintrin.h 2>/dev/null || true)
    case "${AMX:-auto}" in
        on) return ;;
        off) echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;;
        auto) if [ -f "$header" ] && grep -q 'ldtilecfg.*"m" (\*((const void \*\*)' "$header"; then
                  echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
              fi ;;
    esac
}
EXTRA_FLAGS=$(amx_flags)
if [ -n "$EXTRA_FLAGS" ]; then
    echo "building without AMX ($EXTRA_FLAGS): $CXX's _tile_loadconfig is miscompiled (see amx_flags)" >&2
fi

download_sdist() {
    if [ ! -f "$SDIST" ]; then
        mkdir -p "$OUT"
        "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT"
    fi
}

build_bindings() {
    download_sdist
    # --no-cache-dir: pip's wheel cache does not key on CMAKE_ARGS, so a cached generic build could
    # come back instead of the native one.
    # CFLAGS / CXXFLAGS seed a fresh CMake configure's CMAKE_C_FLAGS / CMAKE_CXX_FLAGS.
    # LLAVA_BUILD=OFF: no multimodal library (libmtmd), which the benchmark does not load; minutes less.
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CFLAGS="$EXTRA_FLAGS" CXXFLAGS="$EXTRA_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        nice -n "$NICE" "$PYTHON" -m pip install --no-cache-dir --force-reinstall --no-deps "$SDIST"
    # Its runtime dependencies, without letting pip touch anything already installed (torch).
    "$PYTHON" -m pip install "typing-extensions>=4.5.0" "numpy>=1.20.0" "diskcache>=5.6.1" "jinja2>=2.11.3"
    "$PYTHON" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"
}

build_server() {
    download_sdist
    if [ ! -d "$SOURCES" ]; then
        mkdir -p "$OUT/src"
        tar -xzf "$SDIST" -C "$OUT/src"
    fi
    # Static libraries: the binary does not depend on the bindings' shared ones.
    nice -n "$NICE" cmake -S "$SOURCES/vendor/llama.cpp" -B "$SERVER_BUILD" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_FLAGS="$EXTRA_FLAGS" -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS" \
        -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF
    nice -n "$NICE" cmake --build "$SERVER_BUILD" --target llama-server -j "$JOBS"
    "$SERVER_BUILD/bin/llama-server" --version
    echo "built $SERVER_BUILD/bin/llama-server"
}

case "$part" in
    bindings) build_bindings ;;
    server) build_server ;;
    all) build_bindings; build_server ;;
    *) echo "usage: $0 [bindings|server|all]" >&2; exit 2 ;;
esac
