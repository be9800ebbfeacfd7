"""JSON from untrusted bodies, with its shape bounded before any model sees it.

`client_max_size` caps a body's bytes, but a megabyte of `[[[[…` still makes the parser
recurse until it fails (a 500 before this module existed), a 4,000-digit integer costs
quadratic time to convert, and `1e999` becomes infinity. `loads_bounded` refuses those
with a message that names the limit and the setting that raises it. It costs one parse, and
one walk of the parsed value (stopped at the depth limit) only when the body could break a
shape limit: a body no longer than the string limit holds no longer string, and one with no
more `{` and `[` bytes than the depth limit nests no deeper, whatever its encoding. A webhook
delivery (a few hundred bytes, a handful of brackets) is therefore parsed and never walked.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

INTEROPERABLE_INTEGER = 2**53  # the largest integer every JSON reader holds exactly (RFC 7493)


@dataclass(frozen=True)
class JsonLimits:
    """What one request body may hold; `ServiceSettings.json_limits()` builds it from settings."""

    max_depth: int = 32
    max_number: int = INTEROPERABLE_INTEGER
    max_string: int = 64 * 1024


class JsonLimitExceeded(ValueError):
    """The body is JSON, but beyond a limit; the message names it (for a 400)."""


def loads_bounded(body: bytes | str, limits: JsonLimits) -> Any:
    """Parse `body`; raise JsonLimitExceeded past a limit, or ValueError when it is not JSON.

    `json.JSONDecodeError` and `UnicodeDecodeError` (both ValueErrors) pass through unchanged,
    so callers keep their own "not JSON" messages. Bytes are decoded as `json.loads` decodes them.
    """
    if isinstance(body, bytes):
        text = body.decode(json.detect_encoding(body), "surrogatepass")
    else:
        if body.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", body, 0)
        text = body
    try:
        data = _decoder(limits).decode(text)
    except RecursionError:
        raise _depth_error(limits) from None
    if not _within_shape(body, limits):
        check_shape(data, limits)
    return data


@functools.lru_cache(maxsize=16)
def _decoder(limits: JsonLimits) -> json.JSONDecoder:
    """One decoder per set of limits, built once: `json.loads` with hooks would build one per call."""
    digits = len(str(limits.max_number))

    def integer(text: str) -> int:
        if len(text.lstrip("-")) > digits:
            raise _number_error(text, limits)
        value = int(text)
        if abs(value) > limits.max_number:
            raise _number_error(text, limits)
        return value

    def real(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or abs(value) > limits.max_number:
            raise _number_error(text, limits)
        return value

    def constant(text: str) -> Any:
        raise JsonLimitExceeded(f"{text} is not a JSON number; send a finite number")

    return json.JSONDecoder(parse_int=integer, parse_float=real, parse_constant=constant)


def _within_shape(body: bytes | str, limits: JsonLimits) -> bool:
    """True when `body` cannot hold a string longer than the limit nor nest deeper than it.

    A decoded character takes at least one byte (escapes take more), and every `{` or `[` of
    the text is a `{` or `[` byte in UTF-8, UTF-16 and UTF-32 alike; brackets inside strings
    only make the count larger. Two C-speed scans, instead of a walk of every parsed value.
    """
    if len(body) > limits.max_string:
        return False
    if isinstance(body, bytes):
        return body.count(b"{") + body.count(b"[") <= limits.max_depth
    return body.count("{") + body.count("[") <= limits.max_depth


def check_shape(data: Any, limits: JsonLimits) -> None:
    """Refuse values nested deeper than the limit, and over-long strings or object keys."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if len(value) > limits.max_string:
                raise _string_error(len(value), limits)
        elif isinstance(value, dict):
            if depth > limits.max_depth:
                raise _depth_error(limits)
            for key, item in value.items():
                if len(key) > limits.max_string:
                    raise _string_error(len(key), limits)
                if isinstance(item, (dict, list, str)):
                    stack.append((item, depth + 1))
        elif isinstance(value, list):
            if depth > limits.max_depth:
                raise _depth_error(limits)
            stack.extend((item, depth + 1) for item in value if isinstance(item, (dict, list, str)))


def _depth_error(limits: JsonLimits) -> JsonLimitExceeded:
    return JsonLimitExceeded(f"JSON nested deeper than {limits.max_depth} levels (GPUBADGE_JSON_MAX_DEPTH)")


def _string_error(length: int, limits: JsonLimits) -> JsonLimitExceeded:
    return JsonLimitExceeded(
        f"a JSON string of {length} characters is longer than {limits.max_string} (GPUBADGE_JSON_MAX_STRING)"
    )


def _number_error(text: str, limits: JsonLimits) -> JsonLimitExceeded:
    shown = text if len(text) <= 24 else f"{text[:12]}…({len(text)} characters)"
    return JsonLimitExceeded(
        f"JSON number {shown} is out of range: at most ±{limits.max_number} (GPUBADGE_JSON_MAX_NUMBER)"
    )
