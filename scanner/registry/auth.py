"""Registry authentication, without I/O: challenges, token requests and responses, a token cache.

The registry client does the HTTP; this module decides what to send. We never
ping `/v2/`: the real request's 401 carries the challenge, and we remember each
host's challenge so later repositories on that host get a token before their
first request instead of after a wasted 401.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from scanner.registry.credentials import Credentials
from scanner.registry.reference import is_loopback, split_host

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
