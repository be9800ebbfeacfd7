"""The dra, nomad and akash exports: valid for their schedulers, and never wider than gpubadge.

DRA: the ResourceClaimTemplate validates against Kubernetes' resource.k8s.io/v1 schema
(kubernetes-validate, strict); its CEL selector is parsed and evaluated with cel-python over the
devices the NVIDIA DRA driver would publish for the test nodes (semver attributes, memory as a
capacity), and compared with gpubadge's own eligibility. Nomad: the HCL parses with python-hcl2
and is evaluated with Nomad's constraint rules for the operators it uses. Akash: the SDL profile
is loaded as YAML and checked against the SDL's GPU rules.
"""

from __future__ import annotations

import json
import re
from typing import Any

import celpy
import hcl2
import kubernetes_validate
import pytest
import yaml
from celpy import celtypes

from placement.decide import decide
from placement.exports import export_constraints
from placement.exports.akash import akash_gpu
from placement.exports.nomad import CUDA_DRIVER_FLOOR
from tests.test_export_kubernetes import IMAGES, KNOWN, NODES, REQUESTS, Node, node_matches

SEMVER = re.compile(r"semver\('([^']*)'\)")
CANONICAL = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")


def _eligible(image_name: str, request_name: str) -> set[str]:
    decision = decide(
        IMAGES[image_name], REQUESTS[request_name], [node.server() for node in NODES if node.gfd]
    )
    return {entry["server"] for entry in decision.eligible}


# --- DRA ---------------------------------------------------------------------------------------


def _semver(text: Any) -> celtypes.ListType:
    assert CANONICAL.match(str(text)), f"semver() needs canonical X.Y.Z: {text}"
    return celtypes.ListType([celtypes.IntType(int(part)) for part in str(text).split(".")])


def _quantity(text: Any) -> celtypes.IntType:
    match = re.fullmatch(r"(\d+)Mi", str(text))
    assert match, text
    return celtypes.IntType(int(match.group(1)) * 1024**2)


def _compare_to(left: Any, right: Any) -> celtypes.IntType:
    a = [int(x) for x in left] if isinstance(left, celtypes.ListType) else int(left)
    b = [int(x) for x in right] if isinstance(right, celtypes.ListType) else int(right)
    return celtypes.IntType((a > b) - (a < b))  # type: ignore[operator]


def _version(text: str) -> list[int]:
    """How the DRA driver publishes a version: three numeric parts (`550.107.02` -> 550.107.2)."""
    parts = [int(part) for part in text.split(".")]
    return [*parts, 0, 0, 0][:3]


def dra_device(node: Node) -> Any:
    return celpy.json_to_cel(
        {
            "attributes": {
                "gpu.nvidia.com": {
                    "productName": node.product,
                    "brand": node.brand,
                    "driverVersion": _version(node.driver),
                    "cudaDriverVersion": _version(node.cuda),
                    "cudaComputeCapability": _version(node.cc),
                }
            },
            "capacity": {"gpu.nvidia.com": {"memory": node.memory_mib * 1024**2}},
        }
    )


@pytest.mark.parametrize("request_name", sorted(REQUESTS))
@pytest.mark.parametrize("image_name", sorted(IMAGES))
def test_dra_claim_selects_what_gpubadge_would(image_name: str, request_name: str) -> None:
    body = export_constraints(IMAGES[image_name], REQUESTS[request_name], KNOWN, "dra")
    template = body["resourceClaimTemplate"]
    kubernetes_validate.validate(template, "1.37.0", strict=True)
    request = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert request["deviceClassName"] == "gpu.nvidia.com" and request["count"] >= 1
    (selector,) = request["selectors"]
    expression = selector["cel"]["expression"]
    for literal in SEMVER.findall(expression):
        assert CANONICAL.match(literal), literal
    environment = celpy.Environment()
    program = environment.program(
        environment.compile(expression),
        functions={"semver": _semver, "quantity": _quantity, "compareTo": _compare_to},
    )
    eligible = _eligible(image_name, request_name)
    wrong = []
    for node in NODES:
        if not node.gfd:
            continue
        selected = bool(program.evaluate({"device": dra_device(node)})) and node_matches(
            body["affinity"], node.labels()
        )
        expected = node.name in eligible
        if selected != expected and (node.known or selected):
            wrong.append((node.name, node.product, node.driver, selected, expected))
    assert not wrong, (wrong, expression, body["notes"])


def test_dra_claim_schema_check_can_fail() -> None:
    body = export_constraints(IMAGES["cuda-12.2"], REQUESTS["one"], KNOWN, "dra")
    broken = dict(body["resourceClaimTemplate"], spec={"spec": {"devices": {"requests": [{"nam": "gpu"}]}}})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37.0", strict=True)


# --- Nomad -------------------------------------------------------------------------------------


