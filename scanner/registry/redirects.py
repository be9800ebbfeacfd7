"""Following redirects ourselves, so that credentials never cross to another host, and no
registry steers us to a host the operator did not allow.

Registries redirect blob reads to storage (S3, GCS, a CDN) with signed URLs. aiohttp would
follow them and resend the Authorization header; here each hop is sent by the caller's
`send`, the header goes only to the original scheme and host, plain HTTP is refused except
to loopback or registries configured `insecure`, and the number of hops is bounded
(`max_redirects`). Every hop's host is checked before it is contacted (`hop_allowed`): the
registry's own host, a configured registry or mirror, a well-known storage host of a public
registry (`WELL_KNOWN_STORAGE_HOSTS`), or one the operator lists in GPUBADGE_REDIRECT_HOSTS.
A hop anywhere else raises `RedirectRefused` naming the host and the setting; the host is never
contacted, so nothing it could answer reaches a job's error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from urllib.parse import urljoin, urlsplit

import aiohttp

from scanner.registry.errors import InsecureTransport, RedirectRefused, RegistryError
from scanner.registry.reference import is_loopback, split_host
from scanner.settings import ScannerSettings

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
REDIRECT_SETTING = "GPUBADGE_REDIRECT_HOSTS"

# Where public registries send blob reads: exact hosts, or (leading dot) a domain and its subdomains.
# Docker Hub (Cloudflare, R2), ghcr.io, quay.io and registry.redhat.io, gcr.io / pkg.dev / GitLab
# (Google Cloud Storage), ECR and registry.k8s.io (S3, CloudFront), ACR and MCR (Azure blob storage).
WELL_KNOWN_STORAGE_HOSTS: tuple[str, ...] = (
    "production.cloudflare.docker.com",
    ".r2.cloudflarestorage.com",
    "pkg-containers.githubusercontent.com",
    ".quay.io",
    ".redhat.io",
    "storage.googleapis.com",
    ".storage.googleapis.com",
    ".pkg.dev",
    "cdn.registry.gitlab-static.net",
    ".amazonaws.com",
    ".cloudfront.net",
    ".blob.core.windows.net",
    ".data.mcr.microsoft.com",
    ".azurecr.io",
    ".ngc.nvidia.com",
)


def _listed(host: str, entries: Iterable[str]) -> bool:
    """`host` (host[:port]) is an entry, or its name is (port any), or it lies under a `.domain` entry."""
    name = split_host(host).lower().rstrip(".")
    for entry in entries:
        entry = entry.strip().lower()
        if not entry:
            continue
        if entry.startswith("."):
            if name.endswith(entry):
                return True
        elif entry == host.lower() or entry == name:
            return True
    return False


def hop_allowed(settings: ScannerSettings, origin: str, target: str) -> bool:
    """May a redirect from registry host `origin` lead to `target` (host[:port])?

    Yes for the origin itself, a configured registry or mirror, a well-known storage host, a host
    in GPUBADGE_REDIRECT_HOSTS, and, where no registries are configured (any loopback registry may
    then be scanned), from loopback to loopback. Everything else is refused before it is contacted."""
    if target.lower() == origin.lower():
        return True
    if _listed(target, settings.configured_hosts()) or _listed(target, settings.redirect_hosts):
        return True
    if _listed(target, WELL_KNOWN_STORAGE_HOSTS) and not is_loopback(target):
        return True
    return not settings.registries and is_loopback(origin) and is_loopback(target)


def refuse_hop(origin: str, target: str) -> RedirectRefused:
    return RedirectRefused(
        f"{origin} redirected to {target}, which is neither a configured registry nor a known storage "
        f"host; refusing to contact it. Add {target} to {REDIRECT_SETTING} to allow it",
        host=origin,
    )


def plain_http_allowed(settings: ScannerSettings, host: str) -> bool:
    """May `host` be spoken to over plain HTTP? Only loopback, or a registry configured `insecure`."""
    return is_loopback(host) or settings.is_insecure(host)


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
    hop_allowed: Callable[[str, str], bool],
) -> aiohttp.ClientResponse:
    """The first non-redirect response for `method url`, each hop sent by `send`.

    `url` is the client's own `scheme://host/path`; where a registry redirects, the next URL is
    its `Location` resolved against the last one, and parsed as any untrusted URL is. Each hop's
    host must pass `hop_allowed(origin host, hop host)` before it is contacted."""
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
        if hop and not hop_allowed(origin[1], host):
            raise refuse_hop(origin[1], host)
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
