"""NVIDIA_REQUIRE_* grammar and evaluation, checked against NVIDIA's own test tables and real images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from placement.nvidia_require import (
    DeviceFacts,
    ImageRequirements,
    compare_version,
    evaluate,
    evaluate_text,
    legacy_cuda_requirement,
    requirement_texts,
)
from scanner.facts.require_grammar import RequirementSyntaxError, parse_requirement, parse_requirement_lenient
from scanner.models import GpuFacts

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CASES: list[dict[str, Any]] = json.loads((FIXTURES / "nvidia_toolkit_test_cases.json").read_text())
IMAGES: list[dict[str, str]] = json.loads((FIXTURES / "cuda_require_strings.json").read_text())["images"]


def group(name: str) -> list[dict[str, Any]]:
    found = [case for case in CASES if case["group"] == name]
    assert found, name
    return found


def require_string(version: str, platform: str = "linux/amd64") -> str:
    return next(
        i["NVIDIA_REQUIRE_CUDA"]
        for i in IMAGES
        if i["cuda_version"].startswith(version) and i["platform"] == platform
    )


# --- NVIDIA's Go tables ----------------------------------------------------------------------


@pytest.mark.parametrize("case", group("go:constraint-parse"), ids=lambda c: c["description"])
def test_toolkit_constraint_parse_table(case: dict[str, Any]) -> None:
    """TestParse. Where Go and the C runtime differ (unknown keys), we follow C and say so."""
    text = case["condition"]
    if case["expect"] == "parsed":
        expected = case["expected_constraint"]
        (condition,) = parse_requirement(text).conditions
        assert (condition.key, condition.op, condition.value) == (
            expected["property"],
            expected["operator"],
            expected["value"],
        )
    elif case["expect"] == "error":
        with pytest.raises(RequirementSyntaxError) as info:
            parse_requirement(text)
        assert text in str(info.value)
    elif text == "":
        assert parse_requirement(text).always_true
    else:
        # Go skips unknown properties; nvidia-container-cli (what Docker runs) rejects them.
        with pytest.raises(RequirementSyntaxError, match="unknown key 'foo'"):
            parse_requirement(text)


def _shape(expression_dict: dict[str, Any]) -> Any:
    """Our tree in the toolkit table's notation (single-element groups collapse, as Go does)."""
    terms = []
    for term in expression_dict["any_of"]:
        factors = [{"binary": [c["key"], c["op"], c["value"]]} for c in term["all_of"]]
        terms.append(factors[0] if len(factors) == 1 else {"and": factors})
    return terms[0] if len(terms) == 1 else {"or": terms}


@pytest.mark.parametrize("case", group("go:requirement-parse"), ids=lambda c: c["description"])
def test_toolkit_requirement_parse_table(case: dict[str, Any]) -> None:
    text = case["requirement"]
    if case["expect"].startswith("nil"):
        assert parse_requirement(text).always_true
        return
    if case["expect"] == "error":
        with pytest.raises(RequirementSyntaxError):
            parse_requirement(text)
        return
    if "foo=bar" in text:
        # Go ignores the unknown term; C fails only when it reaches it (short-circuit).
        expression = parse_requirement_lenient(text)
        assert _shape({"any_of": [expression.to_dict()["any_of"][0]]}) == case["expected_constraint"]
        assert evaluate(expression, DeviceFacts(cuda="12.0")).ok
        assert evaluate(expression, DeviceFacts(cuda="11.0")).outcome == "error"
        return
    shape = _shape(parse_requirement(text).to_dict())
    if "MISLEADING" in case.get("note", ""):
        # The Go test's and/or labels are swapped (see note); the real rule is space=OR, comma=AND.
        expected = case["expected_constraint"]
        swapped = {"or" if "and" in expected else "and": next(iter(expected.values()))}
        assert shape == swapped
    else:
        assert shape == case["expected_constraint"]


ALWAYS, NEVER = "cuda>=0", "cuda<0"


def _expressible(case: dict[str, Any]) -> bool:
    """Go's empty OR is an internal constructor with no requirement text to write it as (an empty
    text is an empty AND, satisfied in C), so that one case of the table is left out, not skipped."""
    return bool(case["constraints"]) or case["operator"] == "and"


