"""SVG badges: well-formed, accessible, sized to their text, and saying the right thing."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from scanner.models import GpuFacts, ImageReport, InferredCuda, PlatformReport
from web.views.badge_svg import (
    CPU_COLOUR,
    ERROR_COLOUR,
    GPU_COLOUR,
    UNKNOWN_COLOUR,
    BadgeContent,
    badge_for,
    render_badge,
    text_width,
)

SVG = "{http://www.w3.org/2000/svg}"


def report(*platforms: GpuFacts) -> ImageReport:
    return ImageReport(
        reference="r/x:1",
        digest="sha256:" + "a" * 64,
        platforms=[
            PlatformReport(platform="linux/amd64", digest=f"sha256:{i:064x}", gpu=g)
            for i, g in enumerate(platforms)
        ],
    )


def test_gpu_image_names_its_highest_cuda_version() -> None:
    content = badge_for(
        report(GpuFacts(required=True, cuda_version="12.10"), GpuFacts(required=True, cuda_version="12.9"))
    )
    assert content == BadgeContent("nvidia gpu", "cuda 12.10", GPU_COLOUR)


def test_a_newer_cuda_carried_than_declared_is_the_badge() -> None:
    carried = InferredCuda(cuda="13.0", set_by="/x/torch/version.py: torch 2.9.1+cu130, cuda = '13.0'")
    content = badge_for(report(GpuFacts(required=True, cuda_version="12.8", inferred=carried)))
    assert content == BadgeContent("nvidia gpu", "cuda 13.0 inside (declares 12.8)", GPU_COLOUR)
    same = InferredCuda(cuda="12.8")
    assert (
        badge_for(report(GpuFacts(required=True, cuda_version="12.8", inferred=same))).message == "cuda 12.8"
    )


def test_gpu_without_cuda_version_and_cpu_and_unscanned() -> None:
    assert badge_for(report(GpuFacts(required=True))).message == "required"
    assert badge_for(report(GpuFacts())) == BadgeContent("gpu", "cpu only", CPU_COLOUR)
    assert badge_for(None) == BadgeContent("gpu", "not scanned", UNKNOWN_COLOUR)
    failed = badge_for(None, last_scan_failed=True)
    assert (failed.label, failed.message, failed.colour) == ("gpu", "unknown", ERROR_COLOUR)
    limit = "image has 1,500 layers; the limit is 256 (GPUBADGE_MAX_LAYERS)"
    over = badge_for(None, last_scan_failed=True, failure=limit)
    assert over.message == "unknown" and over.title == f"gpu: unknown ({limit})"
    assert f"<title>gpu: unknown ({limit})</title>" in render_badge(over)


def test_text_width_follows_glyph_widths() -> None:
    assert text_width("") == 0
    assert text_width("iiii") < text_width("mmmm")
    # Verdana 11px renders "cuda 12.2" about 55 px wide (shields measures 54.6).
    assert 50 < text_width("cuda 12.2") < 60
    assert text_width("ab", font_size=22) == pytest.approx(2 * text_width("ab"))


@pytest.mark.parametrize(
    "content",
    [
        BadgeContent("nvidia gpu", "cuda 12.2", GPU_COLOUR),
        BadgeContent("gpu", "cpu only", CPU_COLOUR),
        BadgeContent("a<b>&\"'", "</svg><script>x</script>", "#000"),
    ],
)
def test_rendered_svg_is_well_formed_titled_and_sized(content: BadgeContent) -> None:
    svg = render_badge(content)
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    title = root.find(f"{SVG}title")
    assert title is not None and title.text == f"{content.label}: {content.message}"
    assert root.get("aria-label") == title.text
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert texts == [content.label, content.label, content.message, content.message]
    rects = list(root.iter(f"{SVG}rect"))
    label_width, message_width = int(rects[1].get("width", "0")), int(rects[2].get("width", "0"))
    assert int(root.get("width", "0")) == label_width + message_width
    assert label_width == round(text_width(content.label) + 12)
    assert rects[2].get("fill") == content.colour
    assert root.find(f".//{SVG}script") is None
