"""Eligibility in the constraint languages of other schedulers (`gpubadge constraints`, /api/constraints).

`build_constraints` (core) turns an image and a request into scheduler-neutral constraints; each
format module turns those into its scheduler's language. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from placement.exports import akash, dra, kubernetes, nomad
from placement.exports.core import Constraints, KnownGpu, build_constraints, known_gpus
from placement.image_facts import ImageFacts
from placement.request import DeployRequest

Format = Literal["kubernetes", "dra", "nomad", "akash"]
FORMATS: tuple[Format, ...] = ("kubernetes", "dra", "nomad", "akash")
_EXPORTERS: dict[str, Callable[[Constraints], dict[str, Any]]] = {
    "kubernetes": kubernetes.export,
    "dra": dra.export,
    "nomad": nomad.export,
    "akash": akash.export,
}

__all__ = ["FORMATS", "Format", "KnownGpu", "export_constraints", "known_gpus"]


def export_constraints(
    image: ImageFacts, request: DeployRequest, fleet: Sequence[KnownGpu], format: Format
) -> dict[str, Any]:
    """`{"format", "satisfiable", ...the format's fields, "notes"}` for `image` and `request`."""
    constraints = build_constraints(image, request, fleet)
    body = _EXPORTERS[format](constraints)
    return {"format": format, "satisfiable": constraints.satisfiable, **body}
