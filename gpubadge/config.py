"""`gpubadge config [--config FILE] [--json]`: the effective settings, each with its source.

Loads exactly as `serve`, `worker` and `scan` do (the file, the environment, merged by the rule of
`scanner.settings_merge`), so it also checks a configuration before a deploy: an ambiguous merge
or an invalid value exits 2 with the same message those commands give. Secrets print as
`[redacted]`; unset ones as null (text: `-`), so an operator sees whether one is set, never what.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

from scanner.settings import CONFIG_ENV, EffectiveSetting


def parser() -> argparse.ArgumentParser:
    built = argparse.ArgumentParser(
        prog="gpubadge config",
        description="Print the effective settings, each with its source (default, file, environment,"
        " merged, command line); secrets are shown as [redacted].",
    )
    built.add_argument("--config", type=Path, help=f"settings file, TOML or YAML ({CONFIG_ENV})")
    built.add_argument("--json", action="store_true", help="one JSON object: config_file and settings")
    return built


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from web.commands import load_settings  # the service's settings: a superset of the scanner's

    try:
        settings = load_settings(args.config)
    except (ValueError, OSError) as exc:
        print(f"gpubadge config: invalid settings: {exc}", file=sys.stderr)
        return 2
    rows = settings.effective()
    config_file = args.config or settings.config_file()
    if args.json:
        document = {
            "config_file": str(config_file) if config_file else None,
            "settings": [row.model_dump() for row in rows],
        }
        print(json.dumps(document, indent=2))
    else:
        print_table(rows, config_file, sys.stdout)
    return 0


def print_table(rows: list[EffectiveSetting], config_file: Path | None, out: TextIO) -> None:
    """One line per setting (variable, source, value); a merged list or map's entries below it."""
    out.write(f"# config file: {config_file or 'none'}\n")
    width = max(len(row.variable) for row in rows)
    for row in rows:
        source = row.source + (" (over the file)" if row.shadows_file else "")
        value = "-" if row.value is None else json.dumps(row.value)
        out.write(f"{row.variable:<{width}}  {source:<12}  {value}\n")
        for key, entry_source in row.entries.items() if row.source == "merged" else ():
            out.write(f"  {key:<{width - 2}}  {entry_source}\n")
