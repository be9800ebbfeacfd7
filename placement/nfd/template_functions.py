"""The functions an NFD `varsTemplate` may call: Go text/template's built-ins and the sprig functions
NFD rules use in practice, as Go evaluates them. Pure; `placement.nfd.template` calls them.

NFD parses its templates with `sprig.FuncMap()` (Masterminds/sprig v3) beside text/template's
built-ins (`and`, `or`, `not`, `len`, `index`, `slice`, `eq`, `ne`, `lt`, `le`, `gt`, `ge`,
`print`, `printf`, `println`, `html`, `js`, `urlquery`, `call`). Values here are what a template
over NFD's matched features meets: strings (every feature value), Go's untyped constants (ints,
floats, booleans, strings), lists and string-keyed maps. Go's rules are kept where they decide an
answer: `eq` of a string and a number is an error (incompatible types), `and`/`or` return an
operand and stop at the first that decides, `index` of a missing map key is the zero value, printf
marks a missing or extra operand (`%!d(MISSING)`), sprig's `atoi` of a non-number is 0.

Sprig's functions that read the host (`env`, `expandenv`, `getHostByName`), make random or
time-dependent values (`rand*`, `uuidv4`, `now`, `date*`), or handle crypto keys are not offered
(NFD itself drops the host ones); a template that calls one, or any other sprig function not
listed in FUNCTIONS, is a TemplateError naming it. Every result is bounded by the template's byte
budget (`nfd_max_template_bytes`), so no function can build more than a template may write.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import re2


class TemplateError(ValueError):
    """The template cannot be parsed or run, or it needs what gpubadge does not evaluate."""


class Missing:
    """Go's `<no value>`: a nil interface (an absent operand, a variable never set)."""

    def __repr__(self) -> str:
        return "<no value>"


NO_VALUE = Missing()


# --- Go's values ------------------------------------------------------------------------------------


def go_type(value: Any) -> str:
    """The Go type a value stands for, as Go's messages name it."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "[]interface {}"
    if isinstance(value, Mapping):
        return "map[string]interface {}"
    return "<nil>"


def go_float(value: float) -> str:
    """strconv.FormatFloat(f, 'g', -1, 64): the shortest form, an exponent from 1e21 on."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    text = repr(value)
    if "e" in text:
        mantissa, _, exponent = text.partition("e")
        sign = "-" if exponent.startswith("-") else "+"
        digits = exponent.lstrip("+-").lstrip("0") or "0"
        text = f"{mantissa}e{sign}{digits.rjust(2, '0')}"
    return text


def go_text(value: Any) -> str:
    """fmt.Print of a value: strings as they are, maps as `map[k:v]` (sorted keys), lists as `[a b]`."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None or isinstance(value, Missing):
        return "<no value>"
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, Mapping):
        return "map[" + " ".join(f"{k}:{go_text(value[k])}" for k in sorted(value)) + "]"
    if isinstance(value, list):
        return "[" + " ".join(go_text(item) for item in value) + "]"
    return str(value)


def truth(value: Any) -> bool:
    """text/template's truth: false, 0, nil and empty strings, lists and maps are false."""
    if value is None or isinstance(value, Missing):
        return False
    return bool(value)


# --- the built-ins --------------------------------------------------------------------------------


