#!/usr/bin/env bash
# docker-compose (v1, Debian's) through Podman's Docker-compatible API: starts `podman system service`
# on a socket under $PODMAN_SOCKET_DIR if none answers there, then runs docker-compose with DOCKER_HOST.
#   deploy/podman-compose.sh up -d --scale worker=2 redis gateway scheduler worker
#   deploy/podman-compose.sh down -v
# CONTAINERS_CONF defaults to deploy/podman/containers.conf (lower rlimits: Debian's podman 4.3 fails
# to start containers with "setrlimit" errors otherwise). Offline, set REDIS_IMAGE and WORKER_DEVICE
# (see README "Deploy").
# Podman runs health checks from systemd timers; where systemd is not running (containers, CI
# sandboxes) a small loop started next to the API service runs `podman healthcheck run` every 5 s
# instead, so compose's `condition: service_healthy` can be met.
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/podman/containers.conf}
dir=${PODMAN_SOCKET_DIR:-/run/fuseserve-podman}
sock=$dir/podman.sock
mkdir -p "$dir"
if ! curl -s --max-time 2 --unix-socket "$sock" http://d/_ping >/dev/null 2>&1; then
  rm -f "$sock"
  nohup podman system service --time=0 "unix://$sock" >"$dir/service.log" 2>&1 &
  for _ in $(seq 50); do
    curl -s --max-time 2 --unix-socket "$sock" http://d/_ping >/dev/null 2>&1 && break
    sleep 0.2
  done
fi
if [ ! -d /run/systemd/system ] && ! kill -0 "$(cat "$dir/healthchecks.pid" 2>/dev/null)" 2>/dev/null; then
  nohup sh -c 'while true; do
      for c in $(podman ps -q --filter label=com.docker.compose.project); do podman healthcheck run "$c" >/dev/null 2>&1; done; sleep 5
    done' >/dev/null 2>&1 &
  echo $! >"$dir/healthchecks.pid"
fi
export DOCKER_HOST=unix://$sock
exec docker-compose "$@"
