"""The image-compatibility document, field by field as NFD's Go types define it. Pure.

Mirrors `Spec` / `Compatibility` (node-feature-discovery `api/image-compatibility/v1alpha1/
spec.go`) and `GroupRule` / `MatchAnyElem` / `FeatureMatcherTerm` / `MatchExpression`
(`api/nfd/v1alpha1/types.go`), with their JSON field names. NFD's client reads the artifact's
layer with `sigs.k8s.io/yaml` (YAML converted to JSON, then decoded into those structs), so:

- types are strict: a YAML number or boolean where Go has a string (`value: [0300]`, which YAML
  1.1 reads as the octal 192) is an error, as Go's decoder makes it;
- Go ignores fields it does not know. `load_spec` does the same and returns them as warnings;
  `load_spec(strict=True)` refuses them. Every model forbids unknown fields, so what gpubadge
  writes is checked against this schema field by field (`dump_spec` validates before writing).

`dump_spec` writes YAML that reads exactly like NFD's documentation (`vendor: {op: In, value:
["10de"]}`), with every string a YAML reader could take for something else double-quoted, and
the same bytes for the same document (artifacts are deduplicated by digest).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class SpecError(ValueError):
    """The document is not an image-compatibility spec NFD could decode; the message says where."""


class _Go(BaseModel):
    """Go's json decoding: exact types, JSON names, nothing unknown (see `load_spec` for leniency)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


class MatchExpression(_Go):
    """`{op, value, type}`: an operator applied to one feature element's value."""

    op: MatchOp = ""
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

    rules: list[GroupRule]
    weight: int = 0
    tag: str = ""
    description: str = ""


class Spec(_Go):
    """The whole document: `version: v1alpha1` and the compatibility sets."""

    version: str
    compatibilities: list[Compatibility]


def load_spec(raw: bytes | str, *, strict: bool = False) -> tuple[Spec, list[str]]:
    """Decode an artifact layer as NFD's client does; returns the spec and warnings.

    Unknown fields are ignored with a warning (Go's decoder ignores them), or refused with
    `strict`. Raises SpecError for what NFD could not decode: bad YAML, a wrong type, a missing
    `version` or `compatibilities` (NFD's documentation makes both REQUIRED), another version.
    """
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"the document is {len(raw):,} bytes; at most {MAX_SPEC_BYTES:,} are read")
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise SpecError(f"not YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError("the document is not a YAML mapping")
    warnings: list[str] = []
    for _ in range(64):  # each round drops every unknown field reported; nesting is shallow
        try:
            spec = Spec.model_validate(data)
        except ValidationError as exc:
            unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
            if not unknown or strict or len(unknown) < len(exc.errors()):
                raise SpecError(_first_problem(exc)) from None
            for location in unknown:
                warnings.append(f"unknown field {_path(location)} (ignored, as NFD ignores it)")
                _drop(data, location)
            continue
        if spec.version != VERSION:
            raise SpecError(f"version is {spec.version!r}; this reader knows {VERSION!r}")
        return spec, warnings
    raise SpecError("too many unknown fields")


def _path(location: tuple[Any, ...]) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def _drop(data: Any, location: tuple[Any, ...]) -> None:
    for part in location[:-1]:
        data = data[part]
    if isinstance(data, dict):
        data.pop(location[-1], None)


def _first_problem(exc: ValidationError) -> str:
    errors = [e for e in exc.errors() if e["type"] != "extra_forbidden"] or exc.errors()
    first = errors[0]
    where = _path(tuple(first["loc"])) or "document"
    if first["type"] == "extra_forbidden":
        return f"{where}: unknown field (not in NFD's v1alpha1 schema)"
    if first["type"] == "missing":
        return f"{where}: required field missing"
    return f"{where}: {first['msg']} (got {json.dumps(first.get('input'), default=str)[:80]})"


# --- writing -------------------------------------------------------------------------------------

_PLAIN = re.compile(r"^[A-Za-z][A-Za-z0-9_./-]*$")
_YAML11_WORDS = frozenset(
    {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"}
)  # booleans and specials in YAML 1.1 (go-yaml v2, PyYAML) or 1.2, in any case


class _Flow(dict[str, Any]):
    """A mapping written on one line, as NFD's docs write match expressions."""


class _Quoted(str):
    __slots__ = ()


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    plain = _PLAIN.match(text) is not None and text.lower() not in _YAML11_WORDS
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=None if plain else '"')


def _represent_flow(dumper: yaml.SafeDumper, data: _Flow) -> yaml.Node:
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=True)


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    if data and all(isinstance(item, str) for item in data):  # match values: ["10de"], as NFD's docs
        return dumper.represent_sequence("tag:yaml.org,2002:seq", [_Quoted(i) for i in data], flow_style=True)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=False)


def _represent_quoted(dumper: yaml.SafeDumper, text: _Quoted) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(text), style='"')


_Dumper.add_representer(str, _represent_str)
_Dumper.add_representer(_Flow, _represent_flow)
_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(_Quoted, _represent_quoted)


def _expression(expression: MatchExpression) -> _Flow:
    data = _Flow(op=expression.op)
    if expression.value:
        data["value"] = list(expression.value)
    if expression.type:
        data["type"] = expression.type
    return data


def _term(term: FeatureMatcherTerm) -> dict[str, Any]:
    data: dict[str, Any] = {"feature": term.feature}
    if term.match_expressions is not None:
        data["matchExpressions"] = {name: _expression(e) for name, e in term.match_expressions.items()}
    if term.match_name is not None:
        data["matchName"] = _expression(term.match_name)
    return data


def _rule(rule: GroupRule) -> dict[str, Any]:
    data: dict[str, Any] = {"name": rule.name}
    if rule.vars:
        data["vars"] = dict(rule.vars)
    if rule.vars_template:
        data["varsTemplate"] = rule.vars_template
    if rule.match_features is not None:
        data["matchFeatures"] = [_term(t) for t in rule.match_features]
    if rule.match_any is not None:
        data["matchAny"] = [{"matchFeatures": [_term(t) for t in e.match_features]} for e in rule.match_any]
    return data


def spec_document(spec: Spec) -> dict[str, Any]:
    """The spec as the plain mapping NFD's JSON field names give it (what `dump_spec` writes)."""
    sets = []
    for compatibility in spec.compatibilities:
        item: dict[str, Any] = {}
        if compatibility.description:
            item["description"] = compatibility.description
        if compatibility.tag:
            item["tag"] = compatibility.tag
        if compatibility.weight:
            item["weight"] = compatibility.weight
        item["rules"] = [_rule(rule) for rule in compatibility.rules]
        sets.append(item)
    return {"version": spec.version, "compatibilities": sets}


def dump_spec(spec: Spec) -> bytes:
    """The YAML bytes of `spec`, checked against the schema (strictly) before they are returned."""
    text = yaml.dump(spec_document(spec), Dumper=_Dumper, sort_keys=False, width=10_000, allow_unicode=True)
    raw = text.encode()
    reread, _ = load_spec(raw, strict=True)
    if reread != spec:  # a representer bug must never reach a registry
        raise AssertionError("the YAML written does not read back as the same spec")
    return raw
