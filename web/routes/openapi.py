"""`/api/openapi.json`: the OpenAPI 3.1 document of the routes declared on this application.

Nothing here lists the API: each route module declares its routes with their descriptions
(web/api_description.py), and the document is derived from what was declared on the app.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from web.api_description import DECLARED, OBJECT, ApiRoutes, json_reply, openapi_document

ROUTES = ApiRoutes()
# Filled at the first request, when every route module has declared its routes on the app.
DOCUMENT = web.AppKey("openapi_document", dict[str, dict[str, Any]])


@ROUTES.get("/api/openapi.json", "This document", responses={"200": json_reply(OBJECT, "OpenAPI 3.1")})
async def serve_openapi(request: web.Request) -> web.Response:
    built = request.app[DOCUMENT]
    if "document" not in built:
        declared = request.app[DECLARED]
        built["document"] = openapi_document(declared)
    return web.json_response(built["document"])


def setup_routes(app: web.Application) -> None:
    app[DOCUMENT] = {}
    ROUTES.setup(app)
