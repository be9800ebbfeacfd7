"""Registry authentication: challenges, token requests and responses, a token cache, and the
token flow (`RegistryAuth`) that the registry client runs them through.

The registry client does the HTTP (one seam: `RegistryAuth`'s `exchange`); this module decides
what to send. We never ping `/v2/`: the real request's 401 carries the challenge, and we remember
each host's challenge so later repositories on that host get a token before their first request
instead of after a wasted 401.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from scanner.registry.credentials import Credentials, CredentialStore
from scanner.registry.errors import TokenRealmRefused, Unauthorized
from scanner.registry.reference import DOCKER_HUB_API, is_loopback, split_host
from scanner.registry.retry import RetryPolicy
from scanner.settings import ScannerSettings

DEFAULT_TOKEN_LIFETIME = 60.0
TOKEN_EXPIRY_MARGIN = 5.0
TOKEN_RESPONSE_MAX = 64 * 1024
CLIENT_ID = "gpubadge"
REALM_SETTING = "GPUBADGE_REGISTRIES"

# Registries whose token service lives on another, well-known host: (registry host or suffix, realm host).
# A suffix starts with a dot and matches subdomains. Every other public registry we know (ghcr.io,
# quay.io, nvcr.io, *.pkg.dev, *.azurecr.io, public.ecr.aws, registry.redhat.io) names a realm on its
# own host; private ECR answers Basic, so it names no realm at all.
WELL_KNOWN_REALM_HOSTS: tuple[tuple[str, str], ...] = (
    ("docker.io", "auth.docker.io"),
    ("registry-1.docker.io", "auth.docker.io"),
    ("index.docker.io", "auth.docker.io"),
    ("registry.gitlab.com", "gitlab.com"),
    ("gcr.io", "gcr.io"),
    (".gcr.io", "gcr.io"),
)


@dataclass(frozen=True)
class Challenge:
    """One `WWW-Authenticate` challenge: scheme (lowercase) and its parameters."""

    scheme: str
    params: dict[str, str] = field(default_factory=dict)

    @property
    def realm(self) -> str | None:
        return self.params.get("realm")

    @property
    def service(self) -> str | None:
        return self.params.get("service")


def _parse_params(text: str) -> tuple[dict[str, str], str]:
    """Parse `k=v, k="quoted, with \\" escapes"` pairs; return them and what follows (a new scheme)."""
    params: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in " ,\t":
            i += 1
        start = i
        while i < n and text[i] not in "= ,\t":
            i += 1
        key = text[start:i]
        if not key:
            break
        j = i
        while j < n and text[j] in " \t":
            j += 1
        if j >= n or text[j] != "=":
            # A bare token: the start of the next challenge.
            return params, text[start:]
        i = j + 1
        while i < n and text[i] in " \t":
            i += 1
        if i < n and text[i] == '"':
            i += 1
            value_chars: list[str] = []
            while i < n and text[i] != '"':
                if text[i] == "\\" and i + 1 < n:
                    i += 1
                value_chars.append(text[i])
                i += 1
            i += 1
            value = "".join(value_chars)
        else:
            start = i
            while i < n and text[i] not in ",":
                i += 1
            value = text[start:i].strip()
        params[key.lower()] = value
    return params, ""


def parse_challenges(headers: Iterable[str]) -> list[Challenge]:
    """All challenges in one or more `WWW-Authenticate` header values."""
    challenges: list[Challenge] = []
    for header in headers:
        rest = header.strip()
        while rest:
            scheme, _, after = rest.partition(" ")
            scheme = scheme.strip(", ")
            if not scheme:
                break
            params, rest = _parse_params(after)
            challenges.append(Challenge(scheme.lower(), params))
            rest = rest.strip()
    return challenges


class RealmRefused(ValueError):
    """A token realm we will not contact; the message names the host and the setting that allows it."""


def _hostname(netloc: str) -> str:
    return split_host(netloc).lower().rstrip(".")


def _well_known_pair(registry: str, realm: str) -> bool:
    for known, realm_host in WELL_KNOWN_REALM_HOSTS:
        matches = registry.endswith(known) if known.startswith(".") else registry == known
        if matches and realm == realm_host:
            return True
    return False


def check_realm(
    registry_host: str,
    realm_url: str,
    *,
    allowlist: Collection[str],
    sends_credentials: bool,
    insecure_hosts: Collection[str] = (),
) -> None:
    """Refuse a `WWW-Authenticate` realm that would make us an SSRF or leak credentials.

    The realm is chosen by the registry, so it is an outbound request like any other. It may go to
    the registry's own host, to a well-known auth host of that registry (docker.io -> auth.docker.io),
    to a host on the allowlist (GPUBADGE_REGISTRIES), or to loopback for a loopback registry.
    Credentials travel only over https, or to loopback for a loopback registry; anonymous token
    requests may use plain http to loopback or to hosts configured `insecure`.
    """
    realm = urlsplit(realm_url)
    shown = f"{realm.scheme}://{realm.netloc}{realm.path}" if realm.netloc else repr(realm_url[:200])
    if realm.scheme not in ("http", "https") or not realm.netloc:
        raise RealmRefused(f"{registry_host}: the token realm {shown} is not an http(s) URL")
    if realm.username is not None or realm.password is not None:
        raise RealmRefused(f"{registry_host}: the token realm carries user info; refusing it")
    realm_name = _hostname(realm.netloc)
    registry_name = _hostname(registry_host)
    listed = {entry.lower() for entry in allowlist}
    both_loopback = is_loopback(registry_host) and is_loopback(realm.netloc)
    allowed = (
        realm_name == registry_name
        or _well_known_pair(registry_name, realm_name)
        or realm.netloc.lower() in listed
        or realm_name in listed
        or both_loopback
    )
    if not allowed:
        raise RealmRefused(
            f"{registry_host} names token realm {shown}, but {realm.netloc} is neither the registry's "
            f"own host nor a known auth host for it; refusing to contact it. Add {realm.netloc} to "
            f"{REALM_SETTING} to allow it"
        )
    if realm.scheme == "https":
        return
    if sends_credentials:
        if both_loopback:
            return
        raise RealmRefused(
            f"{registry_host}: refusing to send credentials over plain HTTP to token realm {shown}; "
            "credentials go only over https, or to loopback for a loopback registry"
        )
    insecure = {entry.lower() for entry in insecure_hosts}
    if not (
        is_loopback(realm.netloc) or realm.netloc.lower() in insecure or registry_host.lower() in insecure
    ):
        raise RealmRefused(
            f"{registry_host}: refusing to fetch a token over plain HTTP from {realm.netloc}; "
            "plain HTTP is allowed only to loopback or to registries configured 'insecure'"
        )


def check_configured_realm(
    settings: ScannerSettings, registry_host: str, realm_url: str, *, sends_credentials: bool
) -> None:
    """`check_realm` under the settings: a realm may name a configured registry or mirror
    (`configured_hosts`), and anonymous plain HTTP may go to a registry configured `insecure`."""
    check_realm(
        registry_host,
        realm_url,
        allowlist=settings.configured_hosts(),
        sends_credentials=sends_credentials,
        insecure_hosts=[entry.host for entry in settings.registries if entry.insecure],
    )


def pull_scope(repository: str) -> str:
    return f"repository:{repository}:pull"


def basic_authorization(credentials: Credentials) -> str | None:
    if not credentials.has_basic or credentials.password is None:
        return None
    raw = f"{credentials.username}:{credentials.password.get_secret_value()}".encode()
    return "Basic " + base64.b64encode(raw).decode()


@dataclass(frozen=True)
class TokenRequest:
    """How to ask a token server for a token. Holds secrets: never log or repr it."""

    method: str
    url: str
    params: list[tuple[str, str]]
    form: dict[str, str] | None
    authorization: str | None = field(repr=False)

    @property
    def sends_credentials(self) -> bool:
        return self.authorization is not None or self.form is not None


def build_token_request(
    challenge: Challenge, scopes: list[str], credentials: Credentials | None
) -> TokenRequest:
    """GET with Basic credentials (or anonymous), or the OAuth2 POST for an identity token."""
    realm = challenge.realm
    if not realm:
        raise ValueError("the Bearer challenge has no realm")
    service = challenge.service
    if credentials is not None and credentials.identity_token is not None:
        form = {
            "grant_type": "refresh_token",
            "refresh_token": credentials.identity_token.get_secret_value(),
            "client_id": CLIENT_ID,
            "scope": " ".join(scopes),
        }
        if service:
            form["service"] = service
        return TokenRequest("POST", realm, [], form, None)
    params: list[tuple[str, str]] = []
    if service:
        params.append(("service", service))
    params.extend(("scope", scope) for scope in scopes)
    params.append(("client_id", CLIENT_ID))
    authorization = basic_authorization(credentials) if credentials is not None else None
    return TokenRequest("GET", realm, params, None, authorization)


def parse_token_response(body: bytes) -> tuple[str, float]:
    """(token, lifetime in seconds) from a token server's JSON; accepts `token` or `access_token`."""
    if len(body) > TOKEN_RESPONSE_MAX:
        raise ValueError("token response is too large")
    data: Any = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("token response is not a JSON object")
    token = data.get("token") or data.get("access_token")
    if not isinstance(token, str) or not token:
        raise ValueError("token response holds no token")
    lifetime = data.get("expires_in")
    if not isinstance(lifetime, int | float) or isinstance(lifetime, bool) or lifetime <= 0:
        lifetime = DEFAULT_TOKEN_LIFETIME
    return token, float(lifetime)


