"""gpubadge agrees with NFD v0.19.0 where NFD's own tests are silent (issue 32, "NFD parity").

Each case cites the NFD source that decides it (node-feature-discovery at tag v0.19.0, commit
46e042e2): what the code there does is what the test expects, not what gpubadge used to do.
"""

from __future__ import annotations

from typing import Any

import pytest

from placement.nfd.features import Features, parse_node_features
from placement.nfd.match import MatchError, evaluate_expression, evaluate_spec, parse_version
from placement.nfd.schema import MatchExpression, SpecError, load_spec
from placement.nfd.template import TemplateBudget, TemplateError, expand_map

NODE = parse_node_features(
    """
flags:
  kernel.loadedmodule: {elements: {nvidia: {}, overlay: {}}}
attributes:
  kernel.version: {elements: {major: "5", minor: "15", full: "5.15.0-91-generic"}}
instances:
  pci.device:
    elements:
    - attributes: {vendor: "10de", class: "0302", device: "2330"}
    - attributes: {vendor: "8086", class: "0600", device: "1237"}
"""
).features


def spec(text: str) -> Any:
    loaded, _ = load_spec("version: v1alpha1\n" + text)
    return loaded


def rules(text: str, features: Features = NODE) -> dict[str, Any]:
    """Every rule of every set, by name: (verdict, error)."""
    result = evaluate_spec(spec(text), features)
    return {rule.name: (rule.verdict, rule.error) for item in result.sets for rule in item.rules}


# --- vars, varsTemplate and rule.matched ---------------------------------------------------------


def test_a_matched_rules_vars_are_feature_rule_matched_for_later_rules_across_sets() -> None:
    # node-validator.go:77-91: one `features` for every set; after each rule,
    # InsertAttributeFeatures("rule", "matched", ruleOut.Vars) (types.go:386,389; feature.go:70).
    text = """compatibilities:
- rules:
  - name: first
    vars: {gpu-present: "true"}
    matchFeatures:
    - feature: pci.device
      matchExpressions: {vendor: {op: In, value: ["10de"]}}
  - name: same-set
    matchFeatures:
    - feature: rule.matched
      matchExpressions: {gpu-present: {op: IsTrue}}
- rules:
  - name: next-set
    matchFeatures:
    - feature: rule.matched
      matchExpressions: {gpu-present: {op: IsTrue}}
"""
    assert rules(text) == {"first": ("match", None), "same-set": ("match", None), "next-set": ("match", None)}


def test_rule_matched_exists_after_the_first_rule_even_empty_and_is_absent_before() -> None:
    # feature.go:70-80: InsertAttributeFeatures makes the feature (NewAttributeFeatures(nil) is empty)
    # even when ruleOut.Vars is nil (rule.go:201: a failed matchFeatures returns no Vars).
    text = """compatibilities:
- rules:
  - name: before-any
    matchFeatures:
    - feature: rule.matched
  - name: no-gpu-vars
    vars: {x: "1"}
    matchFeatures:
    - feature: pci.device
      matchExpressions: {vendor: {op: In, value: ["1002"]}}
  - name: after
    matchFeatures:
    - feature: rule.matched
      matchExpressions: {x: {op: DoesNotExist}}
"""
    assert rules(text) == {
        "before-any": ("no-match", None),  # the feature does not exist yet
        "no-gpu-vars": ("no-match", None),
        "after": ("match", None),  # it exists now, empty: x was never added
    }


