#!/usr/bin/env bash
# Downloads, here (Debian, with network), the Debian packages that tests/gpu/run.sh unpacks on the
# GPU machine (no network, no libfabric headers): carry .gpudeps with the device call.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpudeps && cd .gpudeps
apt-get download libfabric1 libfabric-dev libfmt9 libfmt-dev libgtest-dev libibverbs1 librdmacm1 \
  libnl-3-200 libnl-route-3-200 libpsm2-2 libpsm-infinipath1 libnuma1 libfabric-bin libcli11-dev
