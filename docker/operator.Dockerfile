# syntax=docker/dockerfile:1
# The operator: kvpool-operator, the project's wheel with its `operator` extra (no vLLM, no torch),
# every requirement pinned by docker/operator.lock and installed without an index.
# Runs as 65532:65532 (the chart's operator.podSecurityContext); its command needs no shell.
# Build from the repository root (see docker/README.md):
#   docker build -f docker/operator.Dockerfile -t mooncake-kvpool-operator:0.1.0 .

FROM python:3.11.11-slim-bookworm AS wheel
WORKDIR /src
COPY docker/operator.lock ./
COPY pyproject.toml README.md LICENSE ./
COPY connector ./connector
COPY operator ./operator
# The project's wheel, and every requirement pinned in the lock (binary wheels, no resolution).
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && python -m pip download --no-cache-dir --no-deps --only-binary=:all: --dest /wheels -r operator.lock \
    && cp operator.lock /wheels/

FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.title="mooncake-kvpool-operator" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/kvpool \
    && /opt/kvpool/bin/pip install --no-cache-dir --no-index --find-links /wheels \
        -r /wheels/operator.lock "mooncake-kvpool[operator]==0.1.0" \
    && rm -rf /wheels
ENV PATH=/opt/kvpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["kvpool-operator"]
CMD ["run"]
