"""NFD's rule semantics, evaluated against a node's features, with the reason each rule fails. Pure.

This follows node-feature-discovery's own evaluator (`pkg/apis/nfd/nodefeaturerule`:
`ExecuteGroupRule`, `evaluateFeatureMatcher`, `MatchMulti`, `evaluateMatchExpression`) as
`nfd compat validate-node` runs it (every term evaluated, no fail-fast), for artifacts written by
anyone:

- A compatibility set holds when every rule matches. A rule matches when all of `matchFeatures`
  match and, if it has `matchAny`, one of those does. A rule with neither matches.
- A term on a feature the node does not have (validate-node has no `local` source, so no
  `local.label`) does not match, and nothing in it is evaluated.
- Flag and attribute features are one union: each expression must match the flag or the
  attribute (`DoesNotExist` needs the name absent from both). Instance features (`pci.device`)
  match when one instance matches every expression. An empty expression set matches.
- Operators: `In`, `NotIn`, `InRegexp` (RE2 syntax, searched, as Go's `regexp.MatchString`),
  `Exists`, `DoesNotExist`, `Gt`, `Ge`, `Lt`, `Le` (one value), `GtLt`, `GeLe` (two), `IsTrue`,
  `IsFalse` (none), `""` (always true). Comparisons are integers (Go's `strconv.Atoi`), or with
  `type: version` versions as NFD parses them (Masterminds semver, leading zeros allowed, at most
  three numbers, pre-release and build parts ignored). A missing element fails every operator
  but `DoesNotExist` (and `""`), without looking at the values.
- Errors end the evaluation as NFD's do: a wrong number of values, a value that is not a number
  or a version (the node's or the rule's), a bad regular expression, another `type`. The rule
  is then `error`, with NFD's reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import re2
from pydantic import BaseModel, Field

from placement.nfd.features import Features
from placement.nfd.schema import Compatibility, FeatureMatcherTerm, GroupRule, MatchExpression, Spec

_INT = re.compile(r"^[+-]?[0-9]+$")
_INT_MAX = 2**63 - 1
_VERSION = re.compile(
    r"^v?([0-9]+)(\.[0-9]+)?(\.[0-9]+)?(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?$"
)
_UINT64_MAX = 2**64 - 1
_REGEX_OPTIONS = re2.Options()
_REGEX_OPTIONS.log_errors = False
_REGEX_OPTIONS.max_mem = 8 << 20  # RE2's own program-size bound; a pattern past it is an error
MAX_REGEX_CACHE = 1024
_regex_cache: dict[str, Any] = {}

Verdict = Literal["match", "no-match", "error"]


class MatchError(ValueError):
    """NFD would stop evaluating here with this error (an invalid expression or value)."""


class ExpressionResult(BaseModel):
    """One expression of one term: did it hold on the node, and what the node has."""

    feature: str
    name: str = Field(description="the element the expression reads; empty for matchName")
    expression: str
    matcher: Literal["matchExpression", "matchName"]
    matched: bool
    reason: str = ""


class TermResult(BaseModel):
    feature: str
    matched: bool
    reason: str = ""
    expressions: list[ExpressionResult] = Field(default_factory=list)


class RuleResult(BaseModel):
    name: str
    verdict: Verdict
    error: str | None = None
    match_features: list[TermResult] = Field(default_factory=list)
    match_any: list[list[TermResult]] = Field(default_factory=list)

    @property
    def matched(self) -> bool:
        return self.verdict == "match"

    def reasons(self) -> list[str]:
        """Why the rule did not match, one line per failing term (every alternative for matchAny)."""
        if self.error is not None:
            return [f"error: {self.error}"]
        lines = [term.reason for term in self.match_features if not term.matched]
        if self.match_any and not any(all(t.matched for t in alternative) for alternative in self.match_any):
            for number, alternative in enumerate(self.match_any, 1):
                failing = "; ".join(t.reason for t in alternative if not t.matched)
                lines.append(f"matchAny #{number}: {failing}")
        return lines


class SetResult(BaseModel):
    """One compatibility set on one node: it holds when every rule matches."""

    index: int
    tag: str = ""
    weight: int = 0
    description: str = ""
    verdict: Verdict
    rules: list[RuleResult] = Field(default_factory=list)

    def reasons(self) -> list[str]:
        return [f"rule {rule.name or '(unnamed)'}: {line}" for rule in self.rules for line in rule.reasons()]


class SpecResult(BaseModel):
    """Every selected set on one node; `compatible` when all of them hold."""

    node: str
    sets: list[SetResult]

    @property
    def verdict(self) -> Verdict:
        if any(s.verdict == "error" for s in self.sets):
            return "error"
        return "match" if all(s.verdict == "match" for s in self.sets) else "no-match"

    @property
    def compatible(self) -> bool:
        return self.verdict == "match"


# --- one expression ------------------------------------------------------------------------------


def _regex(pattern: str) -> Any:
    found = _regex_cache.get(pattern)
    if found is None:
        try:
            found = re2.compile(pattern, options=_REGEX_OPTIONS)
        except re2.error as exc:
            raise MatchError(f"invalid regular expression {pattern!r}: {exc}") from None
        if len(_regex_cache) >= MAX_REGEX_CACHE:
            _regex_cache.clear()
        _regex_cache[pattern] = found
    return found


def _atoi(text: str, where: str) -> int:
    if not _INT.match(text) or abs(int(text)) > _INT_MAX:
        raise MatchError(f"not a number {text!r}{where}")
    return int(text)


def parse_version(text: str) -> tuple[int, int, int]:
    """A version as NFD reads one (semver, coerced): `550.107.02` -> (550, 107, 2); MatchError otherwise."""
    match = _VERSION.match(text)
    if match is None:
        raise MatchError(f"not a version {text!r}")
    numbers = [int(part.lstrip(".")) if part else 0 for part in match.group(1, 2, 3)]
    if any(number > _UINT64_MAX for number in numbers):
        raise MatchError(f"not a version {text!r}")
    prerelease = match.group(4)
    if prerelease:  # validated as semver validates it, then ignored (NFD drops it)
        for part in prerelease.split("."):
            if part.isdigit() and len(part) > 1 and part.startswith("0"):
                raise MatchError(f"not a version {text!r}: a pre-release number starts with 0")
    return numbers[0], numbers[1], numbers[2]


def evaluate_expression(expression: MatchExpression, valid: bool, value: str | None) -> bool:
    """NFD's evaluateMatchExpression: `valid` says the element exists, `value` is its value (None for a flag).

    Raises MatchError where NFD returns an error.
    """
    op, values = expression.op, expression.value
    if op in ("", "Exists", "DoesNotExist"):
        if values:
            raise MatchError(f"invalid expression, 'value' field must be empty for Op {op!r} (have {values})")
        return True if op == "" else valid if op == "Exists" else not valid
    if not valid or value is None:
        return False
    if op in ("In", "NotIn", "InRegexp") and not values:
        raise MatchError(f"invalid expression, 'value' field must be non-empty for Op {op!r}")
    if op == "In":
        return value in values
    if op == "NotIn":
        return value not in values
    if op == "InRegexp":
        compiled = [_regex(pattern) for pattern in values]
        return any(regex.search(value) is not None for regex in compiled)
    if op in ("Gt", "Ge", "Lt", "Le"):
        if len(values) != 1:
            raise MatchError(
                f"invalid expression, 'value' field must contain exactly one element for Op {op!r} (have {values})"
            )
        left, right = _operands(expression, value, values[0])
        return bool({"Gt": left > right, "Ge": left >= right, "Lt": left < right, "Le": left <= right}[op])
    if op in ("GtLt", "GeLe"):
        if len(values) != 2:
            raise MatchError(
                f"invalid expression, 'value' field must contain exactly two elements for Op {op!r} (have {values})"
            )
        here, low = _operands(expression, value, values[0])
        _, high = _operands(expression, value, values[1])
        if expression.type == "" and low >= high:
            raise MatchError(
                f"invalid expression, value[0] must be less than Value[1] for Op {op!r} (have {values})"
            )
        return bool(low < here < high) if op == "GtLt" else bool(low <= here <= high)
    if op in ("IsTrue", "IsFalse"):
        if values:
            raise MatchError(f"invalid expression, 'value' field must be empty for Op {op!r} (have {values})")
        return value == ("true" if op == "IsTrue" else "false")
    raise MatchError(f"invalid Op {op!r}")


def _operands(expression: MatchExpression, value: str, wanted: str) -> tuple[Any, Any]:
    """(the node's value, the rule's value) as integers or versions, as `type` says."""
    if expression.type == "version":
        return parse_version(value), parse_version(wanted)
    if expression.type == "":
        return _atoi(value, ""), _atoi(wanted, f" in {expression.text()}")
    raise MatchError(
        f"invalid expression, 'type' field only accepts 'version' value for Op {expression.op!r} (have {expression.type!r})"
    )


# --- terms ---------------------------------------------------------------------------------------


def _failure(feature: str, name: str, expression: MatchExpression, keys: Any, values: Any) -> str:
    """The node's side of a failed expression on a flag or attribute, in words."""
    if values is not None and name in values:
        return f"{feature}: {name} is {values[name]!r}; needs {expression.text()}"
    if keys is not None and name in keys:
        return f"{feature}: {name} is present; needs {expression.text()}"
    return f"{feature}: {name} is absent; needs {expression.text()}"


