"""`gpubadge constraints REF --format F`: the eligibility of an image in another scheduler's language.

Like `gpubadge eligible`: with `--servers FILE` it scans the image itself and exports locally
(brand and model clauses use that inventory's GPU products); with `--service URL` it asks a
running service (`POST /api/constraints`). Prints the fragment in the scheduler's own syntax
(YAML for kubernetes, dra and akash; HCL for nomad) with the notes as comments, or the whole
answer with --json. Exit status: 0, 3 when nothing can be eligible, 1 on error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from gpubadge.eligible import (
    EXIT_ELIGIBLE,
    EXIT_ERROR,
    EXIT_NONE,
    add_request_arguments,
    ask_service,
    checked_fields,
    scan_locally,
)
from gpubadge.files import load_inventory
from gpubadge.service import service_from_env

FORMATS = ("kubernetes", "dra", "nomad", "akash")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpubadge constraints", description="Export an image's eligibility as scheduler constraints."
    )
    p.add_argument("reference", metavar="REF", help="image reference (tag or digest)")
    p.add_argument("--format", required=True, choices=FORMATS, help="the scheduler's language")
    add_request_arguments(p)
    p.add_argument("--json", action="store_true", help="print the whole answer as JSON")
    return p


async def export_locally(
    reference: str, servers: Path, fields: dict[str, Any], chosen: str
) -> dict[str, Any]:
    from placement.exports import export_constraints, known_gpus
    from placement.image_facts import ImageFacts
    from placement.index import FleetIndex
    from placement.request import DeployRequest

    request = DeployRequest.parse_any(fields)
    inventory = load_inventory(servers)
    report = await scan_locally(reference)
    fleet = known_gpus(FleetIndex.build(inventory.servers))
    body = export_constraints(ImageFacts.from_report(report), request, fleet, chosen)  # type: ignore[arg-type]
    body["image"] = {"reference": report.reference, "digest": report.digest}
    return body


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people to paste: no anchors, long lines (CEL and HCL) kept whole."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _yaml(*documents: Any) -> str:
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, width=1 << 16)


def render(body: dict[str, Any]) -> str:
    """The fragment in the scheduler's syntax, notes first as comments."""
    lines = [f"# {note}" for note in body.get("notes", [])]
    chosen = body["format"]
    if chosen == "nomad":
        text = body["hcl"]
    elif chosen == "kubernetes":
        text = _yaml({"affinity": body["affinity"], "resources": body["resources"]})
        single = body.get("single_strategy")
        if single:  # MIG devices: the mixed strategy first, then the single strategy's form
            text = f"# mig.strategy: mixed\n{text}---\n# mig.strategy: single\n" + _yaml(
                {"affinity": single["affinity"], "resources": single["resources"]}
            )
    elif chosen == "dra":
        documents = [body["resourceClaimTemplate"]] if body.get("resourceClaimTemplate") else []
        text = _yaml(*documents, {"affinity": body["affinity"]})
    else:
        text = _yaml(body["sdl"]) if body.get("sdl") else ""
    return "\n".join([*lines, text.rstrip("\n")]) + "\n"


def main(argv: list[str]) -> int:
    command = parser()
    try:
        args = command.parse_args(argv)
        service_from_env(command, args, ("servers",))
        fields = checked_fields(command, args)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if args.servers:
            body = asyncio.run(export_locally(args.reference, args.servers, fields, args.format))
        else:
            token = args.token or os.environ.get("GPUBADGE_API_TOKEN")
            body = asyncio.run(
                ask_service(
                    args.reference,
                    args.service,
                    {**fields, "format": args.format},
                    token,
                    path="/api/constraints",
                )
            )
    except (RuntimeError, ValueError, OSError) as exc:  # FileProblem, ServiceError, a failed scan
        print(f"gpubadge constraints: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(body) if args.json else render(body), end="" if not args.json else "\n")
    return EXIT_ELIGIBLE if body.get("satisfiable") else EXIT_NONE
