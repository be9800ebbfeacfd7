"""The image-compatibility document written as YAML that reads like NFD's documentation. Pure.

`spec_document` is a `Spec` as the plain mapping NFD's JSON field names give it; `dump_spec`
writes it (`vendor: {op: In, value: ["10de"]}`), every string a YAML reader could take for
something else double-quoted, the same bytes for the same document (artifacts are deduplicated
by digest), and reads it back with `placement.nfd.schema.load_spec`, strictly, before returning.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from placement.nfd.schema import (
    MATCH_OPS,
    FeatureMatcherTerm,
    GroupRule,
    MatchExpression,
    Spec,
    SpecError,
    load_spec,
)

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
    unknown = sorted({e.op for e in _expressions(spec)} - MATCH_OPS)
    if unknown:
        raise SpecError(f"unknown op {unknown[0]!r}: gpubadge writes only the operators NFD knows")
    reread, _ = load_spec(raw, strict=True)
    if reread != spec:  # a representer bug must never reach a registry
        raise AssertionError("the YAML written does not read back as the same spec")
    return raw


def _expressions(spec: Spec) -> list[MatchExpression]:
    terms = [
        term
        for compatibility in spec.compatibilities
        for rule in compatibility.rules
        for term in [
            *(rule.match_features or []),
            *(t for e in rule.match_any or [] for t in e.match_features),
        ]
    ]
    found = [e for term in terms for e in (term.match_expressions or {}).values()]
    return found + [term.match_name for term in terms if term.match_name is not None]
