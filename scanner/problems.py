"""Pydantic validation errors as sentences a user can act on: where, what was expected, what was found.

`problems` turns a `ValidationError` into one line per problem, `where: what` (never pydantic's
dump or its documentation links); `where` is the path in the document (`servers[0].gpus[1].memory_mib`)
and, given the document's YAML or JSON text, its line. `document_error` says the same of a file
that is not YAML or JSON at all. Pure: callers read the files.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

# pydantic's words for the common cases, in the words of someone editing the file
_EXPECTED = {
    "int_parsing": "expected an integer",
    "int_type": "expected an integer",
    "int_from_float": "expected a whole number",
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "bool_parsing": "expected true or false",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "missing": "missing (required)",
    "extra_forbidden": "not a known field",
}


def dotted(loc: Sequence[int | str]) -> str:
    """`("servers", 0, "gpus")` -> `servers[0].gpus`."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def expected(error: Any, *, show_input: bool = True) -> str:
    """What one pydantic error says, as `expected …, got …` where pydantic has a plainer word."""
    kind = error.get("type", "")
    ctx = error.get("ctx") or {}
    if kind == "value_error":
        text = str(ctx.get("error", error.get("msg", "")))
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = next(iter(ctx.values()), "?")
        text = {
            "greater_than_equal": f"must be at least {bound}",
            "greater_than": f"must be more than {bound}",
            "less_than_equal": f"must be at most {bound}",
            "less_than": f"must be less than {bound}",
        }[kind]
    elif kind == "literal_error":
        text = f"expected one of {ctx.get('expected', '?')}"
    else:
        text = _EXPECTED.get(kind) or str(error.get("msg", "invalid"))
    value = error.get("input")
    if show_input and kind not in ("missing", "value_error") and isinstance(value, str | int | float | bool):
        shown = repr(value)
        text += f", got {shown if len(shown) <= MAX_SHOWN_INPUT else shown[: MAX_SHOWN_INPUT - 1] + '…'}"
    return text


MAX_SHOWN_INPUT = 60  # a longer value is cut in a message: the reader knows what they sent


def problems(exc: ValidationError, text: str | None = None, *, show_input: bool = True) -> list[str]:
    """One `line N, path: expected …` (or `path: …` without a line) per error in `exc`.

    `text` is the YAML or JSON document that was validated, to find each path's line; inputs are
    left out with `show_input=False` (settings, which may hold secrets)."""
    root = _compose(text) if text is not None else None
    lines = []
    for error in exc.errors(include_url=False):
        loc = tuple(error.get("loc", ()))
        where = dotted(loc) or "the top level"
        line = _line(root, loc) if root is not None else None
        prefix = f"line {line}, {where}" if line is not None else where
        lines.append(f"{prefix}: {expected(error, show_input=show_input)}")
    return lines


def document_error(exc: BaseException) -> str:
    """A YAML (or JSON) syntax error as `line N, column M: what`.

    Never the snippet PyYAML quotes (the offending line, which may be a settings file's `api_token`
    line), nor a scalar, tag or key it quotes in its problem: PyYAML's problems are fixed phrases, so
    the phrase is kept and anything quoted in it, other than a token kind (`'<block mapping start>'`),
    becomes `(…)`.
    """
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "not YAML"
        phrase = re.sub(r"""(['"])(?!<)[^'"]*\1""", "(…)", problem).strip()
        if mark is None:
            return phrase
        return f"line {mark.line + 1}, column {mark.column + 1}: {phrase}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def lines_of(text: str) -> Callable[[Sequence[int | str]], int | None]:
    """The 1-based line of a path in the YAML or JSON `text`, parsed once for every path asked
    about; None for every path where the text is no YAML (TOML)."""
    root = _compose(text)
    return lambda loc: _line(root, loc) if root is not None else None


def _compose(text: str) -> Any:
    import yaml

    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None


def _line(node: Any, loc: Sequence[int | str]) -> int | None:
    """The 1-based line of the node at `loc` (or of its deepest ancestor the text has)."""
    import yaml

    line: int | None = None
    for part in loc:
        if node is None:
            break
        if isinstance(node, yaml.SequenceNode) and isinstance(part, str):
            continue  # a bare list that the parser wrapped (`[...]` read as `{servers: [...]}`)
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            node = next(
                (value for key, value in node.value if getattr(key, "value", None) == str(part)), None
            )
            if node is None:  # a missing field: its mapping is where to add it
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
        else:
            node = None
    if node is not None:
        line = node.start_mark.line + 1
    return line