LOGICAL = [case for case in group("go:logical") if _expressible(case)]


def test_only_the_inexpressible_logical_case_is_left_out() -> None:
    left_out = [case for case in group("go:logical") if not _expressible(case)]
    assert [(case["operator"], case["constraints"]) for case in left_out] == [("or", [])]


@pytest.mark.parametrize("case", LOGICAL, ids=lambda c: f"{c['operator']}: {c['description']}")
def test_toolkit_logical_table(case: dict[str, Any]) -> None:
    facts = DeviceFacts(cuda="12.4")
    factors = [ALWAYS if c == "always" else NEVER for c in case["constraints"]]
    if not factors:  # the empty AND: an empty requirement text
        assert evaluate_text("", facts).ok is case["expect"]
        return
    text = ",".join(factors) if case["operator"] == "and" else " ".join(factors)
    assert evaluate_text(text, facts).ok is case["expect"]


@pytest.mark.parametrize("case", group("go:legacy-cuda-version-parse"), ids=lambda c: c["cuda_version"])
def test_toolkit_legacy_cuda_version_table(case: dict[str, Any]) -> None:
    if case["expect"] == "error":
        with pytest.raises(ValueError, match="invalid CUDA_VERSION"):
            legacy_cuda_requirement(case["cuda_version"])
    else:
        assert legacy_cuda_requirement(case["cuda_version"]) == f"cuda>={case['expect']}"


@pytest.mark.parametrize("case", group("go:get-requirements"), ids=lambda c: c["description"])
def test_toolkit_get_requirements_table(case: dict[str, Any]) -> None:
    got = [value for _, value in requirement_texts(case["env"])]
    assert sorted(got) == sorted(case["expect_requirements"])
    facts = GpuFacts(required=True, env=case["env"])
    image = ImageRequirements.from_gpu_facts(facts)
    assert sorted(e.text for _, e in image.expressions) == sorted(case["expect_requirements"])


def test_bats_cuda_devel_images_carry_cuda_requirement() -> None:
    (case,) = group("bats:cuda-images")
    assert case["expect"] is True
    amd64 = [i for i in IMAGES if i["platform"] == "linux/amd64"]
    assert amd64 and all("cuda>=" in i["NVIDIA_REQUIRE_CUDA"] for i in amd64)


# --- grammar details of dsl.c ----------------------------------------------------------------


def test_space_is_or_and_comma_is_and_binding_tighter() -> None:
    expression = parse_requirement("cuda>=12.4 brand=tesla,driver>=470,driver<471")
    assert [len(t.conditions) for t in expression.alternatives] == [1, 3]
    assert str(expression) == "cuda>=12.4 OR (brand=tesla AND driver>=470 AND driver<471)"
    assert expression.to_dict()["any_of"][1]["all_of"][0] == {
        "key": "brand",
        "op": "=",
        "value": "tesla",
        "text": "brand=tesla",
    }


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("cuda==12.2", "invalid operator '=='"),
        ("cuda=>12.2", "invalid operator '=>'"),
        ("cuda>=", "empty value"),
        (">=12", "no key"),
        ("cuda", "no operator"),
        ("cuda>=v12.2", "digits and dots"),
        ("driver>=12.2-rc1", "digits and dots"),
        ("brand>=tesla", "only = and !="),
        ("gpu=1", "unknown key 'gpu'"),
        ("cuda>=12.2,arch=8.0 foo<1", "'foo<1'"),
    ],
)
def test_syntax_errors_name_the_bad_term(text: str, fragment: str) -> None:
    with pytest.raises(RequirementSyntaxError) as info:
        parse_requirement(text)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_keys_are_case_insensitive_and_empty_parts_are_skipped() -> None:
    expression = parse_requirement("  CUDA>=12.3   Brand=Tesla,,Driver<600, ")
    assert [c.key for c in expression.conditions] == ["cuda", "brand", "driver"]
    for text in ("", "   ", ",,"):
        assert parse_requirement(text).always_true
        assert evaluate_text(text, DeviceFacts(cuda="1.0")).ok


def test_lone_bang_is_not_equal_like_dsl_c() -> None:
    (condition,) = parse_requirement("cuda!12.2").conditions
    assert condition.op == "!="
    assert not evaluate_text("cuda!12.2", DeviceFacts(cuda="12.2")).ok


