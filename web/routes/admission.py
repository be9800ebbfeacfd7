"""`POST /k8s/admit`: a Kubernetes admission webhook (AdmissionReview v1) for GPU images.

Validating by default; `?mutate=true` turns it into the mutating webhook (a JSONPatch
adding the GPU limit and node affinity). The decisions are pure (placement/admission.py);
this module parses the review, looks each image up in the store (stored reports only, no
registry call, so an answer never waits on a registry), and writes the AdmissionReview back.

Failure policy: the API server's `failurePolicy` decides what happens when gpubadge is
down or slow; the manifests in deploy/kubernetes/ use `Ignore`, so gpubadge can never
block a cluster, and a short `timeoutSeconds`. Inside the handler, any problem with one
image (an unparsable reference, a store error) becomes a warning and that image is
allowed; only a malformed AdmissionReview gets a 400. `GPUBADGE_ADMISSION=warn` turns the
"needs a GPU but requests none" denial into a warning; unreachable-node denials stay.

Who may start work: the endpoint answers anyone from stored reports (that is all an answer
needs), but queues a scan of an unknown image only for a review that proves it comes from the
API server: it carries the API token (`Authorization: Bearer`, which the API server sends when
its AdmissionConfiguration kubeconfig names the token for this webhook), or it arrived on the
HTTPS listener with a client certificate signed by GPUBADGE_ADMISSION_CLIENT_CA. Any other
review queues nothing and says so in its warning. One review queues at most
GPUBADGE_MAX_SCANS_PER_DELIVERY scans, and none past the queue's cap (GPUBADGE_MAX_QUEUED_SCANS).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs.intake import QueueFull
from placement.admission import Pod, Review, containers_of, review_pod
from placement.exports import known_gpus
from placement.exports.core import KnownGpu
from scanner.models import ImageReport
from scanner.registry.reference import ReferenceError, parse_reference
from web.errors import read_json
from web.fleet.live_fleet import fleet_index
from web.guards.connections import GuardedRunner, connection_limits
from web.lookups import find_report
from web.security import holds_api_token
from web.state import services_of_app

if TYPE_CHECKING:
    from web.state import Services

log = logging.getLogger(__name__)

ADMISSION_API = "admission.k8s.io/v1"
MUTATE_PATH = "/k8s/admit/mutate"  # the same as ?mutate=true, for webhook configs (no query in service paths)
MAX_IMAGES = 64  # distinct images looked up per review; more are allowed with a warning


class _GroupVersionKind(BaseModel):
    model_config = ConfigDict(extra="ignore")
    group: str = ""
    version: str = ""
    kind: str = ""


class AdmissionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    uid: str = Field(min_length=1)
    kind: _GroupVersionKind
    operation: str = "CREATE"
    namespace: str | None = None
    object: dict[str, Any] | None = None
    dry_run: bool = Field(default=False, alias="dryRun")


class AdmissionReview(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    api_version: str = Field(alias="apiVersion")
    kind: str
    request: AdmissionRequest


async def admit(
    services: Services, main: web.Application, background: set[asyncio.Task[Any]], request: web.Request
) -> web.Response:
    settings = services.settings
    # Strings are bounded by the body size: kubectl's last-applied-configuration annotation can be long.
    limits = dataclasses.replace(settings.json_limits(), max_string=settings.max_body_bytes)
    try:
        review = AdmissionReview.model_validate(await read_json(request, limits))
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        return _bad_request(f"not an AdmissionReview: {where}: {first['msg']}")
    if review.api_version != ADMISSION_API or review.kind != "AdmissionReview":
        return _bad_request(f"expected apiVersion {ADMISSION_API}, kind AdmissionReview")
    mutate = request.path == MUTATE_PATH or request.query.get("mutate", "").lower() in ("1", "true", "yes")
    started = time.perf_counter()
    answer = await _answer(
        services,
        main,
        background,
        review.request,
        mutate=mutate,
        may_queue=may_queue_scans(services, request),
    )
    webhook = "mutate" if mutate else "validate"
    services.metrics.admission.inc(webhook, _decision(answer))
    services.metrics.admission_seconds.observe(time.perf_counter() - started, webhook)
    return web.json_response({"apiVersion": ADMISSION_API, "kind": "AdmissionReview", "response": answer})


async def _answer(
    services: Services,
    main: web.Application,
    background: set[asyncio.Task[Any]],
    request: AdmissionRequest,
    *,
    mutate: bool,
    may_queue: bool,
) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": request.uid, "allowed": True}
    if request.kind.kind != "Pod" or request.kind.group != "" or request.object is None:
        return response  # not ours to judge; the webhook rules should not send these
    if request.operation not in ("CREATE", "UPDATE"):
        return response
    try:
        pod = Pod.model_validate(request.object)
    except ValidationError:
        response["warnings"] = ["gpubadge could not read this Pod's spec; not checked"]
        return response
    reports, warnings = await _stored_reports(services, pod)
    unknown = [image for image, report in reports.items() if report is None]
    outdated = [
        image
        for image, report in reports.items()
        if report is not None and any(platform.outdated for platform in report.platforms)
    ]
    warnings += [
        f"{image}: judged from a report an older gpubadge analysis wrote, which may miss what newer judges read"
        for image in outdated
    ]
    unknown += outdated  # a scan reads them again (it does not reuse an outdated report)
    if not request.dry_run and unknown:  # queuing a scan is our one side effect: NoneOnDryRun
        if may_queue:
            _scan_unknown(services, background, unknown)
        elif services.settings.admission_scan_unknown and services.runs_scans:
            warnings.append(
                "gpubadge queued no scan of the unknown images: this review carries neither the API token nor"
                " a client certificate signed by GPUBADGE_ADMISSION_CLIENT_CA"
            )
    fleet = await _known_gpus(main) if mutate else []
    outcome: Review = review_pod(
        pod,
        reports,
        mode=services.settings.admission,
        mutate=mutate,
        fleet=fleet,
        gpu_code_rule=services.settings.gpu_code_rule,
    )
    outcome.warnings = warnings + outcome.warnings
    response["allowed"] = outcome.allowed
    if not outcome.allowed:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": outcome.message}
    if outcome.warnings:
        response["warnings"] = outcome.warnings
    if outcome.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(outcome.patch).encode()).decode()
    return response


async def _stored_reports(services: Services, pod: Pod) -> tuple[dict[str, ImageReport | None], list[str]]:
    """Stored reports only (the store runs SQL in its own threads); unknown images map to None."""
    images = list(dict.fromkeys(ref.container.image for ref in containers_of(pod) if ref.container.image))
    warnings = []
    if len(images) > MAX_IMAGES:
        warnings.append(f"gpubadge checked the first {MAX_IMAGES} of {len(images)} images")
        images = images[:MAX_IMAGES]

    found: dict[str, ImageReport | None] = {}
    try:
        for image in images:
            try:
                found[image] = await find_report(services, parse_reference(image))
            except ReferenceError:
                found[image] = None
    except Exception:  # the store failing must not turn into a denial or a 500 the API server retries
        log.exception("admission: store lookup failed")
        return {}, [*warnings, "gpubadge could not read its store; images not checked"]
    return found, warnings


async def _known_gpus(main: web.Application) -> list[KnownGpu]:
    """The GPU products of the live fleet (kept between requests by web.fleet.live_fleet); none if unreadable."""
    try:
        return known_gpus(await fleet_index(main))
    except Exception:
        log.exception("admission: reading the fleet failed; brand clauses get no product lists")
        return []


def _decision(answer: dict[str, Any]) -> str:
    if not answer["allowed"]:
        return "denied"
    if "patch" in answer:
        return "patched"
    return "warned" if answer.get("warnings") else "allowed"


def may_queue_scans(services: Services, request: web.Request) -> bool:
    """Whether this review may queue scans: it holds the API token, or its TLS connection carries a
    client certificate the listener verified against GPUBADGE_ADMISSION_CLIENT_CA."""
    if holds_api_token(request, services.settings.api_token):
        return True
    if services.settings.admission_client_ca is None or request.transport is None:
        return False
    tls = request.transport.get_extra_info("ssl_object")
    return isinstance(tls, ssl.SSLObject) and bool(tls.getpeercert())


def _scan_unknown(services: Services, background: set[asyncio.Task[Any]], images: list[str]) -> None:
    """Queue scans of unknown images on allowed registries, so the next pod is checked; never awaited here.

    At most GPUBADGE_MAX_SCANS_PER_DELIVERY of them; none when the queue is full."""
    if not services.settings.admission_scan_unknown or not services.runs_scans:
        return
    wanted = []
    for image in images:
        try:
            reference = parse_reference(image)
        except ReferenceError:
            continue
        if services.settings.allows(reference.registry):
            wanted.append((str(reference), reference.registry))
    if not wanted:
        return
    wanted = wanted[: services.settings.max_scans_per_delivery]

    async def enqueue() -> None:
        try:
            await services.intake.enqueue(
                wanted, source="admission", max_attempts=services.settings.max_attempts
            )
            services.wake_workers()
        except QueueFull as full:
            log.warning("admission: %s", full)
        except Exception:
            log.exception("admission: queueing scans of unknown images failed")

    task = asyncio.get_running_loop().create_task(enqueue())
    background.add(task)
    task.add_done_callback(background.discard)


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


def routes(services: Services, main: web.Application) -> list[web.RouteDef]:
    """The admission routes; `main` is the service's application (its fleet), wherever they are served."""
    handler = functools.partial(admit, services, main, set())
    return [web.post("/k8s/admit", handler), web.post(MUTATE_PATH, handler)]


