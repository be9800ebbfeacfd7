#!/bin/sh
# The air-gapped base image, made from Debian packages: no container registry involved.
#
#   deploy/airgapped/base.sh [TAG_NAME]      (root; needs debootstrap and a Debian mirror on first use)
#
# debootstrap (--variant=minbase) makes a root tree with python3 and ca-certificates, trimmed of
# package caches, documentation, manuals and translations, and saves it as a tarball cached in
# $GPUBADGE_CACHE (default ~/.cache/gpubadge): later runs skip debootstrap. The suite defaults to the
# host's own (VERSION_CODENAME of /etc/os-release) because the wheelhouse is resolved by the host's
# pip: the base must run the same Python minor version (bookworm: 3.11). The tarball is then
# `docker import`ed as TAG_NAME:SUITE (default gpubadge-base) into the daemon DOCKER_HOST names,
# unless that tag is already there, and the tag is printed. Delete the tarball to refresh the packages.
set -eu
name=${1:-gpubadge-base}
. /etc/os-release
suite=${GPUBADGE_BASE_SUITE:-${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release: set GPUBADGE_BASE_SUITE}}
mirror=${GPUBADGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${GPUBADGE_CACHE:-$HOME/.cache/gpubadge}
docker=${DOCKER:-docker}
tarball="$cache/$suite-$(dpkg --print-architecture)-base.tar"

if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || { echo "base.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
    mkdir -p "$cache"
    work=$(mktemp -d "$cache/root.XXXXXX")
    # debootstrap mounts /proc and /sys inside the tree while it works: never rm -rf through a mount.
    trap 'grep -o " $work/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l; rm -rf --one-file-system "$work"' EXIT
    root="$work/root"
    # Two stages, so that dpkg skips its fsync()s while it configures (force-unsafe-io): the tree is
    # thrown away if this fails, and tar reads it afterwards. That halves the second stage on a busy disk.
    debootstrap --foreign --variant=minbase --include=python3,ca-certificates "$suite" "$root" "$mirror" \
        >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
    mkdir -p "$root/etc/dpkg/dpkg.cfg.d" && echo force-unsafe-io >"$root/etc/dpkg/dpkg.cfg.d/gpubadge-unsafe-io"
    chroot "$root" /debootstrap/debootstrap --second-stage \
        >>"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
    rm -f "$root/etc/dpkg/dpkg.cfg.d/gpubadge-unsafe-io"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/*
    tar --numeric-owner -C "$root" -cf "$work/base.tar" .
    mv "$work/base.tar" "$tarball"
fi

tag="$name:$suite"
$docker image inspect "$tag" >/dev/null 2>&1 || $docker import "$tarball" "$tag" >/dev/null
echo "$tag"
