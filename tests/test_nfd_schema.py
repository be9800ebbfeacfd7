"""The image-compatibility YAML against NFD's schema, field by field.

`NFD_SCHEMA` is written here by hand from node-feature-discovery's Go types (api/image-compatibility/
v1alpha1/spec.go: Spec, Compatibility; api/nfd/v1alpha1/types.go: GroupRule, MatchAnyElem,
FeatureMatcherTerm, MatchExpression, with their `json:` names and the CRD's operator enum), apart
from gpubadge's own pydantic models, so a field either of them gets wrong fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from placement.exports.nfd import artifact_yaml, compatibility_spec
from placement.nfd.schema import SpecError, load_spec
from placement.nfd.write import dump_spec
from scanner.facts.gpu import gpu_facts
from scanner.models import GpuArchs, ImageReport, InferredCuda, PlatformReport

NFD_SCHEMA: dict[str, dict[str, Any]] = {
    "Spec": {"version": str, "compatibilities": ["Compatibility"]},
    "Compatibility": {"rules": ["GroupRule"], "weight": int, "tag": str, "description": str},
    "GroupRule": {
        "name": str,
        "vars": {str: str},
        "varsTemplate": str,
        "matchFeatures": ["FeatureMatcherTerm"],
        "matchAny": ["MatchAnyElem"],
    },
    "MatchAnyElem": {"matchFeatures": ["FeatureMatcherTerm"]},
    "FeatureMatcherTerm": {
        "feature": str,
        "matchExpressions": {str: "MatchExpression"},
        "matchName": "MatchExpression",
    },
    "MatchExpression": {"op": str, "value": [str], "type": str},
}
REQUIRED = {
    "Spec": {"version", "compatibilities"},
    "Compatibility": {"rules"},
    "FeatureMatcherTerm": {"feature"},
}
OPERATORS = {
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


def _check(value: Any, kind: Any, path: str) -> None:
    if kind is str or kind is int:
        assert type(value) is kind, f"{path}: {value!r} is not a {kind.__name__}"
    elif isinstance(kind, list):
        assert isinstance(value, list), f"{path}: not a list"
        for i, item in enumerate(value):
            _check(item, kind[0], f"{path}[{i}]")
    elif isinstance(kind, dict) and str in kind:
        assert isinstance(value, dict), f"{path}: not a mapping"
        for key, item in value.items():
            _check(key, str, f"{path} key")
            _check(item, kind[str], f"{path}.{key}")
    else:
        fields = NFD_SCHEMA[kind]
        assert isinstance(value, dict), f"{path}: not a {kind}"
        for key, item in value.items():
            assert key in fields, f"{path}.{key}: unknown field of {kind}"
            _check(item, fields[key], f"{path}.{key}")
        missing = REQUIRED.get(kind, set()) - value.keys()
        assert not missing, f"{path}: {kind} lacks {missing}"
        if kind == "MatchExpression":
            assert value["op"] in OPERATORS, f"{path}.op: {value['op']!r}"
            assert value.get("type", "version") == "version", f"{path}.type"


def check_against_nfd_schema(document: Any) -> None:
    """Raise AssertionError naming the first field NFD's types would not hold."""
    _check(document, "Spec", "spec")
    assert document["version"] == "v1alpha1"


def _platform(env: dict[str, str], **extra: Any) -> PlatformReport:
    gpu = gpu_facts({"config": {"Env": [f"{k}={v}" for k, v in env.items()]}})
    gpu = gpu.model_copy(update=extra)
    return PlatformReport(platform="linux/amd64", digest="sha256:" + "b" * 64, gpu=gpu)


def _report(*platforms: PlatformReport) -> ImageReport:
    return ImageReport(reference="r/x:1", digest="sha256:" + "a" * 64, platforms=list(platforms))


CUDA_REQUIRE = (
    "cuda>=12.4 brand=tesla,driver>=470,driver<471 brand=unknown,driver>=470,driver<471 "
    "brand=nvidia,driver>=535,driver<536 brand=geforce,driver>=535,driver<536"
)
REPORTS = {
    "nvidia-cuda": _report(_platform({"NVIDIA_REQUIRE_CUDA": CUDA_REQUIRE, "CUDA_VERSION": "12.4.1"})),
    "legacy": _report(_platform({"CUDA_VERSION": "10.0.130"})),
    "driver-range-and-equal": _report(
        _platform(
            {
                "NVIDIA_REQUIRE_CUDA": "driver>=535.54.03,driver<560 cuda=12.2.0.0",
                "NVIDIA_REQUIRE_ARCH": "arch>=8.0",
            }
        )
    ),
    "brand-only": _report(_platform({"NVIDIA_REQUIRE_CUDA": "brand=tesla,driver>=470"})),
    "disabled": _report(_platform({"NVIDIA_REQUIRE_CUDA": "cuda>=12.2", "NVIDIA_DISABLE_REQUIRE": "true"})),
    "malformed-later": _report(_platform({"NVIDIA_REQUIRE_CUDA": "cuda>=12.0 cuda>>13 cuda>=11.8"})),
    "inferred-and-archs": _report(
        _platform(
            {"NVIDIA_VISIBLE_DEVICES": "all"},
            inferred=InferredCuda(cuda="12.1", evidence=["torch/version.py: cuda 12.1"]),
            archs=GpuArchs(sass=["sm_80", "sm_90"], ptx=["compute_90"]),
        )
    ),
    "platforms-differ": _report(
        _platform({"NVIDIA_REQUIRE_CUDA": "cuda>=12.4"}),
        _platform({"NVIDIA_REQUIRE_CUDA": "cuda>=12.6"}).model_copy(update={"platform": "linux/arm64"}),
    ),
}


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_what_gpubadge_writes_holds_nfds_schema(name: str) -> None:
    raw = artifact_yaml(REPORTS[name])
    assert raw is not None
    document = yaml.safe_load(raw)  # YAML 1.1, like sigs.k8s.io/yaml's reader: '0300' must stay a string
    check_against_nfd_schema(document)
    spec, warnings = load_spec(raw, strict=True)
    assert warnings == [] and dump_spec(spec) == raw  # the same bytes for the same document
    assert artifact_yaml(REPORTS[name]) == raw


