#!/usr/bin/env bash
# The prepared GPU check: one script, about 20 minutes on one H200 (four device calls), results in one folder.
#
#   benchmarks/gpu_check.sh                 on the GPU machine, from anywhere (it cds to the repository)
#   benchmarks/gpu_check.sh --dry-run       on a CPU machine: tiny shapes, interpreted Triton (checks the script)
#   benchmarks/gpu_check.sh --fetch-wheels  on a networked machine: pytest wheels for the GPU machine's
#                                           Python 3.12 into benchmarks/wheels/ (carry that folder)
#
# Results: $OUT if set, else benchmarks/results/gpu_check-<UTC time>/ :
#   summary.txt      one line per step: exit status, seconds
#   results.jsonl    one JSON record per result (env, parity, forward_pass, attention, workload)
#   <step>.log       each step's output; kernel_tests.xml (JUnit) when pytest is there
#
# GPU_CHECK_STEPS=env,kernels,... runs only the steps named (one device call runs at most 600 s: the
# whole check is four calls, e.g. env,graphs,graphs-7b then kernels,smollm2,compiled,attention then
# llama2-7b then int4-7b alone: on a fresh machine it writes the 7B checkpoint and its GPTQ copy first).
#
# Steps (each under its own time limit, so a slow one cannot eat the others' time):
#   env          versions, GPU, which attention backends can run here
#   kernels      tests/unit/test_triton_kernels.py + test_triton_quant_linear.py (W4A16 / W8A16 GEMM)
#                + test_flash_attn_kernel.py + the reference's test + test_fp8_kv_cache.py (fp8 KV cache)
#                + test_lora_kernels.py (the multi-LoRA SGMV shrink/expand pair),
#                compiled on the GPU (not interpreted); needs pytest (carried as wheels if absent)
#   smollm2      SmolLM2-shaped random model: bf16 greedy parity with transformers, pass times per backend
#   compiled     the same model with the compiled forward (--compile): compile seconds, parity, pass times
#   graphs       the same model with CUDA graphs (on by default): capture seconds, parity replaying them,
#                pass times replayed vs eager (1 / 16 / 256 tokens)
#   graphs-7b    the same on the Llama-2-7B shape, token budget 2048, then the paper's workload both ways
#   attention    attention-only time per pass and error vs the torch reference, both shapes, every backend
#                (torch, Triton, flash-attn if installed, PyTorch FlexAttention as a peer)
#   llama2-7b    Llama-2-7B-shaped random model: parity, pass times, then the paper's workload through
#                the pipeline (prompt/output means 2600/60, std 0.3 x mean; clients 1, 4, 16)
#   int4-7b      the same model written as GPTQ 4-bit (groups of 128): the W4A16 GEMM against fp32 at
#                1-2048 rows, greedy parity with transformers on the dequantized weights (fp32: the
#                verdict; bf16: informative), kernel per layer shape, decode tok/s at batch 1 / 16
#                against the bf16 model (benchmarks/gpu_check_quant.py; ~400 s on a fresh machine)
#
# What the GPU machine has: Python 3.12, torch (CUDA), Triton, transformers, grpcio, protobuf,
# prometheus-client; no network, no fastapi/uvicorn/redis/gguf/flash-attn. fuseserve is not installed
# there: the script puts a package view of this checkout on PYTHONPATH (no pip needed).

set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --fetch-wheels)
    PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
    mkdir -p benchmarks/wheels
    exec "$PY" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform any -d benchmarks/wheels pytest
    ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --fetch-wheels]" >&2; exit 2 ;;
esac

