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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from scanner.credentials import Credentials

DEFAULT_TOKEN_LIFETIME = 60.0
TOKEN_EXPIRY_MARGIN = 5.0
TOKEN_RESPONSE_MAX = 64 * 1024
CLIENT_ID = "gpubadge"


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
