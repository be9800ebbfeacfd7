"""The analysis processes' framed protocol (scanner.layers.analysis), with a real analysis process.

Each frame that crosses the pipes wakes a process; a pushed image's scan pays for every one. These
tests count the frames and check the answers against the same analysis run in this process
(`analysis_processes = 0`): the verdict comes with the reply to the last layer, not in a round trip
of its own; a small layer costs no ACK, a big one an ACK per half window, and the sender still never
runs more than a window ahead of what the process has parsed.
"""

from __future__ import annotations

import gzip
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import pytest

from fixtures.catalog import ubuntu_base
from fixtures.oci import LAYER_MEDIA_TYPES, LayerSpec, file, tar_bytes
from scanner.layers import analysis as protocol
from scanner.layers.analysis import ACK_EVERY, VERDICT, WINDOW_BYTES, AnalysisPool, RemoteSession, Session
from scanner.layers.image import ImageVerdict
from scanner.layers.limits import AnalysisLimits

GZIP = LAYER_MEDIA_TYPES["gzip"]


def blob(layer: LayerSpec) -> bytes:
    return gzip.compress(tar_bytes(layer.entries), compresslevel=1)


async def chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.fixture
def frames(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Counter[int]]]:
    """Frames sent to the analysis process by kind, and frames it sent back (ACKs and replies)."""
    seen: dict[str, Counter[int]] = {"sent": Counter(), "acks": Counter(), "replies": Counter()}
    send, wake = protocol._Worker.send, protocol._Worker._wake

    def counted_send(self: protocol._Worker, kind: int, session: int, payload: bytes = b"") -> None:
        seen["sent"][kind] += 1
        send(self, kind, session, payload)

    def counted_wake(self: protocol._Worker, session: int) -> None:
        future = self.waiting.get(session)
        seen["replies" if future is None or future.done() else "acks"][session] += 1
        wake(self, session)

    monkeypatch.setattr(protocol._Worker, "send", counted_send)
    monkeypatch.setattr(protocol._Worker, "_wake", counted_wake)
    yield seen


async def analyse(pool: AnalysisPool, layers: list[bytes], *, cuda: bool, chunk: int) -> ImageVerdict:
    session: Session = await pool.open(
        "amd64", len(layers), AnalysisLimits(), time.monotonic() + 60, cuda=cuda
    )
    try:
        for data in layers:
            if session.done:
                break
            await session.read_layer(chunks(data, chunk), GZIP)
        return await session.verdict(bytes_read=sum(map(len, layers)), bytes_total=sum(map(len, layers)) + 1)
    finally:
        session.close()


async def test_the_verdict_comes_with_the_last_layers_reply_and_a_small_layer_costs_no_ack(
    frames: dict[str, Counter[int]],
) -> None:
    layers = [blob(LayerSpec([file("app/main.py", "print('hi')\n")])), blob(ubuntu_base())]
    assert all(len(data) < ACK_EVERY for data in layers)
    pool = AnalysisPool(1)
    try:
        remote = await analyse(pool, layers, cuda=True, chunk=16 << 10)
    finally:
        await pool.close()
    local = await analyse(AnalysisPool(0), layers, cuda=True, chunk=16 << 10)
    assert remote == local  # the byte counts too: the scanning process fills them in
    assert remote.libc.flavour == "glibc" and remote.libc.bytes_total == sum(map(len, layers)) + 1
    assert frames["sent"][VERDICT] == 0  # no round trip of its own
    assert sum(frames["acks"].values()) == 0  # nothing to wait for: each layer fits the window
    assert sum(frames["replies"].values()) == 2  # one per layer


async def test_a_verdict_asked_before_every_layer_was_fed_is_a_round_trip(
    frames: dict[str, Counter[int]],
) -> None:
    pool = AnalysisPool(1)
    try:
        session = await pool.open("amd64", 3, AnalysisLimits(), time.monotonic() + 60, cuda=True)
        try:
            await session.read_layer(chunks(blob(ubuntu_base()), 16 << 10), GZIP)
            assert isinstance(session, RemoteSession) and not session.done
            verdict = await session.verdict(bytes_read=7, bytes_total=9)
        finally:
            session.close()
    finally:
        await pool.close()
    assert frames["sent"][VERDICT] == 1
    assert (verdict.libc.bytes_read, verdict.libc.bytes_total) == (7, 9)


async def test_a_big_layer_is_acked_per_half_window_and_the_sender_stays_within_the_window(
    frames: dict[str, Counter[int]],
) -> None:
    payload = os.urandom(4 << 20)  # incompressible: 4 MiB on the wire
    data = blob(LayerSpec([file("opt/blob.bin", payload)]))
    pool = AnalysisPool(1)
    ahead: list[int] = []
    try:
        session = await pool.open("amd64", 1, AnalysisLimits(), time.monotonic() + 60, cuda=True)
        assert isinstance(session, RemoteSession)
        worker, sent = session._worker, 0

        async def watched() -> AsyncIterator[bytes]:
            nonlocal sent
            async for chunk in chunks(data, 16 << 10):
                ahead.append(sent - worker.parsed.get(session._id, 0))
                sent += len(chunk)
                yield chunk

        try:
            outcome = await session.read_layer(watched(), GZIP)
            verdict = await session.verdict(bytes_read=len(data), bytes_total=len(data))
        finally:
            session.close()
    finally:
        await pool.close()
    assert outcome.complete and outcome.compressed_bytes == len(data)
    assert verdict.libc.bytes_read == len(data)
    acks = sum(frames["acks"].values())
    assert 0 < acks <= len(data) // ACK_EVERY + 1  # every 16 KiB chunk was 256 ACKs before
    assert max(ahead) <= WINDOW_BYTES  # the early-stop bound holds with the sparser ACKs
    assert frames["sent"][VERDICT] == 0