def _match_term(term: FeatureMatcherTerm, features: Features) -> TermResult:
    feature = term.feature.lower()
    flag = features.flags.get(feature)
    attribute = features.attributes.get(feature)
    instance = features.instances.get(feature)
    if flag is None and attribute is None and instance is None:
        return TermResult(
            feature=feature, matched=False, reason=f"{feature}: feature not available on this node"
        )
    keys: Mapping[str, Any] | None = flag.elements if flag is not None else None
    values: Mapping[str, str] | None = attribute.elements if attribute is not None else None
    instances: list[dict[str, str]] = [i.attributes for i in instance.elements or []] if instance else []
    results: list[ExpressionResult] = []
    matched = True
    if term.match_expressions is not None:
        matched, results = _match_multi(feature, term.match_expressions, keys, values, instances)
    if matched and term.match_name is not None:
        names = [*(keys or {}), *(values or {}), *(name for attrs in instances for name in attrs)]
        hit = any(evaluate_expression(term.match_name, True, name) for name in names)
        results.append(
            ExpressionResult(
                feature=feature,
                name="",
                expression=term.match_name.text(),
                matcher="matchName",
                matched=hit,
                reason="" if hit else f"{feature}: no element name matches {term.match_name.text()}",
            )
        )
        matched = hit
    failing = list(dict.fromkeys(r.reason for r in results if not r.matched))
    reason = "" if matched else "; ".join(failing) or f"{feature}: no match"
    return TermResult(feature=feature, matched=matched, reason=reason, expressions=results)


