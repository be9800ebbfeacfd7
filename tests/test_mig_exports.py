"""MIG in the exports, checked the way each scheduler would use them, against gpubadge's own decision.

Kubernetes: every server of the mixed MIG fleet (fixtures/fleet_mig.yaml) and of the whole-GPU
fleet becomes a node, labelled as NVIDIA's GPU Feature Discovery labels it under the device
plugin's `mixed` and `single` MIG strategies (k8s-device-plugin internal/lm: the full-GPU labels
for every GPU, `nvidia.com/mig.strategy`, per profile `nvidia.com/mig-<profile>.{count,product,
memory,multiprocessors,slices.gi,...}` under mixed, the same under `nvidia.com/gpu.` under single,
and `-MIG-INVALID` when a single-strategy node has several profiles or a mix with whole GPUs),
with the resources the plugin advertises. A node is selected when the exported affinity matches
(tests/test_export_kubernetes.py's matcher) and its allocatable resources cover the request: it
must never be a node gpubadge finds ineligible, and for a named profile it must be every eligible
one. Pods validate with kubernetes-validate. DRA: the claim's CEL runs in cel-python over the MIG
devices the NVIDIA DRA driver publishes. Nomad: the HCL parses and its constraints run over the
devices nomad-device-nvidia fingerprints (MIG devices as GPUs named `<product> MIG <profile>`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import celpy
import hcl2
import kubernetes_validate
import pytest
import yaml

from gpubadge.constraints import render
from placement.admission import Pod, review_pod
from placement.decide import decide
from placement.exports import export_constraints
from placement.exports.core import build_constraints, known_gpus
from placement.exports.kubernetes import export as kubernetes_export
from placement.exports.kubernetes import gfd_mig_product, gfd_product
from placement.exports.nomad import NOT_A_MIG_DEVICE
from placement.image_facts import ImageFacts
from placement.index import FleetIndex
from placement.inventory import Server, parse_inventory
from placement.mig import kubernetes_name, profile_from_resource, resource_name
from placement.request import DeployRequest
from scanner.models import GpuFacts, ImageReport, PlatformReport
from tests.test_export_kubernetes import check_schema_gaps, node_matches
from tests.test_exports import _compare_to, _holds, _quantity, _semver, _version, unquote

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FLEET = parse_inventory((FIXTURES / "fleet_mig.yaml").read_text()).servers
KNOWN = known_gpus(FleetIndex.build(FLEET))


def image(requirement: str, cuda: str = "12.2") -> ImageFacts:
    env = {"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VERSION": cuda, "NVIDIA_REQUIRE_CUDA": requirement}
    platform = PlatformReport(
        platform="linux/amd64",
        digest="sha256:" + "5" * 64,
        gpu=GpuFacts(required=True, cuda_version=cuda, env=env),
    )
    return ImageFacts.from_report(ImageReport(reference="example/mig:1", platforms=[platform]))


IMAGES = {
    "cuda-12.2": image("cuda>=12.2"),
    "hopper": image("arch>=9.0,cuda>=12.0"),
    "cuda-13": image("cuda>=13.0", "13.0"),
    "brand": image("brand=nvidia,cuda>=12.0 brand=unknown,cuda>=12.0"),
}
PROFILES = sorted({d.profile for s in FLEET for g in s.gpus for d in g.mig_devices})
REQUESTS = {
    "whole": DeployRequest(gpus=1),
    "any-mig": DeployRequest(mig_devices=1),
    "two-mig": DeployRequest(mig_devices=2),
    "memory-30Gi": DeployRequest(mig_devices=1, min_gpu_memory="30Gi"),
    "h100-model": DeployRequest(mig_devices=1, gpu_models=["h100"]),
    **{f"profile-{p}": DeployRequest(mig_profiles=[p]) for p in PROFILES},
}
EXACT = {"whole", "any-mig", "two-mig", *(f"profile-{p}" for p in PROFILES)}  # no approximation allowed


def eligible(facts: ImageFacts, request: DeployRequest) -> set[str]:
    return {entry["server"] for entry in decide(facts, request, FLEET).eligible}


# --- GFD and the device plugin, per strategy ----------------------------------------------------


def gfd_node(server: Server, strategy: str) -> tuple[dict[str, str], dict[str, int]]:
    """(labels, allocatable) of a node running GFD and the device plugin with this MIG strategy."""
    first = server.gpus[0]
    driver = (server.driver_version or "").split(".")
    cuda = (server.cuda_driver_version or "").split(".")
    major, minor = first.compute_capability.split(".")
    labels = {
        "kubernetes.io/arch": server.arch,
        "nvidia.com/cuda.driver-version.major": driver[0],
        "nvidia.com/cuda.driver-version.minor": driver[1],
        "nvidia.com/cuda.driver-version.revision": driver[2] if len(driver) > 2 else "",
        "nvidia.com/cuda.runtime-version.major": cuda[0],
        "nvidia.com/cuda.runtime-version.minor": cuda[1],
        # the full-GPU labeller covers every GPU, in MIG mode or not
        "nvidia.com/gpu.product": gfd_product(first.name),
        "nvidia.com/gpu.count": str(len(server.gpus)),
        "nvidia.com/gpu.memory": str(first.memory_mib),
        "nvidia.com/gpu.compute.major": major,
        "nvidia.com/gpu.compute.minor": minor,
        "nvidia.com/mig.strategy": strategy,
    }
    devices = [(gpu, device) for gpu in server.gpus for device in gpu.mig_devices]
    whole = [gpu for gpu in server.gpus if not gpu.mig]
    allocatable: dict[str, int] = {}
    if strategy == "mixed":
        allocatable["nvidia.com/gpu"] = len(whole)
        for profile, count in Counter(device.profile for _, device in devices).items():
            gpu, device = next((g, d) for g, d in devices if d.profile == profile)
            prefix = f"{resource_name(profile)}."
            labels |= {
                prefix + "count": str(count),
                prefix + "product": gfd_mig_product(gpu.name, profile),
                prefix + "memory": str(device.memory_mib),
                prefix + "multiprocessors": str(device.multiprocessors),
                prefix + "slices.gi": profile.split("g.")[0][-1],
            }
            allocatable[resource_name(profile)] = count
        return labels, allocatable
    if not devices and not any(gpu.mig for gpu in server.gpus):
        allocatable["nvidia.com/gpu"] = len(whole)  # no MIG: as the `none` strategy
        return labels, allocatable
    profiles = {device.profile for _, device in devices}
    if len(profiles) != 1 or whole or any(gpu.mig and not gpu.mig_devices for gpu in server.gpus):
        labels |= {
            "nvidia.com/gpu.product": f"{gfd_product(first.name)}-MIG-INVALID",
            "nvidia.com/gpu.count": "0",
            "nvidia.com/gpu.memory": "0",
        }
        allocatable["nvidia.com/gpu"] = 0
        return labels, allocatable
    (profile,) = profiles
    gpu, device = devices[0]
    labels |= {
        "nvidia.com/gpu.product": gfd_mig_product(gpu.name, profile),
        "nvidia.com/gpu.count": str(len(devices)),
        "nvidia.com/gpu.memory": str(device.memory_mib),
        "nvidia.com/gpu.multiprocessors": str(device.multiprocessors),
        "nvidia.com/gpu.slices.gi": profile.split("g.")[0][-1],
    }
    allocatable["nvidia.com/gpu"] = len(devices)
    return labels, allocatable


def fits(resources: dict[str, Any], allocatable: dict[str, int]) -> bool:
    return all(allocatable.get(name, 0) >= int(count) for name, count in resources.get("limits", {}).items())


def validate(affinity: dict[str, Any], resources: dict[str, Any]) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "app"},
        "spec": {
            "affinity": affinity,
            "containers": [{"name": "app", "image": "app:1", "resources": resources}],
        },
    }
    kubernetes_validate.validate(pod, "1.37.0", strict=True)
    check_schema_gaps(affinity)


@pytest.mark.parametrize("request_name", sorted(REQUESTS))
@pytest.mark.parametrize("image_name", sorted(IMAGES))
def test_kubernetes_both_strategies_select_what_gpubadge_would(image_name: str, request_name: str) -> None:
    facts, request = IMAGES[image_name], REQUESTS[request_name]
    body = kubernetes_export(build_constraints(facts, request, KNOWN))
    wanted = eligible(facts, request)
    forms = {"mixed": (body["affinity"], body["resources"])}
    if request.slices_needed:
        assert body["mig_strategy"] == "mixed"
        single = body["single_strategy"]
        forms["single"] = (single["affinity"], single["resources"])
        assert single["resources"].get("limits", {"nvidia.com/gpu": 1}) == {
            "nvidia.com/gpu": request.slices_needed
        }
    else:
        assert "single_strategy" not in body
        forms["single"] = forms["mixed"]  # one answer for whole GPUs, whatever the strategy
    for strategy, (affinity, resources) in forms.items():
        validate(affinity, resources)
        selected = set()
        for server in FLEET:
            labels, allocatable = gfd_node(server, strategy)
            if node_matches(affinity, labels) and fits(resources, allocatable):
                selected.add(server.name)
        assert selected <= wanted, (strategy, selected - wanted, body["notes"])
        # Exact where nothing is approximated; under single, only nodes with one profile can serve.
        if request_name in EXACT and strategy == "mixed":
            assert selected == wanted or (request.slices_needed and not request.mig_profiles), (
                selected,
                wanted,
            )
        if request_name in EXACT and strategy == "single":
            # A single-strategy node serves MIG devices when all its GPUs share one profile (else
            # GFD labels it -MIG-INVALID and the plugin offers nothing), and whole GPUs when none
            # of its GPUs is in MIG mode.
            single_capable = {
                s.name
                for s in FLEET
                if gfd_node(s, "single")[1].get("nvidia.com/gpu", 0) and any(g.mig for g in s.gpus)
            }
            no_mig = {s.name for s in FLEET if not any(g.mig for g in s.gpus)}
            expected = wanted & (single_capable if request.slices_needed else no_mig)
            assert selected == expected, (selected, expected)


def test_the_comparison_is_not_trivial() -> None:
    """Both strategies select some MIG nodes and leave others out; whole GPUs never land on MIG."""
    body = kubernetes_export(build_constraints(IMAGES["cuda-12.2"], REQUESTS["profile-1g.10gb"], KNOWN))
    assert body["resources"] == {"limits": {"nvidia.com/mig-1g.10gb": 1}}
    picked = {
        s.name
        for s in FLEET
        if node_matches(body["affinity"], gfd_node(s, "mixed")[0])
        and fits(body["resources"], gfd_node(s, "mixed")[1])
    }
    assert picked == {"a100-80-mig", "h100-half-mig"}
    single = body["single_strategy"]
    products = next(
        r["values"]
        for t in single["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        for r in t["matchExpressions"]
        if r["key"] == "nvidia.com/gpu.product"
    )
    assert products == ["NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"]
    whole = kubernetes_export(build_constraints(IMAGES["cuda-12.2"], REQUESTS["whole"], KNOWN))
    h200_single = gfd_node(next(s for s in FLEET if s.name == "h200-mig"), "single")
    assert h200_single[1] == {"nvidia.com/gpu": 7}  # seven 1g.18gb devices offered as nvidia.com/gpu
    assert not node_matches(whole["affinity"], h200_single[0])


def test_a_minimum_memory_picks_one_mixed_resource_and_names_the_others() -> None:
    body = kubernetes_export(build_constraints(IMAGES["cuda-12.2"], REQUESTS["memory-30Gi"], KNOWN))
    assert body["resources"] == {"limits": {"nvidia.com/mig-3g.40gb": 1}}
    assert any("nvidia.com/mig-4g.40gb would also do" in note for note in body["notes"])
    single = body["single_strategy"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    memory = {
        r["values"][0]
        for t in single["nodeSelectorTerms"]
        for r in t["matchExpressions"]
        if r["key"] == "nvidia.com/gpu.memory"
    }
    assert memory == {str(int(30 * 1024 * 0.92))}  # MiB, Gt, after placement's 8% tolerance


def test_a_profile_no_known_gpu_has_is_still_asked_for() -> None:
    body = kubernetes_export(
        build_constraints(IMAGES["cuda-12.2"], DeployRequest(mig_profiles=["1g.24gb+me.all"]), KNOWN)
    )
    assert body["resources"] == {"limits": {"nvidia.com/mig-1g.24gb.me.all": 1}}
    assert kubernetes_name("1g.10gb+me") == "1g.10gb.me"
    assert any("no MIG device (1g.24gb+me.all)" in note for note in body["notes"])
    validate(body["affinity"], body["resources"])


# --- DRA --------------------------------------------------------------------------------------


def dra_mig_devices(server: Server) -> list[Any]:
    """The `mig.nvidia.com` devices the NVIDIA DRA driver publishes for a server's MIG devices."""
    found = []
    for gpu in server.gpus:
        for device in gpu.mig_devices:
            found.append(
                celpy.json_to_cel(
                    {
                        "attributes": {
                            "gpu.nvidia.com": {
                                "type": "mig",
                                "uuid": device.uuid,
                                "parentUUID": gpu.uuid,
                                "profile": device.profile,
                                "productName": gpu.name,
                                "brand": gpu.brand,
                                "driverVersion": _version(server.driver_version or "0"),
                                "cudaDriverVersion": _version(server.cuda_driver_version or "0"),
                                "cudaComputeCapability": _version(gpu.compute_capability),
                            }
                        },
                        "capacity": {
                            "gpu.nvidia.com": {
                                "memory": device.memory_mib * 1024**2,
                                "multiprocessors": device.multiprocessors,
                            }
                        },
                    }
                )
            )
    return found


