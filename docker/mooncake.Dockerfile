# syntax=docker/dockerfile:1
# The Mooncake master and store: mooncake_master and mooncake_client from the
# mooncake-transfer-engine release the connector is tested with. Master and store pods
# hold host memory and need no GPU, so this is the release's CPU build (same commands,
# TCP and RDMA); its programs need libibverbs, libnuma and libcurl from Debian.
# Runs as 1000:1000 (the operator's pod securityContext for master and store pods);
# the operator sets the command (mooncake_master or mooncake_client) and its flags.
# Build from the repository root (see docker/README.md):
#   docker build -f docker/mooncake.Dockerfile -t mooncake-store:0.1.0 .

FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.title="mooncake-store" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers librdmacm1 libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/mooncake \
    && /opt/mooncake/bin/pip install --no-cache-dir "mooncake-transfer-engine-non-cuda==0.3.13.post1"
ENV PATH=/opt/mooncake/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1
USER 1000:1000
CMD ["mooncake_master", "--help"]