def test_a_failed_match_any_still_adds_vars_when_match_features_hold() -> None:
    # rule.go:167-208 with failFast=false (node-validator.go:84): no early return when matchAny fails;
    # matchFeatures hold, so maps.Copy(vars, r.Vars) (rule.go:208) runs though IsMatch is false.
    text = """compatibilities:
- rules:
  - name: half
    vars: {half: "yes"}
    matchFeatures:
    - feature: kernel.loadedmodule
      matchExpressions: {nvidia: {op: Exists}}
    matchAny:
    - matchFeatures:
      - feature: kernel.loadedmodule
        matchExpressions: {amdgpu: {op: Exists}}
  - name: sees-it
    matchFeatures:
    - feature: rule.matched
      matchExpressions: {half: {op: In, value: ["yes"]}}
"""
    assert rules(text) == {"half": ("no-match", None), "sees-it": ("match", None)}


def test_vars_template_expands_over_the_matched_elements() -> None:
    # rule.go:184,203 executeTemplate over MatchedFeatures; template.go:62 missingkey=error,
    # template.go:80-96 ExpandMap: trimmed `key=value` lines. Instances give their attributes,
    # attributes {Name, Value} (expression.go MatchMulti).
    text = """compatibilities:
- rules:
  - name: templated
    varsTemplate: |
      {{- range .pci.device }}
      vendor-{{ .vendor }}=present
      {{- end }}
      {{ range $i, $e := .kernel.version }}kernel-{{ $e.Name }}={{ $e.Value }}{{ end }}
    matchFeatures:
    - feature: pci.device
      matchExpressions: {class: {op: In, value: ["0302", "0600"]}}
    - feature: kernel.version
      matchExpressions: {major: {op: Gt, value: ["4"]}}
  - name: uses
    matchFeatures:
    - feature: rule.matched
      matchExpressions:
        vendor-10de: {op: In, value: [present]}
        vendor-8086: {op: Exists}
        kernel-major: {op: In, value: ["5"]}
"""
    assert rules(text) == {"templated": ("match", None), "uses": ("match", None)}


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("{{ .pci.nothing }}", 'map has no entry for key "nothing"'),  # template.go:62 missingkey=error
        ("{{ range .pci.device }}no-equals{{ end }}", "missing value in expanded template line"),  # :94
        ("{{ .pci.device | foo }}", 'function "foo" not defined'),  # Go's parser: an unknown function
        ('{{ env "PATH" }}', 'function "env" not defined'),  # NFD drops sprig's host functions
        ('{{ semverCompare ">1" "2" }}', "'semverCompare' is not evaluated"),  # named, never ignored
        ('{{ eq "1" 1 }}', "incompatible types for comparison"),  # Go compares basic kinds only
        ("{{ .pci 1 }}", "can't give argument to field .pci"),
        ("{{ index .pci.device 5 }}", "index out of range: 5"),
        ("{{ if .pci.device }}x=1", "has no {{end}}"),
    ],
)
def test_template_errors_are_errors(template: str, problem: str) -> None:
    data = {"pci": {"device": [{"vendor": "10de"}]}}
    with pytest.raises(TemplateError, match=problem):
        expand_map(template, data, TemplateBudget(max_bytes=4096))