OUT=${OUT:-$REPO/benchmarks/results/gpu_check-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ "$MODE" = dry ] && [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
# random checkpoints (the 7B one is 13.5 GB): in memory (/dev/shm) when it has room, else on disk
SHM_FREE_GB=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [ "${SHM_FREE_GB:-0}" -ge 40 ]; then DEFAULT_MODELS=/dev/shm/fuseserve-gpu-check; else DEFAULT_MODELS=${TMPDIR:-/tmp}/fuseserve-gpu-check; fi
export GPU_CHECK_MODELS=${GPU_CHECK_MODELS:-$DEFAULT_MODELS}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
START=$SECONDS
echo "gpu_check mode=$MODE out=$OUT python=$PY" | tee "$OUT/summary.txt"

# fuseserve importable without installing it: a package view (symlinks) mapping fuseserve.worker to
# services/worker etc., as pyproject's package-dir does.
if [ -n "${GPU_CHECK_VIEW:-}" ] || ! "$PY" -c "import fuseserve.worker.attention" 2>/dev/null; then
  VIEW=$(mktemp -d)
  mkdir "$VIEW/fuseserve"
  for f in "$REPO"/fuseserve/*; do ln -s "$f" "$VIEW/fuseserve/"; done
  ln -s "$REPO/services/gateway" "$VIEW/fuseserve/gateway"
  ln -s "$REPO/services/scheduler" "$VIEW/fuseserve/scheduler"
  ln -s "$REPO/services/worker" "$VIEW/fuseserve/worker"
  ln -s "$REPO/kernels" "$VIEW/fuseserve/kernels"
  ln -s "$REPO/proto" "$VIEW/fuseserve/proto"
  export PYTHONPATH="$VIEW:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONSAFEPATH=1  # `python -m` run here would put the checkout (its bare fuseserve/) before the view
  echo "fuseserve: package view at $VIEW" | tee -a "$OUT/summary.txt"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

# pytest: installed, else from carried wheels (benchmarks/wheels, see --fetch-wheels), else skipped.
# Pure-Python wheels are zip files: unpacked with the standard library (no pip), and put on the path of
# the kernel tests only (they would shadow the machine's own packaging for the other steps).
TEST_PATH=$PYTHONPATH
if ! "$PY" -c "import pytest" 2>/dev/null && ls benchmarks/wheels/pytest-*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d)
  for w in benchmarks/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$SITE"; done
  TEST_PATH="$PYTHONPATH:$SITE"
  echo "pytest: from benchmarks/wheels, unpacked at $SITE" | tee -a "$OUT/summary.txt"
fi

# run NAME LIMIT_S CMD...: one step under a time limit; its output in NAME.log, its status in summary.txt
run() {
  local name=$1 limit=$2; shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then return; fi
  local t0=$SECONDS
  echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)" | tee -a "$OUT/summary.txt"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local verdict=ok
  [ $rc -eq 124 ] && verdict="TIMED OUT"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="FAILED"
  echo "   $name: $verdict (exit $rc, $((SECONDS - t0)) s)" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log" | sed 's/^/   | /'
}

CHECK=("$PY" -m benchmarks.gpu_check)

if [ "$MODE" = dry ]; then
  # the GPU machine's missing packages hidden from the Python steps, to prove they are not needed
  export GPU_CHECK_ABSENT=fastapi,uvicorn,redis,gguf,accelerate,flash_attn
  export TRITON_INTERPRET=1  # Triton on CPU runs interpreted; torch imports triton before fuseserve does
  run env 60 "${CHECK[@]}" env "$OUT"
  run kernels 240 env PYTHONPATH="$TEST_PATH" "$PY" -m pytest -q -rs -p no:cacheprovider --import-mode=append tests/unit/test_triton_kernels.py tests/unit/test_triton_quant_linear.py \
    tests/unit/test_flash_attn_kernel.py tests/unit/test_fp8_kv_cache.py tests/unit/test_lora_kernels.py --junitxml="$OUT/kernel_tests.xml"
  run tiny 300 "${CHECK[@]}" model "$OUT" tiny workload
  run compiled 300 "${CHECK[@]}" compiled "$OUT" tiny
  run graphs 300 "${CHECK[@]}" graphs "$OUT" tiny workload
  run attention 120 "${CHECK[@]}" attention "$OUT" tiny
  run int4 180 "$PY" -m benchmarks.gpu_check_quant "$OUT" tiny
else
  # time limits add up to 1305 s: over one device call's 600 s, so a call runs a part (GPU_CHECK_STEPS)
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
  run env 20 "${CHECK[@]}" env "$OUT"
  if PYTHONPATH=$TEST_PATH "$PY" -c "import pytest" 2>/dev/null; then
    run kernels 120 env PYTHONPATH="$TEST_PATH" "$PY" -m pytest -q -rs -p no:cacheprovider --import-mode=append tests/unit/test_triton_kernels.py tests/unit/test_triton_quant_linear.py \
      tests/unit/test_flash_attn_kernel.py tests/unit/test_reference_attention.py tests/unit/test_fp8_kv_cache.py \
      tests/unit/test_lora_kernels.py --junitxml="$OUT/kernel_tests.xml"
  else
    echo "== kernels: SKIPPED, pytest is not installed and benchmarks/wheels/ has no wheels (--fetch-wheels)" \
      | tee -a "$OUT/summary.txt"
  fi
  run smollm2 90 "${CHECK[@]}" model "$OUT" smollm2
  run compiled 90 "${CHECK[@]}" compiled "$OUT" smollm2
  run graphs 120 "${CHECK[@]}" graphs "$OUT" smollm2
  run graphs-7b 300 "${CHECK[@]}" graphs "$OUT" llama2-7b workload
  run attention 50 "${CHECK[@]}" attention "$OUT"
  run llama2-7b 95 "${CHECK[@]}" model "$OUT" llama2-7b workload
  run int4-7b 470 "$PY" -m benchmarks.gpu_check_quant "$OUT" llama2-7b  # alone: a fresh machine writes the 7B and its GPTQ copy first (~175 s)
fi
rm -rf "$GPU_CHECK_MODELS"
echo "total $((SECONDS - START)) s; results in $OUT" | tee -a "$OUT/summary.txt"
grep -h '"ok": false\|"error"' "$OUT/results.jsonl" 2>/dev/null | head -20 | sed 's/^/PROBLEM /' | tee -a "$OUT/summary.txt"
exit 0
