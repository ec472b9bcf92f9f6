#!/usr/bin/env bash
# Real Prometheus and promtool for the tests, without installing a system service: Debian's
# `prometheus` package (2.42 in bookworm) is downloaded with `apt-get download` and unpacked with
# `dpkg-deb -x` into ~/.cache/igw/prometheus. Idempotent: once the binaries are cached and run, a
# second call only checks them. Prints the directory that holds `prometheus` and `promtool`.
set -euo pipefail

DEST="${XDG_CACHE_HOME:-$HOME/.cache}/igw/prometheus"
BIN="$DEST/usr/bin"

if [ -x "$BIN/prometheus" ] && [ -x "$BIN/promtool" ] && "$BIN/promtool" --version >/dev/null 2>&1; then
  echo "$BIN"
  exit 0
fi

command -v apt-get >/dev/null || { echo "fetch.sh: needs apt-get (Debian) to download prometheus" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
# apt-get download needs package lists; on a fresh machine they may be missing or stale.
if ! apt-get download -qq prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq >/dev/null; fi
  apt-get download -qq prometheus >/dev/null 2>&1 || {
    echo "fetch.sh: 'apt-get download prometheus' failed (try: apt-get update; apt-cache policy prometheus)" >&2
    exit 1; }
fi
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
dpkg-deb -x prometheus_*.deb "$DEST.tmp"
"$DEST.tmp/usr/bin/promtool" --version >/dev/null
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo "$BIN"
