"""A blob's bytes as they arrive, counted and checked against the digest at the end."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import struct
import termios
from collections.abc import Callable

import aiohttp

from scanner.registry.errors import DigestMismatch, TransportError, describe_transport_error


class BlobStream:
    """Async iterator over a blob's bytes that verifies the digest when the last chunk is read.

    Every chunk is counted as it is consumed (`bytes_read`), and reported to `received`. A
    consumer that stops early calls `discard()` before the connection is dropped: the bytes that
    had already reached this host (in aiohttp's buffer and in the socket's receive queue) are
    counted too, so `bytes_received` never under-reports what the registry got through to us.
    """

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        digest: str,
        chunk_size: int,
        what: str,
        timeout: float,
        received: Callable[[int], None],
    ) -> None:
        self._response = response
        self._received = received
        self._iterator = response.content.iter_chunked(chunk_size)
        self._expected = digest
        self._hasher = hashlib.new(digest.split(":", 1)[0])
        self._what = what
        self._timeout = timeout
        self.content_length = response.content_length
        self.bytes_read = 0
        self.bytes_received = 0
        self.verified = False

    def __aiter__(self) -> BlobStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._iterator.__anext__()
        except StopAsyncIteration:
            actual = f"{self._expected.split(':', 1)[0]}:{self._hasher.hexdigest()}"
            if actual != self._expected:
                raise DigestMismatch(
                    f"{self._what}: content digest {actual} does not match {self._expected}"
                ) from None
            self.verified = True
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            message, retryable = describe_transport_error(exc, self._timeout, url=str(self._response.url))
            raise TransportError(f"{self._what}: {message}", retryable=retryable) from None
        self._hasher.update(chunk)
        self.bytes_read += len(chunk)
        self.bytes_received += len(chunk)
        self._received(len(chunk))
        return chunk

    def discard(self) -> int:
        """Count what arrived but was never consumed (call before closing); returns that count."""
        unread = max(0, self._response.content.total_bytes - self.bytes_read)
        connection = self._response.connection
        transport = connection.transport if connection is not None else None
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                queued = fcntl.ioctl(sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
                unread += struct.unpack("i", queued)[0]
        if unread:
            self.bytes_received += unread
            self._received(unread)
        return unread
