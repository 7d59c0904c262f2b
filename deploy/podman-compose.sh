#!/usr/bin/env bash
# docker-compose (v1, Debian's) through Podman's Docker-compatible API: starts `podman system service`
# on a socket under $PODMAN_SOCKET_DIR if none answers there, then runs docker-compose with DOCKER_HOST.
#   deploy/podman-compose.sh --profile monitoring up -d --scale worker=2
#   deploy/podman-compose.sh --profile monitoring down -v
# CONTAINERS_CONF defaults to deploy/podman/containers.conf (lower rlimits and runc: Debian's podman
# 4.3 fails to start containers otherwise, see that file). Offline, set REDIS_IMAGE, PROMETHEUS_IMAGE
# and WORKER_DEVICE (see README "Deploy").
# Podman runs health checks from systemd timers; where systemd is not running (containers, CI
# sandboxes) a small loop started next to the API service runs `podman healthcheck run` every 5 s
# instead, so compose's `condition: service_healthy` can be met.
# What this script starts it stops: after a `down` that leaves no compose container on this Podman,
# the health-check loop and the API service it started (their process groups) are ended. A service
# or loop it did not start (one already answering on the socket) is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
CONTAINERS_CONF=$(realpath "${CONTAINERS_CONF:-$PWD/deploy/podman/containers.conf}")  # read from other folders too
export CONTAINERS_CONF
dir=${PODMAN_SOCKET_DIR:-/run/fuseserve-podman}
sock=$dir/podman.sock
mkdir -p "$dir"
answers() { curl -s --max-time 2 --unix-socket "$sock" http://d/_ping >/dev/null 2>&1; }
# alive PIDFILE WORD: the process the file names runs and its command line holds WORD (a stale file
# whose pid was reused by another program does not count)
alive() { [ -f "$1" ] && tr '\0' ' ' 2>/dev/null < "/proc/$(cat "$1")/cmdline" | grep -qF -- "$2"; }
stop_group() {  # stop_group PIDFILE WORD: end the process group this script started (setsid: pid = group)
  if alive "$1" "$2"; then
    local pid
    pid=$(cat "$1")
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

if ! answers; then
  rm -f "$sock"
  setsid podman system service --time=0 "unix://$sock" >"$dir/service.log" 2>&1 < /dev/null &
  echo $! >"$dir/service.pid"
  for _ in $(seq 50); do answers && break; sleep 0.2; done
fi
if [ ! -d /run/systemd/system ] && ! alive "$dir/healthchecks.pid" "podman healthcheck run"; then
  setsid sh -c 'while true; do
      for c in $(podman ps -q --filter label=com.docker.compose.project); do podman healthcheck run "$c" >/dev/null 2>&1; done; sleep 5
    done' >/dev/null 2>&1 < /dev/null &
  echo $! >"$dir/healthchecks.pid"
fi
export DOCKER_HOST=unix://$sock
rc=0
docker-compose "$@" || rc=$?
is_down=0
for arg in "$@"; do [ "$arg" = down ] && is_down=1; done
if [ "$is_down" = 1 ] && [ -z "$(podman ps -aq --filter label=com.docker.compose.project)" ]; then
  stop_group "$dir/healthchecks.pid" "podman healthcheck run"
  stop_group "$dir/service.pid" "$sock"
fi
exit "$rc"
