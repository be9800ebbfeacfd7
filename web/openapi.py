"""The OpenAPI 3.1 document for `/api/openapi.json`, built from the same pydantic models the API uses."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel

from scanner.models import ImageReport


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
    for name, definition in schema.pop("$defs", {}).items():
        components[name] = definition
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def query(name: str, description: str, kind: str = "string") -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": {"type": kind},
    }


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}


@cache
def openapi_document() -> dict[str, Any]:
    from web.api import JobView, ScanBody

    components: dict[str, Any] = {"Error": ERROR}
    report = _schema(ImageReport, components)
    job = _schema(JobView, components)
    scan_body = _schema(ScanBody, components)
    error = {"$ref": "#/components/schemas/Error"}
    bearer: list[dict[str, list[str]]] = [{"bearer": []}]
    paths: dict[str, Any] = {
        "/api/images": {
            "get": {
                "summary": "List scanned images",
                "parameters": [
                    query("gpu", "true: needs an NVIDIA GPU; false: CPU only", "boolean"),
                    query("libc", "glibc, musl, none or unknown"),
                    query("cuda", "CUDA version, e.g. 12 or 12.2"),
                    query("registry", "registry host"),
                    query("q", "free text over repository, reference, digest and distro"),
                    query("page", "page number, from 1", "integer"),
                    query("limit", "rows per page (max 200)", "integer"),
                ],
                "responses": {"200": _json({"type": "object"}, "a page of images")},
            }
        },
        "/api/images/by-ref": {
            "get": {
                "summary": "Latest report for a tag or digest reference (the `gpubadge scan --json` shape)",
                "parameters": [{**query("ref", "image reference"), "required": True}],
                "responses": {
                    "200": _json(report, "the report"),
                    "400": _json(error, "invalid reference"),
                    "404": _json(error, "not scanned; `pending` says whether a scan is queued"),
                },
            }
        },
        "/api/scans": {
            "get": {"summary": "Recent scan jobs", "responses": {"200": _json({"type": "object"}, "jobs")}},
            "post": {
                "summary": "Request a scan",
                "security": bearer,
                "requestBody": {"required": True, "content": {"application/json": {"schema": scan_body}}},
                "responses": {
                    "202": _json(job, "queued"),
                    "400": _json(error, "invalid reference"),
                    "401": _json(error, "token required"),
                    "403": _json(error, "registry not allowed"),
                },
            },
        },
        "/api/scans/{job_id}": {
            "get": {
                "summary": "A scan job's state and error",
                "parameters": [
                    {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}},
                    query("wait", "seconds to wait for the job to finish (max 60)", "number"),
                ],
                "responses": {"200": _json(job, "the job"), "404": _json(error, "unknown job")},
            }
        },
        "/api/scans/{job_id}/retry": {
            "post": {
                "summary": "Retry a failed scan job",
                "security": bearer,
                "parameters": [
                    {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {"202": _json(job, "queued again"), "404": _json(error, "unknown job")},
            }
        },
        "/hooks/{source}": {
            "post": {
                "summary": "Registry webhook (distribution, dockerhub, harbor, ghcr, quay, gar, ecr, jfrog)",
                "parameters": [
                    {"name": "source", "in": "path", "required": True, "schema": {"type": "string"}},
                    query("token", "shared secret, for senders that cannot set headers"),
                ],
                "responses": {
                    "202": _json({"type": "object"}, "jobs committed"),
                    "400": _json(error, "malformed payload"),
                    "401": _json(error, "bad or missing secret or signature"),
                    "403": _json(error, "registry not on the allowlist"),
                    "404": _json(error, "unknown source"),
                    "413": _json(error, "body too large"),
                },
            }
        },
        "/healthz": {"get": {"summary": "Liveness", "responses": {"200": _json({"type": "object"}, "ok")}}},
        "/metrics": {
            "get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text format"}}}
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpubadge", "version": "0.1.0"},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def add_paths(extra: dict[str, Any]) -> None:
    """Let other route modules (placement, agents) document their paths too."""
    openapi_document()["paths"].update(extra)
