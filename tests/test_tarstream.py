"""The streaming layer reader: tar push parser, decompression, limits, corrupt input; and ELF heads."""

from __future__ import annotations

import gzip
import io
import math
import os
import random
import struct
import tarfile
import zlib
from collections.abc import AsyncIterator

import pytest
import zstandard

from fixtures.oci import LAYER_MEDIA_TYPES, Compression, Entry, compress, fake_elf, file, symlink, tar_bytes
from scanner.layers.elf import parse_elf
from scanner.layers.errors import CorruptLayer
from scanner.layers.limits import AnalysisLimits, LimitExceeded
from scanner.layers.tarstream import (
    StreamStats,
    TarEntry,
    TarParser,
    iter_layer,
    normalise_path,
)

GiB = 1 << 30


async def chunked(blob: bytes, size: int = 65536, pulled: list[int] | None = None) -> AsyncIterator[bytes]:
    for start in range(0, len(blob), size):
        chunk = blob[start : start + size]
        if pulled is not None:
            pulled.append(len(chunk))
        yield chunk


async def read_all(
    blob: bytes, media_type: str = LAYER_MEDIA_TYPES["gzip"], head: int = 4096, limit: int = GiB
) -> tuple[list[tuple[TarEntry, bytes]], StreamStats]:
    stats = StreamStats()
    items = [
        item
        async for item in iter_layer(
            chunked(blob, 1000),
            media_type,
            limits=AnalysisLimits(max_layer_bytes=limit),
            want=lambda _e: head,
            stats=stats,
        )
    ]
    return items, stats


SAMPLE = [
    Entry("/bin", kind="dir"),
    file("/bin/busybox", fake_elf("/lib/ld-musl-x86_64.so.1", padding=5000)),
    symlink("/bin/sh", "/bin/busybox"),
    Entry("/bin/ash", kind="hardlink", target="/bin/busybox"),
    file("/etc/os-release", 'PRETTY_NAME="Alpine Linux v3.20"\n'),
]


@pytest.mark.parametrize("compression", ["gzip", "zstd", "none"])
async def test_entries_and_heads_for_each_compression(compression: Compression) -> None:
    items, stats = await read_all(compress(tar_bytes(SAMPLE), compression), LAYER_MEDIA_TYPES[compression])
    by_path = {entry.path: (entry, head) for entry, head in items}
    assert [entry.path for entry, _ in items] == [
        "/bin",
        "/bin/busybox",
        "/bin/sh",
        "/bin/ash",
        "/etc/os-release",
    ]
    busybox, head = by_path["/bin/busybox"]
    assert busybox.kind == "file" and busybox.size == len(fake_elf("/lib/ld-musl-x86_64.so.1", padding=5000))
    assert len(head) == min(4096, busybox.size) == 4096
    info = parse_elf(head)
    assert (
        info is not None and info.interpreter == "/lib/ld-musl-x86_64.so.1" and info.machine_name == "x86_64"
    )
    assert by_path["/bin/sh"][0].kind == "symlink" and by_path["/bin/sh"][0].linkname == "/bin/busybox"
    assert by_path["/bin/ash"][0].kind == "hardlink" and by_path["/bin/ash"][0].linkname == "/bin/busybox"
    assert by_path["/etc/os-release"][1] == b'PRETTY_NAME="Alpine Linux v3.20"\n'
    assert stats.compression == compression and stats.reached_end and stats.entries == 5


async def test_head_is_only_what_was_asked_and_the_rest_is_skipped() -> None:
    content = bytes(range(256)) * 40
    raw = tar_bytes([file("/a", content), file("/b", b"second")])
    items, _ = await read_all(raw, LAYER_MEDIA_TYPES["none"], head=10)
    assert items[0][1] == content[:10]
    assert items[1][0].path == "/b" and items[1][1] == b"second"[:10]


def test_push_parser_gives_the_same_entries_whatever_the_slicing() -> None:
    raw = tar_bytes([*SAMPLE, file("/x/" + "long-" * 40 + "name", b"z" * 700)])
    whole = TarParser(lambda _e: 100).feed(raw)
    parser = TarParser(lambda _e: 100)
    pieces = [item for offset in range(len(raw)) for item in parser.feed(raw[offset : offset + 1])]
    assert pieces == whole
    assert parser.done
    parser.close()