def _basic(value: Any) -> str:
    """Go's basic kind of a value for comparisons: bool, int, float, string (else an error)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if value is None or isinstance(value, Missing):
        return "nil"
    raise TemplateError(f"invalid type for comparison: {go_type(value)}")


def _comparable(a: Any, b: Any) -> None:
    kinds = (_basic(a), _basic(b))
    if kinds[0] != kinds[1]:
        raise TemplateError("incompatible types for comparison")


def _eq(first: Any, *others: Any) -> bool:
    if not others:
        raise TemplateError("missing argument for comparison")
    for other in others:
        if _basic(first) == "nil" or _basic(other) == "nil":
            if _basic(first) == _basic(other):
                return True
            continue
        _comparable(first, other)
        if first == other:
            return True
    return False


def _lt(a: Any, b: Any) -> bool:
    _comparable(a, b)
    if isinstance(a, bool) or a is None or isinstance(a, Missing):
        raise TemplateError("invalid type for comparison")
    return bool(a < b)


def _index(item: Any, *keys: Any) -> Any:
    for key in keys:
        if isinstance(item, Mapping):
            if not isinstance(key, str):
                raise TemplateError(f"error calling index: value has type {go_type(key)}; should be string")
            if key in item:
                item = item[key]
            else:  # the map's zero value: "" for map[string]string (NFD's matched elements)
                item = "" if all(isinstance(v, str) for v in item.values()) else NO_VALUE
        elif isinstance(item, list | str):
            if isinstance(key, bool) or not isinstance(key, int):
                raise TemplateError(f"error calling index: cannot index slice/array with type {go_type(key)}")
            if not 0 <= key < len(item):
                raise TemplateError(f"error calling index: index out of range: {key}")
            item = (
                item[key] if isinstance(item, list) else ord(item.encode("latin-1", "replace")[key : key + 1])
            )
        else:
            raise TemplateError(f"error calling index: can't index item of type {go_type(item)}")
    return item


def _slice(item: Any, *bounds: Any) -> Any:
    if not isinstance(item, list | str):
        raise TemplateError(f"error calling slice: can't slice item of type {go_type(item)}")
    if len(bounds) > 2 + isinstance(item, list):
        raise TemplateError(f"error calling slice: too many slice indexes: {len(bounds)}")
    numbers = [_int_argument(b, "slice") for b in bounds]
    low = numbers[0] if numbers else 0
    high = numbers[1] if len(numbers) > 1 else len(item)
    if not 0 <= low <= high <= len(item):
        raise TemplateError(f"error calling slice: index out of range: {high}")
    return item[low:high]


def _length(item: Any) -> int:
    if isinstance(item, str):
        return len(item.encode())
    if isinstance(item, list | Mapping):
        return len(item)
    raise TemplateError(f"error calling len: len of type {go_type(item)}")


def _sprint(*values: Any) -> str:
    """fmt.Sprint: a space between operands when neither is a string."""
    out = ""
    for position, value in enumerate(values):
        if position and not isinstance(value, str) and not isinstance(values[position - 1], str):
            out += " "
        out += go_text(value)
    return out


_VERB = re.compile(r"%([-+# 0]*)(\*|\d+)?(?:\.(\*|\d+)?)?([a-zA-Z%])")


def _printf(form: Any, *operands: Any) -> str:
    """fmt.Sprintf for the verbs templates use (%v %s %q %d %x %X %o %b %c %f %e %g %t %%)."""
    if not isinstance(form, str):
        raise TemplateError(f"wrong type for value; expected string; got {go_type(form)}")
    out: list[str] = []
    position = 0
    used = 0
    for match in _VERB.finditer(form):
        out.append(form[position : match.start()])
        position = match.end()
        flags, width, precision, verb = match.groups()
        if verb == "%":
            out.append("%")
            continue
        if used >= len(operands):
            out.append(f"%!{verb}(MISSING)")
            continue
        value = operands[used]
        used += 1
        out.append(_format(value, flags, width, precision, verb))
    out.append(form[position:])
    if used < len(operands):
        extra = ", ".join(f"{go_type(v)}={go_text(v)}" for v in operands[used:])
        out.append(f"%!(EXTRA {extra})")
    return "".join(out)


def _format(value: Any, flags: str, width: str | None, precision: str | None, verb: str) -> str:
    if (width and width != "*" and int(width) > MAX_WIDTH) or (
        precision and precision != "*" and int(precision) > MAX_WIDTH
    ):
        raise TemplateError(f"printf width or precision above {MAX_WIDTH}")
    spec = flags.replace("#", "") + (width or "").replace("*", "") + (f".{precision}" if precision else "")
    if verb in ("v", "s"):
        text = go_text(value)
        if precision:
            text = text[: int(precision)]
        return _pad(text, flags, width)
    if verb == "q":
        return _pad(
            json.dumps(go_text(value), ensure_ascii=False) if isinstance(value, str) else go_text(value),
            flags,
            width,
        )
    if verb == "t":
        return (
            _pad(go_text(value), flags, width)
            if isinstance(value, bool)
            else f"%!t({go_type(value)}={go_text(value)})"
        )
    if verb in "dxXobc" and isinstance(value, int) and not isinstance(value, bool):
        if verb == "c":
            return _pad(chr(value), flags, width)
        return format(value, spec + verb)
    if verb in "xX" and isinstance(value, str):
        return (
            format(int.from_bytes(value.encode(), "big"), f"0{2 * len(value.encode())}{verb}")
            if value
            else ""
        )
    if verb in "feEgG" and isinstance(value, int | float) and not isinstance(value, bool):
        if verb in "gG" and not precision:
            return _pad(
                go_float(float(value)) if verb == "g" else go_float(float(value)).upper(), flags, width
            )
        return format(float(value), spec + ("f" if verb == "F" else verb))
    return f"%!{verb}({go_type(value)}={go_text(value)})"


def _pad(text: str, flags: str, width: str | None) -> str:
    if not width or width == "*":
        return text
    return text.ljust(int(width)) if "-" in flags else text.rjust(int(width))


MAX_WIDTH = 4096  # a printf width or precision past this is refused, not allocated


def _js(*values: Any) -> str:
    text = _sprint(*values)
    out = []
    for char in text:
        if char in "\\'\"":
            out.append("\\" + char)
        elif char in "<>&=" or ord(char) < 0x20:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return "".join(out)


def _html(*values: Any) -> str:
    return html.escape(_sprint(*values), quote=True).replace("&#x27;", "&#39;")


def _urlquery(*values: Any) -> str:
    return urllib.parse.quote_plus(_sprint(*values))


# --- sprig ----------------------------------------------------------------------------------------


def _string(value: Any, function: str) -> str:
    if isinstance(value, str):
        return value
    raise TemplateError(
        f"error calling {function}: wrong type for value; expected string; got {go_type(value)}"
    )


def to_string(value: Any) -> str:
    """sprig's strval / toString: a string as it is, anything else as fmt.Sprint prints it."""
    return go_text(value)


