#!/bin/sh
# restart-backoff.sh CMD [ARG...]: run CMD (exec) after a pause that doubles with each quick restart.
#
# docker-compose.yml makes it the entrypoint of every long-running service. Podman restarts a failed
# container at once, with no back-off (measured 0.3-0.5 s apart: a crash at import made 465 restarts
# in 9.5 min, load 11.7 on 2 CPUs); Docker backs off by itself, and under Docker this adds its pause
# to Docker's. A restarted container keeps its file system, so the count of quick starts lives in a
# file of the container's own (a new container, after `down` or a rebuild, starts afresh):
# - the first start, and a start more than RESET s after the previous one (the previous run lasted
#   that long: it was not crash-looping), run CMD at once;
# - the n-th start in a row within RESET s of the one before waits 2^(n-2) s (1, 2, 4, ...), at most MAX s.
# SIGTERM or SIGINT during the pause (`stop`, `down`) exits 0 at once. POSIX sh, date and sleep only
# (Debian, busybox).
# Environment: RESTART_BACKOFF_MAX_S (default 60), RESTART_BACKOFF_RESET_S (default 120),
# RESTART_BACKOFF_STATE (default /tmp/.fuseserve-restart-backoff).
state=${RESTART_BACKOFF_STATE:-/tmp/.fuseserve-restart-backoff}
max=${RESTART_BACKOFF_MAX_S:-60}
reset=${RESTART_BACKOFF_RESET_S:-120}
starts=0 last=0
if [ -f "$state" ]; then read -r starts last < "$state" || true; fi
case "$starts$last" in *[!0-9]*|'') starts=0 last=0 ;; esac  # unreadable: start afresh
if [ $(($(date +%s) - last)) -ge "$reset" ]; then starts=0; fi
delay=0
if [ "$starts" -gt 0 ]; then
  delay=1 i=1
  while [ "$i" -lt "$starts" ] && [ "$delay" -lt "$max" ]; do delay=$((delay * 2)) i=$((i + 1)); done
  if [ "$delay" -gt "$max" ]; then delay=$max; fi
  trap 'exit 0' TERM INT
  echo "restart-backoff: start $((starts + 1)) within ${reset} s of the previous one: waiting ${delay} s" >&2
  sleep "$delay" &
  wait $!
  trap - TERM INT
fi
echo "$((starts + 1)) $(date +%s)" > "$state"
exec "$@"
