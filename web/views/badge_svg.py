"""Shields-style SVG badges (`nvidia gpu | cuda 12.2`) for READMEs. Pure: text in, SVG text out.

Widths are estimated from Verdana 11px advance widths (the font shields badges use), and
each text also carries `textLength`, so a renderer with a different font squeezes or
stretches the glyphs to the box instead of spilling over the edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from scanner.models import ImageReport

FONT_SIZE_PX = 11
HORIZONTAL_PADDING_PX = 6
BADGE_HEIGHT_PX = 20
LABEL_COLOUR = "#555"

# Colours, explained by the legend on the images page.
GPU_COLOUR = "#76b900"  # NVIDIA green: needs an NVIDIA GPU
CPU_COLOUR = "#007ec6"  # blue: runs without a GPU
UNKNOWN_COLOUR = "#9f9f9f"  # grey: not scanned yet
ERROR_COLOUR = "#e05d44"  # red: the last scan failed

# Verdana advance widths in em (units per em / 2048), for the characters badges use most.
_EM_WIDTHS: dict[str, float] = {
    " ": 0.352, "!": 0.394, '"': 0.459, "#": 0.818, "%": 1.076, "&": 0.727, "'": 0.269,
    "(": 0.454, ")": 0.454, "*": 0.636, "+": 0.818, ",": 0.364, "-": 0.431, ".": 0.364,
    "/": 0.454, ":": 0.454, ";": 0.454, "<": 0.818, "=": 0.818, ">": 0.818, "?": 0.545,
    "@": 1.0, "[": 0.454, "]": 0.454, "_": 0.636, "|": 0.454, "~": 0.818,
    "a": 0.601, "b": 0.623, "c": 0.521, "d": 0.623, "e": 0.596, "f": 0.352, "g": 0.623,
    "h": 0.633, "i": 0.274, "j": 0.344, "k": 0.592, "l": 0.274, "m": 0.973, "n": 0.633,
    "o": 0.607, "p": 0.623, "q": 0.623, "r": 0.427, "s": 0.521, "t": 0.394, "u": 0.633,
    "v": 0.592, "w": 0.818, "x": 0.592, "y": 0.592, "z": 0.525,
    "A": 0.684, "B": 0.686, "C": 0.698, "D": 0.771, "E": 0.632, "F": 0.575, "G": 0.775,
    "H": 0.751, "I": 0.421, "J": 0.455, "K": 0.693, "L": 0.557, "M": 0.843, "N": 0.748,
    "O": 0.787, "P": 0.603, "Q": 0.787, "R": 0.695, "S": 0.684, "T": 0.616, "U": 0.732,
    "V": 0.684, "W": 0.989, "X": 0.685, "Y": 0.615, "Z": 0.685,
}  # fmt: skip
_DIGIT_EM = 0.636  # Verdana digits share one width
_FALLBACK_EM = 0.7  # wide enough for most other glyphs; textLength absorbs the rest


def text_width(text: str, font_size: float = FONT_SIZE_PX) -> float:
    """Estimated rendered width of `text` in Verdana at `font_size` pixels."""
    total = 0.0
    for char in text:
        total += _DIGIT_EM if char.isdigit() else _EM_WIDTHS.get(char, _FALLBACK_EM)
    return total * font_size


@dataclass(frozen=True)
class BadgeContent:
    """What one badge says: `label | message` on a coloured right half."""

    label: str
    message: str
    colour: str
    reason: str | None = None  # why the badge cannot say more (a failed scan's error)

    @property
    def title(self) -> str:
        text = f"{self.label}: {self.message}"
        return f"{text} ({self.reason})" if self.reason else text


INFERRED_COLOUR = "#dfb317"  # shields' yellow: GPU optional (CUDA inside, no GPU declared)


def badge_for(
    report: ImageReport | None, *, last_scan_failed: bool = False, failure: str | None = None
) -> BadgeContent:
    """The README badge for an image: `nvidia gpu | cuda 12.2`, `gpu | cpu only`, `gpu | not scanned`,
    or `gpu optional | cuda 12.1 inside` for CUDA found in the layers of an image that declares none;
    `nvidia gpu | cuda 13.0 inside (declares 12.8)` where the layers carry a newer CUDA than declared.

    A failed scan gives `gpu | unknown` with the error as the reason (in the title and
    aria-label): it never guesses a verdict, e.g. for an image past a scan limit. While the layers
    are read, a GPU image keeps its badge (the config decided it) with the pending read as the
    reason, and an image that declares no GPU says `gpu | checking layers`.
    """
    if report is None:
        if last_scan_failed:
            return BadgeContent("gpu", "unknown", ERROR_COLOUR, reason=failure or "the last scan failed")
        return BadgeContent("gpu", "not scanned", UNKNOWN_COLOUR)
    pending = "layers are still being read (libc, CUDA inside)" if report.pending else None
    if report.gpu_required:  # the config says so: no layer can change it
        versions = sorted(
            {p.gpu.cuda_version for p in report.platforms if p.gpu.cuda_version},
            key=_version_key,
        )
        message = f"cuda {versions[-1]}" if versions else "required"
        carried = sorted(
            {p.gpu.inferred.cuda for p in report.platforms if p.gpu.inferred and p.gpu.inferred.cuda},
            key=_version_key,
        )
        if (
            carried
            and versions
            and "." in carried[-1]
            and _version_key(carried[-1]) > _version_key(versions[-1])
        ):
            # the layers carry a newer CUDA than the config declares: that one decides the driver
            message = f"cuda {carried[-1]} inside (declares {versions[-1]})"
        return BadgeContent("nvidia gpu", message, GPU_COLOUR, reason=pending)
    inferred = [p.gpu.inferred for p in report.platforms if p.gpu.inferred is not None]
    if inferred:
        found = sorted({i.cuda for i in inferred if i.cuda}, key=_version_key)
        # placement.image_needs' "GPU optional": carries CUDA, declares no GPU, runs on a CPU too
        message = f"cuda {found[-1]} inside" if found else "cuda inside"
        return BadgeContent("gpu optional", message, INFERRED_COLOUR, reason=pending)
    if pending:  # CUDA may yet be found inside: "cpu only" would be a guess
        return BadgeContent("gpu", "checking layers", UNKNOWN_COLOUR, reason=pending)
    broken = next((p.error for p in report.platforms if p.error and p.libc.state == "analysed"), None)
    if broken:  # the layers that would show CUDA inside could not be read
        return BadgeContent("gpu", "unknown", ERROR_COLOUR, reason=broken)
    return BadgeContent("gpu", "cpu only", CPU_COLOUR)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else 0 for part in version.split("."))


def render_badge(content: BadgeContent) -> str:
    """A flat, shields-style SVG with a `<title>` and `aria-label` for screen readers."""
    label_text_width = text_width(content.label)
    message_text_width = text_width(content.message)
    label_width = round(label_text_width + 2 * HORIZONTAL_PADDING_PX)
    message_width = round(message_text_width + 2 * HORIZONTAL_PADDING_PX)
    total_width = label_width + message_width
    title = escape(content.title)
    # Text is drawn at 10x scale and shrunk, as shields does, so sub-pixel positions stay crisp.
    label_x = label_width * 5
    message_x = label_width * 10 + message_width * 5
    label_length = round(label_text_width * 10)
    message_length = round(message_text_width * 10)
    label = escape(content.label)
    message = escape(content.message)
    colour = quoteattr(content.colour)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_width}" height="{BADGE_HEIGHT_PX}"'
        f' role="img" aria-label={quoteattr(content.title)}>'
        f"<title>{title}</title>"
        '<linearGradient id="s" x2="0" y2="100%">'
        '<stop offset="0" stop-color="#bbb" stop-opacity=".1"/><stop offset="1" stop-opacity=".1"/>'
        "</linearGradient>"
        f'<clipPath id="r"><rect width="{total_width}" height="{BADGE_HEIGHT_PX}" rx="3" fill="#fff"/></clipPath>'
        '<g clip-path="url(#r)">'
        f'<rect width="{label_width}" height="{BADGE_HEIGHT_PX}" fill="{LABEL_COLOUR}"/>'
        f'<rect x="{label_width}" width="{message_width}" height="{BADGE_HEIGHT_PX}" fill={colour}/>'
        f'<rect width="{total_width}" height="{BADGE_HEIGHT_PX}" fill="url(#s)"/>'
        "</g>"
        '<g fill="#fff" text-anchor="middle" font-family="Verdana,Geneva,DejaVu Sans,sans-serif"'
        ' text-rendering="geometricPrecision" font-size="110">'
        f'<text aria-hidden="true" x="{label_x}" y="150" fill="#010101" fill-opacity=".3"'
        f' transform="scale(.1)" textLength="{label_length}">{label}</text>'
        f'<text x="{label_x}" y="140" transform="scale(.1)" textLength="{label_length}">{label}</text>'
        f'<text aria-hidden="true" x="{message_x}" y="150" fill="#010101" fill-opacity=".3"'
        f' transform="scale(.1)" textLength="{message_length}">{message}</text>'
        f'<text x="{message_x}" y="140" transform="scale(.1)" textLength="{message_length}">{message}</text>'
        "</g></svg>"
    )
