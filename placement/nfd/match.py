"""NFD's rule semantics, evaluated against a node's features, with the reason each rule fails. Pure.

This follows node-feature-discovery v0.19.0's own evaluator (`pkg/apis/nfd/nodefeaturerule`:
`ExecuteGroupRule`, `evaluateFeatureMatcher`, `MatchMulti`, `MatchNamesMulti`,
`evaluateMatchExpression`) as `nfd compat validate-node` runs it (`pkg/client-nfd/compat/
node-validator`: every term evaluated, no fail-fast), for artifacts written by anyone:

- Sets are evaluated in order on one copy of the node's features; after each rule, the vars it
  produced (`vars`, and what `varsTemplate` expands to) are added to the attribute feature
  `rule.matched`, which later rules, in this set or a later one, can match on. As in NFD, the
  feature exists (maybe empty) from the first rule on, and a rule whose `matchFeatures` fail adds
  nothing, while one whose `matchAny` alone fails still adds its `vars`.
- A rule matches when all of `matchFeatures` match and, if it has `matchAny`, one of those does.
  A rule with neither matches.
- A term on a feature the node does not have (validate-node has no `local` source, so no
  `local.label`) does not match, and nothing in it is evaluated. As in NFD, whether a term
  matched carries over to the next term until that one evaluates `matchExpressions`: a term with
  only `matchName` after a failing term is not evaluated (so its errors do not surface) and fails.
- Flag and attribute features are one union: each expression must match the flag or the
  attribute (`DoesNotExist` needs the name absent from both). Instance features (`pci.device`)
  match when one instance matches every expression. An empty expression set matches.
  `matchName` evaluates every name (flags, attributes, every instance's attributes) and is an
  error if any name is an error, as `MatchNamesMulti` is.
- Operators: `In`, `NotIn`, `InRegexp` (searched, as Go's `regexp.MatchString`), `Exists`,
  `DoesNotExist`, `Gt`, `Ge`, `Lt`, `Le` (one value), `GtLt`, `GeLe` (two), `IsTrue`, `IsFalse`
  (none), `""` (always true); any other op is an error when evaluated, before anything else.
  Comparisons are integers as Go's `strconv.Atoi` reads them (ASCII digits, one sign, nothing
  after them, not even a newline; the full int64 range), or with `type: version` versions as
  Masterminds semver reads them (leading zeros allowed, at most three numbers, pre-release and
  build parts ignored). A missing element fails every operator but `DoesNotExist` (and `""`).
- Regular expressions: RE2 (the library Go's `regexp` reimplements), with Go's syntax where the
  two differ: `\\C` is refused as Go refuses it. Residual gaps: the Unicode tables of `\\pL` and
  friends are RE2's, not Go's release's, and Go's own size limits differ from RE2's `max_mem`.
  Every compile is bounded: one pattern by `regex_max_mem` (`nfd_regex_max_mem`), all the
  distinct patterns of one evaluation by `regex_budget` RE2 instructions (`nfd_regex_budget`; a
  refused pattern costs what the largest allowed one would), and the process-wide cache of
  compiled patterns by REGEX_CACHE_INSTRUCTIONS in total. Past a bound the rule is an error
  naming the setting.
- `varsTemplate` is Go's text/template over the matched elements, expanded into `key=value`
  lines as NFD's template helper does. gpubadge evaluates text/template's language (fields,
  variables, `range`, `if`, `with`, `else`, trim markers, comments) but no function (NFD also
  offers sprig's): a template that calls one is an error saying so. Its output is bounded by
  `max_template_bytes` (`nfd_max_template_bytes`).
- Time: one evaluation (a spec on a node) runs at most `max_evaluations` expressions on single
  elements (`nfd_max_evaluations`); past it the rule is an error naming the setting.
- Errors end the rule's evaluation as NFD's do: a wrong number of values, a value that is not a
  number or a version (the node's or the rule's), a bad regular expression, another `type`, an
  unknown op, a template error. The rule is then `error`, with NFD's reason. (NFD stops the whole
  validation at the first error; gpubadge goes on to show the other rules, and its exit status
  says error either way.)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field

from placement.nfd.budget import Budget, MatchError
from placement.nfd.features import AttributeFeatureSet, Features
from placement.nfd.schema import (
    DEFAULT_LIMITS,
    Compatibility,
    DocumentLimits,
    FeatureMatcherTerm,
    GroupRule,
    MatchExpression,
    Spec,
)
from placement.nfd.template import TemplateError, expand_map

_INT = re.compile(r"[+-]?[0-9]+\Z")
_INT64 = (-(2**63), 2**63 - 1)
_VERSION = re.compile(
    r"v?([0-9]+)(\.[0-9]+)?(\.[0-9]+)?(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?\Z"
)
_UINT64_MAX = 2**64 - 1
MATCH_OPS = frozenset(
    {
        "",
        "In",
        "NotIn",
        "InRegexp",
        "Exists",
        "DoesNotExist",
        "Gt",
        "Ge",
        "Lt",
        "Le",
        "GtLt",
        "GeLe",
        "IsTrue",
        "IsFalse",
    }
)  # NFD's matchOps (pkg/apis/nfd/nodefeaturerule/expression.go)
RULE_BACKREF = "rule.matched"  # nfdv1alpha1.RuleBackrefDomain + "." + RuleBackrefFeature

Verdict = Literal["match", "no-match", "error"]


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


def _atoi(text: str, where: str) -> int:
    """Go's strconv.Atoi on a 64-bit platform: ASCII digits, one sign, the int64 range, nothing else."""
    if not _INT.match(text) or not _INT64[0] <= int(text) <= _INT64[1]:
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


