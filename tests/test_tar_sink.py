"""Tar members streamed to a content sink: every byte once, in order, never buffered; early stop."""

from __future__ import annotations

import pytest

from fixtures.oci import file, tar_bytes
from scanner.layers.tarstream import TarEntry, TarParser

BIG = bytes(range(256)) * 4099  # not a multiple of 512: padding follows the content


class Recorder:
    def __init__(self, stop_after: int | None = None) -> None:
        self.data = bytearray()
        self.closed: bool | None = None
        self.stop_after = stop_after
        self.largest_slice = 0

    def feed(self, data: memoryview) -> bool:
        self.data += data
        self.largest_slice = max(self.largest_slice, len(data))
        return self.stop_after is None or len(self.data) < self.stop_after

    def close(self, complete: bool) -> None:
        assert self.closed is None, "closed twice"
        self.closed = complete


def parse(archive: bytes, chunk: int, head: int, sinks: dict[str, Recorder]) -> list[tuple[TarEntry, bytes]]:
    parser = TarParser(
        lambda entry: head if entry.path == "/big" else 0, stream=lambda entry: sinks.get(entry.path)
    )
    out: list[tuple[TarEntry, bytes]] = []
    for start in range(0, len(archive), chunk):
        out += parser.feed(archive[start : start + chunk])
    parser.close()
    return out


@pytest.mark.parametrize("chunk", [13, 511, 4096, 1 << 20])
@pytest.mark.parametrize("head", [0, 100, len(BIG)])
def test_sink_gets_every_byte_and_the_next_entry_still_parses(chunk: int, head: int) -> None:
    archive = tar_bytes([file("/big", BIG), file("/after", b"tail")])
    sink = Recorder()
    entries = parse(archive, chunk, head, {"/big": sink})
    assert bytes(sink.data) == BIG and sink.closed is True
    assert [entry.path for entry, _ in entries] == ["/big", "/after"]
    assert entries[0][1] == BIG[:head]  # the head others asked for is still delivered


@pytest.mark.parametrize("chunk", [7, 65536])
def test_sink_that_stops_skips_the_rest(chunk: int) -> None:
    archive = tar_bytes([file("/big", BIG), file("/after", b"tail")])
    sink = Recorder(stop_after=1000)
    entries = parse(archive, chunk, 0, {"/big": sink})
    assert 1000 <= len(sink.data) < len(BIG) and sink.closed is False
    assert [entry.path for entry, _ in entries] == ["/big", "/after"]
