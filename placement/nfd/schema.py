"""The image-compatibility document, field by field as NFD's Go types define it. Pure.

Mirrors `Spec` / `Compatibility` (node-feature-discovery `api/image-compatibility/v1alpha1/
spec.go`) and `GroupRule` / `MatchAnyElem` / `FeatureMatcherTerm` / `MatchExpression`
(`api/nfd/v1alpha1/types.go`), with their JSON field names. NFD's client reads the artifact's
layer with `sigs.k8s.io/yaml` v1.6 (go-yaml v2 resolves the YAML, it is converted to JSON with
the Go types as a guide, then encoding/json decodes it), and `load_spec` reads it the same way:

- a YAML number or boolean where Go has a string becomes that string (`value: [10]` is "10",
  `value: [0300]` is the octal 192, so "192", `yes` is "true", `1.5e3` is "1500", formatted as
  Go formats a float32); where Go has an int (`weight`) a string is an error;
- field names match case-insensitively (`MatchExpressions:` is `matchExpressions`), the exact
  name first; unknown fields are ignored (returned as warnings; `strict=True` refuses them);
- a missing `version`, `compatibilities` or a set's `rules` is empty, and any version is read.
- merge keys (`<<: *base`) apply as go-yaml v2 applies them, in document order; only the first
  YAML document is read.

The YAML is read from the parser's events, never composed recursively, and bounded whatever its
byte size (`DocumentLimits`: expanded nodes, aliases counted each time they are used, and depth),
so an alias bomb or `[` x 100,000 is a SpecError naming the setting, never a stall or a
RecursionError. Every model forbids unknown fields, so what gpubadge writes is checked against
this schema field by field (`placement.nfd.write.dump_spec` validates before writing).

Residual gaps to Go (documented, not silent): go-yaml v2 timestamps (`2024-01-02`) where Go has
a string come out as RFC 3339 text in Go and as written here; Unicode case folding of field
names beyond ASCII (Go's `equalFold` also folds `ſ` and the Kelvin sign) is not done.

`placement.nfd.write.dump_spec` writes YAML that reads exactly like NFD's documentation (`vendor: {op: In, value:
["10de"]}`), with every string a YAML reader could take for something else double-quoted, and
the same bytes for the same document (artifacts are deduplicated by digest).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

if TYPE_CHECKING:
    from scanner.settings import ScannerSettings

ARTIFACT_TYPE = "application/vnd.nfd.image-compatibility.v1alpha1"
SPEC_MEDIA_TYPE = "application/vnd.nfd.image-compatibility.spec.v1alpha1+yaml"
VERSION = "v1alpha1"
SPEC_FILE_NAME = "image-compatibility.yaml"

# The operators NFD's CRD validation lists (kubebuilder enum), plus "" (Go's MatchAny: always true).
MatchOp = Literal[
    "", "In", "NotIn", "InRegexp", "Exists", "DoesNotExist", "Gt", "Ge", "Lt", "Le", "GtLt", "GeLe", "IsTrue",
    "IsFalse",
]  # fmt: skip
MATCH_OPS: frozenset[str] = frozenset(MatchOp.__args__)  # type: ignore[attr-defined]
MAX_SPEC_BYTES = 1024 * 1024  # a compatibility document is a few KiB; NFD has no bound of its own
# Defaults of the `nfd_*` settings (scanner/settings.py): far above any real document (gpubadge's
# own is ~60 YAML nodes, 12 deep; NFD's examples have a few hundred), far below what stalls.
DEFAULT_MAX_NODES = 20_000
DEFAULT_MAX_DEPTH = 64
DEFAULT_REGEX_MAX_MEM = 1024 * 1024  # RE2's memory for one pattern: `\pL{30}` fits, `\pL{300}` not
DEFAULT_REGEX_BUDGET = 400_000  # RE2 program instructions compiled per document (~0.1 s of compiling)
DEFAULT_MAX_EVALUATIONS = 500_000  # expressions evaluated (on one element each) per evaluation: ~1 s
DEFAULT_MAX_TEMPLATE_BYTES = 64 * 1024  # a varsTemplate's expansion (NFD bounds the template to 64 KiB)


class SpecError(ValueError):
    """The document is not one NFD could decode, or it goes past one of gpubadge's bounds (the message
    says where, or which setting)."""


class _Go(BaseModel):
    """Go's json decoding: exact types, JSON names, nothing unknown (see `load_spec` for leniency)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


