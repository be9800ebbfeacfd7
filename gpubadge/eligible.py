"""`gpubadge eligible REF`: which servers can run an image, for deploy pipelines.

With `--servers FILE` it scans the image itself and decides locally (placement's
pure `decide`); with `--service URL` it asks a running service. Exit status:
0 when any server is eligible, 3 when none is, 1 on error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from gpubadge.files import load_inventory
from gpubadge.service import SERVICE_ENV, ServiceError, call, service_from_env, service_url

if TYPE_CHECKING:
    from scanner.models import ImageReport

# The option that sets each field of a deploy request (and of the answer's shape), for usage errors.
OPTION_OF_FIELD = {
    "gpus": "--gpus",
    "mig_devices": "--mig-devices",
    "mig_profiles": "--mig-profile",
    "gpu_models": "--gpu-model",
    "min_gpu_memory": "--min-gpu-memory",
    "min_compute_capability": "--min-compute-capability",
    "min_driver": "--min-driver",
    "cpus": "--cpus",
    "memory": "--memory",
    "labels": "--label",
    "gpu_code_rule": "--gpu-code-rule",
    "limit": "--limit",
    "cursor": "--cursor",
    "explain": "--explain",
}

EXIT_ELIGIBLE, EXIT_ERROR, EXIT_NONE = 0, 1, 3


def add_request_arguments(p: argparse.ArgumentParser) -> None:
    """Where the fleet comes from and what the deploy asks for: shared by `eligible` and `constraints`."""
    where = p.add_mutually_exclusive_group()  # one of them, or $GPUBADGE (service_from_env)
    where.add_argument("--servers", type=Path, help="inventory file (YAML or JSON, {servers: [...]})")
    where.add_argument(
        "--service",
        type=service_url,
        help=f"URL of a running gpubadge service (http://host:port; default ${SERVICE_ENV})",
    )
    p.add_argument("--gpus", type=int, help="whole GPUs needed (a GPU image defaults to 1)")
    p.add_argument(
        "--mig-devices", type=int, help="MIG devices needed instead of whole GPUs (1 with --mig-profile)"
    )
    p.add_argument(
        "--mig-profile",
        action="append",
        default=[],
        dest="mig_profiles",
        help="acceptable MIG profile, e.g. 1g.10gb (repeat)",
    )
    p.add_argument(
        "--gpu-model", action="append", default=[], dest="gpu_models", help="acceptable model (repeat)"
    )
    p.add_argument("--min-gpu-memory", help="per-GPU (or per-MIG-device) memory, e.g. 40Gi")
    p.add_argument("--min-compute-capability", help="e.g. 8.0")
    p.add_argument("--min-driver", help="e.g. 535.104.05")
    p.add_argument("--cpus", type=float, help="CPU cores")
    p.add_argument("--memory", help="memory, e.g. 64Gi")
    p.add_argument("--label", action="append", default=[], help="required server label key=value (repeat)")
    p.add_argument(
        "--gpu-code-rule",
        choices=("dispatch", "strict"),
        help="judge the image's GPU code as packages load it (dispatch, the default) or every kernel everywhere"
        " (strict); default: GPUBADGE_GPU_CODE_RULE",
    )
    p.add_argument("--token", help="API token for --service (or GPUBADGE_API_TOKEN)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpubadge eligible", description="List the servers that can run an image."
    )
    p.add_argument("reference", metavar="REF", help="image reference (tag or digest)")
    add_request_arguments(p)
    p.add_argument("--limit", type=int, default=50, help="eligible servers to list (default 50)")
    p.add_argument("--cursor", help="`next_cursor` of a previous --json answer: the next page")
    p.add_argument(
        "--explain",
        choices=("summary", "all"),
        default="summary",
        help="summary: ineligible servers by reason (default); all: every server with every reason",
    )
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    return p


def answer_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The answer's shape, as /api/eligibility takes it."""
    fields: dict[str, Any] = {"limit": args.limit, "explain": args.explain}
    if args.cursor:
        fields["cursor"] = args.cursor
    return fields