def test_pax_long_names_and_long_link_targets() -> None:
    long_dir = "/opt/" + "/".join(["segment-with-a-long-name"] * 8)
    target = "/usr/lib/" + "t" * 150
    entries = TarParser(lambda _e: 0).feed(
        tar_bytes([file(f"{long_dir}/f", b"x"), symlink(f"{long_dir}/l", target)])
    )
    assert entries[0][0].path == f"{long_dir}/f"
    assert entries[1][0].path == f"{long_dir}/l" and entries[1][0].linkname == target


def test_gnu_longname_longlink_and_ustar_prefix() -> None:
    buffer = io.BytesIO()
    long_name = "usr/" + "n" * 180
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        info = tarfile.TarInfo(long_name)
        info.size = 3
        archive.addfile(info, io.BytesIO(b"abc"))
        link = tarfile.TarInfo("bin/link")
        link.type, link.linkname = tarfile.SYMTYPE, "../" + "k" * 150
        archive.addfile(link)
    gnu = TarParser(lambda _e: 10).feed(buffer.getvalue())
    assert gnu[0] == (TarEntry("/" + long_name, "file", 3, 0o644), b"abc")
    assert gnu[1][0].linkname == "../" + "k" * 150

    buffer = io.BytesIO()
    prefixed = "a/" * 60 + "leaf"  # > 100 chars, fits name+prefix
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        archive.addfile(tarfile.TarInfo(prefixed))
    assert TarParser(lambda _e: 0).feed(buffer.getvalue())[0][0].path == "/" + prefixed


def test_paths_are_normalised() -> None:
    assert normalise_path("./usr/bin/") == "/usr/bin"
    assert normalise_path("/") == "/" and normalise_path("./") == "/"
    assert normalise_path("a/../../etc//passwd") == "/etc/passwd"


async def test_compression_is_detected_by_magic_not_the_media_type() -> None:
    raw = tar_bytes(SAMPLE)
    for compression, lie in (("gzip", "none"), ("zstd", "gzip"), ("none", "zstd")):
        items, stats = await read_all(compress(raw, compression), LAYER_MEDIA_TYPES[lie])  # type: ignore[arg-type]
        assert stats.compression == compression and len(items) == 5


async def test_multi_member_gzip_is_read_through() -> None:
    raw = tar_bytes(SAMPLE)
    blob = gzip.compress(raw[:700]) + gzip.compress(raw[700:])
    items, _ = await read_all(blob)
    assert len(items) == 5


async def test_multi_frame_zstd_is_read_through() -> None:
    raw = tar_bytes(SAMPLE)
    blob = zstandard.ZstdCompressor().compress(raw[:700]) + zstandard.ZstdCompressor().compress(raw[700:])
    items, _ = await read_all(blob, LAYER_MEDIA_TYPES["zstd"])
    assert len(items) == 5


def _bomb_tar_parts(size: int) -> tuple[bytes, int]:
    info = tarfile.TarInfo("zeros")
    info.size = size
    return info.tobuf(format=tarfile.PAX_FORMAT), size


