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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from scanner.models import ImageReport

EXIT_ELIGIBLE, EXIT_ERROR, EXIT_NONE = 0, 1, 3


def add_request_arguments(p: argparse.ArgumentParser) -> None:
    """Where the fleet comes from and what the deploy asks for: shared by `eligible` and `constraints`."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--servers", type=Path, help="inventory file (YAML or JSON, {servers: [...]})")
    where.add_argument("--service", help="URL of a running gpubadge service")
    p.add_argument("--gpus", type=int, help="GPUs needed (a GPU image defaults to 1)")
    p.add_argument(
        "--gpu-model", action="append", default=[], dest="gpu_models", help="acceptable model (repeat)"
    )
    p.add_argument("--min-gpu-memory", help="per-GPU memory, e.g. 40Gi")
    p.add_argument("--min-compute-capability", help="e.g. 8.0")
    p.add_argument("--min-driver", help="e.g. 535.104.05")
    p.add_argument("--cpus", type=float, help="CPU cores")
    p.add_argument("--memory", help="memory, e.g. 64Gi")
    p.add_argument("--label", action="append", default=[], help="required server label key=value (repeat)")
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


def request_fields(args: argparse.Namespace) -> dict[str, Any]:
    labels = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--label {item!r}: expected key=value")
        labels[key] = value
    fields = {
        "gpus": args.gpus,
        "gpu_models": args.gpu_models or None,
        "min_gpu_memory": args.min_gpu_memory,
        "min_compute_capability": args.min_compute_capability,
        "min_driver": args.min_driver,
        "cpus": args.cpus,
        "memory": args.memory,
        "labels": labels or None,
    }
    return {key: value for key, value in fields.items() if value is not None}


async def decide_locally(
    reference: str, servers: Path, fields: dict[str, Any], shape: dict[str, Any]
) -> dict[str, Any]:
    from placement.answer import AnswerOptions, answer
    from placement.decide import ImageFacts, decide
    from placement.inventory import parse_inventory
    from placement.request import DeployRequest

    request = DeployRequest.parse_any(fields)
    options = AnswerOptions.model_validate(shape)
    inventory = parse_inventory(servers.read_text())
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


async def ask_service(
    reference: str, url: str, fields: dict[str, Any], token: str | None, *, path: str = "/api/eligibility"
) -> dict[str, Any]:
    """POST `{"image": reference, **fields}` to the service (`--service`); its JSON answer."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(
            f"{url.rstrip('/')}{path}", json={"image": reference, **fields}, headers=headers
        ) as response,
    ):
        body = await response.json(content_type=None)
        if response.status != 200:
            raise RuntimeError(f"service answered {response.status}: {body.get('error', body)}")
        result: dict[str, Any] = body
        return result


def print_decision(decision: dict[str, Any]) -> None:
    for entry in decision.get("eligible", []):
        gpus = ", ".join(entry.get("gpus", [])) or "no GPUs"
        print(f"eligible    {entry['server']}  ({gpus}; score {entry.get('score')})")
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

    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        fields = request_fields(args)
        shape = answer_fields(args)
        if args.servers:
            decision = asyncio.run(decide_locally(args.reference, args.servers, fields, shape))
        else:
            token = args.token or os.environ.get("GPUBADGE_API_TOKEN")
            decision = asyncio.run(ask_service(args.reference, args.service, {**fields, **shape}, token))
    except (RuntimeError, ValueError, OSError, aiohttp.ClientError) as exc:
        print(f"gpubadge eligible: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(decision))
    else:
        print_decision(decision)
    return EXIT_ELIGIBLE if decision.get("eligible_count", len(decision.get("eligible", []))) else EXIT_NONE