def checked_fields(
    parser: argparse.ArgumentParser, args: argparse.Namespace, shape: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`request_fields`, validated as the service validates them: a bad value is a usage error
    (exit 2) naming its option, before anything is scanned or asked."""
    from pydantic import ValidationError

    from placement.answer import AnswerOptions
    from placement.request import DeployRequest
    from scanner.problems import expected

    try:
        fields = request_fields(args)
        DeployRequest.parse_any(fields)
        if shape is not None:
            AnswerOptions.model_validate(shape)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        parser.error(f"argument {OPTION_OF_FIELD.get(field, field)}: {expected(error)}")
    except ValueError as exc:
        parser.error(str(exc))
    return fields


def request_fields(args: argparse.Namespace) -> dict[str, Any]:
    labels = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"argument --label: expected key=value, got {item!r}")
        labels[key] = value
    fields = {
        "gpus": args.gpus,
        "mig_devices": args.mig_devices,
        "mig_profiles": args.mig_profiles or None,
        "gpu_models": args.gpu_models or None,
        "min_gpu_memory": args.min_gpu_memory,
        "min_compute_capability": args.min_compute_capability,
        "min_driver": args.min_driver,
        "cpus": args.cpus,
        "memory": args.memory,
        "labels": labels or None,
        "gpu_code_rule": args.gpu_code_rule,
    }
    return {key: value for key, value in fields.items() if value is not None}


async def decide_locally(
    reference: str, servers: Path, fields: dict[str, Any], shape: dict[str, Any]
) -> dict[str, Any]:
    from placement.answer import AnswerOptions, answer
    from placement.decide import decide
    from placement.image_facts import ImageFacts
    from placement.request import DeployRequest
    from scanner.settings import ScannerSettings

    request = DeployRequest.parse_any(fields)
    if request.gpu_code_rule is None:
        request = request.model_copy(update={"gpu_code_rule": ScannerSettings.load().gpu_code_rule})
    options = AnswerOptions.model_validate(shape)
    inventory = load_inventory(servers)
    report = await scan_locally(reference)
    decision = decide(ImageFacts.from_report(report), request, inventory.servers)
    result: dict[str, Any] = dict(answer(decision, options))
    result["image"] = {"reference": report.reference, "digest": report.digest}
    return result


async def scan_locally(reference: str) -> ImageReport:
    """Scan without a store or a service (`--servers`): the report, or RuntimeError with its error."""
    from scanner.registry.client import RegistryClient
    from scanner.scan import Scanner
    from scanner.settings import ScannerSettings

    settings = ScannerSettings.load()
    async with RegistryClient(settings) as client:
        report = await Scanner(client, None, settings).scan(reference)
    if report.error:
        raise RuntimeError(f"{reference}: {report.error}")
    return report


SCAN_WAIT_SECONDS = 1800  # a queued scan of the image is waited for this long (the scan's own default bound)


async def ask_service(
    reference: str, url: str, fields: dict[str, Any], token: str | None, *, path: str = "/api/eligibility"
) -> dict[str, Any]:
    """POST `{"image": reference, **fields}` to the service (`--service`); its JSON answer, or
    ServiceError saying what went wrong and what to do.

    An image the service could not scan within GPUBADGE_UNSCANNED_SCAN_WAIT comes back 404 with the scan
    it queued: that scan is waited for (a line on stderr says so), for at most `SCAN_WAIT_SECONDS`, and
    the question asked again once it is done."""
    deadline = time.monotonic() + SCAN_WAIT_SECONDS
    while True:
        try:
            return await call(url, path, token, body={"image": reference, **fields})
        except ServiceError as error:
            if error.scan is None or time.monotonic() >= deadline:
                raise
            print(f"scanning    {reference} (scan {error.scan}); waiting for it", file=sys.stderr)
            await _wait_for_scan(url, error.scan, token, deadline)


async def _wait_for_scan(url: str, scan: str, token: str | None, deadline: float) -> None:
    """Until scan `scan` is done; ServiceError where it failed, or is still waiting at `deadline`."""
    while (left := deadline - time.monotonic()) > 0:
        asked = time.monotonic()
        job = await call(url, f"/api/scans/{quote(scan, safe='')}?wait={min(60, max(1, int(left)))}", token)
        if job.get("state") == "done":
            return
        if job.get("state") == "failed":
            raise ServiceError(f"scan {scan} failed: {job.get('error') or 'no reason given'}")
        # at most one question a second, whatever the service does with `wait`
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - asked)))
    raise ServiceError(
        f"scan {scan} was not done within {SCAN_WAIT_SECONDS // 60} minutes: ask again when it is"
        f" (GET /api/scans/{scan})"
    )


GPU_WORDS = {  # placement.image_needs' answer, as the image page and `gpubadge scan` say it
    "required": "needs an NVIDIA GPU (it declares one)",
    "optional": "GPU optional (it carries CUDA, declares no GPU: runs on a CPU too)",
    "none": "CPU only (it declares no GPU and carries no CUDA)",
}


def print_decision(decision: dict[str, Any]) -> None:
    """The answer as lines: the image's GPU answer, eligible servers (why each passes with --explain
    all), the others by reason, then warnings and hints."""
    if decision.get("image_gpu") in GPU_WORDS:
        print(f"image       {GPU_WORDS[decision['image_gpu']]}")
    every = decision.get("ineligible") is not None
    for entry in decision.get("eligible", []):
        gpus = ", ".join(entry.get("gpus", [])) or "no GPUs"
        print(f"eligible    {entry['server']}  ({gpus}; score {entry.get('score')})")
        if every:
            for line in entry.get("why", []):
                print(f"              because {line}")
    shown = len(decision.get("eligible", []))
    if decision.get("eligible_count", shown) > shown:
        print(
            f"eligible    ... {decision['eligible_count'] - shown} more (--limit, or --cursor NEXT with --json)"
        )
    if decision.get("ineligible") is not None:
        for entry in decision["ineligible"]:
            print(f"ineligible  {entry['server']}: {'; '.join(entry['reasons'])}")
    else:
        for item in decision.get("ineligible_by_reason", []):
            examples = ", ".join(item["examples"])
            more = (
                f" and {item['count'] - len(item['examples'])} more"
                if item["count"] > len(item["examples"])
                else ""
            )
            print(f"ineligible  {examples}{more}: {item['reason']}")
    for warning in decision.get("warnings", []):
        print(f"warning     {warning}")
    for hint in decision.get("hints", []):
        print(f"hint        the image {hint}")
    if not decision.get("eligible_count", len(decision.get("eligible", []))):
        print("no server can run this image with this request")


def main(argv: list[str]) -> int:
    import os

    command = parser()
    try:
        args = command.parse_args(argv)
        service_from_env(command, args, ("servers",))
        shape = answer_fields(args)
        fields = checked_fields(command, args, shape)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if args.servers:
            decision = asyncio.run(decide_locally(args.reference, args.servers, fields, shape))
        else:
            token = args.token or os.environ.get("GPUBADGE_API_TOKEN")
            decision = asyncio.run(ask_service(args.reference, args.service, {**fields, **shape}, token))
    except (RuntimeError, ValueError, OSError) as exc:  # FileProblem, ServiceError, a failed scan
        print(f"gpubadge eligible: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(decision))
    else:
        print_decision(decision)
    return EXIT_ELIGIBLE if decision.get("eligible_count", len(decision.get("eligible", []))) else EXIT_NONE
