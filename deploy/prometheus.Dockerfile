# syntax=docker/dockerfile:1
# An offline stand-in for prom/prometheus where no registry answers: Debian bookworm's prometheus
# package (2.42, with promtool), installed by mmdebstrap into a root filesystem of its own
# (deploy/build-images.sh imports it as ROOTFS_IMAGE; nothing is downloaded during this build).
#   PROMETHEUS_IMAGE=localhost/fuseserve-prometheus:latest docker compose --profile monitoring up
# docker-compose.yml mounts monitoring/prometheus.yml and monitoring/alerts.yml over /etc/prometheus.
ARG ROOTFS_IMAGE=localhost/fuseserve-prometheus-rootfs:bookworm

FROM ${ROOTFS_IMAGE}
# The package made the prometheus user; its data directory is the volume compose mounts at /prometheus.
RUN mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
# promtool 2.42 has no `check healthy`; an instant query answers only once the server serves its API
# (the same command works in prom/prometheus, which has promtool too).
HEALTHCHECK --interval=10s --timeout=5s --retries=6 \
    CMD ["promtool", "query", "instant", "http://127.0.0.1:9090", "vector(1)"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
