"""`gpubadge serve` and `gpubadge eligible`: argument parsing around the service and placement."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, cast

from web.settings import ServiceSettings


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpubadge serve",
        description="Run the service: registry webhooks, the scan queue, the JSON API and the web UI.",
        epilog="Settings (environment variables; the same names, lower-case and without the prefix,"
        " work in the --config file):\n" + ServiceSettings.describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", help="listen address (GPUBADGE_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (GPUBADGE_PORT, default 8080)")
    parser.add_argument("--db", type=Path, help="SQLite file (GPUBADGE_DB, default ./gpubadge.db)")
    parser.add_argument("--config", type=Path, help="settings file, TOML or YAML (GPUBADGE_CONFIG)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    return parser


def load_settings(config: Path | None, **overrides: Any) -> ServiceSettings:
    chosen = {key: value for key, value in overrides.items() if value is not None}
    settings = cast(ServiceSettings, ServiceSettings.load(config, **chosen))
    settings.check_consistent()
    return settings


async def _freeze_startup_objects(_: object) -> None:
    """The serve process owns its interpreter: modules, schemas and settings live as long as it does,
    so moving them out of the collector's reach keeps full GC passes (and the 202 tail) short."""
    import gc

    gc.freeze()


def run_serve(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from web.security import RedactingLogFilter

    for handler in logging.getLogger().handlers:  # this process's own handlers, set up just above
        handler.addFilter(RedactingLogFilter())
    try:
        settings = load_settings(args.config, host=args.host, port=args.port, db=args.db)
    except (ValueError, OSError) as exc:
        print(f"gpubadge serve: invalid settings: {exc}", file=sys.stderr)
        return 2
    from aiohttp import web

    from store import StoreUnavailable
    from web.app import create_app
    from web.security import RedactingAccessLogger

    try:
        app = create_app(settings)
    except StoreUnavailable as exc:
        print(f"gpubadge serve: {exc}", file=sys.stderr)
        return 1
    app.on_startup.append(_freeze_startup_objects)
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        print=lambda message: logging.info("%s", message),
        access_log_class=RedactingAccessLogger,
    )
    return 0
