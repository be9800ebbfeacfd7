"""Which paths of a root filesystem tell its C library, what each says, and what one layer
contributes to the libc verdict (`LayerEvidence`, cacheable by layer digest). Pure; the merged
view and the verdict are `scanner.layers.libc`.

The paths: the probed binaries (`PROBES`, and any shell-like name in `BIN_DIRS`), whose ELF
interpreter names the libc (`classify_interpreter`); the dynamic loaders in library directories
(`loader_flavour`); os-release (`parse_os_release`); and the directories above them, whose
symlinks (usrmerge) a path resolves through (`ANCESTORS`, the triplet dirs).
"""

from __future__ import annotations

import posixpath
import re
from typing import Literal

from pydantic import BaseModel, Field

from scanner.layers.elf import ElfInfo
from scanner.layers.tarstream import EntryKind

EVIDENCE_SCHEMA = 1

BIN_DIRS = frozenset({"/bin", "/sbin", "/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin"})
# Binaries whose interpreter names the system libc; /bin/sh first (uv's order, plus multi-call tools).
PROBES = (
    "/bin/sh",
    "/usr/bin/env",
    "/bin/busybox",
    "/bin/bash",
    "/bin/dash",
    "/usr/bin/python3",
    "/usr/local/bin/python3",
    "/bin/ls",
    "/usr/bin/perl",
)
_PROBE_NAME = re.compile(
    r"^(sh|bash|dash|ash|zsh|mksh|busybox|toybox|coreutils|env|ls|perl|python3?(\.\d+)?)$"
)
OS_RELEASE_PATHS = ("/etc/os-release", "/usr/lib/os-release")
ANCESTORS = frozenset(
    {"/", "/etc", "/usr", "/usr/local"}
    | BIN_DIRS
    | {"/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32"}
)
_LIB_DIR = re.compile(r"^(/usr)?/lib(32|64|x32)?(/[^/]+-linux-[^/]+)?$")
TRIPLET_DIR = re.compile(r"^(/usr)?/lib/[^/]+-linux-[^/]+$")
_GLIBC_LOADER = re.compile(r"^(ld-linux[^/]*\.so\.\d+|ld64\.so\.\d+)$")
_MUSL_LOADER = re.compile(r"^ld-musl-[^/]+\.so\.1$")


def classify_interpreter(path: str) -> Literal["glibc", "musl"] | None:
    """The libc an ELF interpreter path names, or None for anything else."""
    name = posixpath.basename(path)
    if name.startswith("ld-musl-"):
        return "musl"
    if _GLIBC_LOADER.match(name):
        return "glibc"
    return None


def loader_flavour(path: str) -> Literal["glibc", "musl"] | None:
    """glibc/musl when `path` is a dynamic loader in a library directory."""
    directory, name = posixpath.split(path)
    if not _LIB_DIR.match(directory):
        return None
    if _MUSL_LOADER.match(name):
        return "musl"
    if _GLIBC_LOADER.match(name):
        return "glibc"
    return None


def parse_os_release(text: str) -> str | None:
    """PRETTY_NAME, else `ID VERSION_ID`, else NAME, from os-release text."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, equals, value = line.strip().partition("=")
        if not equals or not key or key.startswith("#"):
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key] = re.sub(r"\\(.)", r"\1", value)
    if values.get("PRETTY_NAME"):
        return values["PRETTY_NAME"]
    if values.get("ID"):
        return " ".join(v for v in (values["ID"], values.get("VERSION_ID", "")) if v)
    return values.get("NAME") or None


def is_probe(path: str) -> bool:
    directory, name = posixpath.split(path)
    return directory in BIN_DIRS and bool(_PROBE_NAME.match(name))


def is_relevant(path: str) -> bool:
    return (
        path in ANCESTORS
        or bool(TRIPLET_DIR.match(path))
        or is_probe(path)
        or loader_flavour(path) is not None
        or path in OS_RELEASE_PATHS
    )


class PathRecord(BaseModel):
    """One relevant entry of a layer.

    `target`: a symlink's target as stored, or the member a hardlink names. `probed`: the
    file's head was read; then `elf` is its ELF header (None: not ELF, e.g. a script).
    """

    kind: EntryKind
    target: str | None = None
    probed: bool = False
    elf: ElfInfo | None = None
    os_release: str | None = None


class LayerEvidence(BaseModel):
    """What one layer contributes to the libc verdict; cacheable by layer digest."""

    schema_version: int = EVIDENCE_SCHEMA
    complete: bool = Field(default=False, description="the layer was read to its end")
    entries: dict[str, PathRecord] = Field(default_factory=dict)
    whiteouts: list[str] = Field(default_factory=list, description="paths deleted from lower layers")
    opaque_dirs: list[str] = Field(default_factory=list, description="dirs whose lower content is hidden")