def test_comma_only_term_ends_evaluation() -> None:
    facts = DeviceFacts(cuda="12.0")
    assert evaluate_text(", cuda>=99", facts).ok  # first term empty: satisfied
    assert evaluate_text("cuda>=99 , cuda>=1", facts).outcome == "unsatisfied"  # later terms never looked at
    assert evaluate_text("cuda>=99 , foo=bar", facts).outcome == "unsatisfied"


# --- evaluation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "op", "wanted", "expected"),
    [
        ("12.2", "=", "12.2.0", True),
        ("12.2.0", "=", "12.2", True),
        ("12.2", "<", "12.2.1", True),
        ("12.10", ">", "12.9", True),
        ("470.57.02", "=", "470.57.2", True),
        ("470.57.02", "=", "470", False),
        ("470.57.02", ">", "470", True),
        ("470.57.02", ">=", "470", True),
        ("470.57.02", "<", "471", True),
        ("525.60.13", "<", "471", False),
        ("12.0", "!=", "12", False),
        ("12.0", "<=", "12", True),
        ("9.0", ">=", "7.5", True),
        ("7.0", ">=", "7.5", False),
        ("12.2", ">=", "v12", None),
        ("12.2", ">=", ".5", None),
        ("12.2", ">=", "99999999999999999999999", None),
    ],
)
def test_version_comparison(host: str, op: str, wanted: str, expected: bool | None) -> None:
    assert compare_version(host, op, wanted) is expected


def test_unsatisfied_message_matches_nvidia_container_cli() -> None:
    verdict = evaluate_text("cuda>=12.2 brand=tesla,driver>=470,driver<471", DeviceFacts("12.0", "525.60.13"))
    assert verdict.outcome == "unsatisfied"
    assert verdict.message == (
        "unsatisfied condition: cuda>=12.2, please update your driver to a newer version, "
        "or use an earlier cuda container"
    )
    assert "driver CUDA 12.0 < cuda>=12.2" in verdict.failed
    assert "driver 525.60.13 is not in branch 470" in verdict.failed
    upper = evaluate_text("CUDA>=12.3", DeviceFacts("12.2"))
    assert upper.message == "unsatisfied condition: CUDA>=12.3"  # strncmp is case-sensitive


def test_errors_surface_only_when_reached() -> None:
    assert evaluate_text("cuda>=12.2 foo=bar", DeviceFacts(cuda="12.4")).ok
    reached = evaluate_text("cuda>=12.2 foo=bar", DeviceFacts(cuda="12.0"))
    assert (reached.outcome, reached.message) == ("error", "invalid expression")
    assert "unknown key 'foo'" in reached.failed[0]
    assert evaluate_text("cuda>=99,foo=bar", DeviceFacts(cuda="12.0")).outcome == "unsatisfied"


def test_no_visible_device_makes_arch_and_brand_true() -> None:
    hidden = DeviceFacts(cuda="12.4", driver="535.104.05", device_visible=False)
    assert evaluate_text("brand=tesla,driver>=535,driver<536", hidden).ok
    assert evaluate_text("arch>=99 brand>=x", hidden).ok  # the rule returns before validating
    visible = DeviceFacts(cuda="12.4", driver="535.104.05", arch="8.0", brand="Nvidia")
    assert evaluate_text("brand>=x", visible).outcome == "error"
    assert not evaluate_text("brand=tesla", visible).ok
    assert evaluate_text("brand=NVIDIA", visible).ok


def test_unknown_host_values_are_true() -> None:
    assert evaluate_text("cuda>=99,driver>=999", DeviceFacts()).ok


def test_long_failing_factor_is_invalid_expression() -> None:
    long_value = "0" * 127 + "999"  # leading zeros keep it a small number
    assert evaluate_text(f"driver>={long_value}", DeviceFacts(driver="535")).outcome == "error"
    assert evaluate_text(
        f"driver<{long_value}", DeviceFacts(driver="535")
    ).ok  # true factors are not formatted


# --- the real NVIDIA_REQUIRE_CUDA strings against realistic servers ---------------------------

