"""`gpubadge referrers REF`: the reports attached to an image as OCI referrers, read back.

The same list `oras discover --artifact-type application/vnd.gpubadge.report.v1+json REF`
shows: the referrers API where the registry has one, else the referrers tag schema.
Exit status: 0 when at least one report is attached, 3 when none is, 1 on error, 2 on usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpubadge referrers", description="List the gpubadge reports attached to an image."
    )
    parser.add_argument("reference", metavar="REF", help="image reference: a tag or a digest")
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per report: digest, annotations, report"
    )
    parser.add_argument("--config", type=Path, default=None, help="settings file (TOML or YAML)")
    return parser


def main(argv: Sequence[str]) -> int:
    try:
        args = build_parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    from scanner.registry.client import RegistryClient
    from scanner.registry.errors import RegistryError
    from scanner.registry.reference import ReferenceError, parse_reference
    from scanner.registry.referrers import Referrer, list_referrers, read_report
    from scanner.settings import ScannerSettings

    try:
        reference = parse_reference(args.reference)
    except ReferenceError as exc:
        print(f"gpubadge referrers: {exc}", file=sys.stderr)
        return 2
    settings = ScannerSettings.load(args.config)

    async def run() -> tuple[str, list[Referrer]]:
        async with RegistryClient(settings) as client:
            digest, found = await list_referrers(client, reference)
            pinned = reference.with_digest(digest)
            return digest, [
                Referrer(r.digest, r.artifact_type, r.annotations, await read_report(client, pinned, r))
                for r in found
            ]

    try:
        digest, referrers = asyncio.run(run())
    except (RegistryError, ValueError) as exc:
        print(f"gpubadge referrers: {reference}: {exc}", file=sys.stderr)
        return 1
    for referrer in referrers:
        if args.json:
            line = {
                "subject": digest,
                "digest": referrer.digest,
                "artifactType": referrer.artifact_type,
                "annotations": referrer.annotations,
                "report": referrer.report,
            }
            print(json.dumps(line, sort_keys=True))
        else:
            summary = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in sorted(referrer.annotations.items()))
            print(f"{referrer.digest}  {summary}")
    if not referrers:
        print(
            f"gpubadge referrers: no gpubadge report is attached to {reference} ({digest})", file=sys.stderr
        )
        return 3
    return 0