class TokenCache:
    """Bearer tokens per (host, service, scope) until shortly before they expire."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._tokens: dict[tuple[str, str, str], tuple[str, float]] = {}

    def get(self, key: tuple[str, str, str]) -> str | None:
        entry = self._tokens.get(key)
        if entry is None:
            return None
        token, expires_at = entry
        if self._clock() >= expires_at:
            del self._tokens[key]
            return None
        return token

    def put(self, key: tuple[str, str, str], token: str, lifetime: float) -> None:
        margin = min(TOKEN_EXPIRY_MARGIN, lifetime / 10)
        self._tokens[key] = (token, self._clock() + lifetime - margin)

    def __repr__(self) -> str:
        return f"TokenCache({len(self._tokens)} tokens)"


# Docker Hub's challenge is well known: asking for its token first saves a 401 per cold start.
DOCKER_HUB_CHALLENGE = Challenge(
    "bearer", {"realm": "https://auth.docker.io/token", "service": "registry.docker.io"}
)

TokenExchange = Callable[[str, TokenRequest, Credentials | None], Awaitable[bytes]]


def describe_token_request(host: str, request: TokenRequest) -> str:
    """`token from <realm host><path> for <registry>`: how errors name a token request (no secrets)."""
    realm = urlsplit(request.url)
    return f"token from {realm.netloc}{realm.path} for {host}"


class RegistryAuth:
    """The token flow of one `RegistryClient`, one step per method, as httpx's `Auth` does it.

    `authorization` is what a request carries up front (a configured registry token, or what the
    host's remembered challenge asks for); `answer_challenge` takes a 401's challenges and gets
    what they ask for; `token` is a cached token or a fresh one, single-flight per (host, service,
    scope); `fetch_token` builds the token request, checks its realm (`check_configured_realm`) and parses
    the answer. The one seam to the network is `exchange`: the client sends the token request
    with its HTTP session, counts and observes it, and maps a refusal to a `RegistryError`.
    """

    def __init__(
        self,
        settings: ScannerSettings,
        credentials: CredentialStore,
        retry: RetryPolicy,
        exchange: TokenExchange,
    ) -> None:
        self.settings = settings
        self.credentials = credentials
        self.retry = retry
        self._exchange = exchange
        self._challenges: dict[str, Challenge] = {DOCKER_HUB_API: DOCKER_HUB_CHALLENGE}
        self._tokens = TokenCache()
        self._token_locks: dict[tuple[str, str, str], asyncio.Lock] = {}

    async def authorization(self, host: str, repository: str) -> str | None:
        """The Authorization header to send up front, if we already know what this host wants."""
        credentials = await self.credentials.get(host)
        if credentials is not None and credentials.registry_token is not None:
            return "Bearer " + credentials.registry_token.get_secret_value()
        challenge = self._challenges.get(host)
        if challenge is None:
            return None
        if challenge.scheme == "basic":
            return basic_authorization(credentials) if credentials else None
        token = await self.token(host, challenge, repository, credentials, rejected=None)
        return f"Bearer {token}"

    async def answer_challenge(
        self, host: str, repository: str, challenges: list[Challenge], sent: str | None
    ) -> bool:
        """Remember the host's challenge and get what it asks for; False if we have nothing to offer."""
        if not challenges and host in self._challenges:
            challenges = [self._challenges[host]]
        credentials = await self.credentials.get(host)
        bearer = next((c for c in challenges if c.scheme == "bearer" and c.realm), None)
        if bearer is not None:
            remembered = Challenge("bearer", {k: v for k, v in bearer.params.items() if k != "scope"})
            self._challenges[host] = remembered
            rejected = sent.removeprefix("Bearer ") if sent and sent.startswith("Bearer ") else None
            scope = bearer.params.get("scope")
            await self.token(host, remembered, repository, credentials, rejected=rejected, scope=scope)
            return True
        basic = next((c for c in challenges if c.scheme == "basic"), None)
        if basic is not None:
            self._challenges[host] = basic
            offer = basic_authorization(credentials) if credentials else None
            return offer is not None and offer != sent
        return False

    async def token(
        self,
        host: str,
        challenge: Challenge,
        repository: str,
        credentials: Credentials | None,
        *,
        rejected: str | None,
        scope: str | None = None,
    ) -> str:
        """A cached or fresh token for pulling `repository`; single-flight per (host, service, scope)."""
        key = (host, challenge.service or "", pull_scope(repository))
        lock = self._token_locks.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self._tokens.get(key)
            if cached is not None and cached != rejected:
                return cached
            scopes = [pull_scope(repository)]
            if scope and scope not in scopes:
                scopes.insert(0, scope)
            token, lifetime = await self.retry.run(
                lambda: self.fetch_token(host, challenge, scopes, credentials), host=host
            )
            self._tokens.put(key, token, lifetime)
            return token

    async def fetch_token(
        self, host: str, challenge: Challenge, scopes: list[str], credentials: Credentials | None
    ) -> tuple[str, float]:
        try:
            request = build_token_request(challenge, scopes, credentials)
        except ValueError as exc:
            raise Unauthorized(f"{host}: {exc}", host=host) from None
        try:
            check_configured_realm(
                self.settings, host, request.url, sends_credentials=request.sends_credentials
            )
        except RealmRefused as exc:
            raise TokenRealmRefused(str(exc), host=host) from None
        body = await self._exchange(host, request, credentials)
        try:
            return parse_token_response(body)
        except ValueError as exc:
            raise Unauthorized(f"{describe_token_request(host, request)}: {exc}", host=host) from None
