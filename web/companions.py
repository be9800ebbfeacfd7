"""The artifacts attached beside each report, composed here because they come from placement.

scanner/ attaches what it is handed (`scanner.registry.referrers.Companion`: a media type and
bytes), and placement/ knows what the bytes say (`placement.exports.nfd`); web/ composes the two,
so neither imports upward.
"""

from __future__ import annotations

from placement.exports.nfd import artifact_yaml
from placement.nfd.schema import ARTIFACT_TYPE, SPEC_FILE_NAME, SPEC_MEDIA_TYPE
from scanner.models import ImageReport
from scanner.registry.referrers import Companion, CompanionContent
from scanner.settings import ScannerSettings

NFD_KIND = "nfd"


def nfd_content(report: ImageReport) -> CompanionContent | None:
    """NFD's image-compatibility document for the manifest `report` describes; None for no GPU."""
    data = artifact_yaml(report)
    return None if data is None else CompanionContent(SPEC_MEDIA_TYPE, data, SPEC_FILE_NAME)


NFD_COMPANION = Companion(kind=NFD_KIND, artifact_type=ARTIFACT_TYPE, build=nfd_content)


def companions(settings: ScannerSettings) -> list[Companion]:
    """What to attach beside reports: NFD's artifact unless `attach_nfd` is off."""
    return [NFD_COMPANION] if settings.attach_nfd else []
