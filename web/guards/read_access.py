"""Private reads: with `public_reads=false`, a middleware that asks every read for the API token.

Liveness probes, the API description, static files, webhooks and the agents' endpoints stay
open; they carry no image data or authenticate with their own secrets.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Middleware

from web.errors import Handler, json_http_error
from web.security import BASIC_CHALLENGE, BEARER_CHALLENGE, holds_api_token
from web.settings import ServiceSettings

# Open even with public_reads=false: liveness probes carry no secrets, the API description and
# the stylesheet say nothing about the images, and agents authenticate with their own tokens.
ALWAYS_OPEN = ("/healthz", "/api/openapi.json")
ALWAYS_OPEN_PREFIXES = ("/static/", "/hooks/", "/api/agents/")
# Reads done with POST: they answer from stored results like a GET does.
POST_READS = frozenset({"/api/eligibility"})


def is_read(request: web.BaseRequest) -> bool:
    """Whether private reads guard this request: every GET, the POST reads, and every UI request.

    The UI's own form POST (`/scans`) answers with the page, job list included, so it is a read
    too; a browser signed in with HTTP Basic sends the token with it anyway. API writes are not
    reads: they check the API (or agent) token themselves.
    """
    path = request.path
    if path in ALWAYS_OPEN or path.startswith(ALWAYS_OPEN_PREFIXES):
        return False
    if request.method in ("GET", "HEAD") or not path.startswith("/api/"):
        return True
    return request.method == "POST" and path in POST_READS


def private_reads(settings: ServiceSettings) -> Middleware:
    """With public_reads=false, a middleware that asks every read for the API token.

    The JSON API takes `Authorization: Bearer <token>`. UI pages, badges and /metrics also take
    HTTP Basic with the token as the password, so a browser can prompt for it and Prometheus
    can send it; the 401 of a page asks for Basic, so that the browser shows its prompt.
    """

    @web.middleware
    async def require_token_for_reads(request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_read(request) and not holds_api_token(request, settings.api_token):
            if request.path.startswith("/api/"):
                raise json_http_error(
                    web.HTTPUnauthorized,
                    "reads need the API token here (Authorization: Bearer <token>)",
                    headers={"WWW-Authenticate": BEARER_CHALLENGE},
                )
            raise web.HTTPUnauthorized(
                text="This gpubadge needs the API token to be read: sign in with any user name"
                " and the token as the password.\n",
                headers={"WWW-Authenticate": BASIC_CHALLENGE},
            )
        return await handler(request)

    return require_token_for_reads