def _int_argument(value: Any, function: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TemplateError(f"error calling {function}: wrong type for value; expected int; got {go_type(value)}")


def to_int(value: Any) -> int:
    """sprig's toInt64 (cast.ToInt64E, errors as 0): strings parsed as Go integers (0x.., 0o.., 0b..)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) else 0
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            return int(text, 0) if text[:2].lower() in ("0x", "0o", "0b") else int(text, 10)
        except ValueError:
            try:
                return int(float(text)) if math.isfinite(float(text)) else 0
            except ValueError:
                return 0
    return 0


def to_float(value: Any) -> float:
    """sprig's toFloat64 (cast.ToFloat64E, errors as 0)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return 0.0
    return 0.0


def _atoi(value: Any) -> int:
    text = _string(value, "atoi")
    try:
        return int(text, 10)
    except ValueError:
        return 0  # strconv.Atoi's error is dropped by sprig: 0


def _list_of(value: Any, function: str) -> list[Any]:
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        raise TemplateError(f"error calling {function}: Cannot find {function} on type string")
    raise TemplateError(f"error calling {function}: Cannot find {function} on type {go_type(value)}")


def _empty(value: Any) -> bool:
    return not truth(value)


def _default(fallback: Any, *given: Any) -> Any:
    if not given or _empty(given[0]):
        return fallback
    return given[0]


def _coalesce(*values: Any) -> Any:
    return next((value for value in values if not _empty(value)), NO_VALUE)


def _ternary(yes: Any, no: Any, condition: Any) -> Any:
    if not isinstance(condition, bool):
        raise TemplateError(
            f"error calling ternary: wrong type for value; expected bool; got {go_type(condition)}"
        )
    return yes if condition else no


def _split(separator: Any, text: Any) -> dict[str, str]:
    parts = _string(text, "split").split(_string(separator, "split"))
    return {f"_{i}": part for i, part in enumerate(parts)}


def _splitn(separator: Any, count: Any, text: Any) -> dict[str, str]:
    n = _int_argument(count, "splitn")
    parts = _string(text, "splitn").split(_string(separator, "splitn"), n - 1 if n > 0 else -1)
    return {f"_{i}": part for i, part in enumerate(parts)} if n != 0 else {}


def _join(separator: Any, items: Any) -> str:
    values = items if isinstance(items, list) else [items]
    return _string(separator, "join").join(to_string(v) for v in values)


def _trunc(count: Any, text: Any) -> str:
    n, s = _int_argument(count, "trunc"), _string(text, "trunc")
    if n < 0:
        return s[-n:] if -n < len(s) else s
    return s[:n]


def _substr(start: Any, end: Any, text: Any) -> str:
    s, low, high = _string(text, "substr"), _int_argument(start, "substr"), _int_argument(end, "substr")
    if low < 0:
        return s[:high]
    if high < 0 or high > len(s):
        return s[low:]
    return s[low:high]


def _indent(spaces: Any, text: Any) -> str:
    pad = " " * _int_argument(spaces, "indent")
    return pad + _string(text, "indent").replace("\n", "\n" + pad)


def _title(text: Any) -> str:
    return re.sub(r"(^|[^\w'])(\w)", lambda m: m.group(1) + m.group(2).upper(), _string(text, "title"))


def _regex(pattern: Any, function: str) -> Any:
    text = _string(pattern, function)
    options = re2.Options()
    options.log_errors = False
    options.max_mem = REGEX_MAX_MEM
    try:
        return re2.compile(text, options)
    except re2.error as exc:
        raise TemplateError(f"error calling {function}: {exc}") from None


REGEX_MAX_MEM = 8 << 20  # RE2's memory for one template regex: Go's regexp has no backtracking either


def _regex_find_all(pattern: Any, text: Any, count: Any) -> list[str]:
    n = _int_argument(count, "regexFindAll")
    found = [m.group(0) for m in _regex(pattern, "regexFindAll").finditer(_string(text, "regexFindAll"))]
    return found if n < 0 else found[:n]


def _regex_replace(pattern: Any, text: Any, replacement: Any, function: str, literal: bool) -> str:
    compiled = _regex(pattern, function)
    template = _string(replacement, function)
    if literal:
        return str(compiled.sub(lambda _m: template, _string(text, function)))

    # Go's ${1} / $1 expansion, as regexp.ReplaceAllString does
    def expand(match: Any) -> str:
        return re.sub(
            r"\$(\{(\w+)\}|(\w+))",
            lambda g: (
                (match.group(int(g.group(2) or g.group(3))) or "")
                if (g.group(2) or g.group(3) or "").isdigit()
                else ""
            ),
            template,
        )

    return str(compiled.sub(expand, _string(text, function)))


def _uniq(items: Any) -> list[Any]:
    out: list[Any] = []
    for item in _list_of(items, "uniq"):
        if item not in out:
            out.append(item)
    return out


def _dict(*pairs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for position in range(0, len(pairs), 2):
        key = to_string(pairs[position])
        out[key] = pairs[position + 1] if position + 1 < len(pairs) else ""
    return out


def _keys(*maps: Any) -> list[str]:
    return [key for item in maps for key in _map_of(item, "keys")]


def _map_of(value: Any, function: str) -> Mapping[str, Any]:
    if isinstance(value, Mapping):
        return value
    raise TemplateError(f"error calling {function}: wrong type for value; expected map; got {go_type(value)}")


def _number(function: str) -> Callable[..., Any]:
    def apply(*values: Any) -> int:
        numbers = [to_int(v) for v in values]
        if function == "add":
            return sum(numbers)
        if function == "mul":
            product = 1
            for n in numbers:
                product *= n
            return product
        if function in ("max", "min"):
            return (max if function == "max" else min)(numbers)
        a, b = numbers
        if function == "sub":
            return a - b
        if b == 0:
            raise TemplateError(f"error calling {function}: runtime error: integer divide by zero")
        quotient = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)  # Go truncates towards zero
        return quotient if function == "div" else a - b * quotient

    return apply


def _has(needle: Any, haystack: Any) -> bool:
    return needle in _list_of(haystack, "has") if haystack is not None else False


# name -> (function, whether it takes the template's byte bound into account itself)
FUNCTIONS: dict[str, Callable[..., Any]] = {
    # text/template's built-ins (and/or/not/call/len/index/slice are evaluated by the runner where
    # Go evaluates them specially)
    "eq": _eq,
    "ne": lambda a, b: not _eq(a, b),
    "lt": _lt,
    "le": lambda a, b: _lt(a, b) or _eq(a, b),
    "gt": lambda a, b: not (_lt(a, b) or _eq(a, b)),
    "ge": lambda a, b: not _lt(a, b),
    "not": lambda value: not truth(value),
    "len": _length,
    "index": _index,
    "slice": _slice,
    "print": _sprint,
    "printf": _printf,
    "println": lambda *values: " ".join(go_text(v) for v in values) + "\n",
    "html": _html,
    "js": _js,
    "urlquery": _urlquery,
    # sprig: strings
    "upper": lambda s: _string(s, "upper").upper(),
    "lower": lambda s: _string(s, "lower").lower(),
    "title": _title,
    "untitle": lambda s: (lambda t: t[:1].lower() + t[1:])(_string(s, "untitle")),
    "trim": lambda s: _string(s, "trim").strip(),
    "trimAll": lambda cut, s: _string(s, "trimAll").strip(_string(cut, "trimAll")),
    "trimPrefix": lambda prefix, s: _string(s, "trimPrefix").removeprefix(_string(prefix, "trimPrefix")),
    "trimSuffix": lambda suffix, s: _string(s, "trimSuffix").removesuffix(_string(suffix, "trimSuffix")),
    "trunc": _trunc,
    "substr": _substr,
    "repeat": lambda count, s: _string(s, "repeat") * _int_argument(count, "repeat"),
    "replace": lambda old, new, s: _string(s, "replace").replace(
        _string(old, "replace"), _string(new, "replace")
    ),
    "contains": lambda sub, s: _string(sub, "contains") in _string(s, "contains"),
    "hasPrefix": lambda prefix, s: _string(s, "hasPrefix").startswith(_string(prefix, "hasPrefix")),
    "hasSuffix": lambda suffix, s: _string(s, "hasSuffix").endswith(_string(suffix, "hasSuffix")),
    "quote": lambda *values: " ".join(
        json.dumps(to_string(v), ensure_ascii=False) for v in values if v is not None
    ),
    "squote": lambda *values: " ".join(f"'{to_string(v)}'" for v in values if v is not None),
    "cat": lambda *values: " ".join(
        to_string(v) for v in values if v is not None and not isinstance(v, Missing)
    ),
    "indent": _indent,
    "nindent": lambda spaces, s: "\n" + _indent(spaces, s),
    "nospace": lambda s: re.sub(r"\s", "", _string(s, "nospace")),
    "toString": to_string,
    "split": _split,
    "splitList": lambda sep, s: _string(s, "splitList").split(_string(sep, "splitList")),
    "splitn": _splitn,
    "join": _join,
    "sortAlpha": lambda items: sorted(to_string(v) for v in (items if isinstance(items, list) else [items])),
    "regexMatch": lambda pattern, s: (
        _regex(pattern, "regexMatch").search(_string(s, "regexMatch")) is not None
    ),
    "regexFind": lambda pattern, s: (lambda m: m.group(0) if m else "")(
        _regex(pattern, "regexFind").search(_string(s, "regexFind"))
    ),
    "regexFindAll": _regex_find_all,
    "regexReplaceAll": lambda p, s, r: _regex_replace(p, s, r, "regexReplaceAll", literal=False),
    "regexReplaceAllLiteral": lambda p, s, r: _regex_replace(p, s, r, "regexReplaceAllLiteral", literal=True),
    "regexSplit": lambda p, s, n: (
        lambda parts: parts if _int_argument(n, "regexSplit") < 0 else parts[: _int_argument(n, "regexSplit")]
    )(list(_regex(p, "regexSplit").split(_string(s, "regexSplit")))),
    # sprig: numbers
    "atoi": _atoi,
    "int": to_int,
    "int64": to_int,
    "float64": to_float,
    "add": _number("add"),
    "add1": lambda value: to_int(value) + 1,
    "sub": _number("sub"),
    "mul": _number("mul"),
    "div": _number("div"),
    "mod": _number("mod"),
    "max": _number("max"),
    "min": _number("min"),
    "floor": lambda value: float(math.floor(to_float(value))),
    "ceil": lambda value: float(math.ceil(to_float(value))),
    "round": lambda value, places=0, half=0.5: (
        math.floor(to_float(value) * 10 ** to_int(places) + to_float(half)) / 10 ** to_int(places)
    ),
    # sprig: defaults and logic
    "default": _default,
    "empty": _empty,
    "coalesce": _coalesce,
    "ternary": _ternary,
    "toJson": lambda value: json.dumps(
        value if not isinstance(value, Missing) else None, separators=(",", ":")
    ),
    # sprig: lists
    "list": lambda *values: list(values),
    "first": lambda items: _list_of(items, "first")[0] if _list_of(items, "first") else NO_VALUE,
    "last": lambda items: _list_of(items, "last")[-1] if _list_of(items, "last") else NO_VALUE,
    "rest": lambda items: _list_of(items, "rest")[1:],
    "initial": lambda items: _list_of(items, "initial")[:-1],
    "append": lambda items, value: [*_list_of(items, "append"), value],
    "prepend": lambda items, value: [value, *_list_of(items, "prepend")],
    "concat": lambda *lists: [item for items in lists for item in _list_of(items, "concat")],
    "reverse": lambda items: list(reversed(_list_of(items, "reverse"))),
    "has": _has,
    "without": lambda items, *drop: [item for item in _list_of(items, "without") if item not in drop],
    "uniq": _uniq,
    "compact": lambda items: [item for item in _list_of(items, "compact") if not _empty(item)],
    # sprig: maps
    "dict": _dict,
    "get": lambda item, key: _map_of(item, "get").get(_string(key, "get"), ""),
    "hasKey": lambda item, key: _string(key, "hasKey") in _map_of(item, "hasKey"),
    "keys": _keys,
    "values": lambda item: list(_map_of(item, "values").values()),
    "pick": lambda item, *names: {k: v for k, v in _map_of(item, "pick").items() if k in names},
    "omit": lambda item, *names: {k: v for k, v in _map_of(item, "omit").items() if k not in names},
    # sprig: encodings
    "b64enc": lambda s: base64.b64encode(_string(s, "b64enc").encode()).decode(),
    "b64dec": lambda s: base64.b64decode(_string(s, "b64dec").encode(), validate=False).decode(
        errors="replace"
    ),
    "sha256sum": lambda s: hashlib.sha256(_string(s, "sha256sum").encode()).hexdigest(),
    "sha1sum": lambda s: hashlib.sha1(_string(s, "sha1sum").encode(), usedforsecurity=False).hexdigest(),
}
BUILTINS = frozenset(
    [
        "and",
        "or",
        "not",
        "call",
        "len",
        "index",
        "slice",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "print",
        "printf",
        "println",
        "html",
        "js",
        "urlquery",
    ]
)
# Sprig's other functions: named as not evaluated here, never "not defined" (NFD would run them).
SPRIG_NOT_EVALUATED = frozenset(
    [
        "abbrev",
        "abbrevboth",
        "adler32sum",
        "ago",
        "bcrypt",
        "buildCustomCert",
        "camelcase",
        "chunk",
        "date",
        "dateInZone",
        "dateModify",
        "date_in_zone",
        "date_modify",
        "decryptAES",
        "deepCopy",
        "deepEqual",
        "derivePassword",
        "dig",
        "duration",
        "durationRound",
        "encryptAES",
        "fail",
        "float64",
        "fromJson",
        "genCA",
        "genCAWithKey",
        "genPrivateKey",
        "genSelfSignedCert",
        "genSelfSignedCertWithKey",
        "genSignedCert",
        "genSignedCertWithKey",
        "htmlDate",
        "htmlDateInZone",
        "htpasswd",
        "initials",
        "kebabcase",
        "kindIs",
        "kindOf",
        "merge",
        "mergeOverwrite",
        "mustAppend",
        "mustDateModify",
        "mustDeepCopy",
        "mustFirst",
        "mustFromJson",
        "mustHas",
        "mustInitial",
        "mustLast",
        "mustMerge",
        "mustMergeOverwrite",
        "mustPrepend",
        "mustPush",
        "mustRegexFind",
        "mustRegexFindAll",
        "mustRegexMatch",
        "mustRegexReplaceAll",
        "mustRegexReplaceAllLiteral",
        "mustRegexSplit",
        "mustRest",
        "mustReverse",
        "mustSlice",
        "mustToDate",
        "mustToJson",
        "mustToPrettyJson",
        "mustToRawJson",
        "mustUniq",
        "mustWithout",
        "now",
        "omit",
        "plural",
        "push",
        "randAlpha",
        "randAlphaNum",
        "randAscii",
        "randBytes",
        "randInt",
        "randNumeric",
        "regexQuoteMeta",
        "semver",
        "semverCompare",
        "seq",
        "set",
        "shuffle",
        "snakecase",
        "sortAlpha",
        "splitn",
        "swapcase",
        "toDate",
        "toDecimal",
        "toPrettyJson",
        "toRawJson",
        "toStrings",
        "tuple",
        "typeIs",
        "typeIsLike",
        "typeOf",
        "unixEpoch",
        "unset",
        "until",
        "untilStep",
        "urlJoin",
        "urlParse",
        "uuidv4",
        "wrap",
        "wrapWith",
        "b32dec",
        "b32enc",
        "biggest",
        "addf",
        "add1f",
        "subf",
        "mulf",
        "divf",
        "maxf",
        "minf",
        "sha512sum",
        "getHostByName",
        "env",
        "expandenv",
        "osBase",
        "osClean",
        "osDir",
        "osExt",
        "osIsAbs",
        "base",
        "clean",
        "dir",
        "ext",
        "isAbs",
        "list",
        "atoi",
    ]
) - set(FUNCTIONS)
# NFD drops these (they read the host); Go's parser then says the function is not defined.
NFD_DROPPED = frozenset(("env", "expandenv", "getHostByName"))


def known(name: str) -> bool:
    """Whether Go's parser would accept `name` as a function of NFD's templates."""
    return name in FUNCTIONS or name in BUILTINS or (name in SPRIG_NOT_EVALUATED and name not in NFD_DROPPED)


def _size(value: Any) -> int:
    """What a value weighs against the byte budget: a string's bytes, a list's or map's entries."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list | Mapping):
        return len(value)
    return 0


def call(name: str, arguments: Sequence[Any], max_bytes: int) -> Any:
    """Call one function (not and/or, which the runner evaluates lazily as Go does); a result
    larger than `max_bytes` (a string's bytes, a list's entries) is a TemplateError, so no chain
    of calls can build more than the template may write."""
    function = FUNCTIONS.get(name)
    if function is None:
        if name == "call":
            raise TemplateError("error calling call: no function values exist in an NFD template's data")
        raise TemplateError(
            f"the sprig function {name!r} is not evaluated by gpubadge (NFD offers it; see"
            " placement/nfd/template_functions.py for the ones it evaluates)"
        )
    count, text = (arguments[0], arguments[1]) if len(arguments) == 2 else (0, "")
    if (
        name == "repeat"
        and isinstance(count, int)
        and isinstance(text, str)
        and count * len(text) > max_bytes
    ):
        raise TemplateError(f"repeat expands past {max_bytes:,} bytes (the setting nfd_max_template_bytes)")
    try:
        result = function(*arguments)
    except TemplateError:
        raise
    except TypeError:
        raise TemplateError(f"wrong number of args for {name}: got {len(arguments)}") from None
    except (ValueError, ArithmeticError, UnicodeError, KeyError, IndexError) as exc:
        raise TemplateError(f"error calling {name}: {exc}") from None
    if _size(result) > max_bytes:
        raise TemplateError(f"{name} expands past {max_bytes:,} bytes (the setting nfd_max_template_bytes)")
    return result