@pytest.mark.parametrize("request_name", sorted(name for name in REQUESTS if name != "whole"))
@pytest.mark.parametrize("image_name", sorted(IMAGES))
def test_dra_claims_mig_devices_gpubadge_would_give(image_name: str, request_name: str) -> None:
    facts, request = IMAGES[image_name], REQUESTS[request_name]
    body = export_constraints(facts, request, KNOWN, "dra")
    template = body["resourceClaimTemplate"]
    kubernetes_validate.validate(template, "1.37.0", strict=True)
    exactly = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["deviceClassName"] == "mig.nvidia.com" and exactly["count"] == request.slices_needed
    expression = exactly["selectors"][0]["cel"]["expression"]
    environment = celpy.Environment()
    program = environment.program(
        environment.compile(expression),
        functions={"semver": _semver, "quantity": _quantity, "compareTo": _compare_to},
    )
    wanted = eligible(facts, request)
    for server in FLEET:
        matching = sum(bool(program.evaluate({"device": device})) for device in dra_mig_devices(server))
        selected = matching >= exactly["count"] and node_matches(
            body["affinity"], {"kubernetes.io/arch": server.arch}
        )
        assert selected == (server.name in wanted), (server.name, expression)


# --- Nomad ------------------------------------------------------------------------------------


