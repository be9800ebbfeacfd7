"""A blob's bytes as they arrive: read in growing ranges, counted, checked against the digest.

A consumer that may stop early (the libc analysis usually knows its verdict after a few KiB)
reads a blob in HTTP ranges that grow from `FIRST_RANGE` by `RANGE_GROWTH` up to `MAX_RANGE`:
the registry then never sends more than the range it was asked for, so an early stop costs at
most the rest of one range, not the socket buffers of a whole blob (several MiB on a fast
link), and the count of what was fetched is exact or an upper bound, never an under-count. A
consumer that reads whole blobs (the deep scan) asks for the blob in one request.

Every read is held to GPUBADGE_MIN_TRANSFER_RATE (`scanner.registry.transfer`): a registry
that drips a blob is cut off with `SlowTransfer` instead of holding the scan for its whole
budget. Bytes are counted as they are consumed (`bytes_read`) and as they are known to have been sent
(`bytes_received`): when a read stops, the rest of the current range (or, without ranges,
what already sat in aiohttp's buffer and the socket's receive queue) counts as received. The
digest is checked when the last byte is read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import re
import struct
import termios
from collections.abc import Awaitable, Callable

import aiohttp

from scanner.registry.errors import DigestMismatch, RegistryError, TransportError, describe_transport_error
from scanner.registry.transfer import TransferGuard

FIRST_RANGE = 1 << 20
RANGE_GROWTH = 4
MAX_RANGE = 128 << 20
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")

# (first byte, last byte or None for "to the end") -> a 2xx response for that range
RangeOpener = Callable[[int, int | None], Awaitable[aiohttp.ClientResponse]]


def next_range(start: int, previous: int, size: int) -> tuple[int, int]:
    """The next range after `previous` bytes were asked for last time: (first, last) byte."""
    length = min(MAX_RANGE, max(FIRST_RANGE, previous * RANGE_GROWTH))
    return start, min(size, start + length) - 1


class BlobStream:
    """Async iterator over a blob's bytes; see the module docstring.

    `open_range` is given for ranged reads of a blob of known `size`; without it the blob is one
    response. Call `close()` when done (the stream context of the registry client does).
    """

    def __init__(
        self,
        open_range: RangeOpener,
        digest: str,
        *,
        size: int | None,
        ranged: bool,
        chunk_size: int,
        what: str,
        timeout: float,
        received: Callable[[int], None],
        guard: Callable[[], TransferGuard] | None = None,
    ) -> None:
        self._open_range = open_range
        self._make_guard = guard  # built once the first range has chosen its host
        self._guard: TransferGuard | None = None
        self._received = received
        self._expected = digest
        self._hasher = hashlib.new(digest.split(":", 1)[0])
        self._what = what
        self._timeout = timeout
        self._chunk_size = chunk_size
        self.size = size
        self._ranged = ranged and size is not None and size > FIRST_RANGE
        self._response: aiohttp.ClientResponse | None = None
        self._iterator: object = None
        self._range_end: int | None = None  # last byte of the range being read (ranged reads)
        self._range_length = 0  # bytes the last range asked for
        self._skip = 0  # bytes to drop: a registry that answered a later range with the whole blob
        self._response_received = 0  # bytes received from the current response
        self.requests = 0
        self.bytes_read = 0
        self.bytes_received = 0
        self.verified = False

    def __aiter__(self) -> BlobStream:
        return self

    async def start(self) -> None:
        """Open the first range now, so that a blob that cannot be fetched fails before any read."""
        if self._response is None:
            await self._next_response()

    async def _next_response(self) -> None:
        """Ask for the next range (or the whole blob) and check that the answer fits it."""
        if self._response is not None:
            self._response.release()  # read to the end of its range: the connection can be reused
        start, end = self.bytes_read, None
        if self._ranged:
            assert self.size is not None
            start, end = next_range(start, self._range_length, self.size)
            self._range_length = end + 1 - start
        response = await self._open_range(start, end)
        self.requests += 1
        self._response, self._range_end, self._response_received = response, None, 0
        self._iterator = response.content.iter_chunked(self._chunk_size)
        if response.status == 206:
            match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
            if match is None or int(match.group(1)) != start:
                raise RegistryError(f"{self._what}: the registry answered range {start}- with another range")
            self._range_end = int(match.group(2))
        elif start > 0:  # the whole blob again: read past what was read already
            self._skip, self._ranged = start, False
        else:
            self._ranged = False  # the registry ignores ranges: one response carries it all

    async def __anext__(self) -> bytes:
        while True:
            if self._response is None:
                await self._next_response()
            assert self._response is not None
            if self._guard is None and self._make_guard is not None:
                self._guard = self._make_guard()
            since = self._guard.clock() if self._guard is not None else 0.0
            try:
                chunk: bytes = await self._iterator.__anext__()  # type: ignore[attr-defined]
            except StopAsyncIteration:
                if self._ranged and self.size is not None and self.bytes_read < self.size:
                    await self._next_response()
                    continue
                actual = f"{self._expected.split(':', 1)[0]}:{self._hasher.hexdigest()}"
                if actual != self._expected:
                    raise DigestMismatch(
                        f"{self._what}: content digest {actual} does not match {self._expected}"
                    ) from None
                self.verified = True
                raise
            except (aiohttp.ClientError, TimeoutError) as exc:
                slow = self._guard.timed_out() if self._guard and isinstance(exc, TimeoutError) else None
                if slow is not None:
                    raise slow from None
                message, retryable = describe_transport_error(exc, self._timeout, url=str(self._response.url))
                raise TransportError(f"{self._what}: {message}", retryable=retryable) from None
            self.bytes_received += len(chunk)
            self._response_received += len(chunk)
            self._received(len(chunk))
            if self._guard is not None:
                self._guard.received(since, len(chunk))  # raises SlowTransfer below the rate floor
            if self._skip:
                dropped = min(self._skip, len(chunk))
                self._skip -= dropped
                chunk = chunk[dropped:]
                if not chunk:
                    continue
            self._hasher.update(chunk)
            self.bytes_read += len(chunk)
            return chunk

    def close(self) -> None:
        """End the read: reuse the connection after a full read; else count what was sent, and drop it."""
        response, self._response = self._response, None
        if response is None:
            return
        if self.verified:
            response.release()
            return
        if self._range_end is not None:  # the registry sends at most the range it was asked for
            unread = max(0, self._range_end + 1 - self.bytes_read)
        else:
            unread = self._buffered(response)
        if unread:
            self.bytes_received += unread
            self._received(unread)
        response.close()  # stopped early: drop the connection rather than drain the blob

    def _buffered(self, response: aiohttp.ClientResponse) -> int:
        """What already reached this host unread: aiohttp's buffer and the socket's receive queue."""
        unread = max(0, response.content.total_bytes - self._response_received)
        connection = response.connection
        transport = connection.transport if connection is not None else None
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                queued = fcntl.ioctl(sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
                unread += struct.unpack("i", queued)[0]
        return unread
