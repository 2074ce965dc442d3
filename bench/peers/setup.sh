#!/usr/bin/env bash
# Installs the peers that bench/compare.sh measures against into a virtual environment, once:
# NIXL (nixl-cu13: its wheels carry UCX 1.23 and the plugins; host memory needs neither CUDA nor
# torch, so it is installed without its torch dependency) and Mooncake Transfer Engine (non-CUDA
# build), with numpy for the drivers. A no-op when the environment already imports them.
# Usage: bench/peers/setup.sh VENV_DIR
set -euo pipefail
venv=${1:?usage: setup.sh VENV_DIR}
check() { "$venv/bin/python" -c 'import numpy, nixl_cu13, mooncake.engine' >/dev/null 2>&1; }
check && exit 0
echo "peers: installing NIXL and Mooncake into $venv" >&2
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check numpy \
  mooncake-transfer-engine-non-cuda==0.3.13.post1
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps nixl-cu13==1.5.1
check || { echo "peers: $venv does not import numpy, nixl_cu13 and mooncake.engine" >&2; exit 1; }
