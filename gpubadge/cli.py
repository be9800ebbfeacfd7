"""`gpubadge scan | serve | eligible | agent`: a thin dispatcher that imports each command lazily."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    del argv
    print("usage: gpubadge {scan,serve,eligible,agent} ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
