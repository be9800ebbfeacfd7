"""One error shape for the whole service: `{"error": "..."}` with a status that fits.

Every failure inside a handler ends here, so the service stays up and the client learns
what went wrong in words, never a stack trace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from scanner.problems import dotted, expected
from scanner.redaction import redact_secrets
from store import StoreUnavailable
from web.bounded_json import JsonLimitExceeded, JsonLimits, loads_bounded

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ModelT = TypeVar("ModelT", bound=BaseModel)


def json_error(status: int, message: str, **extra: object) -> web.Response:
    """The error body; secrets in the message (a pre-signed URL, `?token=`) are redacted."""
    return web.json_response({"error": redact_secrets(message), **extra}, status=status)


def json_http_error(
    kind: type[web.HTTPException], message: str, headers: dict[str, str] | None = None, **extra: object
) -> web.HTTPException:
    """An HTTP error to raise from deep in a handler, with the same `{"error": ...}` body as json_error
    (and `extra` fields beside it: a queued scan's ID)."""
    return kind(
        text=json.dumps({"error": redact_secrets(message), **extra}),
        content_type="application/json",
        headers=headers,
    )


async def read_json(
    request: web.Request, limits: JsonLimits, *, empty: Any = None, most: tuple[int, str] | None = None
) -> Any:
    """The request body as JSON within `limits`; 400 (or 413) with the reason otherwise.

    `empty` is returned for an empty body when given (a heartbeat may have none). `most`, (bytes,
    the setting's name), bounds this body below GPUBADGE_MAX_BODY_BYTES: a larger one is 413,
    refused on its Content-Length before it is read where it declares one, and never parsed.
    """
    if most is not None and (request.content_length or 0) > most[0]:
        raise _too_large(most[0], request.content_length or 0, most[1])
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise web.HTTPRequestEntityTooLarge(
            max_size=request.app._client_max_size,
            text=json.dumps({"error": "body larger than the limit (GPUBADGE_MAX_BODY_BYTES)"}),
            content_type="application/json",
        ) from None
    if most is not None and len(body) > most[0]:
        raise _too_large(most[0], len(body), most[1])
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


def _too_large(most: int, size: int, setting: str) -> web.HTTPException:
    return web.HTTPRequestEntityTooLarge(
        max_size=most,
        actual_size=size,
        text=json.dumps({"error": f"body of {size:,} bytes; at most {most:,} are accepted here ({setting})"}),
        content_type="application/json",
    )


async def read_model(
    request: web.Request,
    limits: JsonLimits,
    model: type[ModelT],
    what: str,
    *,
    empty: Any = None,
    most: tuple[int, str] | None = None,
) -> ModelT:
    """The request body (read_json within `limits` and `most`) checked as `model`; 400 `invalid {what}: ...` otherwise."""
    data = await read_json(request, limits, empty=empty, most=most)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise json_http_error(web.HTTPBadRequest, f"invalid {what}: {first_error(exc)}") from None


def first_error(exc: ValidationError) -> str:
    """The first validation error in plain words, `where: what was expected, got what`
    (scanner.problems), never pydantic's phrasing: `gpus: expected an integer, got 'two'`."""
    error = exc.errors(include_url=False)[0]
    where = dotted(tuple(error.get("loc", ())))
    return f"{where}: {expected(error)}" if where else expected(error)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON (or plain) error; the service stays up."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if (
            exc.status >= 400
            and exc.content_type != "application/json"
            and request.path.startswith(("/api", "/hooks", "/k8s"))
        ):
            return json_error(
                exc.status, exc.reason if exc.text is None else exc.text.removeprefix(f"{exc.status}: ")
            )
        raise
    except StoreUnavailable as exc:  # the database is locked, full or gone: the client may retry
        log.warning("%s %s: %s", request.method, request.path, exc)
        return web.json_response(  # the cause in words, not where (no file path, no host)
            {"error": f"the database is unavailable, retry later: {exc.public}"},
            status=503,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    except ConnectionResetError:
        # the client went away, or was closed for sending too slowly (web/connections.py): no one to answer
        log.info("%s %s: connection closed before the request was read", request.method, request.path)
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(500, "internal error; see the service log")
