"""The one JSON error shape (`{"error": ...}`) and reading JSON bodies into it.

Kept apart from web/app.py so that handler modules can use it without importing the app.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from web.bounded_json import JsonLimitExceeded, JsonLimits, loads_bounded
from web.security import redact_secrets


def json_error(status: int, message: str, **extra: object) -> web.Response:
    return web.json_response({"error": redact_secrets(message), **extra}, status=status)


def json_http_error(
    kind: type[web.HTTPException], message: str, headers: dict[str, str] | None = None
) -> web.HTTPException:
    """An HTTP error to raise from deep in a handler, with the same `{"error": ...}` body as json_error."""
    return kind(
        text=json.dumps({"error": redact_secrets(message)}),
        content_type="application/json",
        headers=headers,
    )


async def read_json(request: web.Request, limits: JsonLimits, *, empty: Any = None) -> Any:
    """The request body as JSON within `limits`; 400 (or 413) with the reason otherwise.

    `empty` is returned for an empty body when given (a heartbeat may have none).
    """
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise web.HTTPRequestEntityTooLarge(
            max_size=request.app._client_max_size,
            text=json.dumps({"error": "body larger than the limit (GPUBADGE_MAX_BODY_BYTES)"}),
            content_type="application/json",
        ) from None
    if not body.strip() and empty is not None:
        return empty
    try:
        return loads_bounded(body, limits)
    except JsonLimitExceeded as exc:
        raise json_http_error(web.HTTPBadRequest, f"body refused: {exc}") from None
    except UnicodeDecodeError:
        raise json_http_error(web.HTTPBadRequest, "body is not UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise json_http_error(
            web.HTTPBadRequest, f"body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
