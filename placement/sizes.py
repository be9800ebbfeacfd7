"""Byte sizes in words, one way everywhere: binary units, at most two decimals, no trailing zeros.

`22.49 GiB` on the servers page, in the eligibility explorer's reasons and in the API's; what a
server has is rounded down and what a request needs rounded up, so `have < need` never reads as
`40 GiB < 40 GiB`. Pure; placement's reasons and the web pages both call it.
"""

from __future__ import annotations

import math
from typing import Literal

UNITS: tuple[tuple[str, int], ...] = (
    ("B", 1),
    ("KiB", 1024),
    ("MiB", 1024**2),
    ("GiB", 1024**3),
    ("TiB", 1024**4),
)


def unit_for(size: float) -> tuple[str, int]:
    """The largest unit that `size` bytes fills at least once (bytes below 1 KiB)."""
    chosen = UNITS[0]
    for unit in UNITS:
        if abs(size) >= unit[1]:
            chosen = unit
    return chosen


def size_text(
    size: float, rounding: Literal["down", "up"] = "down", unit: tuple[str, int] | None = None
) -> str:
    """`size` bytes as `22.49 GiB` (in `unit`, else the largest it fills), rounded `down` or `up` at
    the second decimal."""
    name, scale = unit or unit_for(size)
    if scale == 1:
        return f"{int(size)} B"
    hundredths = size * 100 / scale
    shown = (math.floor(hundredths) if rounding == "down" else math.ceil(hundredths)) / 100
    return f"{shown:.2f}".rstrip("0").rstrip(".") + f" {name}"


def compared_sizes(have: float, need: float) -> tuple[str, str]:
    """`have` and `need` (bytes; have < need) in one unit, the need's: what a server has rounded
    down, what a request needs rounded up, so the two never read equal."""
    unit = unit_for(need) if need >= 1024**3 else UNITS[2]
    return size_text(have, "down", unit), size_text(need, "up", unit)
