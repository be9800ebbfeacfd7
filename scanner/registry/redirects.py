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
    """The first non-redirect response for `method url`, each hop sent by `send`.

    `url` is the client's own `scheme://host/path`; where a registry redirects, the next URL is
    its `Location` resolved against the last one, and parsed as any untrusted URL is."""
    first = url
    scheme, _, rest = url.partition("://")
    origin = target = (scheme, rest.split("/", 1)[0])
    for hop in range(max_redirects + 1):
        if hop:
            parts = urlsplit(url)
            target = (parts.scheme, parts.netloc)
        scheme, host = target
        if scheme == "http" and not plain_http_allowed(host):
            raise InsecureTransport(
                f"refusing plain HTTP to {host}: only loopback or registries configured "
                "'insecure' may use http",
                host=host,
            )
        if scheme not in ("http", "https"):
            raise RegistryError(f"redirect to unsupported scheme {scheme!r}")
        send_headers = dict(headers)
        if authorization and target == origin:
            send_headers["Authorization"] = authorization
        response = await send(method, url, send_headers, timeout)
        location = response.headers.get("Location")
        if response.status not in REDIRECT_STATUSES or not location:
            return response
        response.release()
        url = urljoin(url, location)
        if response.status == 303 and method != "HEAD":
            method = "GET"
    raise RegistryError(f"too many redirects from {origin[1]}{urlsplit(first).path}", host=origin[1])
