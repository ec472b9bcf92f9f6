#!/usr/bin/env bash
# Make the container tier's base image, localhost/debian-python:bookworm, without a registry: a Debian
# minbase root file system with python3 and venv, made by debootstrap and imported into podman.
# Idempotent and cached; a rerun is a fast no-op.
#
#   scripts/container/base_image.sh          # prints the image name on its last line
#
# Cache:  the image in podman's store, labelled igw.base-key=<key>; the root file system tarball in
#         ${IGW_CACHE:-$HOME/.cache/igw}/debian-python/rootfs-<key>.tar (so a wiped podman store is
#         re-imported in seconds). <key> hashes everything that shapes the image (suite, variant,
#         packages, this script's version), so changing any of them builds a new one.
# Needs:  root, podman, runc, debootstrap (`make container-deps` installs them on Debian).
set -euo pipefail

SUITE="bookworm"
VARIANT="minbase"
INCLUDE="python3,python3-venv,ca-certificates"
MIRROR="${IGW_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
IMAGE="localhost/debian-python:$SUITE"
RECIPE_VERSION=1  # bump when the steps below change what the image holds

cache="${IGW_CACHE:-$HOME/.cache/igw}/debian-python"
key="$(printf '%s|%s|%s|%s|%s' "$RECIPE_VERSION" "$SUITE" "$VARIANT" "$INCLUDE" "$MIRROR" | sha256sum | cut -c1-16)"
tarball="$cache/rootfs-$key.tar"
podman=(podman --runtime /usr/sbin/runc)

log() { printf '[base_image %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

mkdir -p "$cache"
exec 9>"$cache/.lock"  # two test sessions starting at once build it once
flock 9

if "${podman[@]}" image exists "$IMAGE" \
  && [[ "$("${podman[@]}" image inspect --format '{{index .Labels "igw.base-key"}}' "$IMAGE")" == "$key" ]]; then
  log "cached: $IMAGE (key $key)"
  echo "$IMAGE"
  exit 0
fi

if [[ ! -s "$tarball" ]]; then
  t0=$SECONDS
  root="$(mktemp -d "$cache/rootfs.XXXXXX")"
  trap 'rm -rf "$root" "$tarball.tmp"' EXIT
  log "debootstrap --variant=$VARIANT --include=$INCLUDE $SUITE (about a minute)"
  if ! debootstrap --variant="$VARIANT" --include="$INCLUDE" "$SUITE" "$root" "$MIRROR" >"$cache/debootstrap.log" 2>&1; then
    tail -n 20 "$cache/debootstrap.log" >&2
    log "debootstrap failed (full log: $cache/debootstrap.log)"
    exit 1
  fi
  # What a container image needs no copy of: downloaded packages and package lists.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
  tar --numeric-owner -C "$root" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$root"
  trap - EXIT
  log "root file system: $tarball ($(du -h "$tarball" | cut -f1), $((SECONDS - t0)) s)"
fi

log "podman import -> $IMAGE"
"${podman[@]}" import --quiet \
  --change "LABEL igw.base-key=$key" \
  --change "ENV LANG=C.UTF-8" \
  --change 'CMD ["/bin/bash"]' \
  "$tarball" "$IMAGE" >/dev/null
echo "$IMAGE"