def nomad_devices(server: Server) -> list[dict[str, str]]:
    """What nomad-device-nvidia fingerprints: whole GPUs, and each MIG device as a GPU of its own
    (named as NVML names it, with its own memory); GPUs in MIG mode themselves are skipped."""
    devices = []
    for gpu in server.gpus:
        if not gpu.mig:
            devices.append({"model": gpu.name, "memory": str(gpu.memory_mib)})
        for device in gpu.mig_devices:
            devices.append({"model": f"{gpu.name} MIG {device.profile}", "memory": str(device.memory_mib)})
    return devices


@pytest.mark.parametrize("request_name", sorted(REQUESTS))
@pytest.mark.parametrize("image_name", sorted(IMAGES))
def test_nomad_selects_mig_devices_by_name_and_never_an_ineligible_node(
    image_name: str, request_name: str
) -> None:
    facts, request = IMAGES[image_name], REQUESTS[request_name]
    body = export_constraints(facts, request, KNOWN, "nomad")
    parsed = unquote(hcl2.loads(body["hcl"]))
    (device_block,) = parsed["device"]
    device = device_block["nvidia/gpu"]
    wanted = eligible(facts, request)
    for server in FLEET:
        # All `count` devices come from one device group: devices of the same name, on one node.
        groups: Counter[str] = Counter()
        for found in nomad_devices(server):
            values = {
                "${attr.cpu.arch}": server.arch,
                "${device.model}": found["model"],
                "${device.attr.memory}": found["memory"],
                "${device.attr.driver_version}": server.driver_version or "",
            }
            if all(_holds(c, values) for c in parsed.get("constraint", [])) and all(
                _holds(c, values) for c in device.get("constraint", [])
            ):
                groups[found["model"]] += 1
        selected = any(count >= int(device["count"]) for count in groups.values())
        assert not selected or server.name in wanted, (server.name, body["hcl"])
    assert NOT_A_MIG_DEVICE in body["hcl"] or request.slices_needed or "${device.model}" in body["hcl"]


