"""Secrets on the HTTP side: the access log that redacts them, and the tokens a request presents
(bearer or HTTP Basic), compared in constant time.

Webhook senders that cannot set headers put their secret in the URL (`?token=`), and
registries answer with pre-signed URLs (`X-Amz-Signature`, `sig`). Such URLs must not reach
the access log or an error message, so every URL-shaped text the service writes out passes
through `scanner.redaction.redact_secrets` first (every process's log lines pass its
`RedactingLogFilter`). The access logger here does that for each line aiohttp logs;
`gpubadge serve` and the test fixtures run the service with it.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Iterable

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web_log import AccessLogger
from pydantic import SecretStr

from scanner.redaction import REDACTED, SECRET_HEADERS, redact_secrets


class RedactingAccessLogger(AccessLogger):
    """aiohttp's access log, with secrets in the request line and logged headers redacted.

    The format and the `extra` fields stay aiohttp's, so existing log pipelines keep working.
    """

    def _format_line(
        self, request: web.BaseRequest, response: web.StreamResponse, time: float
    ) -> Iterable[tuple[str | tuple[str, str], str]]:
        line = []
        for key, value in super()._format_line(request, response, time):
            if isinstance(key, tuple) and key[1].lower() in SECRET_HEADERS and value != "-":
                value = REDACTED
            elif isinstance(value, str):
                value = redact_secrets(value)
            line.append((key, value))
        return line


ACCESS_LOGGER: type[AbstractAccessLogger] = RedactingAccessLogger


# ------------------------------------------------------------------ credentials on requests


def bearer_token(request: web.BaseRequest) -> str | None:
    """The token of `Authorization: Bearer <token>`, if that is what the request carries."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def presented_token(request: web.BaseRequest) -> str | None:
    """A Bearer token, or the password of HTTP Basic auth (how a browser sends it to the UI)."""
    token = bearer_token(request)
    if token is not None:
        return token
    scheme, _, encoded = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic" or not encoded.strip():
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.partition(":")[2] or None


def token_matches(expected: SecretStr | None, given: str) -> bool:
    """True when no token is configured, or `given` equals it (compared in constant time)."""
    if expected is None:
        return True
    return hmac.compare_digest(given.encode(), expected.get_secret_value().encode())


def holds_api_token(request: web.BaseRequest, api_token: SecretStr | None) -> bool:
    """True only when a token is configured and the request presents it.

    Unlike `token_matches`, an unconfigured token proves nothing: what is shown only to token
    holders (deployment env values) stays hidden when there is no token to hold.
    """
    if api_token is None:
        return False
    return token_matches(api_token, presented_token(request) or "")


def mask_values(values: dict[str, str]) -> dict[str, str]:
    """Names kept, values hidden: `{"DB_PASSWORD": "[redacted]"}`."""
    return dict.fromkeys(values, REDACTED)


BASIC_CHALLENGE = 'Basic realm="gpubadge", charset="UTF-8"'
BEARER_CHALLENGE = 'Bearer realm="gpubadge"'