def _bomb(compression: str, size: int) -> bytes:
    """A tar of one file of `size` zero bytes, compressed: a few KiB per MiB on the wire."""
    header, size = _bomb_tar_parts(size)
    zeros = b"\0" * (1 << 20)
    if compression == "gzip":
        deflater = zlib.compressobj(9, zlib.DEFLATED, 31)
        blob = deflater.compress(header) + b"".join(deflater.compress(zeros) for _ in range(size >> 20))
        return blob + deflater.flush()
    writer = zstandard.ZstdCompressor(level=3).compressobj()
    blob = writer.compress(header) + b"".join(writer.compress(zeros) for _ in range(size >> 20))
    return blob + writer.flush()


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
async def test_a_layer_past_max_layer_bytes_stops_with_the_setting_named(compression: str) -> None:
    blob = _bomb(compression, 128 << 20)
    assert len(blob) < 4 << 20  # small on the wire, 128 MiB inside
    stats = StreamStats()
    limits = AnalysisLimits(max_layer_bytes=16 << 20, max_inflation_ratio=1 << 30)
    with pytest.raises(LimitExceeded, match=r"more than 16,777,216 bytes.*\(GPUBADGE_MAX_LAYER_BYTES\)$"):
        async for _ in iter_layer(
            chunked(blob), LAYER_MEDIA_TYPES[compression], limits=limits, want=lambda _e: 0, stats=stats
        ):
            pass
    assert stats.decompressed_bytes <= (16 << 20) + (256 << 10)


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
async def test_a_decompression_bomb_stops_at_the_inflation_ratio(compression: str) -> None:
    """Past the floor, a layer inflating more than the ratio stops within one slice of crossing it."""
    blob = _bomb(compression, 64 << 20)
    stats = StreamStats()
    limits = AnalysisLimits(max_inflation_ratio=100, inflation_ratio_floor=4 << 20)
    with pytest.raises(LimitExceeded, match=r"inflates more than 100x.*\(GPUBADGE_MAX_INFLATION_RATIO\)$"):
        async for _ in iter_layer(
            chunked(blob), LAYER_MEDIA_TYPES[compression], limits=limits, want=lambda _e: 0, stats=stats
        ):
            pass
    assert stats.decompressed_bytes <= max(4 << 20, 100 * stats.compressed_bytes) + (256 << 10)


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
async def test_the_inflation_ratio_is_enforced_at_its_bound(compression: str) -> None:
    """A layer inflating an even R times (4 KiB of noise, then 60 KiB of zeros, repeated): a bound
    a quarter above R reads it to its end, a bound a fifth below R stops it. So the guard is the
    bound as set, not some multiple of it (a bomb inflating 1000x would pass either way)."""
    rng = random.Random(11)
    content = b"".join(rng.randbytes(4096) + bytes(60 << 10) for _ in range(128))  # 8 MiB
    blob = compress(tar_bytes([file("/data", content)]), compression)

    async def read(ratio: int) -> StreamStats:
        stats = StreamStats()
        limits = AnalysisLimits(max_inflation_ratio=ratio, inflation_ratio_floor=1 << 20)
        media_type = LAYER_MEDIA_TYPES[compression]  # type: ignore[index]
        async for _ in iter_layer(chunked(blob), media_type, limits=limits, want=lambda _e: 0, stats=stats):
            pass
        return stats

    whole = await read(1 << 30)
    ratio = whole.decompressed_bytes / whole.compressed_bytes
    assert 8 < ratio < 32, ratio  # what the content gives, so the bounds below mean what they say
    assert (await read(math.ceil(ratio * 1.25))).reached_end
    with pytest.raises(LimitExceeded, match="GPUBADGE_MAX_INFLATION_RATIO"):
        await read(math.floor(ratio * 0.8))


async def test_a_real_layer_inflating_a_few_times_reads_to_its_end() -> None:
    """Text-like content (about 3x) under a ratio of 2 passes while below the floor, fails past it."""
    rng = random.Random(7)
    text = bytes(rng.choice(b"abcdefgh \n") for _ in range(1 << 20)) * 3
    blob = compress(tar_bytes([file("/usr/lib/libtext.so", text)]), "gzip")
    items, stats = await read_all(blob, limit=GiB)
    assert stats.reached_end and items[0][0].path == "/usr/lib/libtext.so"
    strict = AnalysisLimits(max_inflation_ratio=2, inflation_ratio_floor=1 << 20)
    with pytest.raises(LimitExceeded, match="GPUBADGE_MAX_INFLATION_RATIO"):
        async for _ in iter_layer(chunked(blob), LAYER_MEDIA_TYPES["gzip"], limits=strict, want=lambda _e: 0):
            pass


async def test_corrupt_gzip_is_a_clear_error() -> None:
    blob = bytearray(compress(tar_bytes(SAMPLE), "gzip"))
    blob[20:40] = b"\xff" * 20
    with pytest.raises(CorruptLayer, match="gzip"):
        await read_all(bytes(blob))


