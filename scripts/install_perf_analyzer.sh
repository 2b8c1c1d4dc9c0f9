#!/usr/bin/env bash
# Install Triton's perf_analyzer (the benchmark tool Triton and KServe users
# run) under .venv/opt/perf_analyzer, for bench/perf_analyzer.py and the
# test that runs it. It ships as a binary inside the tritonclient 2.41.0
# wheel (later wheels dropped it); without a GPU it needs Debian's
# libb64-0d and the CUDA runtime library from the nvidia-cuda-runtime-cu12
# wheel, which sits beside it. Prints the binary's path; does nothing when
# it is there already.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.venv/opt/perf_analyzer
bin=$dest/perf_analyzer
if [ -x "$bin" ] && [ -e "$dest/lib/libcudart.so.12" ]; then
  echo "$bin"
  exit 0
fi
if ! ldconfig -p 2>/dev/null | grep -q libb64.so.0d; then
  echo "install_perf_analyzer: installing libb64-0d (perf_analyzer links it)" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libb64-0d >&2 \
    || { $SUDO apt-get update -q >&2 && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libb64-0d >&2; }
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "install_perf_analyzer: fetching tritonclient==2.41.0 and nvidia-cuda-runtime-cu12==12.3.101 wheels" >&2
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 -d "$tmp" \
  tritonclient==2.41.0 nvidia-cuda-runtime-cu12==12.3.101 >&2
mkdir -p "$dest/lib"
python3 - "$tmp" "$dest" <<'PY'
import sys, zipfile, pathlib
tmp, dest = map(pathlib.Path, sys.argv[1:])
for whl in tmp.glob("*.whl"):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if name.endswith("/bin/perf_analyzer"):
                (dest / "perf_analyzer").write_bytes(z.read(name))
            elif name.endswith("/libcudart.so.12"):
                (dest / "lib" / "libcudart.so.12").write_bytes(z.read(name))
PY
chmod +x "$bin"
echo "$bin"
