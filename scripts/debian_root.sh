#!/usr/bin/env bash
# A minimal Debian root file system (debootstrap --variant=minbase), the
# base the image test (tests/integration/test_image.py) runs the
# Dockerfile's steps on: what `FROM debian:RELEASE-slim` pulls, made from
# Debian's own archive. Made once per machine and kept (as a container
# engine keeps a pulled base image); the image's steps run on a copy.
#
#   scripts/debian_root.sh RELEASE DEST     e.g. bookworm .venv/opt/rootfs/bookworm
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: scripts/debian_root.sh RELEASE DEST" >&2; exit 2; }
release=$1 dest=$2
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ -x "$dest/bin/sh" ] && [ -f "$dest/.complete" ] && exit 0
command -v debootstrap >/dev/null || { echo "debian_root: debootstrap is missing (scripts/bootstrap.sh test)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "debian_root: debootstrap needs root" >&2; exit 1; }
tmp="$dest.partial"
rm -rf "$tmp"
mkdir -p "$(dirname "$dest")"
echo "debian_root: debootstrap --variant=minbase $release from $mirror (about half a minute)" >&2
log=$(mktemp)
if ! debootstrap --variant=minbase "$release" "$tmp" "$mirror" >"$log" 2>&1; then
  tail -20 "$log" >&2
  rm -rf "$tmp" "$log"
  exit 1
fi
rm -f "$log"
# As Debian's slim images: no package lists, nothing cached.
rm -rf "$tmp"/var/lib/apt/lists/* "$tmp"/var/cache/apt/archives/*.deb
touch "$tmp/.complete"
rm -rf "$dest"
mv "$tmp" "$dest"
