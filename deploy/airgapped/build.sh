#!/bin/sh
# `make image-airgapped`: build the gpubadge image with no container registry and no network in the build.
#
#   deploy/airgapped/build.sh [IMAGE]        (default gpubadge:latest; the daemon DOCKER_HOST names)
#
# 1. the base: deploy/airgapped/base.sh (debootstrapped from Debian packages, cached);
# 2. the wheelhouse, build/wheelhouse: the dependencies resolved by the pip index configured on this
#    host (pip.conf, PIP_INDEX_URL: a mirror inside the air gap), plus pip itself to install them.
#    They are cached in $GPUBADGE_CACHE/wheels-HASH, keyed by pyproject.toml and the Python version;
#    gpubadge's own wheel is built fresh every time;
# 3. `docker build --network none` of the same Dockerfile as the online build, with BASE and
#    WHEELHOUSE set: the build stage installs from the wheelhouse only (pip --no-index).
set -eu
image=${1:-gpubadge:latest}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=${PYTHON:-python3}
docker=${DOCKER:-docker}
cache=${GPUBADGE_CACHE:-$HOME/.cache/gpubadge}

# The base (debootstrap: mostly downloads and dpkg) and the wheels (pip) are made side by side.
mkdir -p "$cache"
base_log=$(mktemp)
trap 'rm -f "$base_log"' EXIT
DOCKER="$docker" GPUBADGE_CACHE="$cache" "$here/base.sh" gpubadge-base >"$base_log" 2>&1 &
base_pid=$!

tag=$($python -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
deps="$cache/wheels-$tag-$(sha256sum <"$repo/pyproject.toml" | cut -c1-16)"
if [ ! -d "$deps" ]; then
    fresh=$(mktemp -d "$cache/wheels.XXXXXX")
    $python -m pip wheel --quiet --wheel-dir "$fresh" "$repo" pip
    rm -f "$fresh"/gpubadge-*.whl
    mv "$fresh" "$deps"
fi
wheelhouse="$repo/build/wheelhouse"
# setuptools would reuse stale files left in build/lib by an earlier wheel build
rm -rf "$wheelhouse" "$repo/build/lib" "$repo"/build/bdist.*
mkdir -p "$wheelhouse"
cp "$deps"/*.whl "$wheelhouse"/
$python -m pip wheel --quiet --no-deps --wheel-dir "$wheelhouse" "$repo"
wait "$base_pid" || { cat "$base_log" >&2; exit 1; }
base=$(tail -n 1 "$base_log")

$docker build --network none --build-arg BASE="$base" --build-arg WHEELHOUSE=build/wheelhouse \
    -t "$image" "$repo"