def test_the_checker_and_the_strict_reader_fail_on_an_unknown_field() -> None:
    raw = artifact_yaml(REPORTS["nvidia-cuda"])
    assert raw is not None
    document = yaml.safe_load(raw)
    document["compatibilities"][0]["rules"][0]["matchFeatures"][0]["matchExpression"] = {}  # a typo
    with pytest.raises(AssertionError, match="unknown field of FeatureMatcherTerm"):
        check_against_nfd_schema(document)
    text = yaml.safe_dump(document)
    with pytest.raises(
        SpecError, match=r"compatibilities\[0\]\.rules\[0\]\.matchFeatures\[0\]\.matchExpression"
    ):
        load_spec(text, strict=True)
    spec, warnings = load_spec(text)  # NFD's decoder ignores it; so does the lenient reader, and says so
    assert warnings == [
        "unknown field compatibilities[0].rules[0].matchFeatures[0].matchExpression (ignored, as NFD ignores it)"
    ]
    assert spec.compatibilities[0].rules[0].match_features is not None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("version: v1alpha1\ncompatibilities:\n- weight: 1.5\n  rules: []\n", "weight"),
        ("version: v1alpha1\ncompatibilities:\n- weight: heavy\n", "weight"),
        ("version: v1alpha1\ncompatibilities: {rules: []}\n", "compatibilities"),
        (
            "version: v1alpha1\ncompatibilities:\n- rules:\n  - matchFeatures: {feature: a.b}\n",
            "matchFeatures",
        ),
        ("- not a mapping\n", "mapping"),
    ],
)
def test_what_nfd_could_not_decode_is_refused(text: str, problem: str) -> None:
    with pytest.raises(SpecError, match=problem):
        load_spec(text)


def test_nfds_documented_example_reads_and_writes_back() -> None:
    spec, warnings = load_spec(DOCUMENTED_EXAMPLE, strict=True)
    assert warnings == []
    assert yaml.safe_load(dump_spec(spec)) == yaml.safe_load(DOCUMENTED_EXAMPLE)
    check_against_nfd_schema(yaml.safe_load(dump_spec(spec)))


def test_no_gpu_no_spec_and_pending_reports_claim_nothing() -> None:
    cpu = _report(PlatformReport(platform="linux/amd64", digest="sha256:" + "c" * 64))
    assert compatibility_spec(cpu) is None
    assert compatibility_spec(REPORTS["legacy"].model_copy(update={"pending": True})) is None
    assert compatibility_spec(REPORTS["legacy"].model_copy(update={"error": "boom"})) is None


def test_gpubadges_models_have_exactly_the_fields_of_nfds_types() -> None:
    from placement.nfd import schema

    models = {
        "Spec": schema.Spec,
        "Compatibility": schema.Compatibility,
        "GroupRule": schema.GroupRule,
        "MatchAnyElem": schema.MatchAnyElem,
        "FeatureMatcherTerm": schema.FeatureMatcherTerm,
        "MatchExpression": schema.MatchExpression,
    }
    for name, model in models.items():
        names = {field.alias or key for key, field in model.model_fields.items()}
        assert names == set(NFD_SCHEMA[name]), name
        assert model.model_config.get("extra") == "forbid"


DOCUMENTED_EXAMPLE = """\
version: v1alpha1
compatibilities:
- description: "My image requirements"
  rules:
  - name: "kernel and cpu"
    matchFeatures:
    - feature: kernel.loadedmodule
      matchExpressions:
        vfio-pci: {op: Exists}
    - feature: cpu.model
      matchExpressions:
        vendor_id: {op: In, value: ["Intel", "AMD"]}
  - name: "one of available nics"
    matchAny:
    - matchFeatures:
      - feature: pci.device
        matchExpressions:
          vendor: {op: In, value: ["0eee"]}
          class: {op: In, value: ["0200"]}
    - matchFeatures:
      - feature: pci.device
        matchExpressions:
          vendor: {op: In, value: ["0fff"]}
          class: {op: In, value: ["0200"]}
"""