# (cuda version of image, driver CUDA, driver, compute capability, runtime brand, expected)
REAL_CASES = [
    ("12.2", "12.2", "535.104.05", "9.0", "Nvidia", True),  # H100, 535: CUDA is new enough
    ("12.2", "12.0", "525.60.13", "9.0", "Nvidia", True),  # H100, 525 branch escape term
    ("12.2", "12.0", "525.60.13", "9.0", "Unknown", True),  # same host, pre-2022 libnvidia-container
    ("12.2", "11.4", "470.57.02", "7.0", "Tesla", True),  # V100 on branch 470 (forward compat)
    ("12.2", "11.8", "520.61.05", "7.0", "Tesla", False),  # branch 520 is not listed
    ("12.2", "12.0", "525.60.13", "7.5", "Tesla", True),  # T4
    ("12.2", "12.0", "525.60.13", "8.6", "GeForce", True),  # GeForce is listed up to 12.4
    ("12.6", "12.4", "550.54.15", "8.9", "GeForce", False),  # dropped from 12.5 on
    ("12.6", "12.4", "550.54.15", "8.9", "Nvidia", True),  # L4 on branch 550
    ("12.6", "12.6", "560.35.03", "8.6", "GeForce", True),  # new enough driver
    ("13.0", "12.8", "570.124.06", "9.0", "Nvidia", True),  # branch 570 escape
    ("13.0", "12.9", "575.57.08", "9.0", "Nvidia", True),
    ("13.0", "12.2", "535.104.05", "8.0", "Nvidia", True),
    ("13.0", "12.4", "550.54.15", "8.9", "GeForce", False),
    ("13.0", "12.6", "560.35.03", "9.0", "Nvidia", False),  # 560 is not an escape branch for 13.0
    ("11.8", "11.4", "470.57.02", "7.5", "Tesla", True),
    ("11.8", "11.6", "510.47.03", "7.5", "Tesla", False),
]


@pytest.mark.parametrize(("image", "cuda", "driver", "arch", "brand", "expected"), REAL_CASES)
def test_real_cuda_image_requirements(
    image: str, cuda: str, driver: str, arch: str, brand: str, expected: bool
) -> None:
    verdict = evaluate(parse_requirement(require_string(image)), DeviceFacts(cuda, driver, arch, brand))
    assert verdict.ok is expected, verdict
    if not expected:
        assert verdict.message.startswith(f"unsatisfied condition: cuda>={image}")
        assert f"driver CUDA {cuda} < cuda>={image}" in verdict.failed


def test_real_string_failure_explains_branch_and_brand() -> None:
    geforce = evaluate(
        parse_requirement(require_string("12.6")), DeviceFacts("12.4", "550.54.15", "8.9", "GeForce")
    )
    assert geforce.failed[0] == "driver CUDA 12.4 < cuda>=12.6"
    assert any(line.startswith("brand GeForce is not one of unknown, grid, tesla") for line in geforce.failed)
    assert not any("branch" in line for line in geforce.failed)  # 550 is listed; the brand is what's missing
    tesla = evaluate(
        parse_requirement(require_string("12.2")), DeviceFacts("11.8", "520.61.05", "7.0", "Tesla")
    )
    assert tesla.failed == ("driver CUDA 11.8 < cuda>=12.2", "driver 520.61.05 is not in branch 470, 525")


def test_arm64_and_uppercase_strings() -> None:
    assert evaluate_text(require_string("12.2", "linux/arm64"), DeviceFacts("12.2")).ok
    assert not evaluate_text(require_string("12.2", "linux/arm64"), DeviceFacts("12.0", "525.60.13")).ok
    upper = require_string("12.3", "linux/arm64")
    assert upper == "CUDA>=12.3"
    assert evaluate(parse_requirement(upper), DeviceFacts("12.4")).ok


# --- image-level rules -----------------------------------------------------------------------


def test_image_rules_and_all_requirements() -> None:
    env = {"NVIDIA_REQUIRE_CUDA": "cuda>=12.0", "NVIDIA_REQUIRE_ARCH": "arch>=8.0"}
    image = ImageRequirements.from_gpu_facts(GpuFacts(required=True, env=env))
    assert image.check(DeviceFacts("12.2", "535.104.05", "9.0", "Nvidia")).ok
    verdict = image.check(DeviceFacts("12.2", "535.104.05", "7.5", "Tesla"))
    assert not verdict.ok and verdict.failed == ("NVIDIA_REQUIRE_ARCH: compute capability 7.5 < arch>=8.0",)


