"""The OpenAPI 3.1 document for `/api/openapi.json`, built from the same pydantic models the API uses."""

from __future__ import annotations

from functools import cache
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from placement.answer import AnswerOptions, EligibilityAnswer, ReasonCount
from placement.exports import FORMATS
from placement.inventory import Server
from placement.protocol import DeploymentsResponse, DeploymentStatus, Heartbeat, RegisterResponse
from placement.request import DeployRequest
from scanner.models import ImageReport
from web.api_models import Deployment, JobView, RunSpec, ScanBody


def _schema(
    model: type[BaseModel], components: dict[str, Any], mode: JsonSchemaMode = "serialization"
) -> dict[str, str]:
    """Register `model` (and the models it uses) under components; returns a `$ref` to it."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
    for name, definition in schema.pop("$defs", {}).items():
        components[name] = definition
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _image_body(name: str, components: dict[str, Any], *models: type[BaseModel]) -> dict[str, str]:
    """A flat `{"image": REF, ...fields of models}` request body, as the placement endpoints read it.

    The handlers pop `image` (and the run fields) before validating the rest, so the body is one
    object, not an `allOf` of the models: those forbid unknown fields and would reject `image`.
    """
    properties: dict[str, Any] = {
        "image": {"type": "string", "description": "image reference: a tag or a digest"}
    }
    required = ["image"]
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        components.update(schema.pop("$defs", {}))
        properties.update(schema.get("properties", {}))
        required += schema.get("required", [])
    components[name] = {
        "title": name,
        "description": "The request fields may also be an Akash SDL `resources` block or ZenML ResourceSettings.",
        "type": "object",
        "properties": properties,
        "required": required,
    }
    return {"$ref": f"#/components/schemas/{name}"}


def query(name: str, description: str, kind: str = "string") -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": {"type": kind},
    }


def _path(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}


@cache
def openapi_document() -> dict[str, Any]:

    components: dict[str, Any] = {"Error": ERROR}
    report = _schema(ImageReport, components)
    job = _schema(JobView, components)
    scan_body = _schema(ScanBody, components)
    server = _schema(Server, components, mode="validation")
    registered = _schema(RegisterResponse, components)
    heartbeat = _schema(Heartbeat, components, mode="validation")
    decision = _schema(EligibilityAnswer, components)
    reason_counts = _schema(ReasonCount, components)
    deployment = _schema(Deployment, components)
    agent_deployments = _schema(DeploymentsResponse, components)
    deployment_status = _schema(DeploymentStatus, components, mode="validation")
    eligibility_body = _image_body("EligibilityRequest", components, DeployRequest, AnswerOptions)
    deployment_body = _image_body("DeploymentRequest", components, DeployRequest, RunSpec)
    error = {"$ref": "#/components/schemas/Error"}
    bearer: list[dict[str, list[str]]] = [{"bearer": []}]
    servers_list = {"type": "object", "properties": {"servers": {"type": "array", "items": server}}}
    deployments_list = {
        "type": "object",
        "properties": {"deployments": {"type": "array", "items": deployment}},
    }
    eligibility_answer = {
        "allOf": [
            decision,
            {
                "type": "object",
                "properties": {
                    "image": {
                        "type": "object",
                        "properties": {
                            "reference": {"type": "string"},
                            "digest": {"type": ["string", "null"]},
                        },
                    },
                    "seconds": {"type": "number", "description": "time spent deciding"},
                },
            },
        ]
    }
    constraints_body = {
        "allOf": [
            eligibility_body,
            {
                "type": "object",
                "properties": {"format": {"enum": list(FORMATS)}},
                "required": ["format"],
            },
        ]
    }
    constraints_answer = {
        "type": "object",
        "properties": {
            "format": {"enum": list(FORMATS)},
            "satisfiable": {"type": "boolean", "description": "false: no node can be eligible"},
            "notes": {"type": "array", "items": {"type": "string"}},
            "affinity": {"type": "object", "description": "core/v1 Affinity (kubernetes, dra)"},
            "resources": {"type": "object", "description": "container resources (kubernetes)"},
            "resourceClaimTemplate": {"type": ["object", "null"], "description": "resource.k8s.io/v1 (dra)"},
            "hcl": {"type": "string", "description": "Nomad task fragment (nomad)"},
            "sdl": {"type": ["object", "null"], "description": "Akash SDL profiles (akash)"},
            "image": {"type": "object"},
        },
        "required": ["format", "satisfiable", "notes"],
    }
    # With GPUBADGE_PUBLIC_READS=false every read needs the API token too.
    private = {"401": _json(error, "API token required (writes, scans, and reads when reads are private)")}
    agent_only = {
        "401": _json(error, "agent token required"),
        "403": _json(error, "a per-agent token presented for another server"),
    }
    too_large = {"413": _json(error, "body larger than GPUBADGE_MAX_BODY_BYTES")}
    bad_query = {"400": _json(error, "a query parameter is not of its type")}
    not_placeable = {
        **private,
        **too_large,
        "400": _json(error, "invalid body or reference, or JSON beyond the GPUBADGE_JSON_* limits"),
        "403": _json(error, "registry not on the allowlist"),
        "422": _json(error, "the image could not be scanned"),
        "503": _json(error, "scanner not ready"),
    }
    paths: dict[str, Any] = {
        "/api/images": {
            "get": {
                "summary": "List scanned images",
                "parameters": [
                    query("gpu", "true: needs an NVIDIA GPU; false: CPU only", "boolean"),
                    query("libc", "glibc, musl, none or unknown"),
                    query("cuda", "CUDA version, e.g. 12 or 12.2"),
                    query(
                        "inferred", "true: CUDA found in the layers (deep scan); false: none found", "boolean"
                    ),
                    query("registry", "registry host"),
                    query("q", "free text over repository, reference, digest and distro"),
                    query("page", "page number, from 1", "integer"),
                    query("limit", "rows per page (max 200)", "integer"),
                ],
                "responses": {"200": _json({"type": "object"}, "a page of images"), **bad_query, **private},
            }
        },
        "/api/images/by-ref": {
            "get": {
                "summary": "Latest report for a tag or digest reference (the `gpubadge scan --json` shape)",
                "parameters": [
                    {**query("ref", "image reference"), "required": True},
                    query("wait", "seconds to wait for the report (max 60)", "number"),
                    {
                        "name": "until",
                        "in": "query",
                        "description": "what `wait` waits for: done (the full report, the default) or facts"
                        " (the config facts, published before the layers are read; `pending` is true then)",
                        "schema": {"type": "string", "enum": ["done", "facts"]},
                    },
                ],
                "responses": {
                    "200": _json(report, "the report; `pending` true while its layers are still being read"),
                    "400": _json(error, "invalid reference, wait or until"),
                    "404": _json(error, "not scanned; `pending` says whether a scan is queued"),
                    **private,
                },
            }
        },
        "/api/scans": {
            "get": {
                "summary": "Recent scan jobs",
                "parameters": [
                    query("state", "comma-separated job states: queued, running, done, failed"),
                    query("limit", "rows (max 200)", "integer"),
                ],
                "responses": {"200": _json({"type": "object"}, "jobs"), **bad_query, **private},
            },
            "post": {
                "summary": "Request a scan",
                "security": bearer,
                "requestBody": {"required": True, "content": {"application/json": {"schema": scan_body}}},
                "responses": {
                    "202": _json(job, "queued"),
                    "400": _json(error, "invalid reference or body"),
                    "401": _json(error, "token required"),
                    "403": _json(error, "registry not allowed"),
                    **too_large,
                    "503": _json(
                        error, "the queue holds GPUBADGE_MAX_QUEUED_SCANS scans; Retry-After says when"
                    ),
                },
            },
        },
        "/api/scans/{job_id}": {
            "get": {
                "summary": "A scan job's state and error",
                "parameters": [
                    _path("job_id"),
                    query("wait", "seconds to wait for the job to finish (max 60)", "number"),
                ],
                "responses": {
                    "200": _json(job, "the job"),
                    "404": _json(error, "unknown job"),
                    **bad_query,
                    **private,
                },
            }
        },
        "/api/scans/{job_id}/retry": {
            "post": {
                "summary": "Retry a failed scan job",
                "security": bearer,
                "parameters": [_path("job_id")],
                "responses": {
                    "202": _json(job, "queued again"),
                    "401": _json(error, "token required"),
                    "404": _json(error, "unknown job"),
                },
            }
        },
        "/hooks/{source}": {
            "post": {
                "summary": "Registry webhook (distribution, dockerhub, harbor, ghcr, quay, gar, ecr, jfrog, acr)",
                "parameters": [
                    _path("source"),
                    query("token", "shared secret, for senders that cannot set headers"),
                ],
                "responses": {
                    "202": _json({"type": "object"}, "jobs committed"),
                    "400": _json(error, "malformed payload, or JSON beyond the GPUBADGE_JSON_* limits"),
                    "401": _json(error, "bad or missing secret or signature, or no secret for this source"),
                    "403": _json(error, "registry not on the allowlist"),
                    "404": _json(error, "unknown source"),
                    "413": _json(error, "body too large, or more scans than GPUBADGE_MAX_SCANS_PER_DELIVERY"),
                    "503": _json(
                        error, "the queue holds GPUBADGE_MAX_QUEUED_SCANS scans; Retry-After says when"
                    ),
                },
            }
        },
        "/api/servers": {
            "get": {
                "summary": "Live servers: the inventory file plus agents heard from recently, with GPUs in use",
                "responses": {"200": _json(servers_list, "the fleet"), **private},
            },
            "post": {
                "summary": "Register a server (node agents); registering again replaces its inventory",
                "security": bearer,
                "requestBody": {"required": True, "content": {"application/json": {"schema": server}}},
                "responses": {
                    "200": _json(registered, "registered; heartbeat this often"),
                    "400": _json(error, "invalid server"),
                    **agent_only,
                    "409": _json(error, "a GPU UUID is reported by another live server; `claimed` names it"),
                    **too_large,
                },
            },
        },
        "/api/servers/{name}/heartbeat": {
            "post": {
                "summary": "Agent heartbeat; a `gpus` list replaces the server's GPUs",
                "security": bearer,
                "parameters": [_path("name")],
                "requestBody": {"required": False, "content": {"application/json": {"schema": heartbeat}}},
                "responses": {
                    "200": _json({"type": "object"}, "ok"),
                    "400": _json(error, "invalid heartbeat"),
                    **agent_only,
                    "404": _json(error, "unknown server: register again"),
                    "409": _json(error, "a GPU UUID is reported by another live server; `claimed` names it"),
                    **too_large,
                },
            }
        },
        "/api/eligibility": {
            "post": {
                "summary": "Which servers can run an image with this request, best fit first, and why not the others",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": eligibility_body}},
                },
                "description": "Eligible servers come a page at a time (`limit`, default 50; pass "
                "`next_cursor` back as `cursor`); ineligible servers are counted by reason with a few "
                "examples. `explain: all` lists every server, with every reason. `limit`, `cursor` "
                "and `explain` may also be given in the query string.",
                "parameters": [
                    query("limit", "eligible servers per page (default 50)", "integer"),
                    query("cursor", "`next_cursor` of the previous page"),
                    query("explain", "summary (default) or all"),
                ],
                "responses": {
                    "200": _json(eligibility_answer, "the decision"),
                    **not_placeable,
                    "404": _json(error, "never scanned, and no API token to scan it: says how to request it"),
                },
            }
        },
        "/api/constraints": {
            "post": {
                "summary": "The eligibility of an image in a scheduler's language: kubernetes, dra, nomad or akash",
                "description": "The eligibility body plus `format`. `kubernetes`: `affinity` (GPU Feature "
                "Discovery labels, integer Gt/Lt terms) and `resources`; `dra`: `resourceClaimTemplate` "
                "(resource.k8s.io/v1, CEL selectors) and an arch `affinity`; `nomad`: `hcl` (a task-level "
                "constraint and a device block); `akash`: `sdl` (a compute profile, null when no known "
                "model qualifies). `notes` says what the format cannot express or only approximates.",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": constraints_body}},
                },
                "responses": {
                    "200": _json(constraints_answer, "the constraints"),
                    **not_placeable,
                    "404": _json(error, "never scanned, and no API token to scan it: says how to request it"),
                },
            }
        },
        "/api/deployments": {
            "get": {
                "summary": "Deployments, newest first",
                "parameters": [query("server", "only this server's deployments")],
                "responses": {"200": _json(deployments_list, "deployments"), **private},
            },
            "post": {
                "summary": "Deploy an image: reserve GPUs on the best eligible server for its agent to run",
                "security": bearer,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": deployment_body}},
                },
                "responses": {
                    "201": _json(deployment, "reserved; the server's agent will run it"),
                    **not_placeable,
                    "401": _json(error, "token required"),
                    "404": _json(error, "no stored report for the image"),
                    "409": _json(
                        {
                            "allOf": [
                                error,
                                {
                                    "type": "object",
                                    "properties": {
                                        "ineligible_count": {"type": "integer"},
                                        "ineligible_by_reason": {"type": "array", "items": reason_counts},
                                    },
                                },
                            ]
                        },
                        "no server can run it; `ineligible_by_reason` says why",
                    ),
                },
            },
        },
        "/api/deployments/{id}": {
            "get": {
                "summary": "A deployment's state, exit code and last log lines",
                "parameters": [_path("id")],
                "responses": {
                    "200": _json(deployment, "the deployment"),
                    "404": _json(error, "unknown"),
                    **private,
                },
            },
            "delete": {
                "summary": "Stop a deployment (at once when its agent has not picked it up yet)",
                "security": bearer,
                "parameters": [_path("id")],
                "responses": {
                    "200": _json(deployment, "already finished"),
                    "202": _json(deployment, "stopping"),
                    "401": _json(error, "token required"),
                    "404": _json(error, "unknown deployment"),
                },
            },
        },
        "/api/deployments/{id}/status": {
            "post": {
                "summary": "Agent report of a deployment's state; a terminal state frees its GPUs",
                "security": bearer,
                "parameters": [_path("id")],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": deployment_status}},
                },
                "responses": {
                    "200": _json(deployment, "recorded"),
                    "400": _json(error, "invalid status"),
                    **agent_only,
                    "404": _json(error, "unknown deployment"),
                    **too_large,
                },
            }
        },
        "/api/agents/{name}/deployments": {
            "get": {
                "summary": "Agent long poll: answers at once when a deployment needs action, else after `wait`",
                "security": bearer,
                "parameters": [_path("name"), query("wait", "seconds to wait for work (max 60)", "number")],
                "responses": {
                    "200": _json(agent_deployments, "deployments to run or stop (maybe none)"),
                    "400": _json(error, "wait is not a number"),
                    **agent_only,
                    "409": _json(error, "back from silence, but its GPUs are now reported by another server"),
                },
            }
        },
        "/api/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")},
            }
        },
        "/healthz": {"get": {"summary": "Liveness", "responses": {"200": _json({"type": "object"}, "ok")}}},
        "/api/export.sqlite": {
            "get": {
                "summary": "Every stored report and the fleet as a gpubadge SQLite export (Datasette-ready)",
                "security": bearer,
                "responses": {
                    "200": {
                        "description": "the file `gpubadge export sqlite` writes",
                        "content": {
                            "application/vnd.sqlite3": {"schema": {"type": "string", "format": "binary"}}
                        },
                    },
                    "401": _json(error, "the API token is required"),
                    "403": _json(error, "no API token is configured, so nobody may export"),
                    "429": _json(error, "an export is being built; Retry-After says when to try again"),
                    "503": _json(error, "the store cannot be read, or the file cannot be written"),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    "401": {"description": "API token required (reads are private)"},
                },
            }
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


async def serve_openapi(_: web.Request) -> web.Response:
    return web.json_response(openapi_document())


def setup_routes(app: web.Application) -> None:
    app.router.add_get("/api/openapi.json", serve_openapi)