def setup_routes(app: web.Application) -> None:
    app.add_routes(routes(services_of_app(app), app))


def tls_listener(services: Services) -> Callable[[web.Application], AsyncIterator[None]]:
    """A second, HTTPS-only site serving just /k8s/admit, for the API server (which calls webhooks over TLS).

    The certificate is read at start; restart the service after rotating it.
    """
    settings = services.settings

    async def listen(main: web.Application) -> AsyncIterator[None]:
        if settings.admission_tls_port is None:
            yield
            return
        if settings.admission_tls_cert is None or settings.admission_tls_key is None:
            raise ValueError("admission_tls_port needs admission_tls_cert and admission_tls_key")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        await asyncio.to_thread(
            context.load_cert_chain, str(settings.admission_tls_cert), str(settings.admission_tls_key)
        )
        if settings.admission_client_ca is not None:
            # Asked for, not required: a review without one is still answered, from stored reports.
            await asyncio.to_thread(context.load_verify_locations, cafile=str(settings.admission_client_ca))
            context.verify_mode = ssl.CERT_OPTIONAL
        app = web.Application(client_max_size=settings.max_body_bytes)
        app.add_routes(routes(services, main))
        # The guard does the handshake: counted against the cap from the connection's accept, and
        # given request_head_timeout to finish (web/connections.py).
        runner = GuardedRunner(app, connection_limits(settings), tls=context, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.admission_tls_port)
        await site.start()
        log.info("admission webhook on https://%s:%d/k8s/admit", settings.host, settings.admission_tls_port)
        try:
            yield
        finally:
            await runner.cleanup()

    return listen
