"""`gpubadge fleet release GPU-UUID...` and `gpubadge fleet forget SERVER...`: an operator's hand on the
fleet a running service keeps (`--service URL`), with the fleet-wide agent token.

A GPU belongs to the server that first reported it, live or silent, until an operator releases it:
`release` frees the claim (the next server to report the GPU owns it), `forget` removes a server
that is gone (its inventory, and its GPUs' claims). Both refuse what a live server still reports.
The token is `--token`, else $GPUBADGE_AGENT_TOKEN. Exit status: 0 when every one was done, 1
otherwise (each failure on a line of its own), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from urllib.parse import quote

from gpubadge.service import ServiceError, call, service_url


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpubadge fleet",
        description="Release GPUs and remove servers from a running service's fleet (fleet-wide agent token).",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    release = actions.add_parser("release", help="free GPUs from the server that reported them first")
    release.add_argument("names", nargs="+", metavar="GPU-UUID")
    forget = actions.add_parser("forget", help="remove servers that are gone, releasing their GPUs")
    forget.add_argument("names", nargs="+", metavar="SERVER")
    for action in (release, forget):
        action.add_argument("--service", required=True, type=service_url, help="the service's URL")
        action.add_argument("--token", help="the fleet-wide agent token (default $GPUBADGE_AGENT_TOKEN)")
    return p


async def _apply(action: str, names: list[str], service: str, token: str | None) -> int:
    failed = 0
    for name in names:
        try:
            if action == "release":
                answer = await call(service, f"/api/gpus/{quote(name, safe='')}/release", token, body={})
                print(f"released {answer['released']} (was {answer['server']}'s)")
            else:
                answer = await call(service, f"/api/servers/{quote(name, safe='')}", token, method="DELETE")
                gpus = ", ".join(answer["released"]) or "no GPUs"
                print(f"removed {answer['removed']} (released {gpus})")
        except ServiceError as exc:
            failed += 1
            print(f"gpubadge fleet {action} {name}: {exc}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    token = args.token or os.environ.get("GPUBADGE_AGENT_TOKEN") or None
    return asyncio.run(_apply(args.action, args.names, args.service, token))
