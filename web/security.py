"""Secrets and credentials: redaction, the access log and log filter that apply it, and the tokens
a request presents (bearer or HTTP Basic), compared in constant time.

Webhook senders that cannot set headers put their secret in the URL (`?token=`), and
registries answer with pre-signed URLs (`X-Amz-Signature`, `sig`). Such URLs must not reach
the access log or an error message, so every URL-shaped text the service writes out passes
through `redact_secrets` first. The access logger here does that for each line aiohttp logs;
`gpubadge serve` and the test fixtures run the service with it.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import re
from collections.abc import Iterable
from urllib.parse import unquote_plus

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web_log import AccessLogger
from pydantic import SecretStr

REDACTED = "[redacted]"

# Query parameter names that carry a secret (compared lower-case, `-` and `_` ignored).
SECRET_PARAMETERS = frozenset(
    {
        "token",
        "accesstoken",
        "apitoken",
        "authtoken",
        "idtoken",
        "refreshtoken",
        "secret",
        "clientsecret",
        "password",
        "passwd",
        "pass",
        "key",
        "apikey",
        "sig",
        "signature",
        "xamzsignature",
        "xamzsecuritytoken",
        "xamzcredential",
        "xgoogsignature",
        "xgooglesignature",
        "xgoogcredential",
        "code",
        "auth",
        "authorization",
        "session",
        "sessiontoken",
    }
)
# Headers whose value is a credential: logged, if a log format names them, as REDACTED.
SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "cookie", "set-cookie", "x-jfrog-event-auth"}
)

_QUERY_PARAMETER = re.compile(r"(?P<lead>[?&;])(?P<name>[^=&;#\s\"'<>]+)=(?P<value>[^&;#\s\"'<>]*)")
_URL_USERINFO = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@\s:]*):(?P<password>[^/@\s]*)@"
)
_BEARER = re.compile(
    r"(?i)(?P<scheme>\bbearer|authorization:\s*basic)\s+(?P<credential>[A-Za-z0-9._~+/=-]{8,})"
)


def is_secret_parameter(name: str) -> bool:
    """`token`, `X-Amz-Signature`, also when percent-encoded (`%74oken` reads as `token` too)."""
    plain = unquote_plus(name).lower().replace("-", "").replace("_", "")
    return plain in SECRET_PARAMETERS


def redact_secrets(text: str) -> str:
    """`text` with secret query values, URL passwords and Bearer/Basic credentials replaced.

    Works on whole messages, not only on URLs: an error that quotes a pre-signed URL or a
    request line loses the secret and keeps everything a reader needs to act on it.
    """
    if not text:
        return text

    def parameter(match: re.Match[str]) -> str:
        if is_secret_parameter(match["name"]) and match["value"]:
            return f"{match['lead']}{match['name']}={REDACTED}"
        return match[0]

    if "=" in text:
        text = _QUERY_PARAMETER.sub(parameter, text)
    if "@" in text:
        text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    if " " in text:
        text = _BEARER.sub(lambda m: f"{m['scheme']} {REDACTED}", text)
    return text


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


class RedactingLogFilter(logging.Filter):
    """For the handlers of `gpubadge serve`: every log line loses the secrets `redact_secrets` finds.

    Scan errors quote registry and storage URLs, which may be pre-signed. The application installs
    this on its own handlers (library code never touches process-wide logging).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_secrets(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


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