async def test_truncated_layer_is_a_clear_error() -> None:
    raw = tar_bytes([file("/big", os.urandom(20000)), file("/after", b"x")])
    for blob, media in ((compress(raw, "gzip")[:-9000], "gzip"), (raw[:11000], "none"), (raw[:1536], "none")):
        with pytest.raises(CorruptLayer, match="truncated"):
            await read_all(blob, LAYER_MEDIA_TYPES[media])  # type: ignore[index]


async def test_bad_checksum_and_non_tar_data_are_clear_errors() -> None:
    raw = bytearray(tar_bytes(SAMPLE))
    raw[1] ^= 0x20  # flip a bit in the first member's name
    with pytest.raises(CorruptLayer, match="checksum"):
        await read_all(bytes(raw), LAYER_MEDIA_TYPES["none"])
    with pytest.raises(CorruptLayer):
        await read_all(os.urandom(5000), LAYER_MEDIA_TYPES["none"])
    with pytest.raises(CorruptLayer, match="empty"):
        await read_all(b"", LAYER_MEDIA_TYPES["gzip"])


async def test_stops_pulling_when_the_consumer_stops() -> None:
    raw = tar_bytes([file("/first", b"1"), file("/noise", os.urandom(5 << 20)), file("/last", b"2")])
    blob = compress(raw, "gzip")
    pulled: list[int] = []
    entries = iter_layer(chunked(blob, pulled=pulled), "", want=lambda _e: 0)
    async for entry, _ in entries:
        assert entry.path == "/first"
        break
    await entries.aclose()
    assert sum(pulled) <= 2 * 65536 < len(blob)


async def test_stops_pulling_after_the_end_of_archive_marker() -> None:
    blob = tar_bytes(SAMPLE) + os.urandom(1 << 20)  # junk after the end blocks is never read
    pulled: list[int] = []
    stats = StreamStats()
    async for _ in iter_layer(chunked(blob, pulled=pulled), "", want=lambda _e: 0, stats=stats):
        pass
    assert stats.reached_end and sum(pulled) <= 2 * 65536


# -- ELF


def _elf32_big_endian(interpreter: bytes) -> bytes:
    ident = b"\x7fELF" + bytes([1, 2, 1, 0]) + b"\0" * 8
    header = ident + struct.pack(">HHIIIIIHHHHHH", 2, 8, 1, 0x400000, 52, 0, 0, 52, 32, 1, 40, 0, 0)
    interp = interpreter + b"\0"
    program_header = struct.pack(">IIIIIIII", 3, 84, 0, 0, len(interp), len(interp), 4, 1)
    return header + program_header + interp


def test_elf_heads_of_all_shapes() -> None:
    dynamic = parse_elf(fake_elf("/lib/ld-linux-aarch64.so.1", arch="arm64"))
    assert dynamic is not None and dynamic.bits == 64 and dynamic.machine_name == "aarch64"
    assert dynamic.interpreter == "/lib/ld-linux-aarch64.so.1" and not dynamic.static
    static = parse_elf(fake_elf(None))
    assert static is not None and static.static and static.interpreter is None
    big = parse_elf(_elf32_big_endian(b"/lib/ld.so.1"))
    assert big is not None and (big.bits, big.endian, big.machine_name) == (32, "big", "mips")
    assert big.interpreter == "/lib/ld.so.1"
    assert parse_elf(b"#!/bin/sh\necho hi\n") is None
    assert parse_elf(b"") is None


def test_garbage_elf_never_raises() -> None:
    elf = fake_elf("/lib64/ld-linux-x86-64.so.2")
    truncated = parse_elf(elf[:70])
    assert truncated is not None and truncated.error is not None
    random_source = os.urandom
    for _ in range(2000):
        noise = b"\x7fELF" + random_source(int.from_bytes(random_source(1), "big"))
        result = parse_elf(noise)
        assert result is not None
    for cut in range(len(elf)):
        info = parse_elf(elf[:cut])
        assert info is None or info.interpreter in (None, "/lib64/ld-linux-x86-64.so.2")
