"""Secrets out of text, and every gpubadge process's log lines: who wrote them, no secret in them.

Webhook senders that cannot set headers put their secret in the URL (`?token=`), registries
answer with pre-signed URLs (`X-Amz-Signature`, `sig`), and scan errors quote them. So every
URL-shaped text a process writes out passes through `redact_secrets`: secret query values, URL
passwords and Bearer/Basic credentials are replaced, everything a reader needs stays.

`process_logging` sets up a process's root logger the one way every role shares (`serve`, its
worker processes, `gpubadge worker`): each line names the process's role and pid, and passes
`RedactingLogFilter`. It lives here, on the lowest floor, so the job runtime's processes (jobs/,
which never imports web/) redact exactly as the service does.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote_plus

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


class RedactingLogFilter(logging.Filter):
    """For a process's own handlers: every log line loses the secrets `redact_secrets` finds.

    Scan errors quote registry and storage URLs, which may be pre-signed. Each command installs
    this on its own handlers (`process_logging`; library code never touches process-wide logging).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_secrets(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


class ProcessRole(logging.Filter):
    """Names the process in every record (`%(role)s`): `serve`, `worker`, or `worker-2` for the second
    worker process `serve` supervises, so interleaved lines on one stream tell their writers apart."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


LOG_FORMAT = "%(asctime)s %(levelname)s %(role)s[%(process)d] %(name)s: %(message)s"


def process_logging(level: str, role: str) -> None:
    """The root logger of a command's process: `level`, lines on stderr in LOG_FORMAT (role and pid),
    secrets redacted. Raises ValueError for a level logging does not know."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:  # this process's own handlers, set up just above
        handler.addFilter(ProcessRole(role))
        handler.addFilter(RedactingLogFilter())