def test_jetpack_disable_and_legacy() -> None:
    jetpack = GpuFacts(
        env={"NVIDIA_REQUIRE_JETPACK": "csv-mounts=all", "NVIDIA_REQUIRE_JETPACK_HOST_MOUNTS": "x"}
    )
    assert ImageRequirements.from_gpu_facts(jetpack).expressions == ()
    disabled = GpuFacts(disable_require=True, env={"NVIDIA_REQUIRE_CUDA": "cuda>=99"})
    assert ImageRequirements.from_gpu_facts(disabled).check(DeviceFacts("12.0")).ok
    by_env = GpuFacts(env={"NVIDIA_REQUIRE_CUDA": "cuda>=99", "NVIDIA_DISABLE_REQUIRE": "1"})
    assert ImageRequirements.from_gpu_facts(by_env).disabled
    not_true = GpuFacts(env={"NVIDIA_REQUIRE_CUDA": "cuda>=99", "NVIDIA_DISABLE_REQUIRE": "no"})
    assert not ImageRequirements.from_gpu_facts(not_true).check(DeviceFacts("12.0")).ok
    legacy = ImageRequirements.from_gpu_facts(GpuFacts(env={"CUDA_VERSION": "12.4.1"}))
    assert [e.text for _, e in legacy.expressions] == ["cuda>=12.4"]
    assert not legacy.check(DeviceFacts("12.2")).ok
    from_field = ImageRequirements.from_gpu_facts(GpuFacts(cuda_version="11.0"))
    assert [e.text for _, e in from_field.expressions] == ["cuda>=11.0"]


def test_malformed_clause_is_an_error_only_where_reached() -> None:
    image = ImageRequirements.from_gpu_facts(GpuFacts(env={"NVIDIA_REQUIRE_CUDA": "cuda>=12.2 gpu=h100"}))
    assert image.error is None
    (warning,) = image.warnings
    assert "NVIDIA_REQUIRE_CUDA" in warning and "'gpu=h100'" in warning
    assert image.check(DeviceFacts("13.0")).ok
    reached = image.check(DeviceFacts("12.0"))
    assert reached.outcome == "error" and "'gpu=h100'" in reached.failed[0]


def test_more_than_32_requirements_is_an_error() -> None:
    env = {f"NVIDIA_REQUIRE_X{i:02d}": "cuda>=1" for i in range(33)}
    assert "too many requirements" in (ImageRequirements.from_gpu_facts(GpuFacts(env=env)).error or "")
    env.pop("NVIDIA_REQUIRE_X00")
    assert ImageRequirements.from_gpu_facts(GpuFacts(env=env)).error is None


def test_requirement_values_without_env_are_used() -> None:
    image = ImageRequirements.from_gpu_facts(GpuFacts(requirements=["cuda>=12.2", "brand=tesla"]))
    assert len(image.expressions) == 2
    assert not image.check(DeviceFacts("12.4", arch="8.0", brand="Nvidia")).ok


def test_every_clause_that_fails_when_reached_is_named() -> None:
    """Malformed clauses, and well-formed ones the runtime still rejects (too long, too large)."""
    from scanner.facts.gpu import gpu_facts

    long_clause = "driver>=" + "0" * 125 + "535"
    value = f"cuda>=12.2 gpu=h100 brand>=tesla {long_clause} arch>=99999999999999999999999"
    config = {"config": {"Env": [f"NVIDIA_REQUIRE_CUDA={value}", "NVIDIA_VISIBLE_DEVICES=all"]}}
    facts = gpu_facts(config)
    errors = [issue.error for issue in facts.requirement_errors]
    assert len(errors) == 4 and all(
        issue.variable == "NVIDIA_REQUIRE_CUDA" for issue in facts.requirement_errors
    )
    assert "'gpu=h100'" in errors[0] and "brand supports only" in errors[1]
    assert "longer than" in errors[2] and "too large" in errors[3]
    image = ImageRequirements.from_gpu_facts(facts)
    assert len(image.warnings) == 4
    assert image.check(DeviceFacts("12.4")).ok  # none of them is reached on this host