# NFD's own pkg/apis/nfd/nodefeaturerule/grouprule_test.go, TestGroupRuleTemplating (v0.19.0): its
# features, its rule r1, r2 (r1's matchFeatures as its one matchAny element) and the vars both expand to.
GROUP_TEMPLATING_FEATURES = parse_node_features(
    """
flags:
  domain_1.kf_1: {elements: {key-a: {}, key-b: {}, key-c: {}}}
  domain.mf: {elements: {key-a: {}, key-b: {}, key-c: {}}}
attributes:
  domain_1.vf_1: {elements: {key-1: val-1, keu-2: val-2, key-3: val-3, key-4: val-4}}
  domain.mf: {elements: {key-d: val-d, key-e: val-e}}
instances:
  domain_1.if_1:
    elements:
    - attributes: {attr-1: "1", attr-2: val-2}
    - attributes: {attr-1: "10", attr-2: val-20}
    - attributes: {attr-1: "100", attr-2: val-200}
    - attributes: {attr-1: "1000", attr-2: val-2000, attr-3: "3000"}
"""
).features
GROUP_TEMPLATING_R1 = """
name: r1
vars: {var-1: var-val-1}
varsTemplate: |

  var-1=will-be-overridden
  var-2=
  {{range .domain_1.kf_1}}kf-{{.Name}}=true
  {{end}}
  {{range .domain_1.vf_1}}vf-{{.Name}}=vf-{{.Value}}
  {{end}}
  {{range .domain_1.if_1}}if-{{index . "attr-1"}}_{{index . "attr-2"}}=present
  {{end}}
matchFeatures: &terms
- feature: domain_1.kf_1
  matchExpressions: {key-a: {op: Exists}, key-c: {op: Exists}, foo: {op: DoesNotExist}}
- feature: domain_1.vf_1
  matchExpressions: {key-1: {op: In, value: [val-1, val-2]}, bar: {op: DoesNotExist}}
- feature: domain_1.if_1
  matchExpressions: {attr-1: {op: Lt, value: ["100"]}}
- feature: domain_1.if_1
  matchExpressions: {attr-1: {op: Exists}, attr-2: {op: Exists}, attr-3: {op: Exists}}
"""
GROUP_TEMPLATING_VARS = {
    "var-1": "var-val-1",
    "var-2": "",
    "kf-key-a": "true",
    "kf-key-c": "true",
    "kf-foo": "true",
    "vf-key-1": "vf-val-1",
    "vf-bar": "vf-",
    "if-1_val-2": "present",
    "if-10_val-20": "present",
    "if-1000_val-2000": "present",
}


@pytest.mark.parametrize("case", ["r1", "r2"])
def test_nfds_own_group_rule_templating_cases(case: str) -> None:
    import yaml

    from placement.nfd.match import execute_group_rule
    from placement.nfd.schema import GroupRule

    rule = yaml.safe_load(GROUP_TEMPLATING_R1)
    if case == "r2":  # MatchAny, empty MatchFeatures
        rule["matchAny"] = [{"matchFeatures": rule.pop("matchFeatures")}]
    result, variables = execute_group_rule(GroupRule.model_validate(rule), GROUP_TEMPLATING_FEATURES)
    assert result.error is None and result.verdict == "match", result
    assert variables == GROUP_TEMPLATING_VARS


@pytest.mark.parametrize(
    ("template", "expanded"),
    [
        # Go's built-ins, as text/template runs them
        (
            '{{ range .pci.device }}{{ if eq (index . "vendor") "10de" }}nvidia=yes{{ end }}{{ end }}',
            {"nvidia": "yes"},
        ),
        ("devices={{ len .pci.device }}", {"devices": "2"}),
        ("devices={{ .pci.device | len }}", {"devices": "2"}),
        (
            '{{ range $i, $d := .pci.device }}dev-{{ $i }}={{ printf "%s:%04d" $d.vendor 7 }}\n{{ end }}',
            {"dev-0": "10de:0007", "dev-1": "8086:0007"},
        ),
        ('x={{ and (ne "a" "b") (not "") }} y={{ or "" "z" }}', {"x": "true y=z"}),
        (
            '{{ range .pci.device }}{{ if eq .vendor "8086" }}{{ break }}{{ end }}first={{ .vendor }}{{ end }}',
            {"first": "10de"},
        ),
        ('q={{ printf "%q %v %d" "s" true }}', {"q": '"s" true %!d(MISSING)'}),
        # sprig, as NFD rules use it
        (
            '{{ range .pci.device }}{{ .vendor | upper | printf "v-%s" }}={{ .class | trimPrefix "0" }}\n{{ end }}',
            {"v-10DE": "302", "v-8086": "600"},
        ),
        ('major={{ (split "." "5.15.0")._0 }}', {"major": "5"}),
        ('big={{ if gt (atoi "12") 10 }}yes{{ else }}no{{ end }}', {"big": "yes"}),
        ('ids={{ list "a" "b" | join "," }}', {"ids": "a,b"}),
        ('v={{ regexReplaceAll "^0+" "0302" "" }} d={{ default "none" "" }}', {"v": "302 d=none"}),
    ],
)
def test_vars_templates_call_gos_builtins_and_sprigs_functions(
    template: str, expanded: dict[str, str]
) -> None:
    data = {"pci": {"device": [{"vendor": "10de", "class": "0302"}, {"vendor": "8086", "class": "0600"}]}}
    assert expand_map(template, data, TemplateBudget(max_bytes=4096)) == expanded


