#!/usr/bin/env bash
# Fills .gpu/ with what the GPU hosts lack (docs/gpu.md), here, where pip has an index, before a
# session on one: wheels of every distribution the project needs that the host's image does not hold
# (bench/gpu/kit.py missing: the versions installed here, for the host's CPython 3.12; the list of the
# host's distributions is bench/gpu/host-packages.txt), and SmolLM2's tokenizer (the model's 93 MB
# package is too large to carry; checkpoints are built there with random weights of SmolLM2's shapes
# and this vocabulary). About 8 MB.
#
# .gpu/ is git-ignored, so it does not travel with the checkout: a device call takes it along only
# when it names it, carry [".gpu"].
#
#     bash bench/gpu/prepare.sh                                  # the kit for the GPU hosts (uses the index)
#     HOST_PYTHON=local KIT=/tmp/kit bash bench/gpu/prepare.sh   # offline: wheels rebuilt from this machine's
#                                                                # installed distributions, for its own Python
#                                                                # (DRY_RUN=1 bench/gpu/run.sh with KIT=/tmp/kit)
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=${KIT:-.gpu}
PY=${PYTHON:-.venv/bin/python}
HOST_PYTHON=${HOST_PYTHON:-3.12}

if [ -e "$KIT" ] && [ "$KIT" != .gpu ] && [ ! -f "$KIT/python-version" ]; then
    echo "prepare.sh: $KIT exists and is not a kit; not replacing it" >&2
    exit 1
fi
needed=$("$PY" bench/gpu/kit.py missing)
rm -rf "$KIT" && mkdir -p "$KIT/wheels"
# shellcheck disable=SC2086  # one requirement a word
if [ "$HOST_PYTHON" = local ]; then
    "$PY" bench/gpu/kit.py repack --dest "$KIT/wheels" $(echo "$needed" | cut -d= -f1) >/dev/null
    "$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' > "$KIT/python-version"
else
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$HOST_PYTHON" --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$KIT/wheels" $needed
    echo "$HOST_PYTHON" > "$KIT/python-version"
fi
"$PY" bench/gpu/kit.py check-wheels "$KIT/wheels"
"$PY" - "$KIT/tokenizer" <<'PY'
import sys

from depthserve.lab.make_tiny import load_default_tokenizer

tokenizer = load_default_tokenizer()
assert len(tokenizer) > 1000, "SmolLM2's package is not installed here (make install)"
tokenizer.save_pretrained(sys.argv[1])
PY
echo "carried wheels: $(cd "$KIT/wheels" && ls | tr '\n' ' ')"
du -sh "$KIT"
