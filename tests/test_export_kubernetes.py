"""The kubernetes export, checked the way a cluster would use it.

Nodes are labelled as GPU Feature Discovery labels them (zero-padded and empty driver revisions,
`-SHARED` products, nodes without GFD labels); the exported affinity is evaluated with
Kubernetes' node-affinity rules, written here from the Kubernetes documentation (terms ORed,
expressions ANDed, an empty term matches nothing, In/NotIn exact strings, Gt/Lt one integer
value, a missing label fails In/Exists/Gt/Lt); and every node's verdict is compared with
gpubadge's own eligibility (`decide`) for the same node. The affinity, wrapped in a v1 Pod, is
validated with kubernetes-validate (strict), plus what that schema does not check.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from placement.decide import decide
from placement.exports.core import KnownGpu, build_constraints, known_gpus
from placement.exports.kubernetes import export
from placement.image_facts import ImageFacts
from placement.index import FleetIndex
from placement.inventory import Server, parse_inventory
from placement.request import DeployRequest
from scanner.models import (
    ContainerArchs,
    FileArchs,
    GpuArchs,
    GpuFacts,
    ImageReport,
    InferredCuda,
    PlatformReport,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
KNOWN_FLEET = parse_inventory((FIXTURES / "fleet.yaml").read_text()).servers
REAL = json.loads((FIXTURES / "cuda_require_strings.json").read_text())["images"]
KNOWN = known_gpus(FleetIndex.build(KNOWN_FLEET))
NUMERIC_PREFIXES = ("nvidia.com/cuda.", "nvidia.com/gpu.compute.", "nvidia.com/gpu.memory")
INTEGER = re.compile(r"^[+-]?[0-9]+$")  # Go's strconv.ParseInt(s, 10, 64) accepts exactly these

# --- Kubernetes' node affinity matching (from the API reference and scheduling docs) ------------


def _integer(text: str) -> int | None:
    return int(text) if INTEGER.match(text) and -(2**63) <= int(text) < 2**63 else None


def requirement_matches(requirement: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator, values = requirement["key"], requirement["operator"], requirement.get("values", [])
    present = key in labels
    if operator == "In":
        return present and labels[key] in values
    if operator == "NotIn":
        return not present or labels[key] not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt"):
        if len(values) != 1:
            raise AssertionError(f"{operator} takes exactly one value: {requirement}")
        wanted = _integer(values[0])
        if wanted is None:
            raise AssertionError(f"{operator} value is not an integer: {requirement}")
        have = _integer(labels[key]) if present else None
        if have is None:
            return False
        return have > wanted if operator == "Gt" else have < wanted
    raise AssertionError(f"unknown operator {operator}")


def node_matches(affinity: dict[str, Any], labels: dict[str, str]) -> bool:
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return any(
        term.get("matchExpressions") and all(requirement_matches(r, labels) for r in term["matchExpressions"])
        for term in terms
    )


# --- nodes, labelled as GFD labels them --------------------------------------------------------

CUDA_OF_BRANCH = {
    470: "11.4",
    525: "12.0",
    535: "12.2",
    550: "12.4",
    560: "12.6",
    570: "12.8",
    575: "12.9",
    580: "13.0",
}


@dataclass(frozen=True)
class Node:
    name: str
    product: str  # NVML name
    brand: str
    memory_mib: int
    cc: str
    driver: str
    arch: str = "amd64"
    shared: bool = False
    gfd: bool = True

    @property
    def cuda(self) -> str:
        return CUDA_OF_BRANCH[int(self.driver.split(".")[0])]

    def labels(self) -> dict[str, str]:
        labels = {"kubernetes.io/arch": self.arch, "kubernetes.io/hostname": self.name}
        if not self.gfd:
            return labels
        parts = self.driver.split(".")
        cleaned = re.sub(r"\s+", "-", re.sub(r"[^A-Za-z0-9\-_. ]", "", self.product).strip())
        cuda_major, cuda_minor = self.cuda.split(".")
        cc_major, cc_minor = self.cc.split(".")
        labels |= {
            "nvidia.com/cuda.driver-version.major": parts[0],
            "nvidia.com/cuda.driver-version.minor": parts[1],
            "nvidia.com/cuda.driver-version.revision": parts[2] if len(parts) > 2 else "",
            "nvidia.com/cuda.driver-version.full": self.driver,
            "nvidia.com/cuda.runtime-version.major": cuda_major,
            "nvidia.com/cuda.runtime-version.minor": cuda_minor,
            "nvidia.com/gpu.product": cleaned + ("-SHARED" if self.shared else ""),
            "nvidia.com/gpu.memory": str(self.memory_mib),
            "nvidia.com/gpu.compute.major": cc_major,
            "nvidia.com/gpu.compute.minor": cc_minor,
            "nvidia.com/gpu.count": "2",
        }
        return labels

    def server(self) -> Server:
        gpus = [
            {
                "index": i,
                "uuid": f"GPU-{self.name}-{i}",
                "name": self.product,
                "brand": self.brand,
                "memory_mib": self.memory_mib,
                "compute_capability": self.cc,
            }
            for i in range(2)
        ]
        return Server.model_validate(
            {
                "name": self.name,
                "arch": self.arch,
                "cpus": 64,
                "memory": "256Gi",
                "driver_version": self.driver,
                "cuda_driver_version": self.cuda,
                "gpus": gpus,
            }
        )

    @property
    def known(self) -> bool:
        return any(gpu.name == self.product for gpu in KNOWN)


PRODUCTS = [  # (NVML name, brand, MiB, CC); the first five are in the known fleet
    ("NVIDIA H100 80GB HBM3", "NVIDIA", 81559, "9.0"),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA", 40960, "8.0"),
    ("Tesla T4", "Tesla", 15360, "7.5"),
    ("Tesla V100-SXM2-16GB", "Tesla", 16384, "7.0"),
    ("NVIDIA GeForce RTX 4090", "GeForce", 24564, "8.9"),
    ("NVIDIA RTX 6000 Ada Generation", "NvidiaRTX", 49140, "8.9"),  # never seen by gpubadge
    ("Tesla P100-PCIE-16GB", "Tesla", 16280, "6.0"),  # never seen
]
DRIVERS = [
    "470.57.02",
    "525.60.13",
    "535.54.03",
    "535.104.05",
    "550.54.15",
    "560.35.03",
    "570.26",
    "575.57.08",
    "580.65.06",
]


def fleet_of_nodes() -> list[Node]:
    nodes = []
    for p, (product, brand, mib, cc) in enumerate(PRODUCTS):
        for d, driver in enumerate(DRIVERS):
            nodes.append(Node(f"n{p}-{d}", product, brand, mib, cc, driver, shared=(p + d) % 3 == 0))
    nodes.append(Node("arm-h100", "NVIDIA H100 80GB HBM3", "NVIDIA", 81559, "9.0", "550.54.15", arch="arm64"))
    nodes.append(Node("no-gfd", "NVIDIA H100 80GB HBM3", "NVIDIA", 81559, "9.0", "550.54.15", gfd=False))
    return nodes


NODES = fleet_of_nodes()
assert sum(node.known for node in NODES) > 0


def image(
    require: str | None, cuda: str = "12.2", platforms: tuple[str, ...] = ("linux/amd64",)
) -> ImageFacts:
    env = {"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VERSION": cuda}
    if require is not None:
        env["NVIDIA_REQUIRE_CUDA"] = require
    gpu = GpuFacts(required=True, cuda_version=cuda, env=env)
    return ImageFacts.from_report(
        ImageReport(
            reference="example/app:1",
            platforms=[PlatformReport(platform=p, digest="sha256:" + "0" * 64, gpu=gpu) for p in platforms],
        )
    )


def inferred_image(cuda: str, *containers: ContainerArchs) -> ImageFacts:
    """An image that declares nothing, with CUDA found in its layers (and fatbins, when given)."""
    archs = None
    if containers:
        files = [FileArchs(path="/usr/lib/libapp.so", sections=[".nv_fatbin"], containers=list(containers))]
        archs = GpuArchs(files=files)
    gpu = GpuFacts(
        required=False,
        inferred=InferredCuda(cuda=cuda, evidence=["/usr/lib/python3/torch/version.py: cuda = '12.1'"]),
        archs=archs,
    )
    report = ImageReport(
        reference="example/torch:1",
        platforms=[PlatformReport(platform="linux/amd64", digest="sha256:" + "1" * 64, gpu=gpu)],
    )
    return ImageFacts.from_report(report)


def real(version: str) -> str:
    return next(
        i["NVIDIA_REQUIRE_CUDA"]
        for i in REAL
        if i["cuda_version"].startswith(version) and i["platform"] == "linux/amd64"
    )


IMAGES = {
    "cuda-11.8": image(real("11.8"), "11.8"),
    "cuda-12.2": image(real("12.2"), "12.2"),
    "cuda-12.6": image(real("12.6"), "12.6"),
    "cuda-13.0": image(real("13.0"), "13.0"),
    "driver-revision": image("driver>=535.104.05"),
    "driver-window": image("driver>=535.54,driver<=560.35.03 cuda>=12.9"),
    "driver-equal": image("driver=535.104.5"),
    "brand-not-geforce": image("brand!=geforce,cuda>=12.0"),
    "arch-and-brand": image("arch>=8.0,brand=nvidia arch>=7.5,brand=tesla,cuda>=12.2"),
    "malformed-unreached": image("cuda>=12.4 gpu=h100"),
    "malformed-first": image("gpu=h100 cuda>=12.4"),
    "too-long-when-false": image("cuda>=12.0,driver>=" + "0" * 125 + "560"),
    "two-platforms": image(real("12.6"), "12.6", ("linux/amd64", "linux/arm64")),
    "legacy": image(None, "12.4"),
    "nothing": image("cuda>=99"),
    # CUDA found in the layers: the driver floor, and where every fatbin container runs
    "inferred-12.1-sass": inferred_image("12.1", ContainerArchs(sass=("80", "90"))),
    "inferred-12.4-ptx-jit": inferred_image(
        "12.4", ContainerArchs(sass=("90",), ptx=("80",), ptx_isa="8.8"), ContainerArchs(sass=("75", "80"))
    ),
    "inferred-13.0-no-fatbin": inferred_image("13.0"),
    "inferred-12.1-90a": inferred_image("12.1", ContainerArchs(sass=("90a",))),
}
REQUESTS = {
    "one": DeployRequest(gpus=1),
    "memory": DeployRequest(gpus=2, min_gpu_memory="40Gi"),
    "cc-driver": DeployRequest(gpus=1, min_compute_capability="8.0", min_driver="550"),
    "models": DeployRequest(gpus=1, gpu_models=["h100", "t4"]),
}


@pytest.mark.parametrize("request_name", sorted(REQUESTS))
@pytest.mark.parametrize("image_name", sorted(IMAGES))
def test_affinity_selects_what_gpubadge_would(image_name: str, request_name: str) -> None:
    facts, request = IMAGES[image_name], REQUESTS[request_name]
    exported = export(build_constraints(facts, request, KNOWN))
    decision = decide(facts, request, [node.server() for node in NODES if node.gfd])
    eligible = {entry["server"] for entry in decision.eligible}
    notes = " ".join(exported["notes"])
    wrong = []
    for node in NODES:
        selected = node_matches(exported["affinity"], node.labels())
        # A node without GFD labels shows none of the facts gpubadge demands: never selected.
        expected = node.gfd and node.name in eligible
        exact = node.known and not (node.driver.count(".") == 1 and "two parts" in notes)
        if selected != expected and (exact or selected):  # approximations may only leave nodes out
            wrong.append(
                (
                    node.name,
                    node.product,
                    node.driver,
                    node.shared,
                    f"selected={selected}",
                    f"eligible={expected}",
                )
            )
    assert not wrong, (wrong, exported["notes"])
    check_schema_gaps(exported["affinity"])
    validate_pod(exported)


def test_the_comparison_is_not_trivial() -> None:
    """Across the table, some nodes are selected and some are not; approximations are rare."""
    selected = skipped = approximate = 0
    for facts in IMAGES.values():
        exported = export(build_constraints(facts, REQUESTS["one"], KNOWN))
        for node in NODES:
            if node_matches(exported["affinity"], node.labels()):
                selected += 1
            else:
                skipped += 1
        approximate += any("brand" in note for note in exported["notes"])
    assert selected > 100 and skipped > 100 and approximate >= 3


def test_brand_clauses_become_known_products_and_are_named() -> None:
    exported = export(build_constraints(IMAGES["cuda-12.2"], REQUESTS["one"], KNOWN))
    text = json.dumps(exported["affinity"])
    assert "NVIDIA-GeForce-RTX-4090-SHARED" in text and "Tesla-T4" in text
    assert any("no scheduler label carries the GPU brand" in note for note in exported["notes"])
    assert '"In"' not in text.replace('"operator": "In", "values": ["amd64"]', "").replace(
        "nvidia.com/gpu.product", ""
    ) or all(
        not r["key"].startswith(NUMERIC_PREFIXES)
        for t in exported["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        for r in t["matchExpressions"]
        if r["operator"] == "In"
    )
    # Brand clauses that cover every brand are dropped: no product list at all.
    every = image("brand=tesla,cuda>=12.0 brand!=tesla,cuda>=12.0")
    assert "gpu.product" not in json.dumps(
        export(build_constraints(every, REQUESTS["one"], KNOWN))["affinity"]
    )


def test_nothing_eligible_is_one_unmatchable_term_with_a_reason() -> None:
    exported = export(build_constraints(IMAGES["malformed-first"], REQUESTS["one"], KNOWN))
    terms = exported["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert len(terms) == 1 and not any(node_matches(exported["affinity"], n.labels()) for n in NODES)
    assert any("match nothing" in note for note in exported["notes"])
    validate_pod(exported)


def test_resources_carry_the_gpu_count() -> None:
    exported = export(
        build_constraints(IMAGES["cuda-12.2"], DeployRequest(gpus=4, cpus=8, memory="64Gi"), KNOWN)
    )
    assert exported["resources"] == {
        "limits": {"nvidia.com/gpu": 4},
        "requests": {"cpu": "8", "memory": "64Gi"},
    }


# --- schema checks -----------------------------------------------------------------------------


def validate_pod(exported: dict[str, Any]) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "app"},
        "spec": {
            "affinity": exported["affinity"],
            "containers": [{"name": "app", "image": "example/app:1", "resources": exported["resources"]}],
        },
    }
    kubernetes_validate.validate(pod, "1.37.0", strict=True)


def check_schema_gaps(affinity: dict[str, Any]) -> None:
    """What the API server checks and the bundled JSON schema does not."""
    required = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"], "at least one term"
    for term in required["nodeSelectorTerms"]:
        assert set(term) == {"matchExpressions"} and term["matchExpressions"], "no empty term, no matchFields"
        for requirement in term["matchExpressions"]:
            operator, values = requirement["operator"], requirement.get("values", [])
            assert operator in ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
            assert requirement["key"] != "kubernetes.io/hostname"
            if operator in ("Gt", "Lt"):
                assert len(values) == 1 and INTEGER.match(values[0]), requirement
            elif operator in ("In", "NotIn"):
                assert values, requirement
                assert not requirement["key"].startswith(NUMERIC_PREFIXES), (
                    f"In on a numeric label: {requirement}"
                )
            else:
                assert not values, requirement


def test_schema_gap_checks_can_fail() -> None:
    bad = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["1", "2"]}
                        ]
                    }
                ]
            }
        }
    }
    with pytest.raises(AssertionError):
        check_schema_gaps(bad)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_pod({"affinity": {"nodeAffinity": {"bogus": 1}}, "resources": {}})


def test_a_known_product_without_a_brand_passes_brand_clauses_like_the_runtime() -> None:
    """NVML reports no brand: the runtime's brand rule holds without looking, and so does the export."""
    mystery = Node("mystery", "Mystery GPU 24GB", "", 24576, "8.6", "525.60.13")
    fleet = [*KNOWN, KnownGpu("Mystery GPU 24GB", "", 24576, "8.6", frozenset({"amd64"}))]
    for name in ("cuda-12.2", "brand-not-geforce", "arch-and-brand"):
        facts = IMAGES[name]
        exported = export(build_constraints(facts, REQUESTS["one"], fleet))
        eligible = {e["server"] for e in decide(facts, REQUESTS["one"], [mystery.server()]).eligible}
        assert node_matches(exported["affinity"], mystery.labels()) == ("mystery" in eligible), name