def test_template_functions_are_bounded_too() -> None:
    with pytest.raises(TemplateError, match="nfd_max_template_bytes"):  # refused before it is built
        expand_map('x={{ repeat 1000000000 "ab" }}', {}, TemplateBudget(max_bytes=64 * 1024))
    doubling = '{{ $s := "ab" }}{{ range .n }}{{ $s = cat $s $s }}{{ end }}x=1'
    with pytest.raises(TemplateError, match="nfd_max_template_bytes"):  # a chain of calls stops too
        expand_map(doubling, {"n": list(range(64))}, TemplateBudget(max_bytes=64 * 1024))
    with pytest.raises(TemplateError, match="width or precision"):
        expand_map('x={{ printf "%999999999d" 1 }}', {}, TemplateBudget(max_bytes=64 * 1024))


def test_template_output_and_steps_are_bounded() -> None:
    data = {"d": {"e": [{"v": "x" * 100}] * 100}}
    nested = "{{ range .d.e }}{{ range $.d.e }}{{ .v }}{{ end }}{{ end }}"
    with pytest.raises(TemplateError, match="nfd_max_template_bytes"):
        expand_map(nested, data, TemplateBudget(max_bytes=64 * 1024))
    quiet = "{{ range .d.e }}{{ range $.d.e }}{{ range $.d.e }}{{ end }}{{ end }}{{ end }}"
    with pytest.raises(TemplateError, match="nfd_max_evaluations"):
        expand_map(quiet, data, TemplateBudget(max_bytes=64 * 1024, steps=100_000))


# --- matchName -----------------------------------------------------------------------------------


def test_match_name_checks_every_name_and_errors_on_any_invalid_one() -> None:
    # expression.go:583-607 MatchNamesMulti: every key, value and instance name evaluated; the first
    # error returns. `full` is not a number, even though `major` already matched Gt 1.
    text = """compatibilities:
- rules:
  - name: names
    matchFeatures:
    - feature: kernel.version
      matchName: {op: Gt, value: ["1"]}
"""
    verdict, error = rules(text)["names"]
    assert verdict == "error" and error is not None and "not a number 'full'" in error


def test_match_name_only_term_after_a_failing_term_is_skipped() -> None:
    # rule.go:248 `isTermMatch = true` is set once, outside the loop over terms; rule.go:295 evaluates
    # matchName only `if err == nil && isTermMatch`: after a failing term, a matchName-only term keeps
    # the failure and its (erroneous) expression is never evaluated.
    text = """compatibilities:
- rules:
  - name: skipped
    matchFeatures:
    - feature: kernel.loadedmodule
      matchExpressions: {amdgpu: {op: Exists}}
    - feature: kernel.version
      matchName: {op: Gt, value: ["1"]}
  - name: evaluated
    matchFeatures:
    - feature: kernel.loadedmodule
      matchExpressions: {nvidia: {op: Exists}}
    - feature: kernel.version
      matchName: {op: Gt, value: ["1"]}
"""
    outcome = rules(text)
    assert outcome["skipped"] == ("no-match", None)
    assert outcome["evaluated"][0] == "error"


# --- numbers, versions, regular expressions, ops -------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (str(-(2**63)), False),  # strconv.Atoi (expression.go:185) on 64-bit: the whole int64 range
        (str(2**63 - 1), True),
    ],
)
def test_integers_over_the_full_int64_range(value: str, expected: bool) -> None:
    assert evaluate_expression(MatchExpression(op="Gt", value=["0"]), True, value) is expected


