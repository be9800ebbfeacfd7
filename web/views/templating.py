"""The HTML pages' Jinja2 set-up: one autoescaping environment for web/templates/, its filters
(sizes, times, image links), the navigation and the security headers every page carries.

Every value taken from an image (env vars, labels, repository names) reaches the browser as
text; a Content-Security-Policy without inline scripts is the second line of defence.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from aiohttp import web
from markupsafe import Markup

from placement.sizes import size_text
from scanner.registry.reference import Reference

HERE = Path(__file__).parent.parent  # web/, which holds templates/ and static/


TEMPLATE_DIR = HERE / "templates"


STATIC_DIR = HERE / "static"


# Pages carry no inline script; anything injected into the markup could not run.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self';"
        " object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


@cache
def environment() -> jinja2.Environment:
    """The one Jinja2 environment of the process, loaded on first use."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["bytes"] = human_bytes
    env.filters["when"] = format_time
    env.filters["ago"] = time_ago
    env.filters["image_url"] = image_url
    env.filters["breakable"] = breakable
    env.globals["nav"] = NAVIGATION
    return env


def render(name: str, **context: Any) -> str:
    return environment().get_template(name).render(**context)


def page(request: web.Request, name: str, *, status: int = 200, **context: Any) -> web.Response:
    context.setdefault("title", "gpubadge")
    context.setdefault("active", "")
    context["origin"] = origin_of(request)
    return web.Response(
        text=render(name, **context),
        status=status,
        content_type="text/html",
        charset="utf-8",
        headers=SECURITY_HEADERS,
    )


NAVIGATION = (
    ("images", "Images", "/"),
    ("scans", "Scans", "/scans"),
    ("servers", "Servers", "/servers"),
    ("eligibility", "Eligibility", "/eligibility"),
)


def human_bytes(size: int | float) -> str:
    """1536 -> `1.5 KiB`: binary units, as registries and Docker report sizes, written as placement
    writes them in its reasons (placement.sizes: two decimals at most, rounded down)."""
    return size_text(size)


def _parse_time(value: str | datetime) -> datetime:
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def format_time(value: str | datetime | None) -> str:
    if value is None:
        return "never"
    return _parse_time(value).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def time_ago(value: str | datetime | None, now: datetime | None = None) -> str:
    """`3 min ago`, for scan times; the exact time goes in a title attribute beside it."""
    if value is None:
        return "never"
    seconds = ((now or datetime.now(UTC)) - _parse_time(value)).total_seconds()
    if seconds < 60:
        return "just now"
    for limit, size, unit in ((3600, 60, "min"), (86400, 3600, "h"), (math.inf, 86400, "d")):
        if seconds < limit:
            return f"{int(seconds // size)} {unit} ago"
    raise AssertionError("unreachable")


def breakable(name: str) -> Markup:
    """A repository or reference that wraps only after its separators (`/`, `:`, `@`), never inside a
    word: the text escaped, with a line-break opportunity (<wbr>) after each separator."""
    return Markup("").join(
        Markup("{}<wbr>").format(part) if part in "/:@" else part for part in _SEPARATED.split(name)
    )


_SEPARATED = re.compile(r"([/:@])")


def image_url(reference: str) -> str:
    """The detail page of a reference (`127.0.0.1:5000/team/app:1.0` keeps its port and slashes)."""
    return "/images/" + quote(reference, safe="/:@")


def badge_url(reference: Reference) -> str | None:
    """The README badge of a tagged reference, or None for a digest-only one."""
    if reference.tag is None:
        return None
    return "/badge/" + quote(f"{reference.name}/{reference.tag}", safe="/:") + ".svg"


def origin_of(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"