def _match_multi(
    feature: str,
    expressions: Mapping[str, MatchExpression],
    keys: Mapping[str, Any] | None,
    values: Mapping[str, str] | None,
    instances: list[dict[str, str]],
) -> tuple[bool, list[ExpressionResult]]:
    """NFD's MatchMulti (no fail-fast): flags and attributes as a union, then instances apart."""
    union = keys is not None or values is not None
    union_match = union
    per_expression: dict[str, bool] = {}
    for name, expression in expressions.items():
        hit_key = hit_value = False
        if keys is not None:
            hit_key = evaluate_expression(expression, name in keys, None)
            if not hit_key and expression.op == "DoesNotExist":
                union_match, per_expression[name] = False, False
                continue
        if values is not None:
            hit_value = evaluate_expression(expression, name in values, values.get(name))
            if not hit_value and expression.op == "DoesNotExist":
                union_match, per_expression[name] = False, False
                continue
        per_expression[name] = hit_key or hit_value
        if not (hit_key or hit_value):
            union_match = False
    # Instances: each one against every expression (all evaluated, so any error surfaces as in NFD).
    outcomes = [
        {name: evaluate_expression(e, name in attrs, attrs.get(name)) for name, e in expressions.items()}
        for attrs in instances
    ]
    instance_match = any(all(outcome.values()) for outcome in outcomes)
    matched = (union and union_match) or instance_match
    results = []
    for name, expression in expressions.items():
        if instances and not union:
            hits = sum(1 for outcome in outcomes if outcome[name])
            ok = instance_match or hits > 0
            reason = (
                "" if ok else f"{feature}: none of {len(instances)} elements has {name} {expression.text()}"
            )
        else:
            ok = per_expression.get(name, False) or instance_match
            reason = "" if ok else _failure(feature, name, expression, keys, values)
        results.append(
            ExpressionResult(
                feature=feature,
                name=name,
                expression=expression.text(),
                matcher="matchExpression",
                matched=ok,
                reason=reason,
            )
        )
    if not matched and results and all(r.matched for r in results):
        wanted = ", ".join(f"{r.name} {r.expression}" for r in results)
        for result in results:  # each holds somewhere, never all on one element
            result.matched = False
            result.reason = f"{feature}: no single element has {wanted}"
    if not expressions and not matched:
        results.append(
            ExpressionResult(
                feature=feature, name="", expression="(none)", matcher="matchExpression", matched=False,
                reason=f"{feature}: no element",
            )
        )  # fmt: skip
    return matched, results


