#!/usr/bin/env bash
# Install the system packages that a make target needs on a fresh
# Debian/Ubuntu machine, and no others:
#
#   scripts/bootstrap.sh build   what building the package needs (`make setup`,
#                                so `make demo` too): a C toolchain, Python's
#                                venv module, curl and CA certificates for
#                                rustup, and Rust itself
#   scripts/bootstrap.sh test    the programs the tests start (`make test`)
#   scripts/bootstrap.sh bench   the services benchmarks compare with or run on
#                                (`make bench-store`, `make bench-cluster-store`)
#
# What is already there is skipped; each group still missing is printed on
# one line with the reason it is needed, then apt installs them all at once
# with --no-install-recommends (recommended packages, e.g. Chromium's
# printing and desktop stack, are never needed here).
set -euo pipefail

packages=()  # to install
reasons=()   # one line per group: its packages and why

has() { command -v "$1" >/dev/null 2>&1; }

# want WHY CHECK PACKAGE...: add the packages unless the command CHECK succeeds.
# (A CHECK that pipes into `grep -q` fails under pipefail when grep exits
# before the writer is done: the writer dies of SIGPIPE. Let grep read all.)
want() {
  local why=$1 check=$2
  shift 2
  if ! eval "$check" >/dev/null 2>&1; then
    packages+=("$@")
    reasons+=("  $*: $why")
  fi
}

[ $# -gt 0 ] || { echo "usage: scripts/bootstrap.sh build|test|bench..." >&2; exit 2; }
for target in "$@"; do
  case $target in
    build)
      want "a C toolchain links the Rust extension" "has cc" build-essential
      want "Python's venv module makes .venv" "python3 -c 'import venv, ensurepip'" python3-venv
      want "rustup is fetched over HTTPS" "has curl && test -s /etc/ssl/certs/ca-certificates.crt" \
        curl ca-certificates
      ;;
    test)
      want "the cluster tests start real etcd members" "has etcd" etcd-server
      want "the partition test puts a node in a network namespace (ip netns)" "has ip" iproute2
      want "test_dashboard.py loads /dashboard in headless Chromium" "has chromium || has chromium-browser" chromium
      want "test_prometheus.py scrapes a node with a real Prometheus" "has prometheus" prometheus
      want "the AudioQuery tests speak their questions" "has espeak-ng" espeak-ng
      want "the image test runs the Dockerfile's steps on a Debian root it makes" "has debootstrap" debootstrap
      want "Triton's perf_analyzer (a gRPC test, bench/perf_analyzer.py) links it" \
        "ldconfig -p | grep libb64.so.0d" libb64-0d
      ;;
    bench)
      want "the store benchmarks run the same loads against a real Redis" "has redis-server" redis-server
      want "the cluster benchmarks start a real etcd" "has etcd" etcd-server
      ;;
    *)
      echo "bootstrap: unknown target '$target' (known: build, test, bench)" >&2
      exit 2
      ;;
  esac
done

if [ ${#packages[@]} -gt 0 ]; then
  echo "bootstrap ($*): installing, without recommended packages:"
  printf '%s\n' "${reasons[@]}"
  if ! has apt-get; then
    echo "bootstrap: no apt-get here; please install: ${packages[*]}" >&2
    exit 1
  fi
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}"
fi

if [[ " $* " == *" build "* ]] && ! has cargo && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
  echo "bootstrap (build): installing Rust with rustup: the node and the extension are Rust"
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal -c clippy,rustfmt
fi
