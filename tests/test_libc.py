"""libc verdicts from streamed layers, top-down, with whiteouts, symlinks, early stop and the cache."""

from __future__ import annotations

import gzip
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from fixtures.oci import (
    LAYER_MEDIA_TYPES,
    Compression,
    Entry,
    compress,
    directory,
    fake_elf,
    file,
    opaque,
    symlink,
    tar_bytes,
    whiteout,
)
from scanner.layers.errors import CorruptLayer
from scanner.layers.libc import LibcAnalysis, analyse_layer, combine
from scanner.layers.libc_paths import LayerEvidence, parse_os_release
from scanner.layers.tarstream import TarEntry
from scanner.models import LibcVerdict

GiB = 1 << 30
GLIBC_X86 = "/lib64/ld-linux-x86-64.so.2"
MUSL_X86 = "/lib/ld-musl-x86_64.so.1"

UBUNTU = [
    directory("/usr"),
    directory("/usr/bin"),
    directory("/usr/lib"),
    directory("/usr/lib64"),
    directory("/usr/lib/x86_64-linux-gnu"),
    symlink("/bin", "usr/bin"),
    symlink("/lib", "usr/lib"),
    symlink("/lib64", "usr/lib64"),
    directory("/etc"),
    symlink("/etc/os-release", "../usr/lib/os-release"),
    file("/usr/bin/bash", fake_elf(GLIBC_X86, padding=200)),
    file("/usr/bin/dash", fake_elf(GLIBC_X86)),
    symlink("/usr/bin/sh", "dash"),
    file("/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", fake_elf(None)),
    symlink("/usr/lib64/ld-linux-x86-64.so.2", "../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"),
    file(
        "/usr/lib/os-release",
        'NAME="Ubuntu"\nVERSION_ID="22.04"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\nID=ubuntu\n',
    ),
]
ALPINE = [
    directory("/bin"),
    directory("/lib"),
    directory("/etc"),
    file("/bin/busybox", fake_elf(MUSL_X86)),
    symlink("/bin/sh", "/bin/busybox"),
    file(MUSL_X86, fake_elf(None)),
    symlink("/lib/libc.musl-x86_64.so.1", "ld-musl-x86_64.so.1"),
    file("/etc/os-release", "ID=alpine\nVERSION_ID=3.20.3\n"),
]
CUDA_LAYER = [
    directory("/usr/local/cuda-12.2/lib64"),
    file("/usr/local/cuda-12.2/lib64/libcudart.so.12", os.urandom(4096)),
    symlink("/usr/local/cuda", "cuda-12.2"),
]


@dataclass
class Run:
    verdict: LibcVerdict
    evidences: list[LayerEvidence]
    pulled: list[int]  # compressed bytes pulled per streamed layer


async def chunked(blob: bytes, counter: list[int], index: int, size: int = 65536) -> AsyncIterator[bytes]:
    for start in range(0, len(blob), size):
        counter[index] += len(blob[start : start + size])
        yield blob[start : start + size]


async def analyse(
    layers_top_down: list[list[Entry]], compression: Compression = "gzip", arch: str = "amd64"
) -> Run:
    """Stream each layer (top first) through the analysis, the way the orchestrator does."""
    analysis = LibcAnalysis(arch, layers_total=len(layers_top_down))
    evidences: list[LayerEvidence] = []
    pulled = [0] * len(layers_top_down)
    for index, entries in enumerate(layers_top_down):
        if analysis.decided:
            break
        blob = compress(tar_bytes(entries), compression)
        evidence = await analyse_layer(analysis, chunked(blob, pulled, index), LAYER_MEDIA_TYPES[compression])
        evidences.append(evidence)
    return Run(analysis.verdict(), evidences, pulled)


@pytest.mark.parametrize("compression", ["gzip", "zstd", "none"])
async def test_cuda_on_ubuntu_is_glibc_through_usrmerge_symlinks(compression: Compression) -> None:
    run = await analyse([CUDA_LAYER, CUDA_LAYER, UBUNTU], compression)
    assert run.verdict.flavour == "glibc"
    # bash decides first; reading on (cheaply) for os-release also reaches sh, the preferred probe.
    assert run.verdict.evidence == f"/bin/sh -> /usr/bin/dash: ELF interpreter {GLIBC_X86}"
    assert run.verdict.distro == "Ubuntu 22.04.4 LTS"
    assert not run.verdict.musl_also
    assert run.verdict.layers_read == run.verdict.layers_total == 3