def evaluate_expression(
    expression: MatchExpression, valid: bool, value: str | None, budget: Budget | None = None
) -> bool:
    """NFD's evaluateMatchExpression: `valid` says the element exists, `value` is its value (None for a flag).

    Raises MatchError where NFD returns an error (an unknown op first of all, whatever the element).
    """
    if budget is not None:
        budget.evaluation()
    op, values = expression.op, expression.value
    if op not in MATCH_OPS:
        raise MatchError(f"invalid Op {op!r}")
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
        budget = budget or Budget()
        compiled = [budget.regex(pattern) for pattern in values]
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
    if values:  # IsTrue, IsFalse
        raise MatchError(f"invalid expression, 'value' field must be empty for Op {op!r} (have {values})")
    return value == ("true" if op == "IsTrue" else "false")


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

Matched = dict[str, dict[str, list[dict[str, str]]]]  # NFD's matchedFeatures: domain -> feature -> elements


def _failure(feature: str, name: str, expression: MatchExpression, keys: Any, values: Any) -> str:
    """The node's side of a failed expression on a flag or attribute, in words."""
    if values is not None and name in values:
        return f"{feature}: {name} is {values[name]!r}; needs {expression.text()}"
    if keys is not None and name in keys:
        return f"{feature}: {name} is present; needs {expression.text()}"
    return f"{feature}: {name} is absent; needs {expression.text()}"


def _match_term(
    term: FeatureMatcherTerm, features: Features, carried: bool, budget: Budget
) -> tuple[TermResult, bool, list[dict[str, str]]]:
    """One term; `carried` is whether the previous term matched (NFD's isTermMatch outlives a term).

    Returns the result, the isTermMatch NFD carries on, and the elements it matched (for templates).
    """
    feature = term.feature.lower()
    flag = features.flags.get(feature)
    attribute = features.attributes.get(feature)
    instance = features.instances.get(feature)
    if flag is None and attribute is None and instance is None:
        result = TermResult(
            feature=feature, matched=False, reason=f"{feature}: feature not available on this node"
        )
        return result, carried, []
    keys: Mapping[str, Any] | None = flag.elements if flag is not None else None
    values: Mapping[str, str] | None = attribute.elements if attribute is not None else None
    instances: list[dict[str, str]] = [i.attributes for i in instance.elements or []] if instance else []
    results: list[ExpressionResult] = []
    elements: list[dict[str, str]] = []
    matched = carried
    if term.match_expressions is not None:
        matched, results, elements = _match_multi(
            feature, term.match_expressions, keys, values, instances, budget
        )
    if term.match_name is not None and not matched:
        results.append(
            ExpressionResult(
                feature=feature, name="", expression=term.match_name.text(), matcher="matchName", matched=False,
                reason=f"{feature}: matchName {term.match_name.text()} not evaluated: "
                + ("its matchExpressions failed" if term.match_expressions is not None else "an earlier term failed"),
            )
        )  # fmt: skip
    elif term.match_name is not None:
        named = _match_names(term.match_name, keys, values, instances, budget)
        elements += named
        matched = bool(named)
        results.append(
            ExpressionResult(
                feature=feature,
                name="",
                expression=term.match_name.text(),
                matcher="matchName",
                matched=matched,
                reason="" if matched else f"{feature}: no element name matches {term.match_name.text()}",
            )
        )
    failing = list(dict.fromkeys(r.reason for r in results if not r.matched))
    if not matched and not failing and term.match_expressions is None and term.match_name is None:
        failing = [f"{feature}: an earlier term failed (NFD carries that into a term with no expression)"]
    reason = "" if matched else "; ".join(failing) or f"{feature}: no match"
    return TermResult(feature=feature, matched=matched, reason=reason, expressions=results), matched, elements