def test_two_mig_devices_note_that_a_cuda_process_sees_one() -> None:
    for format in ("kubernetes", "dra", "nomad"):
        two = export_constraints(IMAGES["cuda-12.2"], REQUESTS["two-mig"], KNOWN, format)
        assert any(note.startswith("the image needs a process per MIG device") for note in two["notes"]), (
            format
        )
        one = export_constraints(IMAGES["cuda-12.2"], REQUESTS["profile-1g.10gb"], KNOWN, format)
        assert not any("enumerates one MIG device" in note for note in one["notes"]), format


def test_akash_says_it_has_no_mig() -> None:
    body = export_constraints(IMAGES["cuda-12.2"], REQUESTS["profile-1g.10gb"], KNOWN, "akash")
    assert body["sdl"] is None and any("Akash has no MIG" in note for note in body["notes"])
    whole = export_constraints(IMAGES["cuda-12.2"], REQUESTS["whole"], KNOWN, "akash")
    assert whole["sdl"] is not None


def test_admission_counts_a_mig_device_as_a_gpu_request() -> None:
    """A pod asking for nvidia.com/mig-1g.10gb (mixed strategy) has its GPU: not denied, not patched
    with an nvidia.com/gpu it would then also have to get. A container given two MIG devices is
    warned that one CUDA process sees one of them."""
    report = ImageReport(
        reference="example/mig:1",
        gpu_required=True,
        platforms=[
            PlatformReport(
                platform="linux/amd64",
                digest="sha256:" + "5" * 64,
                gpu=GpuFacts(required=True, cuda_version="12.2", env={"NVIDIA_VISIBLE_DEVICES": "all"}),
            )
        ],
    )

    def pod(resources: dict[str, Any]) -> Pod:
        container = {"name": "app", "image": "example/mig:1", "resources": resources}
        return Pod.model_validate({"spec": {"containers": [container]}})

    sliced = pod({"limits": {"nvidia.com/mig-1g.10gb": "1"}})
    review = review_pod(sliced, {"example/mig:1": report})
    assert review.allowed and not review.denials
    (patched,) = review_pod(sliced, {"example/mig:1": report}, mutate=True).patch  # affinity only
    terms = patched["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert patched["path"] == "/spec/affinity" and terms
    assert all(
        {"key": "nvidia.com/mig.strategy", "operator": "In", "values": ["mixed"]} in t["matchExpressions"]
        for t in terms
    )
    assert profile_from_resource("nvidia.com/mig-1g.10gb.me") == "1g.10gb+me"
    assert profile_from_resource("nvidia.com/mig-1c.3g.40gb") == "1c.3g.40gb"
    assert profile_from_resource("nvidia.com/gpu") is None
    bare = review_pod(pod({}), {"example/mig:1": report})
    assert not bare.allowed and "nvidia.com/mig-<profile>" in bare.message
    assert not review.warnings
    two = review_pod(
        pod({"limits": {"nvidia.com/mig-1g.10gb": "1", "nvidia.com/mig-2g.20gb": "1"}}),
        {"example/mig:1": report},
    )
    (spread,) = two.warnings
    assert two.allowed and "on 2 MIG devices: a CUDA process enumerates one MIG device" in spread
    whole = review_pod(pod({"limits": {"nvidia.com/gpu": "2"}}), {"example/mig:1": report})
    assert whole.allowed and not whole.warnings


def test_the_cli_prints_both_strategies_as_yaml_documents() -> None:
    body = export_constraints(IMAGES["cuda-12.2"], REQUESTS["profile-1g.10gb"], KNOWN, "kubernetes")
    text = render(body)
    comments, mixed, single = text.split("# mig.strategy: ")
    assert comments.startswith("# ") and mixed.startswith("mixed\n") and single.startswith("single\n")
    documents = list(yaml.safe_load_all(text))
    assert [d["resources"]["limits"] for d in documents] == [
        {"nvidia.com/mig-1g.10gb": 1},
        {"nvidia.com/gpu": 1},
    ]
