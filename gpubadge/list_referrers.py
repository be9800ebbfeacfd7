"""`gpubadge referrers REF`: gpubadge's reports and NFD's image-compatibility artifacts attached to an image.

The same list `oras discover` shows for those two artifact types: the referrers API where the
registry has one, else the referrers tag schema. Like `nfd compat validate-node`, REF resolves
to its index (its own manifest for a single-platform image), or with `--platform` to that
platform's image. The NFD artifact that NFD's client would read (the newest by
`org.opencontainers.image.created`) is marked; its `layers[0]` is decoded and checked against
NFD's schema, within the `nfd_*` settings' bounds whatever its size (past one, its line says so).
Exit status: 0 when at least one is attached, 3 when none is, 1 on error, 2 on usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpubadge referrers",
        description="List the gpubadge reports and NFD image-compatibility artifacts attached to an image.",
    )
    parser.add_argument("reference", metavar="REF", help="image reference: a tag or a digest")
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per artifact: digest, annotations, report or spec",
    )
    parser.add_argument("--platform", help="the image of this platform in an index (os/arch[/variant])")
    parser.add_argument("--config", type=Path, default=None, help="settings file (TOML or YAML)")
    return parser


def main(argv: Sequence[str]) -> int:
    try:
        args = build_parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    from placement.nfd.schema import ARTIFACT_TYPE as NFD_TYPE
    from placement.nfd.schema import DocumentLimits, SpecError, load_spec
    from placement.nfd.write import spec_document
    from scanner.models import Platform
    from scanner.registry.client import RegistryClient
    from scanner.registry.errors import RegistryError
    from scanner.registry.reference import ReferenceError, parse_reference
    from scanner.registry.referrers import (
        ARTIFACT_TYPE,
        list_referrers,
        newest,
        read_layer,
        read_report,
        resolve_subject,
    )
    from scanner.settings import ScannerSettings

    try:
        reference = parse_reference(args.reference)
        platform = Platform.parse(args.platform) if args.platform else None
        settings = ScannerSettings.load(args.config)  # an ambiguous merge is a usage error too
    except (ReferenceError, ValueError) as exc:
        print(f"gpubadge referrers: {exc}", file=sys.stderr)
        return 2

    async def run() -> tuple[str, list[dict[str, Any]]]:
        async with RegistryClient(settings) as client:
            digest = await resolve_subject(client, reference, platform)
            pinned = reference.with_digest(digest)
            _, found = await list_referrers(client, pinned, artifact_type=None)
            reports = [r for r in found if r.artifact_type == ARTIFACT_TYPE]
            compat = [r for r in found if r.artifact_type == NFD_TYPE]
            current = newest(compat)
            lines: list[dict[str, Any]] = []
            for referrer in reports:
                line = _line(digest, referrer, "report")
                line["report"] = await read_report(client, pinned, referrer)
                lines.append(line)
            for referrer in compat:
                line = _line(digest, referrer, "nfd")
                line["current"] = referrer == current
                try:
                    layer = await read_layer(client, pinned, referrer)
                    spec, warnings = await asyncio.to_thread(
                        load_spec, layer, limits=DocumentLimits.of(settings)
                    )
                except SpecError as exc:
                    line["error"] = f"its image-compatibility spec could not be read: {exc}"
                else:
                    line["spec"] = spec_document(spec)
                    line["warnings"] = warnings
                lines.append(line)
            return digest, lines

    try:
        digest, lines = asyncio.run(run())
    except (RegistryError, ValueError) as exc:
        print(f"gpubadge referrers: {reference}: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        if args.json:
            print(json.dumps(line, sort_keys=True))
        else:
            print(_summary(line))
    if not lines:
        print(
            f"gpubadge referrers: no gpubadge report or NFD artifact is attached to {reference} ({digest})",
            file=sys.stderr,
        )
        return 3
    return 0


def _line(subject: str, referrer: Any, kind: str) -> dict[str, Any]:
    return {
        "subject": subject,
        "kind": kind,
        "digest": referrer.digest,
        "artifactType": referrer.artifact_type,
        "annotations": referrer.annotations,
    }


def _summary(line: dict[str, Any]) -> str:
    annotations = line["annotations"]
    if line["kind"] == "report":
        summary = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in sorted(annotations.items()))
        return f"{line['digest']}  report  {summary}"
    created = annotations.get("org.opencontainers.image.created", "no created time")
    if "error" in line:
        detail = line["error"]
    else:
        sets = line["spec"]["compatibilities"]
        detail = f"{len(sets)} set(s): " + ", ".join(s.get("tag") or "(no tag)" for s in sets)
    marker = "  (the one NFD reads)" if line.get("current") else ""
    return f"{line['digest']}  nfd  created={created}  {detail}{marker}"
