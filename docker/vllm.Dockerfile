# syntax=docker/dockerfile:1
# vLLM with the connector: the official vLLM OpenAI image of the release the connector is
# tested with, plus Mooncake's client (the CUDA 13 build, as vLLM 0.32 runs CUDA 13; for a
# CUDA 12 vLLM image install mooncake-transfer-engine instead) and mooncake-kvpool with its
# `connector` extra. Runs as 1000:1000 with its home in /home/vllm; the entry point stays
# vLLM's own (`vllm serve`).
# Build from the repository root (see docker/README.md):
#   docker build -f docker/vllm.Dockerfile -t mooncake-kvpool-vllm:0.1.0 .

FROM python:3.11.11-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY connector ./connector
COPY operator ./operator
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM vllm/vllm-openai:v0.32.0
LABEL org.opencontainers.image.title="mooncake-kvpool-vllm" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=wheel /wheels /wheels
RUN uv pip install --system --no-cache "mooncake-transfer-engine-cuda13==0.3.13.post1" \
    && uv pip install --system --no-cache --find-links /wheels "mooncake-kvpool[connector]==0.1.0" \
    && rm -rf /wheels \
    && mkdir -p /home/vllm/.cache \
    && chown -R 1000:1000 /home/vllm
ENV HOME=/home/vllm \
    USER=vllm \
    LOGNAME=vllm \
    HF_HOME=/home/vllm/.cache/huggingface \
    PYTHONHASHSEED=0
USER 1000:1000