@pytest.mark.parametrize("value", ["5\n", str(2**63), "-9223372036854775809", "١٢", "5_0", " 5"])
def test_what_atoi_refuses(value: str) -> None:
    # strconv.Atoi (expression.go:185): ASCII digits and one sign, nothing after (not even "\n").
    with pytest.raises(MatchError, match="not a number"):
        evaluate_expression(MatchExpression(op="Gt", value=["0"]), True, value)


def test_versions_refuse_a_trailing_newline() -> None:
    # expression.go:632 extractVersion -> Masterminds semver NewVersion: its regexp ends in `$`,
    # which in Go is the end of the text.
    with pytest.raises(MatchError, match="not a version"):
        parse_version("1.2.3\n")


def test_regular_expressions_use_gos_syntax() -> None:
    # expression.go:149 compileRegexp -> Go's regexp.Compile: RE2 syntax without `\C`.
    with pytest.raises(MatchError, match=r"\\C"):
        evaluate_expression(MatchExpression(op="InRegexp", value=[r"a\C"]), True, "ab")
    assert evaluate_expression(MatchExpression(op="InRegexp", value=[r"\\C"]), True, "a\\C")


def test_an_unknown_op_is_an_error_only_when_evaluated_and_before_anything_else() -> None:
    # Go decodes any string into MatchOp (types.go MatchOp string); expression.go:99-100 refuses it
    # first, even for a missing element.
    loaded = spec("""compatibilities:
- rules:
  - name: unknown
    matchFeatures:
    - feature: kernel.version
      matchExpressions: {absent: {op: Frobnicate}}
""")
    assert loaded.compatibilities[0].rules[0].match_features[0].match_expressions["absent"].op == "Frobnicate"
    with pytest.raises(MatchError, match="invalid Op 'Frobnicate'"):
        evaluate_expression(MatchExpression(op="Frobnicate"), False, None)
    assert evaluate_spec(loaded, NODE).sets[0].rules[0].verdict == "error"


# --- decoding as sigs.k8s.io/yaml does (client.go:131 yaml.Unmarshal into compatv1alpha1.Spec) ---


def test_field_names_match_case_insensitively() -> None:
    # sigs.k8s.io/yaml yaml.go convertToJSONableObject: the exact field name, else equalFold; then
    # encoding/json, also case-insensitive. `MatchExpressions:` is not dropped: the rule stays strict.
    text = """compatibilities:
- Rules:
  - Name: strict
    MatchFeatures:
    - Feature: pci.device
      MatchExpressions: {vendor: {Op: In, Value: ["1002"]}}
"""
    loaded, warnings = load_spec("version: v1alpha1\n" + text)
    assert warnings == []
    assert evaluate_spec(loaded, NODE).sets[0].verdict == "no-match"  # an AMD GPU is wanted


def test_unquoted_numbers_and_booleans_are_strings_where_go_has_a_string() -> None:
    # yaml.go convertToJSONableObject: int -> FormatInt, float -> FormatFloat(v, 'g', -1, 32), bool ->
    # "true"/"false" when the target is a string; go-yaml v2 resolve: 0300 is octal, yes is a bool.
    loaded = spec("""compatibilities:
- tag: 2024
  description: yes
  rules:
  - name: 7
    matchFeatures:
    - feature: pci.device
      matchExpressions:
        class: {op: In, value: [0302, 302, 1.5e3, 1e7, 0.1, 0x1F, on, 18446744073709551615, 1_000]}
""")
    compatibility = loaded.compatibilities[0]
    assert (compatibility.tag, compatibility.description, compatibility.rules[0].name) == (
        "2024",
        "true",
        "7",
    )
    assert compatibility.rules[0].match_features[0].match_expressions["class"].value == [
        "194", "302", "1500", "1e+07", "0.1", "31", "true", "18446744073709551615", "1000",
    ]  # fmt: skip