def _match_names(
    expression: MatchExpression,
    keys: Mapping[str, Any] | None,
    values: Mapping[str, str] | None,
    instances: list[dict[str, str]],
    budget: Budget,
) -> list[dict[str, str]]:
    """NFD's MatchNamesMulti: every name evaluated (an error on any one is an error); the matched elements."""
    found = [
        {"Name": name} for name in sorted(keys or {}) if evaluate_expression(expression, True, name, budget)
    ]
    found += [
        {"Name": name, "Value": value}
        for name, value in sorted((values or {}).items())
        if evaluate_expression(expression, True, name, budget)
    ]
    found.sort(key=lambda element: element["Name"])
    for attributes in instances:
        hits = [evaluate_expression(expression, True, name, budget) for name in attributes]
        if any(hits):
            found.append(dict(attributes))
    return found


def _match_multi(
    feature: str,
    expressions: Mapping[str, MatchExpression],
    keys: Mapping[str, Any] | None,
    values: Mapping[str, str] | None,
    instances: list[dict[str, str]],
    budget: Budget,
) -> tuple[bool, list[ExpressionResult], list[dict[str, str]]]:
    """NFD's MatchMulti (no fail-fast): flags and attributes as a union, then instances apart."""
    union = keys is not None or values is not None
    union_match = union
    per_expression: dict[str, bool] = {}
    elements: list[dict[str, str]] = []
    for name, expression in expressions.items():
        hit_key = hit_value = False
        if keys is not None:
            hit_key = evaluate_expression(expression, name in keys, None, budget)
            if hit_key:
                elements.append({"Name": name})
            elif expression.op == "DoesNotExist":
                union_match, per_expression[name] = False, False
                continue
        if values is not None:
            hit_value = evaluate_expression(expression, name in values, values.get(name), budget)
            if hit_value:
                elements.append({"Name": name, "Value": values.get(name, "")})
            elif expression.op == "DoesNotExist":
                union_match, per_expression[name] = False, False
                continue
        per_expression[name] = hit_key or hit_value
        if not (hit_key or hit_value):
            union_match = False
    elements.sort(key=lambda element: element["Name"])
    # Instances: each one against every expression (all evaluated, so any error surfaces as in NFD).
    outcomes = [
        {
            name: evaluate_expression(e, name in attrs, attrs.get(name), budget)
            for name, e in expressions.items()
        }
        for attrs in instances
    ]
    elements += [
        dict(attrs) for attrs, outcome in zip(instances, outcomes, strict=True) if all(outcome.values())
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
    return matched, results, elements


# --- rules, sets, specs --------------------------------------------------------------------------


def _match_terms(
    terms: Iterable[FeatureMatcherTerm], features: Features, budget: Budget
) -> tuple[bool, list[TermResult], Matched]:
    """NFD's evaluateFeatureMatcher (no fail-fast): every term, and the elements each matched."""
    results: list[TermResult] = []
    matched: Matched = {}
    carried = True
    for term in terms:
        domain, dot, name = term.feature.partition(".")
        if not dot:
            domain, name = term.feature.lower(), ""
        result, carried, elements = _match_term(term, features, carried, budget)
        if result.reason.endswith("feature not available on this node"):
            matched.setdefault(domain, {})
        else:
            matched.setdefault(domain, {}).setdefault(name, []).extend(elements)
        results.append(result)
    return all(r.matched for r in results), results, matched


def evaluate_rule(rule: GroupRule, features: Features, budget: Budget | None = None) -> RuleResult:
    """NFD's ExecuteGroupRule for validate-node: matchAny (any one) and matchFeatures (all)."""
    return _execute_rule(rule, features, budget or Budget())[0]


def execute_group_rule(
    rule: GroupRule, features: Features, budget: Budget | None = None
) -> tuple[RuleResult, dict[str, str] | None]:
    """NFD's ExecuteGroupRule: the rule's result and its vars (`vars` over what `varsTemplate`
    expands to; None where NFD returns none)."""
    return _execute_rule(rule, features, budget or Budget())


def _execute_rule(
    rule: GroupRule, features: Features, budget: Budget
) -> tuple[RuleResult, dict[str, str] | None]:
    """The rule's result and the vars NFD's ExecuteGroupRule returns (None where it returns none)."""
    variables: dict[str, str] = {}
    limit = budget.template
    try:
        any_results = []
        for alternative in rule.match_any or []:
            ok, results, matched = _match_terms(alternative.match_features, features, budget)
            any_results.append((ok, results))
            if ok:
                variables.update(expand_map(rule.vars_template, matched, limit))
        all_match, term_results, matched = _match_terms(rule.match_features or [], features, budget)
        any_ok = not rule.match_any or any(ok for ok, _ in any_results)
        features_ok = not rule.match_features or all_match
        if rule.match_features and not all_match:
            out: dict[str, str] | None = None
        else:
            if rule.match_features:
                variables.update(expand_map(rule.vars_template, matched, limit))
            variables.update(rule.vars or {})
            out = variables
    except MatchError as exc:
        return RuleResult(name=rule.name, verdict="error", error=str(exc)), None
    except TemplateError as exc:
        return RuleResult(name=rule.name, verdict="error", error=f"varsTemplate: {exc}"), None
    result = RuleResult(
        name=rule.name,
        verdict="match" if any_ok and features_ok else "no-match",
        match_features=term_results,
        match_any=[results for _, results in any_results],
    )
    return result, out


def _with_backref(features: Features, variables: dict[str, str] | None) -> Features:
    """NFD's InsertAttributeFeatures("rule", "matched", vars): the feature made (maybe empty), vars added."""
    current = features.attributes.get(RULE_BACKREF)
    if current is not None and not variables:
        return features
    elements = {**((current.elements or {}) if current is not None else {}), **(variables or {})}
    attributes = {**features.attributes, RULE_BACKREF: AttributeFeatureSet(elements=elements)}
    return features.model_copy(update={"attributes": attributes})


def evaluate_set(
    index: int, compatibility: Compatibility, features: Features, budget: Budget | None = None
) -> SetResult:
    """One set on its own (no earlier set's `rule.matched`); `evaluate_spec` chains sets as NFD does."""
    return _evaluate_set(index, compatibility, features, budget or Budget())[0]


def _evaluate_set(
    index: int, compatibility: Compatibility, features: Features, budget: Budget
) -> tuple[SetResult, Features]:
    rules = []
    for rule in compatibility.rules:
        result, variables = _execute_rule(rule, features, budget)
        rules.append(result)
        if result.verdict != "error":
            features = _with_backref(features, variables)
    verdict: Verdict = (
        "error"
        if any(r.verdict == "error" for r in rules)
        else "match"
        if all(r.matched for r in rules)
        else "no-match"
    )
    outcome = SetResult(
        index=index,
        tag=compatibility.tag,
        weight=compatibility.weight,
        description=compatibility.description,
        verdict=verdict,
        rules=rules,
    )
    return outcome, features


def evaluate_spec(
    spec: Spec,
    features: Features,
    node: str = "node",
    tags: Iterable[str] = (),
    limits: DocumentLimits = DEFAULT_LIMITS,
) -> SpecResult:
    """Every compatibility set in order (only those whose tag is in `tags`, when given, as `--tags` does),
    each rule's vars visible to the later rules as `rule.matched`, within `limits`."""
    wanted = set(tags)
    budget = Budget(limits)
    sets = []
    for index, compatibility in enumerate(spec.compatibilities, 1):
        if wanted and compatibility.tag not in wanted:
            continue
        result, features = _evaluate_set(index, compatibility, features, budget)
        sets.append(result)
    return SpecResult(node=node, sets=sets)
