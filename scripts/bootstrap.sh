#!/usr/bin/env bash
# Install what building and testing Slipstream needs on a fresh Debian/Ubuntu
# machine: a C toolchain, Python's venv module, espeak-ng, etcd, iproute2, and
# Rust (via rustup) if cargo is missing.
set -euo pipefail
need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
# The AudioQuery example speaks with espeak-ng (a Debian package).
command -v espeak-ng >/dev/null 2>&1 || need_apt+=(espeak-ng)
# Clusters run on etcd; the cluster tests start real etcd members and put
# nodes in network namespaces (ip, tc from iproute2).
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
# The dashboard's test loads /dashboard in a headless Chromium.
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
# tests/integration/test_prometheus.py scrapes a node with a real Prometheus.
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -q && $SUDO apt-get install -y -q "${need_apt[@]}"
  else
    echo "bootstrap: please install: ${need_apt[*]}" >&2; exit 1
  fi
fi
if ! command -v cargo >/dev/null 2>&1 && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
  echo "bootstrap: installing Rust with rustup" >&2
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal -c clippy,rustfmt
fi