class MatchExpression(_Go):
    """`{op, value, type}`: an operator applied to one feature element's value.

    `op` is read as any string, as Go's `MatchOp` is: an unknown one is an error only when
    evaluated (`evaluateMatchExpression`), as in NFD. It is typed as the operators NFD knows, for
    those who write expressions (gpubadge's builder); `dump_spec` refuses another.
    """

    op: MatchOp = ""

    @field_validator("op", mode="plain")
    @classmethod
    def _any_op(cls, value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError("op must be a string")
        return value

    value: list[str] = Field(default_factory=list)
    type: str = ""  # "" or "version" (for Gt, Ge, Lt, Le, GtLt, GeLe)

    def text(self) -> str:
        """`Ge 525.60.13 (version)`, for people."""
        parts: list[str] = [self.op or "(any)"]
        if self.value:
            parts.append(", ".join(self.value))
        if self.type:
            parts.append(f"({self.type})")
        return " ".join(parts)


class FeatureMatcherTerm(_Go):
    """Requirements on one feature (`pci.device`, `kernel.loadedmodule`, `local.label`, ...)."""

    feature: str
    match_expressions: dict[str, MatchExpression] | None = Field(default=None, alias="matchExpressions")
    match_name: MatchExpression | None = Field(default=None, alias="matchName")


class MatchAnyElem(_Go):
    match_features: list[FeatureMatcherTerm] = Field(default_factory=list, alias="matchFeatures")


class GroupRule(_Go):
    """A NodeFeatureGroup rule: every `matchFeatures` term, and one of `matchAny`, must match."""

    name: str = ""
    vars: dict[str, str] | None = None
    vars_template: str = Field(default="", alias="varsTemplate")
    match_features: list[FeatureMatcherTerm] | None = Field(default=None, alias="matchFeatures")
    match_any: list[MatchAnyElem] | None = Field(default=None, alias="matchAny")


class Compatibility(_Go):
    """One compatibility set: rules, and optional weight, tag and description."""

    rules: list[GroupRule] = Field(default_factory=list)
    weight: int = 0
    tag: str = ""
    description: str = ""


class Spec(_Go):
    """The whole document: `version: v1alpha1` and the compatibility sets."""

    version: str = ""
    compatibilities: list[Compatibility] = Field(default_factory=list)


# --- reading: bounded YAML events, then Go's sigs.k8s.io/yaml decoding ------------------------


class DocumentLimits(BaseModel):
    """What reading and evaluating one untrusted document may cost (the `nfd_*` settings).

    Every bound counts what the document expands to, not its bytes: YAML aliases are counted
    each time they are used, so a kilobyte of nested aliases cannot grow past `max_nodes`.
    """

    model_config = ConfigDict(frozen=True)

    max_nodes: int = Field(default=DEFAULT_MAX_NODES, ge=1)
    max_depth: int = Field(default=DEFAULT_MAX_DEPTH, ge=1)
    regex_max_mem: int = Field(default=DEFAULT_REGEX_MAX_MEM, ge=64 * 1024)
    regex_budget: int = Field(default=DEFAULT_REGEX_BUDGET, ge=1)
    max_template_bytes: int = Field(default=DEFAULT_MAX_TEMPLATE_BYTES, ge=1)
    max_evaluations: int = Field(default=DEFAULT_MAX_EVALUATIONS, ge=1)

    @classmethod
    def of(cls, settings: ScannerSettings) -> DocumentLimits:
        """The limits a `ScannerSettings` names (`nfd_max_nodes`, `nfd_max_depth`, ...)."""
        return cls(
            max_nodes=settings.nfd_max_nodes,
            max_depth=settings.nfd_max_depth,
            regex_max_mem=settings.nfd_regex_max_mem,
            regex_budget=settings.nfd_regex_budget,
            max_template_bytes=settings.nfd_max_template_bytes,
            max_evaluations=settings.nfd_max_evaluations,
        )


DEFAULT_LIMITS = DocumentLimits()


@dataclass(frozen=True)
class _GoFloat:
    """A YAML float as go-yaml v2 resolves it (kept apart from ints: Go formats it as float32)."""

    value: float


_NULLS = frozenset({"", "~", "null", "Null", "NULL"})
_TRUE = frozenset({"y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"})
_FALSE = frozenset({"n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"})
_SPECIAL_FLOATS = {
    **dict.fromkeys((".nan", ".NaN", ".NAN"), math.nan),
    **dict.fromkeys((".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"), math.inf),
    **dict.fromkeys(("-.inf", "-.Inf", "-.INF"), -math.inf),
}
_GO_INT = re.compile(r"[+-]?(0[xX][0-9a-fA-F]+|0[oO][0-7]+|0[bB][01]+|0[0-7]*|[1-9][0-9]*)\Z")
_YAML_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?\Z")
_GO_FLOAT = re.compile(
    r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?\Z|[-+]?(inf|infinity|nan)\Z", re.I
)
_INT64 = (-(2**63), 2**63 - 1)


def _go_int(text: str) -> int | None:
    """strconv.ParseInt(text, 0, 64), then ParseUint(text, 0, 64): None when neither reads it."""
    if not _GO_INT.match(text):
        return None
    signed = text[:1] in "+-"
    digits = text[1:] if signed else text
    prefix = digits[:2].lower()
    if prefix in ("0x", "0o", "0b"):
        number = int(digits[2:], {"0x": 16, "0o": 8, "0b": 2}[prefix])
    elif digits.startswith("0"):
        number = int(digits, 8)  # Go's base 0: a leading 0 is octal
    else:
        number = int(digits)
    if text.startswith("-"):
        number = -number
    if _INT64[0] <= number <= _INT64[1] or (not signed and number < 2**64):
        return number
    return None


def _resolve_plain(text: str) -> Any:
    """A plain (unquoted, untagged) scalar as go-yaml v2's `resolve` reads it."""
    if text in _NULLS:
        return None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    if text in _SPECIAL_FLOATS:
        return _GoFloat(_SPECIAL_FLOATS[text])
    first = text[:1]
    if first == ".":
        if _GO_FLOAT.match(text):
            return _GoFloat(float(text))
    elif first in ("+", "-") or (first.isdigit() and first.isascii()):
        plain = text.replace("_", "")
        number = _go_int(plain)
        if number is not None:
            return number
        if _YAML_FLOAT.match(plain):
            return _GoFloat(float(plain))
        if plain.startswith(("0b", "-0b")):  # go-yaml's own binary form
            try:
                return int(plain.replace("0b", "", 1), 2)
            except ValueError:
                pass
    return text


def _go_float32_text(value: float) -> str:
    """strconv.FormatFloat(value, 'g', -1, 32): how sigs.k8s.io/yaml turns a float into a string."""
    if math.isnan(value):
        return "NaN"
    single = struct.unpack("f", struct.pack("f", value))[0] if abs(value) < 3.5e38 else value
    if math.isinf(single):
        return "+Inf" if single > 0 else "-Inf"
    if single == 0:
        return "-0" if math.copysign(1, single) < 0 else "0"
    for precision in range(1, 10):  # the shortest digits that read back as the same float32
        text = f"{single:.{precision - 1}e}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == single:
            break
    mantissa, _, exponent_text = text.partition("e")
    digits = mantissa.replace(".", "").lstrip("-")
    exponent = int(exponent_text)
    sign = "-" if single < 0 else ""
    if exponent < -4 or exponent >= 6:
        rest = f".{digits[1:]}" if len(digits) > 1 else ""
        return f"{sign}{digits[0]}{rest}e{'-' if exponent < 0 else '+'}{abs(exponent):02d}"
    if exponent < 0:
        return f"{sign}0.{'0' * (-exponent - 1)}{digits}"
    whole, fraction = digits[: exponent + 1], digits[exponent + 1 :]
    return f"{sign}{whole.ljust(exponent + 1, '0')}{'.' + fraction if fraction else ''}"


class _Tree:
    """A YAML node built from parser events: its value and what it costs once expanded."""

    __slots__ = ("depth", "nodes", "value")

    def __init__(self, value: Any, nodes: int, depth: int) -> None:
        self.value, self.nodes, self.depth = value, nodes, depth


def _read_yaml(raw: bytes | str, limits: DocumentLimits) -> Any:
    """The first YAML document as plain values, built from the parser's events without recursion.

    Aliases are counted at their full expanded size (their value is shared, not copied); the
    document may expand to at most `max_nodes` nodes, `max_depth` deep. Raises SpecError.
    """
    anchors: dict[str, _Tree] = {}
    open_anchors: set[str] = set()
    stack: list[tuple[Any, str | None, list[Any], int]] = []  # (event, anchor, children trees, ...)
    total = 0
    result: _Tree | None = None

    def add(tree: _Tree) -> None:
        nonlocal total, result
        total += tree.nodes
        if total > limits.max_nodes:
            raise SpecError(
                f"the document expands to more than {limits.max_nodes:,} YAML nodes (aliases counted each "
                "time they are used); the bound is the setting nfd_max_nodes"
            )
        if len(stack) + tree.depth > limits.max_depth:
            raise SpecError(
                f"the document nests deeper than {limits.max_depth} levels; the bound is the setting nfd_max_depth"
            )
        if stack:
            stack[-1][2].append(tree)
        elif result is None:
            result = tree

    try:
        for event in yaml.parse(raw, Loader=_EventLoader):
            if isinstance(event, yaml.DocumentEndEvent):
                break  # NFD's client reads the first document only
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                if len(stack) >= limits.max_depth:
                    raise SpecError(
                        f"the document nests deeper than {limits.max_depth} levels; the bound is the setting "
                        "nfd_max_depth"
                    )
                if event.anchor:
                    open_anchors.add(event.anchor)
                stack.append((event, event.anchor, [], 0))
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                start, anchor, children, _ = stack.pop()
                nodes = 1 + sum(child.nodes for child in children)
                depth = 1 + max((child.depth for child in children), default=0)
                total -= nodes - 1  # the children were counted as they were added
                if isinstance(start, yaml.MappingStartEvent):
                    value: Any = _mapping(children)
                else:
                    value = [child.value for child in children]
                tree = _Tree(value, nodes, depth)
                if anchor:
                    open_anchors.discard(anchor)
                    anchors[anchor] = tree
                add(tree)
            elif isinstance(event, yaml.ScalarEvent):
                if event.tag in (None, "!") and event.implicit[0]:
                    scalar = _MERGE if event.value == "<<" else _resolve_plain(event.value)
                elif event.tag == "tag:yaml.org,2002:str" or event.tag is None:
                    scalar = event.value
                else:
                    scalar = _resolve_plain(event.value)
                tree = _Tree(scalar, 1, 0)
                if event.anchor:
                    anchors[event.anchor] = tree
                add(tree)
            elif isinstance(event, yaml.AliasEvent):
                if event.anchor in open_anchors:
                    raise SpecError(f"the alias *{event.anchor} refers to itself")
                target = anchors.get(event.anchor or "")
                if target is None:
                    raise SpecError(f"unknown alias *{event.anchor}")
                add(target)
    except yaml.YAMLError as exc:
        raise SpecError(f"not YAML: {exc}") from None
    except RecursionError:  # the parser itself is iterative; kept as a last line of defence
        raise SpecError("the document nests too deeply; the bound is the setting nfd_max_depth") from None
    return None if result is None else result.value


class _EventLoader(yaml.CSafeLoader if hasattr(yaml, "CSafeLoader") else yaml.SafeLoader):  # type: ignore[misc]
    """The parser alone: events, no composition (aliases stay references until `_read_yaml`)."""


class _Merge:
    """go-yaml v2's merge key: a plain `<<` (`<<: *base` or `<<: [*a, *b]`)."""


_MERGE = _Merge()


def _mapping(children: list[_Tree]) -> dict[str, Any]:
    """A mapping from its key and value trees, merge keys applied as go-yaml v2 applies them: in
    document order, so a key after `<<` overrides the merged one and a key before it is overridden;
    among merged mappings, an earlier one wins over a later one."""
    value: dict[str, Any] = {}
    for key, item in zip(children[0::2], children[1::2], strict=True):
        if key.value is _MERGE:
            sources = item.value if isinstance(item.value, list) else [item.value]
            for source in reversed(sources):
                if not isinstance(source, dict):
                    raise SpecError("a merge key (<<) needs a mapping or a list of mappings")
                value.update(source)
            continue
        value[_map_key(key.value)] = item.value
    return value


def _map_key(key: Any) -> Any:
    """A mapping key as sigs.k8s.io/yaml turns it into a JSON object key."""
    text = _scalar_text(key)
    if text is None:
        raise SpecError(f"a mapping key of type {_go_kind(key)} (JSON objects need string keys)")
    if isinstance(key, _GoFloat):
        return {"+Inf": ".inf", "-Inf": "-.inf", "NaN": ".nan"}.get(text, text)
    return text


def _scalar_text(value: Any) -> str | None:
    """A string, number or boolean as the string sigs.k8s.io/yaml makes of it where Go has a
    string; None for null, mappings and lists."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, _GoFloat):
        return _go_float32_text(value.value)
    return None


# The Go types the document decodes into (api/image-compatibility/v1alpha1/spec.go and the
# GroupRule of api/nfd/v1alpha1/types.go): a struct is its JSON field names and their types.
_STR, _INT_T = "string", "int"
_EXPR: dict[str, Any] = {"op": _STR, "value": [_STR], "type": _STR}
_TERM: dict[str, Any] = {
    "feature": _STR,
    "matchExpressions": ("map", ("ptr", _EXPR)),
    "matchName": ("ptr", _EXPR),
}
_ANY: dict[str, Any] = {"matchFeatures": [_TERM]}
_RULE: dict[str, Any] = {
    "name": _STR, "vars": ("map", _STR), "varsTemplate": _STR, "matchFeatures": [_TERM], "matchAny": [_ANY],
}  # fmt: skip
_COMPAT: dict[str, Any] = {"rules": [_RULE], "weight": _INT_T, "tag": _STR, "description": _STR}
_SPEC: dict[str, Any] = {"version": _STR, "compatibilities": [_COMPAT]}


def _go_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, _GoFloat)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _decode(value: Any, target: Any, where: str, warnings: list[str], into: Any = None) -> Any:
    """`value` decoded as sigs.k8s.io/yaml then encoding/json decode it into the Go type `target`.

    Numbers and booleans become strings where Go has a string; field names match case-insensitively
    (the exact name first); unknown fields are ignored (with a warning); null leaves the zero value.
    An object decoded into a field that already holds a map or struct merges into it, as Go does.
    """
    if value is None:
        return into
    if target == _STR:
        text = _scalar_text(value)
        if text is None:
            raise SpecError(f"{where}: cannot decode {_go_kind(value)} into a string")
        return text
    if target == _INT_T:
        if isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]:
            return value
        if isinstance(value, _GoFloat) and value.value.is_integer() and _INT64[0] <= value.value <= _INT64[1]:
            return int(value.value)
        raise SpecError(f"{where}: cannot decode {_go_kind(value)} {_shown(value)} into an int")
    if isinstance(target, list):
        if not isinstance(value, list):
            raise SpecError(f"{where}: cannot decode {_go_kind(value)} into a list")
        zero: Any = "" if target[0] == _STR else {}
        return [
            zero if item is None else _decode(item, target[0], f"{where}[{index}]", warnings)
            for index, item in enumerate(value)
        ]
    if isinstance(target, tuple) and target[0] == "ptr":
        return _decode(value, target[1], where, warnings, into)
    if not isinstance(value, dict):
        raise SpecError(f"{where}: cannot decode {_go_kind(value)} into an object")
    if isinstance(target, tuple):  # ("map", element type): merged into the map already there
        out: dict[str, Any] = dict(into) if isinstance(into, dict) else {}
        for key in value:  # the document's order, for people (Go's maps have none)
            item, path = value[key], f"{where}.{key}" if where else key
            if item is None and target[1] != _STR:
                raise SpecError(
                    f"{path}: null where NFD needs an expression (its evaluator would dereference nil)"
                )
            out[key] = "" if item is None else _decode(item, target[1], path, warnings)
        return out
    fields: dict[str, Any] = dict(into) if isinstance(into, dict) else {}
    for key in sorted(value, key=_json_order):  # json.Marshal writes a map's keys sorted
        name = key if key in target else next((n for n in target if n.lower() == key.lower()), None)
        path = f"{where}.{key}" if where else key
        if name is None:
            warnings.append(f"unknown field {path} (ignored, as NFD ignores it)")
            continue
        if value[key] is not None:  # Go leaves the field as it was
            fields[name] = _decode(value[key], target[name], path, warnings, fields.get(name))
    return fields


def _json_order(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


def _shown(value: Any) -> str:
    return repr(value.value if isinstance(value, _GoFloat) else value)[:40]


def load_spec(
    raw: bytes | str, *, strict: bool = False, limits: DocumentLimits = DEFAULT_LIMITS
) -> tuple[Spec, list[str]]:
    """Decode an artifact layer as NFD's client does (`yaml.Unmarshal` of sigs.k8s.io/yaml into
    `compatv1alpha1.Spec`, pkg/client-nfd/compat/artifact-client/client.go); returns the spec and warnings.

    Bounded whatever the bytes (`limits`: expanded YAML nodes and depth). As Go decodes it: field
    names match case-insensitively, numbers and booleans become strings where Go has a string
    (`value: [0300]` is the octal 192, so "192"), null leaves the zero value, a missing `version`,
    `compatibilities` or `rules` is empty, and any `version` is read (NFD's client checks none;
    another than v1alpha1 gives a warning). Unknown fields are ignored with a warning, or refused
    with `strict` (gpubadge's own check of what it writes, which also wants `version: v1alpha1`).
    Raises SpecError for what Go's decoder refuses, or past a bound (naming its setting).
    """
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"the document is {len(raw):,} bytes; at most {MAX_SPEC_BYTES:,} are read")
    data = _read_yaml(raw, limits)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"the document is a YAML {_go_kind(data)}, not a mapping")
    warnings: list[str] = []
    decoded = _decode(data, _SPEC, "", warnings)
    if strict and warnings:
        raise SpecError(
            warnings[0].replace(" (ignored, as NFD ignores it)", " (not in NFD's v1alpha1 schema)")
        )
    try:
        spec = Spec.model_validate(decoded)
    except ValidationError as exc:  # the decoder above gives every type; a gap here is a bug made clear
        raise SpecError(_first_problem(exc)) from None
    if spec.version != VERSION:
        if strict:
            raise SpecError(f"version is {spec.version!r}; gpubadge writes {VERSION!r}")
        warnings.append(
            f"version is {spec.version!r}, not {VERSION!r} (NFD's client does not check it; read anyway)"
        )
    return spec, warnings


def read_yaml_as_strings(raw: bytes | str, limits: DocumentLimits = DEFAULT_LIMITS) -> Any:
    """A YAML (or JSON) document within `limits`, every scalar as the string Go's sigs.k8s.io/yaml
    makes of it where Go has a string (numbers, booleans; null stays None). Raises SpecError."""
    return _as_strings(_read_yaml(raw, limits))


def _as_strings(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _as_strings(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_strings(item) for item in value]
    text = _scalar_text(value)
    return value if text is None else text


def _path(location: tuple[Any, ...]) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def _first_problem(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = _path(tuple(first["loc"])) or "document"
    return f"{where}: {first['msg']} (got {json.dumps(first.get('input'), default=str)[:80]})"