@pytest.mark.parametrize("compression", ["gzip", "zstd", "none"])
async def test_alpine_is_musl_through_the_busybox_symlink(compression: Compression) -> None:
    run = await analyse([ALPINE], compression)
    assert run.verdict.flavour == "musl"
    assert run.verdict.evidence == f"/bin/sh -> /bin/busybox: ELF interpreter {MUSL_X86}"
    assert run.verdict.distro == "alpine 3.20.3"


async def test_arm64_alpine_with_a_relative_busybox_link() -> None:
    loader = "/lib/ld-musl-aarch64.so.1"
    # The link comes first in the archive, so the shell is what resolves first.
    layer = [
        symlink("/bin/sh", "busybox"),
        file("/usr/bin/tool", b"x"),
        file("/bin/busybox", fake_elf(loader, arch="arm64")),
    ]
    run = await analyse([layer], arch="arm64")
    assert (run.verdict.flavour, run.verdict.evidence) == (
        "musl",
        f"/bin/sh -> /bin/busybox: ELF interpreter {loader}",
    )


async def test_static_scratch_image_has_no_libc() -> None:
    run = await analyse(
        [[file("/app", fake_elf(None, padding=100)), file("/etc/passwd", "root:x:0:0::/:/app\n")]]
    )
    assert run.verdict.flavour == "none"
    assert run.verdict.evidence == "no ELF interpreter or C library loader in any layer"


async def test_distroless_static_reports_its_distro_and_no_libc() -> None:
    run = await analyse(
        [
            [file("/app/server", fake_elf(None))],
            [file("/etc/os-release", 'PRETTY_NAME="Distroless"\n'), directory("/tmp")],
        ]
    )
    assert (run.verdict.flavour, run.verdict.distro) == ("none", "Distroless")


