#!/bin/sh
# Build gpubadge's air-gapped base images from Debian packages: no container registry involved.
#
#   deploy/airgapped/base.sh TAG_PREFIX      (run as root; needs debootstrap and a Debian mirror)
#
# debootstrap (minbase) makes one root tree with python3 and ca-certificates plus python3-venv;
# it is saved twice, as plain tarballs cached in $GPUBADGE_CACHE (default ~/.cache/gpubadge):
#   *-build.tar  the tree as made: the Dockerfile's build stage creates its venv here
#   *-base.tar   the same tree without python3-venv and pip's bundled wheels: the final stage
# The venv's interpreter is /usr/bin/python3 in both, so the venv copied between them runs.
# The suite defaults to the host's own (VERSION_CODENAME), because the wheelhouse is resolved by
# the host's pip for the host's Python: the base must run that same Python minor version.
# Each tarball is then `docker import`ed as TAG_PREFIX-base:SUITE and TAG_PREFIX-build:SUITE into
# the daemon DOCKER_HOST names (skipped when that tag is already there). A cached tarball is
# reused as is; delete $GPUBADGE_CACHE/SUITE-ARCH-*.tar to refresh the base's packages.
set -eu
prefix=${1:-gpubadge}
. /etc/os-release
suite=${GPUBADGE_BASE_SUITE:-${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release; set GPUBADGE_BASE_SUITE}}
mirror=${GPUBADGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${GPUBADGE_CACHE:-$HOME/.cache/gpubadge}
docker=${DOCKER:-docker}
arch=$(dpkg --print-architecture)
key="$cache/$suite-$arch"

if [ ! -s "$key-base.tar" ] || [ ! -s "$key-build.tar" ]; then
    command -v debootstrap >/dev/null || { echo "base.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
    mkdir -p "$cache"
    work=$(mktemp -d "$cache/root.XXXXXX")
    # debootstrap mounts /proc and /sys inside the tree while it works: never rm -rf through a mount.
    trap 'grep -o " $work/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l; rm -rf --one-file-system "$work"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$suite" "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1 \
        || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
    root="$work/root"
    # Nothing the image needs: package caches and lists, documentation, manuals, translations.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/*
    find "$root/usr/lib/python3" "$root"/usr/lib/python3.* -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null || true
    tar --numeric-owner -C "$root" -cf "$work/build.tar" .
    chroot "$root" dpkg --purge python3-venv "$(chroot "$root" sh -c 'ls /usr/bin/python3.*[0-9]' | sed 's|/usr/bin/||')-venv" \
        python3-pip-whl python3-setuptools-whl >"$work/purge.log" 2>&1 || { cat "$work/purge.log" >&2; exit 1; }
    rm -rf "$root"/var/log/* "$root"/var/cache/debconf/*-old "$root"/var/lib/dpkg/*-old
    tar --numeric-owner -C "$root" -cf "$work/base.tar" .
    mv "$work/build.tar" "$key-build.tar"
    mv "$work/base.tar" "$key-base.tar"
fi

for kind in base build; do
    tag="$prefix-$kind:$suite"
    if ! $docker image inspect "$tag" >/dev/null 2>&1; then
        $docker import "$key-$kind.tar" "$tag" >/dev/null
    fi
    echo "$tag"
done
