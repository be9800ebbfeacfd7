"""The artifacts attached beside each report, composed here because they come from placement.

scanner/ attaches what it is handed (`scanner.publish.Companion`: a media type and
bytes), and placement/ knows what the bytes say (`placement.exports.nfd`); web/ composes the two,
so neither imports upward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from placement.exports.nfd import artifact_yaml
from placement.nfd.schema import (
    ARTIFACT_TYPE,
    MAX_SPEC_BYTES,
    SPEC_FILE_NAME,
    SPEC_MEDIA_TYPE,
    DocumentLimits,
    SpecError,
    load_spec,
)
from placement.nfd.write import spec_document
from scanner.models import ImageReport
from scanner.publish import Companion, CompanionDocument
from scanner.registry.referrers import CompanionContent
from scanner.settings import ScannerSettings

NFD_KIND = "nfd"


def nfd_content(report: ImageReport) -> CompanionContent | None:
    """NFD's image-compatibility document for the manifest `report` describes; None for no GPU."""
    data = artifact_yaml(report)
    return None if data is None else CompanionContent(SPEC_MEDIA_TYPE, data, SPEC_FILE_NAME)


@dataclass(frozen=True)
class NfdDocument:
    """An NFD artifact's layer as the image page shows it: its sets (NFD's JSON shape), or why not."""

    sets: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None


def parse_nfd(layer: bytes, limits: DocumentLimits) -> CompanionDocument:
    """Decode an NFD layer once, within `limits` (never raises): what the attacher's status keeps."""
    try:
        spec, warnings = load_spec(layer, limits=limits)
    except SpecError as exc:
        document = NfdDocument(error=f"its document could not be read: {exc}")
    else:
        document = NfdDocument(spec_document(spec)["compatibilities"], warnings)
    return CompanionDocument(document, _memory(document))


def _memory(document: NfdDocument) -> int:
    """The bytes `document` holds: every container and string counted (shared ones once)."""
    seen: set[int] = set()
    total = 0
    pending: list[Any] = [document.sets, document.warnings, document.error]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return total + sys.getsizeof(document)


def nfd_companion(settings: ScannerSettings) -> Companion:
    """NFD's companion: built from the report, read back within the settings' `nfd_*` bounds."""
    limits = DocumentLimits.of(settings)
    return Companion(
        kind=NFD_KIND,
        artifact_type=ARTIFACT_TYPE,
        build=nfd_content,
        parse=lambda layer: parse_nfd(layer, limits),
        max_bytes=MAX_SPEC_BYTES,  # never more than load_spec reads: a bigger layer is refused at the registry read
    )


def companions(settings: ScannerSettings) -> list[Companion]:
    """What to attach beside reports: NFD's artifact unless `attach_nfd` is off."""
    return [nfd_companion(settings)] if settings.attach_nfd else []
