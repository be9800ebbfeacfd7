"""Following redirects ourselves, so that credentials never cross to another host.

Registries redirect blob reads to storage (S3, GCS, a CDN) with signed URLs. aiohttp would
follow them and resend the Authorization header; here each hop is sent by the caller's
`send`, the header goes only to the original scheme and host, plain HTTP is refused except
to loopback or registries configured `insecure`, and the number of hops is bounded
(`max_redirects`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import urljoin, urlsplit

import aiohttp

from scanner.registry.errors import InsecureTransport, RegistryError

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})

Send = Callable[[str, str, Mapping[str, str], aiohttp.ClientTimeout], Awaitable[aiohttp.ClientResponse]]


async def follow(
    send: Send,
    method: str,
    url: str,
    headers: Mapping[str, str],
    authorization: str | None,
    timeout: aiohttp.ClientTimeout,
    *,
    max_redirects: int,
    plain_http_allowed: Callable[[str], bool],
) -> aiohttp.ClientResponse:
    """The first non-redirect response for `method url`, each hop sent by `send`."""
    origin = target = urlsplit(url)
    for hop in range(max_redirects + 1):
        if hop:
            target = urlsplit(url)
        if target.scheme == "http" and not plain_http_allowed(target.netloc):
            raise InsecureTransport(
                f"refusing plain HTTP to {target.netloc}: only loopback or registries configured "
                "'insecure' may use http",
                host=target.netloc,
            )
        if target.scheme not in ("http", "https"):
            raise RegistryError(f"redirect to unsupported scheme {target.scheme!r}")
        send_headers = dict(headers)
        if authorization and (target.scheme, target.netloc) == (origin.scheme, origin.netloc):
            send_headers["Authorization"] = authorization
        response = await send(method, url, send_headers, timeout)
        location = response.headers.get("Location")
        if response.status not in REDIRECT_STATUSES or not location:
            return response
        response.release()
        url = urljoin(url, location)
        if response.status == 303 and method != "HEAD":
            method = "GET"
    raise RegistryError(f"too many redirects from {origin.netloc}{origin.path}", host=origin.netloc)