def test_a_missing_version_and_a_set_without_rules_are_read() -> None:
    # spec.go:32,41: plain fields, no validation; client.go:131 checks nothing after Unmarshal.
    loaded, warnings = load_spec("compatibilities:\n- tag: empty\n")
    assert loaded.version == "" and loaded.compatibilities[0].rules == []
    assert warnings == ["version is '', not 'v1alpha1' (NFD's client does not check it; read anyway)"]
    assert evaluate_spec(loaded, NODE).sets[0].verdict == "match"  # no rule: nothing fails
    other, _ = load_spec("version: v9\ncompatibilities: []\n")
    assert other.version == "v9"


def test_what_go_still_refuses() -> None:
    with pytest.raises(SpecError, match="weight"):  # a string into Go's int
        load_spec("compatibilities:\n- weight: heavy\n")
    with pytest.raises(SpecError, match="null where NFD needs an expression"):
        load_spec(
            "compatibilities:\n- rules:\n  - matchFeatures:\n    - feature: a.b\n      matchExpressions: {x: null}\n"
        )


def test_compat_exit_status_reads_sets_as_all_or_as_weighted_alternatives(tmp_path: Any) -> None:
    # NFD computes no overall verdict (cmd/nfd/subcmd/compat/validate-node.go prints each set and exits
    # 0); gpubadge's exit status summarises: --sets all (default) or any (sets as alternatives).
    import subprocess
    import sys

    (tmp_path / "spec.yaml").write_text("""version: v1alpha1
compatibilities:
- tag: amd
  weight: 10
  rules:
  - name: amd-gpu
    matchFeatures:
    - feature: pci.device
      matchExpressions: {vendor: {op: In, value: ["1002"]}}
- tag: nvidia
  weight: 5
  rules:
  - name: nvidia-gpu
    matchFeatures:
    - feature: pci.device
      matchExpressions: {vendor: {op: In, value: ["10de"]}}
""")
    (tmp_path / "node.yaml").write_text(
        "instances: {pci.device: {elements: [{attributes: {vendor: '10de', class: '0302'}}]}}\n"
    )

    def compat(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [
            "compat",
            "--spec",
            str(tmp_path / "spec.yaml"),
            "--node",
            str(tmp_path / "node.yaml"),
            *extra,
        ]
        return subprocess.run(
            [sys.executable, "-m", "gpubadge.cli", *args], capture_output=True, text=True, timeout=60
        )

    assert compat().returncode == 3
    assert compat("--sets", "any").returncode == 0
    assert compat("--sets", "any", "--tags", "amd").returncode == 3
    wrong = compat("--sets", "most")
    assert wrong.returncode == 2 and "--sets" in wrong.stderr and "Traceback" not in wrong.stderr


def test_merge_keys_apply_as_go_yaml_v2_applies_them() -> None:
    # go-yaml v2 (decode.go, mapping/merge): `<<` merges in document order, a later key overrides,
    # among a list of merged mappings the earlier wins; a quoted "<<" is an ordinary key.
    loaded = spec("""base: &base {op: In, value: ["10de"]}
other: &other {op: Exists, type: version}
compatibilities:
- rules:
  - name: merged
    matchFeatures:
    - feature: pci.device
      matchExpressions:
        vendor: {<<: [*base, *other], type: ""}
        class: {type: version, <<: *other}
""")
    expressions = loaded.compatibilities[0].rules[0].match_features[0].match_expressions
    assert expressions["vendor"] == MatchExpression(op="In", value=["10de"], type="")
    assert expressions["class"] == MatchExpression(op="Exists", type="version")
    with pytest.raises(SpecError, match="merge key"):
        load_spec("compatibilities: {<<: [1]}\n")
