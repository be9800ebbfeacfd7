"""`gpubadge compat`: check nodes against an image's NFD image-compatibility artifact.

What `nfd compat validate-node --image REF` does, for any node and any artifact (written by
gpubadge or anyone): the artifact is found as NFD's client finds it (REF resolved to its index,
or with `--platform` to that image; its referrers of type
`application/vnd.nfd.image-compatibility.v1alpha1`; the newest by
`org.opencontainers.image.created`; `layers[0]`), or read from a file with `--spec`. Nodes come
from NFD (`--node FILE`: a NodeFeature object, a list of them, or `nfd export features` output;
repeatable) or from gpubadge's fleet (`--servers FILE` or `--service URL`: features derived from
each server's inventory). Every compatibility set is evaluated with NFD's rule semantics
(`--tags` picks sets, as NFD's flag does), and each failing rule says why.

Exit status. NFD itself computes no overall verdict: `nfd compat validate-node` prints each
set's rules and exits 0 whatever they say (1 only on an error), and NFD treats the sets as
alternatives, each with a node-affinity `weight`, not as requirements that must all hold. The
exit status is gpubadge's own summary of what it printed: with `--sets all` (the default) 0 when
every selected set holds on every node; with `--sets any` 0 when on every node at least one
selected set holds (the reading of sets as weighted alternatives); else 3. 1 on error (no
artifact, a registry or file error, a document past a bound, a rule NFD would stop at), 2 on
usage. A document with no (selected) set is vacuously compatible with `all`, and not with `any`.

Every document is read within the `nfd_*` settings' bounds (expanded YAML nodes and depth, regular
expressions, templates), whatever its size: past one, the error names the setting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpubadge.service import SERVICE_ENV, service_from_env, service_url

if TYPE_CHECKING:
    from placement.nfd.features import NodeFeatures
    from placement.nfd.match import SpecResult
    from placement.nfd.schema import DocumentLimits, Spec
    from scanner.settings import ScannerSettings

EXIT_COMPATIBLE, EXIT_ERROR, EXIT_USAGE, EXIT_INCOMPATIBLE = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpubadge compat",
        description="Check nodes against an image's NFD image-compatibility artifact (like nfd compat validate-node).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("reference", metavar="REF", nargs="?", help="image reference: a tag or a digest")
    source.add_argument("--spec", type=Path, help="an image-compatibility YAML file instead of a registry")
    nodes = parser.add_mutually_exclusive_group()  # one of them, or $GPUBADGE (service_from_env)
    nodes.add_argument(
        "--node",
        type=Path,
        action="append",
        help="NodeFeature YAML/JSON or `nfd export features` output (repeat)",
    )
    nodes.add_argument("--servers", type=Path, help="gpubadge inventory file ({servers: [...]})")
    nodes.add_argument(
        "--service",
        type=service_url,
        help=f"URL of a running gpubadge service (http://host:port; default ${SERVICE_ENV}): its fleet",
    )
    parser.add_argument("--token", help="API token for --service (or GPUBADGE_API_TOKEN)")
    parser.add_argument("--platform", help="the image of this platform in an index (os/arch[/variant])")
    parser.add_argument("--tags", default="", help="comma-separated tags: only the sets with these tags")
    parser.add_argument(
        "--sets",
        choices=("all", "any"),
        default="all",
        help="exit 0 when every selected set holds on each node (all, the default) or at least one does (any:"
        " the sets as NFD's weighted alternatives)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per node")
    parser.add_argument("--config", type=Path, default=None, help="settings file (TOML or YAML)")
    return parser


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv))
        service_from_env(parser, args, ("node", "servers"))
    except SystemExit as exc:
        return int(exc.code or 0)
    from placement.nfd.features import FeaturesError
    from placement.nfd.match import evaluate_spec
    from placement.nfd.schema import DocumentLimits, SpecError
    from scanner.settings import ScannerSettings

    tags = [tag.strip() for tag in args.tags.split(",") if tag.strip()]
    try:
        try:
            settings = ScannerSettings.load(args.config)  # an ambiguous merge is a usage error too
        except ValueError as exc:
            raise _Usage(str(exc)) from None
        limits = DocumentLimits.of(settings)
        spec, origin = asyncio.run(_artifact(args, settings, limits))
        nodes = asyncio.run(_nodes(args, settings, limits))
    except _Usage as exc:
        print(f"gpubadge compat: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (SpecError, FeaturesError, OSError, RuntimeError, ValueError) as exc:
        print(f"gpubadge compat: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if not nodes:
        print("gpubadge compat: no node to check", file=sys.stderr)
        return EXIT_ERROR
    results = [evaluate_spec(spec, node.features, node.name, tags, limits) for node in nodes]
    for node, result in zip(nodes, results, strict=True):
        if args.json:
            body: dict[str, Any] = {"artifact": origin, "node": node.name, "source": node.source}
            body.update({"notes": node.notes, "verdict": result.verdict})
            body["sets"] = [item.model_dump() for item in result.sets]
            print(json.dumps(body, sort_keys=True))
        else:
            _print(result, origin)
    if any(r.verdict == "error" for r in results):
        return EXIT_ERROR
    if args.sets == "any":
        held = all(any(s.verdict == "match" for s in r.sets) for r in results)
    else:
        held = all(r.compatible for r in results)
    return EXIT_COMPATIBLE if held else EXIT_INCOMPATIBLE


class _Usage(ValueError):
    pass


async def _artifact(
    args: argparse.Namespace, settings: ScannerSettings, limits: DocumentLimits
) -> tuple[Spec, str]:
    from placement.nfd.schema import ARTIFACT_TYPE, MAX_SPEC_BYTES, SpecError, load_spec

    if args.spec is not None:
        from gpubadge.files import read_text

        try:
            spec, warnings = load_spec(read_text(args.spec, "spec", most=MAX_SPEC_BYTES), limits=limits)
        except SpecError as exc:
            raise SpecError(f"spec {args.spec}: {_in_words(exc)}") from None
        _warn(warnings)
        return spec, str(args.spec)
    from scanner.models import Platform
    from scanner.registry.client import RegistryClient
    from scanner.registry.errors import RegistryError
    from scanner.registry.reference import ReferenceError, parse_reference
    from scanner.registry.referrers import newest_of_type

    try:
        reference = parse_reference(args.reference)
        platform = Platform.parse(args.platform) if args.platform else None
    except (ReferenceError, ValueError) as exc:
        raise _Usage(str(exc)) from None
    try:
        async with RegistryClient(settings) as client:
            subject, referrer, layer = await newest_of_type(client, reference, ARTIFACT_TYPE, platform)
    except RegistryError as exc:
        raise RuntimeError(f"{reference}: {exc}") from None
    if referrer is None or layer is None:
        raise RuntimeError(f"{reference} ({subject}): compatibility artifact not found")
    try:
        spec, warnings = await asyncio.to_thread(load_spec, layer, limits=limits)
    except SpecError as exc:
        raise SpecError(f"{reference}@{referrer.digest}: {exc}") from None
    _warn(warnings)
    return spec, f"{reference}@{referrer.digest}"


def _warn(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"gpubadge compat: warning: {warning}", file=sys.stderr)


async def _nodes(
    args: argparse.Namespace, settings: ScannerSettings, limits: DocumentLimits
) -> list[NodeFeatures]:
    from gpubadge.files import load_inventory, read_text
    from gpubadge.service import call
    from placement.inventory import Server
    from placement.nfd.features import MAX_FEATURES_BYTES, FeaturesError, from_server, parse_node_features

    if args.node:
        nodes = []
        for path in args.node:
            text = read_text(path, "node features", most=MAX_FEATURES_BYTES)
            try:
                nodes.append(parse_node_features(text, path.stem, limits, settings.nfd_max_feature_nodes))
            except FeaturesError as exc:
                raise FeaturesError(f"node features {path}: {_in_words(exc)}") from None
        return nodes
    if args.servers is not None:
        return [from_server(server) for server in load_inventory(args.servers).servers]
    token = args.token or os.environ.get("GPUBADGE_API_TOKEN")
    body = await call(args.service, "/api/servers", token)
    return [from_server(Server.model_validate(item)) for item in body.get("servers", [])]


def _in_words(exc: ValueError) -> str:
    """A spec or features error; a YAML syntax error as `not YAML: line N, column M: what`."""
    from scanner.problems import document_error

    cause = exc.__context__
    if cause is not None and type(cause).__module__.startswith("yaml"):
        return f"not YAML: {document_error(cause)}"
    return str(exc)


def _print(result: SpecResult, origin: str) -> None:
    word = {"match": "compatible", "no-match": "not compatible", "error": "error"}[result.verdict]
    print(f"{result.node}: {word} ({origin})")
    for item in result.sets:
        label = f"set #{item.index}" + (f" {item.tag}" if item.tag else "")
        print(f"  {label}: {'OK' if item.verdict == 'match' else item.verdict.upper()}")
        for line in item.reasons():
            print(f"    {line}")
