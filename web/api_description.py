"""Each API route declared once, with its description; the OpenAPI 3.1 document derived from them.

A route module makes one `ApiRoutes` and declares every handler on it with its summary, parameters,
request body, responses and whether it needs a token (`@ROUTES.get(path, ...)`). `setup` adds those
routes to the application and records them on it (`DECLARED`); `openapi_document` turns declared
routes into the document `/api/openapi.json` serves. Schemas come from the same pydantic models the
handlers use: a description names a model (or `Model(model, mode)`, or `ImageBody`) where a schema
goes, and the document registers it under `components` and puts a `$ref` there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Model:
    """A pydantic model as a schema, in `mode` (validation for bodies the API reads)."""

    model: type[BaseModel]
    mode: JsonSchemaMode = "serialization"


@dataclass(frozen=True)
class ImageBody:
    """A flat `{"image": REF, ...fields of models}` request body, as the placement endpoints read it.

    The handlers pop `image` (and the run fields) before validating the rest, so the body is one
    object, not an `allOf` of the models: those forbid unknown fields and would reject `image`.
    """

    name: str
    models: tuple[type[BaseModel], ...]


@dataclass(frozen=True)
class Operation:
    """One route and its description: what `/api/openapi.json` says of `method path`."""

    method: str
    path: str
    handler: Handler
    summary: str
    responses: Mapping[str, Any]
    parameters: Sequence[Mapping[str, Any]] = ()
    body: Any = None  # a schema (model, `Model`, `ImageBody` or dict) of the JSON request body
    body_required: bool = True
    description: str | None = None
    token: bool = False  # needs a bearer token (API or agent) whatever public_reads says

    def document(self) -> dict[str, Any]:
        """The operation object, schemas still as models (`openapi_document` resolves them)."""
        operation: dict[str, Any] = {"summary": self.summary}
        if self.description is not None:
            operation["description"] = self.description
        if self.token:
            operation["security"] = [{"bearer": []}]
        if self.parameters:
            operation["parameters"] = list(self.parameters)
        if self.body is not None:
            operation["requestBody"] = {
                "required": self.body_required,
                "content": {"application/json": {"schema": self.body}},
            }
        operation["responses"] = dict(self.responses)
        return operation


DECLARED = web.AppKey("declared_routes", list[Operation])


@dataclass
class ApiRoutes:
    """A route module's API routes, each declared once with its description."""

    operations: list[Operation] = field(default_factory=list)

    def route(self, method: str, path: str, summary: str, **described: Any) -> Callable[[Handler], Handler]:
        """Declare the decorated handler as `method path`, described by `summary` and `described`
        (the other fields of `Operation`)."""

        def declare(handler: Handler) -> Handler:
            self.operations.append(Operation(method, path, handler, summary, **described))
            return handler

        return declare

    def get(self, path: str, summary: str, **described: Any) -> Callable[[Handler], Handler]:
        return self.route("GET", path, summary, **described)

    def post(self, path: str, summary: str, **described: Any) -> Callable[[Handler], Handler]:
        return self.route("POST", path, summary, **described)

    def delete(self, path: str, summary: str, **described: Any) -> Callable[[Handler], Handler]:
        return self.route("DELETE", path, summary, **described)

    def setup(self, app: web.Application) -> None:
        """Add the routes to `app`, in the order declared, and record them for its API document."""
        if DECLARED not in app:
            app[DECLARED] = []
        for operation in self.operations:
            app.router.add_route(operation.method, operation.path, operation.handler)
            app[DECLARED].append(operation)


# ------------------------------------------------------------ description parts


def query(name: str, description: str, kind: str = "string") -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": {"type": kind},
    }


def path_parameter(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def json_reply(schema: Any, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {"type": "string"},
        "scan": {
            "type": "string",
            "description": "the ID of the scan queued for the answer, to wait on and ask again",
        },
    },
    "required": ["error"],
}
ERROR = {"$ref": "#/components/schemas/Error"}
OBJECT = {"type": "object"}
# With GPUBADGE_PUBLIC_READS=false every read needs the API token too.
PRIVATE = {"401": json_reply(ERROR, "API token required (writes, scans, and reads when reads are private)")}
AGENT_ONLY = {
    "401": json_reply(ERROR, "agent token required"),
    "403": json_reply(ERROR, "a per-agent token presented for another server"),
}
FLEET_ONLY = {
    "401": json_reply(ERROR, "the fleet-wide agent token is required"),
    "403": json_reply(ERROR, "no fleet-wide agent token is configured"),
}
TOO_LARGE = {"413": json_reply(ERROR, "body larger than GPUBADGE_MAX_BODY_BYTES")}
GPU_CLAIMED = {
    "409": json_reply(
        ERROR, "a GPU UUID belongs to another server (or another live server reports it); `claimed` names it"
    )
}
BAD_QUERY = {"400": json_reply(ERROR, "a query parameter is not of its type")}
NOT_PLACEABLE = {
    **PRIVATE,
    **TOO_LARGE,
    "400": json_reply(ERROR, "invalid body or reference, or JSON beyond the GPUBADGE_JSON_* limits"),
    "403": json_reply(ERROR, "registry not on the allowlist"),
    "422": json_reply(ERROR, "the image could not be scanned"),
    "503": json_reply(ERROR, "scanner not ready"),
}
QUEUE_FULL = "the queue holds GPUBADGE_MAX_QUEUED_SCANS scans; Retry-After says when"
NOT_SCANNED_NO_TOKEN = (
    "never scanned, and no API token to scan it: says how to request it; or, with the token, its scan took"
    " longer than GPUBADGE_UNSCANNED_SCAN_WAIT: it is queued, and the message names the scan's ID"
)


# ------------------------------------------------------------------ the document


def openapi_document(operations: Iterable[Operation]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `operations`, each model registered once under components."""
    components: dict[str, Any] = {"Error": ERROR_SCHEMA}
    paths: dict[str, Any] = {}
    for operation in operations:
        paths.setdefault(operation.path, {})[operation.method.lower()] = _resolve(
            operation.document(), components
        )
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpubadge", "version": "0.1.0"},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _resolve(part: Any, components: dict[str, Any]) -> Any:
    """`part` with every model in it replaced by a `$ref` to its schema, registered in components."""
    if isinstance(part, type) and issubclass(part, BaseModel):
        return _schema(part, components)
    if isinstance(part, Model):
        return _schema(part.model, components, part.mode)
    if isinstance(part, ImageBody):
        return _image_body(part, components)
    if isinstance(part, dict):
        return {key: _resolve(value, components) for key, value in part.items()}
    if isinstance(part, list):
        return [_resolve(value, components) for value in part]
    return part


def _schema(
    model: type[BaseModel], components: dict[str, Any], mode: JsonSchemaMode = "serialization"
) -> dict[str, str]:
    """Register `model` (and the models it uses) under components; returns a `$ref` to it."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
    for name, definition in schema.pop("$defs", {}).items():
        components[name] = definition
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _image_body(body: ImageBody, components: dict[str, Any]) -> dict[str, str]:
    properties: dict[str, Any] = {
        "image": {"type": "string", "description": "image reference: a tag or a digest"}
    }
    required = ["image"]
    for model in body.models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        components.update(schema.pop("$defs", {}))
        properties.update(schema.get("properties", {}))
        required += schema.get("required", [])
    components[body.name] = {
        "title": body.name,
        "description": "The request fields may also be an Akash SDL `resources` block or ZenML ResourceSettings.",
        "type": "object",
        "properties": properties,
        "required": required,
    }
    return {"$ref": f"#/components/schemas/{body.name}"}
