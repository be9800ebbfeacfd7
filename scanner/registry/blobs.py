"""A blob's bytes as they arrive, counted and checked against the digest at the end."""

from __future__ import annotations

import hashlib

import aiohttp

from scanner.registry.errors import DigestMismatch, TransportError, describe_transport_error
from scanner.registry.stats import RequestStats, count


class BlobStream:
    """Async iterator over a blob's bytes that verifies the digest when the last chunk is read.

    Every chunk is counted (`bytes_read`, and `bytes_received` in the active `track()` blocks)
    as it arrives, so a consumer that stops early still accounts for every byte it was sent.
    """

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        digest: str,
        chunk_size: int,
        what: str,
        timeout: float,
        totals: RequestStats,
    ) -> None:
        self._response = response
        self._totals = totals
        self._iterator = response.content.iter_chunked(chunk_size)
        self._expected = digest
        self._hasher = hashlib.new(digest.split(":", 1)[0])
        self._what = what
        self._timeout = timeout
        self.content_length = response.content_length
        self.bytes_read = 0
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
        count(self._totals, bytes_received=len(chunk))
        return chunk
