"""`GET /api/export.sqlite`: the whole store as a gpubadge SQLite export, for a holder of the API token.

For a pipeline that keeps a nightly copy (`curl -H 'Authorization: Bearer …' -o gpubadge.db`).
The file is the one `gpubadge export sqlite` writes (`store.export`): built in a thread (SQL,
sqlite-utils and file I/O never run on the event loop) into a private temporary directory,
then streamed in chunks read in a thread. The directory is removed as soon as the file is
open, so nothing is left behind however the download ends.

Only a configured, presented API token opens it (not merely "no token configured"): the
file holds every report and the fleet. One export is built at a time (`MAX_EXPORTS`); a
second request meanwhile gets 429 with Retry-After rather than another full read of the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

from aiohttp import web

from store import QueryRunner, StoreUnavailable
from store.export import ExportError, export_sqlite
from web.api_description import (
    ERROR,
    ApiRoutes,
    json_reply,
)
from web.errors import json_http_error
from web.security import BEARER_CHALLENGE, holds_api_token
from web.state import services_of

ROUTES = ApiRoutes()

CHUNK = 1 << 20  # bytes read from the file per thread hop while streaming
MAX_EXPORTS = 1  # exports built at once; each reads the whole store
_BUILDING = web.AppKey("export_building", asyncio.Semaphore)


def setup_routes(app: web.Application) -> None:
    app[_BUILDING] = asyncio.Semaphore(MAX_EXPORTS)
    ROUTES.setup(app)


@ROUTES.get(
    "/api/export.sqlite",
    "Every stored report and the fleet as a gpubadge SQLite export (Datasette-ready)",
    token=True,
    responses={
        "200": {
            "description": "the file `gpubadge export sqlite` writes",
            "content": {"application/vnd.sqlite3": {"schema": {"type": "string", "format": "binary"}}},
        },
        "401": json_reply(ERROR, "the API token is required"),
        "403": json_reply(ERROR, "no API token is configured, so nobody may export"),
        "429": json_reply(ERROR, "an export is being built; Retry-After says when to try again"),
        "503": json_reply(ERROR, "the store cannot be read, or the file cannot be written"),
    },
)
async def export_file(request: web.Request) -> web.StreamResponse:
    services = services_of(request)
    if not holds_api_token(request, services.settings.api_token):
        if services.settings.api_token is None:
            raise json_http_error(
                web.HTTPForbidden, "the export needs GPUBADGE_API_TOKEN to be configured, and presented"
            )
        raise json_http_error(
            web.HTTPUnauthorized,
            "the export needs the API token (Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": BEARER_CHALLENGE},
        )
    building = request.app[_BUILDING]
    if building.locked():
        raise json_http_error(
            web.HTTPTooManyRequests,
            "an export is being built; try again shortly",
            headers={"Retry-After": "30"},
        )
    # The build runs to its end even if the client goes away: the semaphore is released, and a
    # file nobody will read is closed, only when the thread is done.
    await building.acquire()
    build = asyncio.ensure_future(asyncio.to_thread(_build, services.store.blocking))
    build.add_done_callback(lambda _: building.release())
    try:
        handle = await asyncio.shield(build)
    except asyncio.CancelledError:
        build.add_done_callback(_close_unread)
        raise
    except ExportError as exc:
        raise json_http_error(web.HTTPServiceUnavailable, f"the export could not be built: {exc}") from exc
    except StoreUnavailable as exc:
        raise json_http_error(web.HTTPServiceUnavailable, str(exc)) from exc
    try:
        response = web.StreamResponse(
            headers={
                "Content-Type": "application/vnd.sqlite3",
                "Content-Disposition": 'attachment; filename="gpubadge.db"',
                "Content-Length": str(os.fstat(handle.fileno()).st_size),
            }
        )
        await response.prepare(request)
        while chunk := await asyncio.to_thread(handle.read, CHUNK):
            await response.write(chunk)
        await response.write_eof()
        return response
    finally:
        handle.close()


def _close_unread(build: asyncio.Future[BinaryIO]) -> None:
    if not build.cancelled() and build.exception() is None:
        build.result().close()


def _build(backend: QueryRunner) -> BinaryIO:
    """Export into a private temporary directory; the open file outlives the directory's removal."""
    directory = Path(tempfile.mkdtemp(prefix="gpubadge-export-"))
    try:
        out = directory / "gpubadge.db"
        export_sqlite(backend, out, source="service")
        return out.open("rb")
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(directory)