async def test_distroless_base_without_a_shell_is_glibc_by_its_loader() -> None:
    base = [
        directory("/lib/x86_64-linux-gnu"),
        file("/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", fake_elf(None)),
        symlink(GLIBC_X86, "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"),
    ]
    run = await analyse([[file("/app", fake_elf(GLIBC_X86))], base])
    assert run.verdict.flavour == "glibc"
    assert run.verdict.evidence in (
        f"loader {GLIBC_X86}",
        "loader /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    )


async def test_a_musl_loader_deleted_by_a_whiteout_does_not_count() -> None:
    lower = [file(MUSL_X86, fake_elf(None)), file("/bin/tool", fake_elf(None))]
    run = await analyse([[whiteout(MUSL_X86)], lower])
    assert run.verdict.flavour == "none"
    with_glibc = [*lower, file(GLIBC_X86, fake_elf(None))]
    run = await analyse([[whiteout(MUSL_X86)], with_glibc])
    assert (run.verdict.flavour, run.verdict.musl_also) == ("glibc", False)


async def test_a_whited_out_shell_falls_back_to_the_lower_truth() -> None:
    # The upper layer deletes busybox and sh; the glibc loader left behind decides.
    lower = [*ALPINE, file(GLIBC_X86, fake_elf(None))]
    run = await analyse([[whiteout("/bin/sh"), whiteout("/bin/busybox"), whiteout(MUSL_X86)], lower])
    assert run.verdict.flavour == "glibc" and run.verdict.evidence == f"loader {GLIBC_X86}"


async def test_an_opaque_dir_hides_lower_loaders_but_not_its_own() -> None:
    upper = [directory("/lib"), opaque("/lib"), file("/lib/ld-linux-x86-64.so.2", fake_elf(None))]
    run = await analyse([upper, [file(MUSL_X86, fake_elf(None))]])
    assert run.verdict.flavour == "glibc"
    assert run.verdict.evidence == "loader /lib/ld-linux-x86-64.so.2" and not run.verdict.musl_also


async def test_glibc_with_the_musl_package_installed() -> None:
    musl_package = [
        directory("/usr/lib/x86_64-linux-musl"),
        file("/usr/lib/x86_64-linux-musl/libc.so", fake_elf(None)),
        symlink(MUSL_X86, "/usr/lib/x86_64-linux-musl/libc.so"),
    ]
    run = await analyse([musl_package, UBUNTU])
    assert run.verdict.flavour == "glibc" and run.verdict.musl_also
    assert run.verdict.evidence == f"/bin/sh -> /usr/bin/dash: ELF interpreter {GLIBC_X86}"


async def test_alpine_with_a_glibc_compat_package_stays_musl_by_its_shell() -> None:
    run = await analyse([[file(GLIBC_X86, fake_elf(None))], ALPINE])
    assert run.verdict.flavour == "musl"
    assert (
        run.verdict.evidence is not None and f"glibc loader {GLIBC_X86} also present" in run.verdict.evidence
    )


async def test_an_upper_layer_shadows_the_lower_shell() -> None:
    upper = [symlink("/bin/sh", "zsh"), file("/bin/zsh", fake_elf(GLIBC_X86))]
    run = await analyse([upper, ALPINE])
    assert run.verdict.flavour == "glibc"
    assert run.verdict.evidence == f"/bin/sh -> /bin/zsh: ELF interpreter {GLIBC_X86}"
    assert len(run.evidences) == 1 and run.pulled[1] == 0  # decided in the top layer


async def test_busybox_image_with_hardlinked_applets() -> None:
    layer = [
        directory("/bin"),
        file("/bin/[", fake_elf(GLIBC_X86)),
        Entry("/bin/sh", kind="hardlink", target="/bin/["),
        file("/lib/ld-linux-x86-64.so.2", fake_elf(None)),
    ]
    run = await analyse([layer])
    assert (run.verdict.flavour, run.verdict.evidence) == ("glibc", f"/bin/sh: ELF interpreter {GLIBC_X86}")


async def test_a_python_binary_in_an_upper_layer_decides_early() -> None:
    top = [directory("/usr/local/bin"), file("/usr/local/bin/python3.12", fake_elf(MUSL_X86))]
    top.append(symlink("/usr/local/bin/python3", "python3.12"))
    run = await analyse([top, ALPINE])
    assert run.verdict.flavour == "musl" and run.pulled[1] == 0
    assert (
        run.verdict.evidence
        == f"/usr/local/bin/python3 -> /usr/local/bin/python3.12: ELF interpreter {MUSL_X86}"
    )


async def test_scripts_and_static_shells_are_not_evidence() -> None:
    layer = [
        file("/bin/sh", "#!/bin/busybox sh\n"),
        file("/bin/busybox", fake_elf(None)),
        file(MUSL_X86, b""),
    ]
    run = await analyse([layer])
    assert (run.verdict.flavour, run.verdict.evidence) == ("musl", f"loader {MUSL_X86}")


async def test_a_garbage_elf_shell_without_loaders_is_unknown() -> None:
    run = await analyse([[file("/bin/sh", b"\x7fELF\x02\x01" + os.urandom(10))]])
    assert run.verdict.flavour == "unknown"
    assert run.verdict.evidence is not None and "/bin/sh: unreadable ELF header" in run.verdict.evidence


async def test_a_large_layer_is_not_read_past_the_evidence() -> None:
    big = [*ALPINE, file("/var/blob", os.urandom(8 << 20)), file("/usr/bin/late", b"x")]
    blob = compress(tar_bytes(big), "gzip")
    analysis = LibcAnalysis("amd64", layers_total=2)
    pulled = [0, 0]
    evidence = await analyse_layer(analysis, chunked(blob, pulled, 0), LAYER_MEDIA_TYPES["gzip"])
    assert analysis.decided and not evidence.complete
    assert pulled[0] <= 2 * 65536 < len(blob) // 50
    assert analysis.verdict().flavour == "musl" and analysis.verdict().distro == "alpine 3.20.3"


async def test_looking_for_the_distro_after_the_verdict_is_bounded() -> None:
    shell = [file("/bin/busybox", fake_elf(MUSL_X86)), symlink("/bin/sh", "busybox")]
    big = [*shell, file("/var/blob", os.urandom(50 << 20)), file("/etc/os-release", "ID=alpine\n")]
    blob = gzip.compress(tar_bytes(big), compresslevel=1)  # incompressible anyway; level 1 is faster
    analysis = LibcAnalysis("amd64", layers_total=1)
    pulled = [0]
    budget = 4 << 20
    evidence = await analyse_layer(analysis, chunked(blob, pulled, 0), "", distro_budget=budget)
    assert not evidence.complete
    assert budget < pulled[0] <= budget + 3 * 65536 < len(blob) // 10
    verdict = analysis.verdict()
    assert (verdict.flavour, verdict.distro) == ("musl", None)


async def test_a_corrupt_layer_before_any_evidence_leaves_the_verdict_unknown() -> None:
    analysis = LibcAnalysis("amd64", layers_total=2)
    blob = compress(tar_bytes(CUDA_LAYER), "gzip")[:-40]
    with pytest.raises(CorruptLayer):
        await analyse_layer(analysis, chunked(blob, [0], 0), LAYER_MEDIA_TYPES["gzip"])
    assert not analysis.decided
    assert analysis.verdict().flavour == "unknown"


async def test_layer_evidence_round_trips_through_the_cache() -> None:
    run = await analyse([CUDA_LAYER, UBUNTU])
    # Both small layers end inside one decompressed slice, so both are read to the end.
    assert run.evidences[0].complete and run.evidences[1].complete
    cached = [LayerEvidence.model_validate_json(e.model_dump_json()) for e in run.evidences]
    assert combine(cached).model_dump(exclude={"bytes_read"}) == run.verdict.model_dump(
        exclude={"bytes_read"}
    )

    # A new image on the same base: its own top layer streamed, the base from the cache.
    analysis = LibcAnalysis("amd64", layers_total=2)
    pulled = [0, 0]
    blob = compress(tar_bytes([file("/srv/app.py", "print(1)\n")]), "gzip")
    await analyse_layer(analysis, chunked(blob, pulled, 0), LAYER_MEDIA_TYPES["gzip"])
    assert not analysis.decided
    assert analysis.layer_from_cache(cached[1])
    assert analysis.decided and analysis.verdict().flavour == "glibc"


async def test_partial_evidence_is_reused_only_when_it_decides() -> None:
    big = [*ALPINE, file("/var/blob", os.urandom(1 << 20))]
    first = await analyse([big])
    partial = first.evidences[0]
    assert not partial.complete and first.verdict.flavour == "musl"

    # Same base under an image whose top layer deleted the shell: partial evidence is not enough.
    analysis = LibcAnalysis("amd64", layers_total=2)
    blob = compress(tar_bytes([whiteout("/bin/sh"), whiteout("/bin/busybox")]), "gzip")
    await analyse_layer(analysis, chunked(blob, [0], 0), LAYER_MEDIA_TYPES["gzip"])
    assert analysis.layer_from_cache(partial) is False
    assert analysis.layers_read == 1

    # Under an unrelated top layer the partial evidence decides on its own.
    fresh = LibcAnalysis("amd64", layers_total=1)
    assert fresh.layer_from_cache(partial) and fresh.verdict().flavour == "musl"


def test_os_release_parsing() -> None:
    assert parse_os_release('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\n') == (
        "Debian GNU/Linux 12 (bookworm)"
    )
    assert parse_os_release("ID='rocky'\nVERSION_ID=\"9.3\"\n") == "rocky 9.3"
    assert parse_os_release("garbage\n\0\n") is None


# ------------------------------------------------------------------ incremental = from scratch

# A small vocabulary of paths and entries, so random stacks of layers keep hitting the probes, their
# directories, links between them, whiteouts and opaque directories.
_DIRS = ["/bin", "/usr/bin", "/lib", "/lib64", "/usr/lib", "/etc", "/usr"]
_FILES = [
    "/bin/sh",
    "/bin/busybox",
    "/bin/bash",
    "/usr/bin/env",
    "/usr/bin/python3",
    "/usr/bin/busybox",
    MUSL_X86,
    GLIBC_X86,
    "/usr/lib/ld-musl-x86_64.so.1",
    "/etc/os-release",
    "/usr/lib/os-release",
]
_TARGETS = [
    "busybox",
    "bash",
    "/bin/busybox",
    "../usr/bin/python3",
    "sh",
    "usr/bin",
    "/usr/lib",
    "../usr/lib/os-release",
]
_HEADS = {
    "glibc": fake_elf(GLIBC_X86),
    "musl": fake_elf(MUSL_X86),
    "static": fake_elf(None),
    "text": b"#!/bin/sh\n",
    "alpine": b"ID=alpine\nVERSION_ID=3.20.1\n",
    "debian": b"ID=debian\nVERSION_ID=12\n",
}


def _random_entry(rng: random.Random, earlier: list[str]) -> tuple[TarEntry, bytes]:
    roll = rng.random()
    if roll < 0.12:
        directory_path = rng.choice(_DIRS)
        return TarEntry(f"{directory_path}/.wh..wh..opq", "file", 0, 0o644), b""
    if roll < 0.27:
        path = rng.choice(_DIRS + _FILES)
        parent, name = path.rsplit("/", 1)
        return TarEntry(f"{parent}/.wh.{name}", "file", 0, 0o644), b""
    if roll < 0.37:
        return TarEntry(rng.choice(_DIRS), "dir", 0, 0o755), b""
    path = rng.choice(_DIRS + _FILES)
    if roll < 0.55:
        return TarEntry(path, "symlink", 0, 0o777, rng.choice(_TARGETS)), b""
    if roll < 0.62 and earlier:
        return TarEntry(path, "hardlink", 0, 0o755, rng.choice(earlier)), b""
    head = _HEADS[rng.choice(list(_HEADS))]
    return TarEntry(path, "file", len(head), 0o755), head


def _decision(analysis: LibcAnalysis) -> tuple[object, str | None]:
    decision = analysis._current_decision()
    return (decision.flavour, decision.evidence) if decision else None, analysis._distro_found


def _replayed(
    total: int, layers: list[list[tuple[TarEntry, bytes]]], open_layer: list[tuple[TarEntry, bytes]] | None
) -> LibcAnalysis:
    """The same entries into a fresh analysis, with no decision taken along the way."""
    analysis = LibcAnalysis("amd64", layers_total=total)
    for layer in layers:
        collector = analysis.begin_layer()
        for entry, head in layer:
            collector.add(entry, head)
        collector.finish(complete=True)
    if open_layer is not None:
        collector = analysis.begin_layer()
        for entry, head in open_layer:
            collector.add(entry, head)
    return analysis


def test_the_incremental_verdict_is_always_the_one_decided_from_scratch() -> None:
    """The verdict is re-decided only when a change touches a path the last decision looked at. Over
    random stacks of layers (probes, links, loops, hardlinks, whiteouts, opaque directories), streamed
    or taken from the cache, asked after every entry and every layer's end, it always equals a fresh analysis of the same entries
    decided once, and so does the final verdict; and asking costs fewer decisions than entries."""
    rng = random.Random(44)
    asked = decided = 0
    for _ in range(400):
        analysis = LibcAnalysis("amd64", layers_total=rng.randint(2, 5))
        done: list[list[tuple[TarEntry, bytes]]] = []
        for _layer in range(analysis.layers_total):
            entries: list[tuple[TarEntry, bytes]] = []
            for _entry in range(rng.randint(0, 7)):
                earlier = [e.path for e, _ in entries if e.kind == "file"]
                entries.append(_random_entry(rng, earlier))
            if rng.random() < 0.3:  # the layer's evidence from the cache, as a scan of another image left it
                alone = LibcAnalysis("amd64", layers_total=1).begin_layer()
                for entry, head in entries:
                    alone.add(entry, head)
                assert analysis.layer_from_cache(alone.finish(complete=True))
            else:
                collector = analysis.begin_layer()
                for n, (entry, head) in enumerate(entries, 1):
                    collector.add(entry, head)
                    asked += 1
                    replayed = _replayed(analysis.layers_total, done, entries[:n])
                    assert _decision(analysis) == _decision(replayed), (done, entries[:n])
                collector.finish(complete=True)
            done.append(entries)
            asked += 1
            assert _decision(analysis) == _decision(_replayed(analysis.layers_total, done, None)), done
        decided += analysis.decisions
        cached = {"layers_cached"}  # the one field that says how the layers came
        final = _replayed(analysis.layers_total, done, None).verdict()
        assert analysis.verdict().model_dump(exclude=cached) == final.model_dump(exclude=cached)
    assert decided < asked
