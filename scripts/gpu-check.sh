#!/usr/bin/env bash
# GPU check (a): kvtier's own tier engine on one CUDA GPU, without vLLM (python -m kvtier.diagnose.gpucheck).
#
#   scripts/gpu-check.sh --fetch      # on a box with network: wheels the check box lacks -> .gpu-wheels/
#   scripts/gpu-check.sh [OUT_DIR]    # on the GPU box: install them offline, run, write OUT_DIR/gpucheck.json
#   scripts/gpu-check.sh --dry        # anywhere: every check but the device's, on the CPU
#
# The check box has PyTorch with CUDA and Python 3.12 but no vLLM and no network: kvtier runs from
# this source tree (PYTHONPATH), and the pure-Python or binary wheels it needs beyond torch (xxhash,
# zstandard, numpy, nvidia-ml-py; about 25 MiB) travel in .gpu-wheels/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS=(xxhash zstandard numpy nvidia-ml-py)
if [ "${1:-}" = "--fetch" ]; then
    "$PY" -m pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 "${WHEELS[@]}" -d .gpu-wheels
    du -sh .gpu-wheels
    exit 0
fi
if [ "${1:-}" = "--dry" ]; then
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m kvtier.diagnose.gpucheck --dry
fi
out="${1:-${OUT:-.}}"
mkdir -p "$out"
if [ -d .gpu-wheels ]; then  # only what is missing; never touch the box's torch
    for mod in xxhash zstandard numpy pynvml; do
        "$PY" -c "import $mod" 2>/dev/null || "$PY" -m pip install -q --no-index --find-links .gpu-wheels \
            "$( [ "$mod" = pynvml ] && echo nvidia-ml-py || echo "$mod")"
    done
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 480 "$PY" -m kvtier.diagnose.gpucheck --out "$out/gpucheck.json"