# --- rules, sets, specs --------------------------------------------------------------------------


def _match_terms(terms: Iterable[FeatureMatcherTerm], features: Features) -> tuple[bool, list[TermResult]]:
    results = [_match_term(term, features) for term in terms]
    return all(r.matched for r in results), results


def evaluate_rule(rule: GroupRule, features: Features) -> RuleResult:
    """NFD's ExecuteGroupRule for validate-node: matchAny (any one) and matchFeatures (all)."""
    try:
        any_results = [_match_terms(e.match_features, features) for e in rule.match_any or []]
        all_match, term_results = _match_terms(rule.match_features or [], features)
    except MatchError as exc:
        return RuleResult(name=rule.name, verdict="error", error=str(exc))
    any_ok = not rule.match_any or any(ok for ok, _ in any_results)
    features_ok = not rule.match_features or all_match
    return RuleResult(
        name=rule.name,
        verdict="match" if any_ok and features_ok else "no-match",
        match_features=term_results,
        match_any=[results for _, results in any_results],
    )


def evaluate_set(index: int, compatibility: Compatibility, features: Features) -> SetResult:
    rules = [evaluate_rule(rule, features) for rule in compatibility.rules]
    verdict: Verdict = (
        "error"
        if any(r.verdict == "error" for r in rules)
        else "match"
        if all(r.matched for r in rules)
        else "no-match"
    )
    return SetResult(
        index=index,
        tag=compatibility.tag,
        weight=compatibility.weight,
        description=compatibility.description,
        verdict=verdict,
        rules=rules,
    )


def evaluate_spec(spec: Spec, features: Features, node: str = "node", tags: Iterable[str] = ()) -> SpecResult:
    """Every compatibility set (only those whose tag is in `tags`, when given, as `--tags` does)."""
    wanted = set(tags)
    sets = [
        evaluate_set(index, compatibility, features)
        for index, compatibility in enumerate(spec.compatibilities, 1)
        if not wanted or compatibility.tag in wanted
    ]
    return SpecResult(node=node, sets=sets)