def unquote(value: Any) -> Any:
    """python-hcl2 keeps string literals' quotes (and marks blocks); plain values for the checks."""
    if isinstance(value, dict):
        return {unquote(k): unquote(v) for k, v in value.items() if k != "__is_block__"}
    if isinstance(value, list):
        return [unquote(item) for item in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return json.loads(value)
    return value


def _go_version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _version_holds(have: str, spec: str) -> bool:
    """Nomad's `version` operator: comma-separated `OP VERSION` clauses, all of which must hold."""
    version = _go_version(have)
    for clause in spec.split(","):
        op, wanted_text = re.fullmatch(r"\s*(>=|<=|>|<|=|!=)\s*([0-9.]+)\s*", clause).groups()  # type: ignore[union-attr]
        wanted = _go_version(wanted_text)
        width = max(len(version), len(wanted))
        a, b = version + (0,) * (width - len(version)), wanted + (0,) * (width - len(wanted))
        ok = {">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b, "=": a == b, "!=": a != b}[op]
        if not ok:
            return False
    return True


def _holds(constraint: dict[str, Any], values: dict[str, str]) -> bool:
    have = values[constraint["attribute"]]
    operator, value = constraint.get("operator", "="), constraint["value"]
    if operator == "regexp":
        return re.search(value, have) is not None
    if operator == "version":
        return _version_holds(have, value)
    if operator == ">=":
        number, unit = value.split()
        assert unit == "MiB"
        return int(have) >= int(number)
    if operator == "=":
        return have == value
    raise AssertionError(f"operator {operator} not used by the export")


@pytest.mark.parametrize("request_name", sorted(REQUESTS))
@pytest.mark.parametrize("image_name", sorted(IMAGES))
def test_nomad_fragment_parses_and_never_selects_an_ineligible_node(
    image_name: str, request_name: str
) -> None:
    body = export_constraints(IMAGES[image_name], REQUESTS[request_name], KNOWN, "nomad")
    parsed = unquote(hcl2.loads(body["hcl"]))
    constraints = parsed.get("constraint", [])
    assert any(c["attribute"] == "${attr.cpu.arch}" for c in constraints)
    devices = parsed.get("device", [])
    assert len(devices) == 1 and "nvidia/gpu" in devices[0]
    device = devices[0]["nvidia/gpu"]
    assert int(device["count"]) >= 1
    for constraint in device.get("constraint", []):
        if constraint["attribute"] == "${device.attr.memory}":
            assert constraint["value"].endswith(" MiB")  # unitless memory never compares
        if constraint["attribute"] == "${device.attr.driver_version}":
            assert constraint["operator"] == "version"  # `>=` would compare strings
    eligible = _eligible(image_name, request_name)
    for node in NODES:
        if not node.gfd or not node.known:
            continue
        values = {
            "${attr.cpu.arch}": node.arch,
            "${device.model}": node.product,
            "${device.attr.memory}": str(node.memory_mib),
            "${device.attr.driver_version}": node.driver,
        }
        selected = all(_holds(c, values) for c in constraints) and all(
            _holds(c, values) for c in device.get("constraint", [])
        )
        assert not selected or node.name in eligible, (node, body["hcl"], body["notes"])


def test_nomad_cuda_floors_follow_nvidia_table() -> None:
    assert CUDA_DRIVER_FLOOR[(12, 2)] == (535, 54, 3) and CUDA_DRIVER_FLOOR[(13, 0)] == (580, 65, 6)
    body = export_constraints(IMAGES["cuda-12.2"], REQUESTS["one"], KNOWN, "nomad")
    assert '">= 535.54.3"' in body["hcl"]
    assert any("CUDA >= 12.2 became driver >= 535.54.3" in note for note in body["notes"])


# --- Akash -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA A100-SXM4-40GB", {"model": "a100", "ram": "40Gi", "interface": "sxm"}),
        ("NVIDIA H100 80GB HBM3", {"model": "h100", "ram": "80Gi", "interface": "sxm"}),
        ("NVIDIA H100 PCIe", {"model": "h100", "interface": "pcie"}),
        ("Tesla T4", {"model": "t4"}),
        ("NVIDIA GeForce RTX 4090", {"model": "rtx4090"}),
        ("NVIDIA RTX A6000", {"model": "rtxa6000"}),
    ],
)
def test_akash_model_names(name: str, expected: dict[str, str]) -> None:
    assert akash_gpu(name) == expected


@pytest.mark.parametrize("image_name", sorted(IMAGES))
def test_akash_profile_is_valid_sdl(image_name: str) -> None:
    body = export_constraints(IMAGES[image_name], REQUESTS["memory"], KNOWN, "akash")
    assert any("cannot be enforced" in note for note in body["notes"])
    if body["sdl"] is None:
        assert not body["satisfiable"] or any("no known GPU model qualifies" in n for n in body["notes"])
        return
    sdl = yaml.safe_load(yaml.safe_dump(body["sdl"]))
    resources = sdl["profiles"]["compute"]["app"]["resources"]
    assert resources["cpu"]["units"] > 0 and re.fullmatch(r"\d+(Mi|Gi|Ti)", resources["memory"]["size"])
    gpu = resources["gpu"]
    assert isinstance(gpu["units"], int) and gpu["units"] == 2
    alternatives = gpu["attributes"]["vendor"]["nvidia"]
    assert alternatives, "an empty list would accept any model"
    for entry in alternatives:
        assert set(entry) <= {"model", "ram", "interface"} and re.fullmatch(r"[a-z0-9]+", entry["model"])
        assert "ram" not in entry or re.fullmatch(r"\d+Gi", entry["ram"])
        assert entry.get("interface", "pcie") in ("pcie", "sxm")
    # 40Gi per GPU: the small GPUs of the known fleet are not offered.
    assert not any(entry["model"] in ("t4", "v100", "rtx4090") for entry in alternatives)
