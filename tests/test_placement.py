"""Placement: GPU aliases, brands, memory slack, request forms and the ranked decision."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from pydantic import ValidationError

from fixtures import catalog
from fixtures.registry import LocalRegistry, free_port
from placement.answer import AnswerOptions, EligibilityAnswer, answer
from placement.decide import decide, kept_decision
from placement.decision import Decision
from placement.gpus import matches_model, memory_satisfies, runtime_brands
from placement.image_facts import ImageFacts
from placement.index import FleetIndex
from placement.inventory import Server, parse_bytes, parse_inventory
from placement.query import Query
from placement.request import DeployRequest
from scanner.models import GpuFacts, ImageReport, LibcVerdict, PlatformReport
from tests.conftest import Pusher
from web.app import create_app
from web.fleet.live_fleet import FLEET_INDEX, FleetIndexCache
from web.settings import ServiceSettings
from web.state import SERVICES

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FLEET = parse_inventory((FIXTURES / "fleet.yaml").read_text()).servers
IMAGES = json.loads((FIXTURES / "cuda_require_strings.json").read_text())["images"]


def cuda_image(
    version: str, platforms: tuple[str, ...] = ("linux/amd64",), libc: str = "glibc"
) -> ImageFacts:
    return ImageFacts.from_report(cuda_report(version, platforms, libc))


def cuda_report(
    version: str, platforms: tuple[str, ...] = ("linux/amd64",), libc: str = "glibc"
) -> ImageReport:
    reports = []
    for platform in platforms:
        require = next(
            i["NVIDIA_REQUIRE_CUDA"]
            for i in IMAGES
            if i["cuda_version"].startswith(version) and i["platform"] == platform
        )
        env = {"NVIDIA_REQUIRE_CUDA": require, "CUDA_VERSION": version, "NVIDIA_VISIBLE_DEVICES": "all"}
        gpu = GpuFacts(required=True, cuda_version=version[:4], requirements=[require], env=env)
        reports.append(
            PlatformReport(
                platform=platform, digest="sha256:" + "0" * 64, gpu=gpu, libc=LibcVerdict(flavour=libc)
            )
        )
    return ImageReport(reference=f"nvidia/cuda:{version}", platforms=reports)


def cpu_image(*platforms: str, libc: str = "glibc") -> ImageFacts:
    reports = [
        PlatformReport(platform=p, digest="sha256:" + "1" * 64, libc=LibcVerdict(flavour=libc))
        for p in platforms
    ]
    return ImageFacts.from_report(ImageReport(reference="alpine", platforms=reports))


def reasons_of(decision: Decision, server: str) -> list[str]:
    return next(item["reasons"] for item in decision.ineligible if item["server"] == server)


def eligible_names(decision: Decision) -> list[str]:
    return [item["server"] for item in decision.eligible]


# --- GPU names, brands, memory ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("nvml_name", "wanted", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "h100", True),
        ("NVIDIA H100 80GB HBM3", "H100-80GB", True),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", True),
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3", True),  # GFD product label
        ("NVIDIA H100 PCIe", "h100", True),
        ("NVIDIA H100 80GB HBM3", "h200", False),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb", True),
        ("NVIDIA A100 80GB PCIe", "a100-80gb", True),
        ("NVIDIA A100-SXM4-40GB", "a100-80gb", False),
        ("NVIDIA A100-SXM4-40GB", "a100", True),
        ("NVIDIA A100-SXM4-40GB", "a10", False),
        ("NVIDIA A10G", "a10", False),
        ("Tesla T4", "t4", True),
        ("NVIDIA T4", "t4", True),
        ("NVIDIA L4", "l4", True),
        ("NVIDIA L40S", "l4", False),
        ("NVIDIA GeForce RTX 4090", "rtx-4090", True),
        ("NVIDIA GH200 480GB", "gh200", True),  # not in the table: derived family
    ],
)
def test_model_aliases(nvml_name: str, wanted: str, expected: bool) -> None:
    assert matches_model(nvml_name, wanted) is expected


@pytest.mark.parametrize(
    ("reported_mib", "wanted", "expected"),
    [
        (40960, "40Gi", True),  # A100-40GB on driver 570
        (39538, "40Gi", True),  # same card as GFD's README shows it
        (81559, "80Gi", True),  # H100 80GB
        (81559, "80GB", True),
        (15360, "16Gi", True),  # T4
        (46068, "48Gi", True),  # L40S
        (32768, "40Gi", False),
        (40960, "48Gi", False),
        (24564, "40Gi", False),
    ],
)
def test_memory_tolerance(reported_mib: int, wanted: str, expected: bool) -> None:
    assert memory_satisfies(reported_mib, parse_bytes(wanted)) is expected


@pytest.mark.parametrize(
    ("brand", "expected"),
    [
        ("Tesla", ("Tesla",)),
        ("GeForce", ("GeForce",)),
        ("NVIDIA", ("Nvidia", "Unknown")),  # data-center GPUs: current and pre-2022 libnvidia-container
        ("NVIDIA RTX", ("NvidiaRTX", "Unknown")),
        ("NVIDIA Virtual Compute Server", ("VCS", "Unknown")),
        ("NvidiaVApps", ("VApps", "Unknown")),
        ("14", ("Nvidia", "Unknown")),
        ("19", ("Unknown",)),  # NVML's NPU brand: libnvidia-container has no name for it
        ("NVML_BRAND_NVIDIA_VGAMEDEV", ("Unknown",)),
        ("NvidiaDLA", ("Unknown",)),
        ("", ()),
    ],
)
def test_runtime_brands(brand: str, expected: tuple[str, ...]) -> None:
    assert runtime_brands(brand) == expected


# --- request forms ---------------------------------------------------------------------------


def test_native_request_parses_units() -> None:
    request = DeployRequest.parse_any(
        {"gpus": 2, "gpu_models": "h100", "min_gpu_memory": "40Gi", "memory": "64Gi", "min_driver": "535"}
    )
    assert request.gpu_models == ["h100"]
    assert request.min_gpu_memory == 40 * 1024**3 and request.memory == 64 * 1024**3


def test_akash_sdl_form() -> None:
    sdl = {
        "cpu": {"units": "500m"},
        "memory": {"size": "16Gi"},
        "gpu": {
            "units": 2,
            "attributes": {
                "vendor": {"nvidia": [{"model": "a100", "ram": "80Gi"}, {"model": "h100", "ram": "80Gi"}]}
            },
        },
    }
    request = DeployRequest.parse_any({"resources": sdl})
    assert request.gpus == 2 and request.gpu_models == ["a100", "h100"]
    assert request.min_gpu_memory == 80 * 1024**3 and request.cpus == 0.5 and request.memory == 16 * 1024**3
    mixed = DeployRequest.parse_any(
        {
            "gpu": {
                "units": 1,
                "attributes": {
                    "vendor": {"nvidia": [{"model": "a100", "ram": "40Gi"}, {"model": "h100", "ram": "80Gi"}]}
                },
            }
        }
    )
    assert mixed.gpu_models == ["a100-40gb", "h100-80gb"] and mixed.min_gpu_memory is None
    anything = DeployRequest.parse_any({"gpu": {"units": 1, "attributes": {"vendor": {"nvidia": None}}}})
    assert anything.gpus == 1 and anything.gpu_models == []


def test_zenml_form() -> None:
    request = DeployRequest.parse_any({"gpu_count": 1, "cpu_count": 4, "memory": "32GB"})
    assert (request.gpus, request.cpus, request.memory) == (1, 4, 32 * 1000**3)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"gpus": -1}, "gpus"),
        ({"gpu": 2}, "gpu"),  # not an Akash block: unknown field in our form
        ({"gpus": 1, "min_gpu_memory": "40 bananas"}, "unknown unit"),
        ({"min_compute_capability": "eight"}, "not a version"),
        ({"gpu": {"units": 1}}, "requires gpu.attributes"),
        ({"gpu": {"units": 1, "attributes": {"vendor": {"amd": []}}}}, "only vendor 'nvidia'"),
        ({"gpu_count": 1, "memory": "32G"}, "ZenML's memory format"),
    ],
)
def test_invalid_requests_say_what_is_wrong(data: dict[str, object], fragment: str) -> None:
    with pytest.raises((ValidationError, ValueError)) as info:
        DeployRequest.parse_any(data)
    assert fragment in str(info.value)


# --- decisions on the sample fleet -----------------------------------------------------------


def test_cuda_12_2_image_on_the_sample_fleet() -> None:
    decision = decide(cuda_image("12.2.2"), DeployRequest(gpus=1), FLEET)
    eligible = eligible_names(decision)
    # t4-legacy is on branch 470 (escape term); a100-80-a on 525; v100-old/rtx4090 have CUDA 12.4 drivers.
    assert set(eligible) == {
        "h100-a",
        "a100-40-a",
        "a100-80-a",
        "t4-legacy",
        "v100-old",
        "rtx4090-lab",
        "l4-edge",
    }
    assert eligible[0] == "l4-edge"  # a single free GPU: no spare left after assignment
    first = decision.eligible[0]
    assert first["gpus"] == ["GPU-l4-0000-0000-0000-000000000000"] and first["platform"] == "linux/amd64"
    assert reasons_of(decision, "gh200-arm") == [
        "CPU architecture arm64 is not among the image's platforms (linux/amd64)"
    ]
    assert reasons_of(decision, "cpu-1") == ["no NVIDIA driver"]  # not also "has 0 free of 0"
    h100 = next(item for item in decision.eligible if item["server"] == "h100-a")
    assert h100["gpus"] == ["GPU-h100a-0002-0000-0000-000000000000"]  # 0 and 1 are in use


def test_multi_arch_image_uses_the_matching_platform() -> None:
    decision = decide(cuda_image("12.2.2", ("linux/amd64", "linux/arm64")), DeployRequest(), FLEET)
    gh200 = next(item for item in decision.eligible if item["server"] == "gh200-arm")
    assert gh200["platform"] == "linux/arm64"


def test_cuda_13_needs_turing_or_newer_and_escape_branches() -> None:
    decision = decide(cuda_image("13.0.2"), DeployRequest(gpus=1), FLEET)
    assert any("compute capability 7.5 or newer" in r for r in reasons_of(decision, "v100-old"))
    assert "l4-edge" in eligible_names(decision)  # driver CUDA 13.0
    assert "a100-40-a" in eligible_names(decision)  # branch 535 is an escape term
    t4 = reasons_of(decision, "t4-legacy")
    assert any("driver CUDA 11.4 < cuda>=13.0" in r for r in t4)
    assert any("is not in branch 535, 550, 565, 570, 575" in r for r in t4)
    geforce = reasons_of(decision, "rtx4090-lab")
    assert any("brand GeForce is not one of" in r for r in geforce)


def test_gpu_count_and_best_fit_ranking() -> None:
    decision = decide(cuda_image("12.2.2"), DeployRequest(gpus=4), FLEET)
    eligible = eligible_names(decision)
    assert eligible[:3] == ["a100-40-a", "a100-80-a", "v100-old"] or eligible[:2] == ["v100-old", "a100-40-a"]
    assert all(len(item["gpus"]) == 4 for item in decision.eligible)
    assert eligible[-1] == "h100-a"  # 6 free: 2 spare after assignment
    assert reasons_of(decision, "t4-legacy")[0] == "needs 4 free GPU(s), has 2 free of 2"
    scores = [item["score"] for item in decision.eligible]
    assert scores == sorted(scores, reverse=True)


def test_model_preference_order_and_memory() -> None:
    request = DeployRequest(
        gpus=1, gpu_models=["a100", "h100"], gpu_model_order="ordered", min_gpu_memory="40Gi"
    )
    decision = decide(cuda_image("12.2.2"), request, FLEET)
    assert eligible_names(decision) == ["a100-40-a", "a100-80-a", "h100-a"]
    t4 = reasons_of(decision, "t4-legacy")
    # Why its GPUs do not suit comes first; the count that follows from it last; one unit per quantity.
    assert t4 == [
        "2 free Tesla T4: model Tesla T4 is not a100 or h100",
        "2 free Tesla T4: GPU memory 15 GiB < requested 40 GiB",
        "needs 1 suitable free GPU(s), has 0 (2 free of 2)",
    ]
    reverse = decide(cuda_image("12.2.2"), request.model_copy(update={"gpu_models": ["h100", "a100"]}), FLEET)
    assert eligible_names(reverse)[0] == "h100-a"
    big = decide(cuda_image("12.2.2"), DeployRequest(gpus=1, gpu_models=["a100-80gb"]), FLEET)
    assert eligible_names(big) == ["a100-80-a"]


def test_every_failed_condition_is_reported() -> None:
    request = DeployRequest(
        gpus=1,
        cpus=64,
        memory="256Gi",
        labels={"zone": "us-east"},
        min_compute_capability="8.0",
        min_driver="535",
    )
    reasons = reasons_of(decide(cuda_image("12.2.2"), request, FLEET), "t4-legacy")
    assert "has 32 CPUs, request needs 64" in reasons
    assert "has 128 GiB memory, request needs 256 GiB" in reasons
    assert "driver 470.57.02 < requested 535" in reasons
    assert "2 free Tesla T4: compute capability 7.5 < requested 8.0" in reasons
    edge = reasons_of(decide(cuda_image("12.2.2"), request, FLEET), "l4-edge")
    assert "label zone=us-east missing (server has zone=edge)" in edge


def test_musl_gpu_image_needs_musl_support() -> None:
    decision = decide(cuda_image("12.2.2", libc="musl"), DeployRequest(), FLEET)
    assert eligible_names(decision) == ["rtx4090-lab"]
    assert "image uses musl libc with GPUs; server has no musl GPU support" in reasons_of(decision, "h100-a")


def test_cpu_image_goes_anywhere_matching_arch() -> None:
    decision = decide(cpu_image("linux/arm64"), DeployRequest(cpus=8), FLEET)
    assert set(eligible_names(decision)) == {"gh200-arm", "cpu-arm"}
    assert all(item["gpus"] == [] for item in decision.eligible)
    with_gpu = decide(cpu_image("linux/amd64"), DeployRequest(gpus=1), FLEET)
    assert "cpu-1" not in eligible_names(with_gpu) and "l4-edge" in eligible_names(with_gpu)


def test_malformed_clause_fails_only_where_the_runtime_reaches_it() -> None:
    """`cuda>=12.2 gpu=h100`: hosts whose CUDA satisfies the first term never read `gpu=h100`."""
    env = {"NVIDIA_REQUIRE_CUDA": "cuda>=12.2 gpu=h100", "NVIDIA_VISIBLE_DEVICES": "all"}
    report = ImageReport(
        reference="bad",
        platforms=[
            PlatformReport(
                platform="linux/amd64", digest="sha256:" + "2" * 64, gpu=GpuFacts(required=True, env=env)
            )
        ],
    )
    decision = decide(ImageFacts.from_report(report), DeployRequest(), FLEET)
    assert "h100-a" in eligible_names(decision)  # driver CUDA 12.8
    assert "a100-40-a" in eligible_names(decision)  # driver CUDA 12.2
    assert any("unknown key 'gpu'" in r for r in reasons_of(decision, "a100-80-a"))  # 12.0 reaches it
    assert any("unknown key 'gpu'" in r for r in reasons_of(decision, "t4-legacy"))
    (warning,) = decision.warnings
    assert "NVIDIA_REQUIRE_CUDA" in warning and "'gpu=h100'" in warning
    unreached = env | {"NVIDIA_REQUIRE_CUDA": "cuda>=99,gpu=h100"}  # the AND-term stops at cuda>=99
    report.platforms[0].gpu = GpuFacts(required=True, env=unreached)
    failing = decide(ImageFacts.from_report(report), DeployRequest(), FLEET)
    assert failing.eligible == [] and failing.warnings
    assert not any("unknown key" in r for item in failing.ineligible for r in item["reasons"])


def test_legacy_brand_naming_is_considered() -> None:
    server = Server.model_validate(
        {
            "name": "custom",
            "driver_version": "535.104.05",
            "cuda_driver_version": "12.2",
            "gpus": [
                {
                    "index": 0,
                    "uuid": "GPU-x",
                    "name": "NVIDIA L4",
                    "brand": "NVIDIA",
                    "compute_capability": "8.9",
                }
            ],
        }
    )
    env = {"NVIDIA_REQUIRE_BRAND": "brand=nvidia", "NVIDIA_VISIBLE_DEVICES": "all"}
    report = ImageReport(
        reference="b",
        platforms=[
            PlatformReport(
                platform="linux/amd64", digest="sha256:" + "3" * 64, gpu=GpuFacts(required=True, env=env)
            )
        ],
    )
    reasons = reasons_of(decide(ImageFacts.from_report(report), DeployRequest(), [server]), "custom")
    assert any("older libnvidia-container reports brand Unknown" in r for r in reasons)


def test_decision_json_shape_and_prepared_index() -> None:
    index = FleetIndex.build(FLEET)
    decision = decide(cuda_image("12.2.2"), DeployRequest(gpus=2), index)
    data = json.loads(json.dumps(answer(decision, AnswerOptions(explain="all"))))
    EligibilityAnswer.model_validate(data)
    assert {"server", "gpus", "score"} <= set(data["eligible"][0])
    assert set(data["ineligible"][0]) == {"server", "reasons"}
    assert len(data["eligible"]) + len(data["ineligible"]) == len(FLEET)
    assert data["eligible_count"] + data["ineligible_count"] == len(FLEET)
    assert decision == decide(cuda_image("12.2.2"), DeployRequest(gpus=2), FLEET)
    summary = answer(decision, AnswerOptions())
    assert "ineligible" not in summary and summary["next_cursor"] is None
    EligibilityAnswer.model_validate(summary)
    for item in summary["ineligible_by_reason"]:  # each server once, under its decisive reason
        having = [entry["server"] for entry in data["ineligible"] if item["reason"] == entry["reasons"][0]]
        assert item["count"] == len(having) and item["examples"] == having[:3]
    assert sum(item["count"] for item in summary["ineligible_by_reason"]) == data["ineligible_count"]


def _many(count: int) -> list[Server]:
    """`count` servers in a few shapes and label sets, names not in shape order."""
    base = {server.name: server for server in FLEET}
    kinds = ["h100-a", "a100-40-a", "a100-80-a", "t4-legacy"]
    servers = []
    for n in range(count):
        template = base[kinds[(n * 7) % len(kinds)]]
        gpus = [gpu.model_copy(update={"uuid": f"GPU-{n}-{gpu.index}"}) for gpu in template.gpus]
        busy = [gpu.uuid for gpu in gpus[: n % 3]]
        servers.append(
            template.model_copy(
                update={
                    "name": f"s{n:04d}",
                    "gpus": gpus,
                    "gpus_in_use": busy,
                    "labels": {"zone": "ab"[n % 2]},
                }
            )
        )
    return servers


@pytest.mark.parametrize("labels", [{}, {"zone": "a"}])
def test_pages_follow_the_ranking_and_survive_fleet_changes(labels: dict[str, str]) -> None:
    fleet = _many(300)
    index = FleetIndex.build(fleet)
    request = DeployRequest(gpus=1, labels=labels)
    decision = decide(cuda_image("12.2.2"), request, index)
    everyone = decision.eligible
    assert len(everyone) == decision.eligible_count > 50
    paged: list[str] = []
    cursor = None
    while True:
        body = answer(decision, AnswerOptions(limit=17, cursor=cursor))
        assert len(body["eligible"]) <= 17
        paged += [entry["server"] for entry in body["eligible"]]
        assert body["eligible"] == everyone[len(paged) - len(body["eligible"]) : len(paged)]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert paged == [entry["server"] for entry in everyone]
    # The fleet changes between two pages: the next page still starts after the last one listed.
    first = answer(decision, AnswerOptions(limit=20))
    last = first["eligible"][-1]["server"]
    index.remove([entry["server"] for entry in everyone[:5]])
    later = decide(cuda_image("12.2.2"), request, index)
    rest = answer(later, AnswerOptions(limit=1000, cursor=first["next_cursor"]))
    remaining = [entry["server"] for entry in later.eligible]
    assert (
        [entry["server"] for entry in rest["eligible"]] == remaining[remaining.index(last) + 1 :]
        if (last in remaining)
        else [entry["server"] for entry in rest["eligible"]] == remaining[15:]
    )


@pytest.mark.parametrize("cursor", ["", "!!", "W10", "WzEsMl0", "x" * 600])
def test_bad_cursors_are_refused(cursor: str) -> None:
    decision = decide(cuda_image("12.2.2"), DeployRequest(gpus=1), FLEET)
    with pytest.raises((ValueError, ValidationError)):
        answer(decision, AnswerOptions(cursor=cursor or "=="))


# --- a prepared index kept current -------------------------------------------------------------


def test_index_updates_match_a_fresh_build() -> None:
    index = FleetIndex.build(FLEET)
    requests = (DeployRequest(gpus=1), DeployRequest(gpus=2, labels={"zone": "b"}), DeployRequest())
    for request in requests:  # asked before the update too: the index keeps these forms' shape verdicts
        decide(cuda_image("12.2.2"), request, index)
    h100 = next(server for server in FLEET if server.name == "h100-a")
    busier = h100.model_copy(update={"gpus_in_use": [gpu.uuid for gpu in h100.gpus[:5]]})
    extra = h100.model_copy(update={"name": "h100-b", "labels": {"zone": "b"}})
    index.update([busier, extra])
    index.remove(["l4-edge"])
    fleet = [busier if s.name == "h100-a" else s for s in FLEET if s.name != "l4-edge"] + [extra]
    for request in requests:
        updated = decide(cuda_image("12.2.2"), request, index)
        assert updated == decide(cuda_image("12.2.2"), request, FleetIndex.build(fleet))
    decision = decide(cuda_image("12.2.2"), DeployRequest(gpus=4), index)
    assert "needs 4 free GPU(s), has 3 free of 8, 5 in use" in reasons_of(decision, "h100-a")
    assert "h100-b" in eligible_names(decision)
    assert all(item["server"] != "l4-edge" for item in [*decision.eligible, *decision.ineligible])


def test_questions_differing_only_in_cpus_memory_or_labels_share_their_gpu_parts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU part of a verdict (driver, requirements, GPU picks: the expensive part) reads neither the
    request's CPUs, memory nor labels, so the index keeps it for the question's GPU form and a question
    that differs in those alone judges no GPU sub-shape again, before and after a fleet change. Each
    answer is the one a fresh index gives; a request that asks for other GPUs judges them afresh."""
    judged: list[str] = []
    gpu_part = Query._gpu_part

    def counted(self: Query, plan: Any, entry: Any) -> Any:
        judged.append(entry.name)
        return gpu_part(self, plan, entry)

    monkeypatch.setattr(Query, "_gpu_part", counted)
    image = cuda_image("12.2.2")
    index = FleetIndex.build(FLEET)
    decide(image, DeployRequest(gpus=1), index)
    assert judged
    h100 = next(server for server in FLEET if server.name == "h100-a")
    busier = h100.model_copy(update={"gpus_in_use": [gpu.uuid for gpu in h100.gpus[:5]]})
    fleet = FLEET
    for request, change in (
        (DeployRequest(gpus=1, cpus=16), False),
        (DeployRequest(gpus=1, memory="64Gi"), False),
        (DeployRequest(gpus=1, labels={"zone": "b"}), True),  # after h100-a's GPUs went busy
        (DeployRequest(gpus=1, cpus=8, memory="32Gi"), False),
    ):
        if change:
            index.update([busier])
            fleet = [busier if s.name == "h100-a" else s for s in FLEET]
        judged.clear()
        shared = decide(image, request, index)
        assert judged == ([busier.name] if change else []), (request, judged)  # only its new sub-shape
        assert shared == decide(image, request, FleetIndex.build(fleet))
    judged.clear()
    decide(image, DeployRequest(gpus=2, cpus=16), index)
    assert judged  # another GPU request: its GPU parts are its own


async def test_a_question_asked_again_is_paged_from_the_kept_decision_without_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import web.placement_requests as placement_requests

    hops: list[str] = []

    async def counted(function: Any, *args: Any) -> Any:
        hops.append(function.__name__)
        return function(*args)

    monkeypatch.setattr(placement_requests.asyncio, "to_thread", counted)
    index, report, request = FleetIndex.build(FLEET), cuda_report("12.2.2"), DeployRequest(gpus=1)
    assert kept_decision(ImageFacts.from_report(report), request, index) is None
    first = await placement_requests.eligibility_answer(report, request, index, AnswerOptions(limit=2))
    assert len(hops) == 1  # a new question: decided in a thread
    again = await placement_requests.eligibility_answer(report, request, index, AnswerOptions(limit=2))
    assert again == first and len(hops) == 1  # paged from the kept decision, on the loop
    cursor = first["next_cursor"]
    page_two = await placement_requests.eligibility_answer(
        report, request, index, AnswerOptions(limit=2, cursor=cursor)
    )
    assert len(hops) == 1 and page_two["eligible"] != first["eligible"]
    everything = await placement_requests.eligibility_answer(
        report, request, index, AnswerOptions(explain="all")
    )
    large = AnswerOptions(limit=placement_requests.SMALL_PAGE + 1)
    await placement_requests.eligibility_answer(report, request, index, large)
    assert len(hops) == 3 and len(everything["eligible"]) == first["eligible_count"]  # O(servers): a thread
    h100 = next(server for server in FLEET if server.name == "h100-a")
    index.update([h100.model_copy(update={"gpus_in_use": [gpu.uuid for gpu in h100.gpus]})])
    assert kept_decision(ImageFacts.from_report(report), request, index) is None  # the fleet changed
    changed = await placement_requests.eligibility_answer(report, request, index, AnswerOptions(limit=2))
    assert len(hops) == 4 and changed["eligible_count"] == first["eligible_count"] - 1


def test_index_lists_servers_in_name_order_whatever_the_input_order() -> None:
    shuffled = sorted(FLEET, key=lambda server: server.name[::-1])
    assert decide(cuda_image("12.2.2"), DeployRequest(gpus=1), shuffled) == decide(
        cuda_image("12.2.2"), DeployRequest(gpus=1), FLEET
    )
    assert [server.name for server in FleetIndex.build(shuffled).servers] == sorted(s.name for s in FLEET)


def test_servers_sharing_gpus_but_not_arch_or_size_get_their_own_verdicts() -> None:
    """Verdicts share the GPU part between servers with identical GPUs; the rest stays per server."""
    h100 = next(server for server in FLEET if server.name == "h100-a")

    def twin(name: str, **update: Any) -> Server:
        gpus = [gpu.model_copy(update={"uuid": f"GPU-{name}-{gpu.index}"}) for gpu in h100.gpus]
        return h100.model_copy(update={"name": name, "gpus": gpus, "gpus_in_use": [], **update})

    fleet = [
        twin("twin-big"),
        twin("twin-small", cpus=8, memory=parse_bytes("16Gi")),
        twin("twin-arm", arch="arm64"),
        twin("twin-arm-small", arch="arm64", cpus=8),
    ]
    request = DeployRequest(gpus=2, cpus=16, memory="64Gi")
    decision = decide(cuda_image("12.2.2"), request, fleet)
    assert decision.eligible == [
        {
            "server": "twin-big",
            "gpus": ["GPU-twin-big-0", "GPU-twin-big-1"],
            "score": 0.1429,
            "platform": "linux/amd64",
            "why": [  # an eligible server says why it passes, each thing asked of it
                "CPU architecture amd64: the image's linux/amd64",
                f"NVIDIA H100 80GB HBM3: NVIDIA_REQUIRE_CUDA: driver CUDA {h100.cuda_driver_version} >= 12.2",
                "has 192 CPUs, request needs 16",
                "has 2 TiB memory, request needs 64 GiB",
            ],
        }
    ]
    arch = "CPU architecture arm64 is not among the image's platforms (linux/amd64)"
    assert reasons_of(decision, "twin-small") == [
        "has 8 CPUs, request needs 16",
        "has 16 GiB memory, request needs 64 GiB",
    ]
    assert reasons_of(decision, "twin-arm") == [arch]
    assert reasons_of(decision, "twin-arm-small") == [arch, "has 8 CPUs, request needs 16"]
    # A GPU failure is listed before the CPU and memory reasons (a bigger server would not help).
    failing = decide(cuda_image("12.2.2"), DeployRequest(gpus=2, cpus=16, min_driver="999"), fleet)
    assert failing.eligible == []
    driver = f"driver {h100.driver_version} < requested 999"
    assert reasons_of(failing, "twin-big") == [driver]
    assert reasons_of(failing, "twin-arm-small") == [arch, driver, "has 8 CPUs, request needs 16"]
    # A CPU image for both architectures: one shared GPU part, each server its own platform.
    anywhere = decide(cpu_image("linux/amd64", "linux/arm64"), DeployRequest(cpus=16), fleet)
    assert {item["server"]: item["platform"] for item in anywhere.eligible} == {
        "twin-big": "linux/amd64",
        "twin-arm": "linux/arm64",
    }


# --- the service keeps one index between requests ----------------------------------------------

API_TOKEN = "api-secret"
AGENT_TOKEN = "agent-secret"
ONE_GPU_FLEET = {
    "servers": [
        {
            "name": "h100-one",
            "cpus": 32,
            "memory": "256Gi",
            "driver_version": "550.54.15",
            "cuda_driver_version": "12.4",
            "gpus": [
                {
                    "index": 0,
                    "uuid": "GPU-one-0",
                    "name": "NVIDIA H100 80GB HBM3",
                    "brand": "NVIDIA",
                    "memory_mib": 81559,
                    "compute_capability": "9.0",
                }
            ],
        }
    ]
}


class FakeClock:
    """The fleet cache's clocks, moved only when a test says: `now` (monotonic) and `wall`, the
    real time moved on by as much as `now` was."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return time.time() + (self.now - 1000.0)


@dataclass
class FleetService:
    url: str
    app: web.Application
    clock: FakeClock
    image: str

    @property
    def cache(self) -> FleetIndexCache:
        return self.app[FLEET_INDEX]

    async def post(self, path: str, body: dict[str, Any], token: str | None = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.url + path, json=body, headers=headers) as response,
        ):
            return response.status, await response.json()

    async def get(self, path: str) -> Any:
        async with aiohttp.ClientSession() as session, session.get(self.url + path) as response:
            assert response.status == 200
            return await response.json()

    async def eligibility(self, **request: Any) -> dict[str, Any]:
        body = {"image": self.image, "explain": "all", **request}
        status, body = await self.post("/api/eligibility", body, API_TOKEN)
        assert status == 200, body
        return dict(body)


@pytest.fixture
async def fleet_service(tmp_path: Path, registry: LocalRegistry, push: Pusher) -> AsyncIterator[FleetService]:
    push(catalog.cuda_ubuntu(), "cache/cuda:12.2")
    inventory = tmp_path / "fleet.yaml"
    inventory.write_text(yaml.safe_dump(ONE_GPU_FLEET))
    settings = ServiceSettings(
        db=tmp_path / "fleet.db",
        port=0,
        inventory_file=inventory,
        agent_token=AGENT_TOKEN,
        api_token=API_TOKEN,
        docker_config=None,
    )
    app = create_app(settings)
    clock = FakeClock()
    app[FLEET_INDEX] = FleetIndexCache(
        check_seconds=5.0, clock=clock, wall=clock.wall
    )  # time moves only when a test says
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield FleetService(f"http://127.0.0.1:{port}", app, clock, f"{registry.host}/cache/cuda:12.2")
    finally:
        await runner.cleanup()


def _eligible(body: dict[str, Any]) -> dict[str, list[str]]:
    return {item["server"]: item["gpus"] for item in body["eligible"]}


def _ineligible(body: dict[str, Any]) -> dict[str, list[str]]:
    return {item["server"]: item["reasons"] for item in body["ineligible"]}


async def test_cached_index_follows_reservations(fleet_service: FleetService) -> None:
    service = fleet_service
    assert _eligible(await service.eligibility(gpus=1)) == {"h100-one": ["GPU-one-0"]}
    deploy = {"image": service.image, "gpus": 1}
    status, first = await service.post("/api/deployments", deploy, API_TOKEN)
    assert status == 201 and first["gpus"] == ["GPU-one-0"]
    status, second = await service.post("/api/deployments", deploy, API_TOKEN)
    assert status == 409, second  # the cached index saw the reservation
    assert second["ineligible_count"] == 1
    (summary,) = [item for item in second["ineligible_by_reason"] if "in use" in item["reason"]]
    assert summary["reason"] == "needs 1 free GPU(s), has 0 free of 1, 1 in use"
    assert summary["examples"] == ["h100-one"]
    body = await service.eligibility(gpus=1)
    assert body["eligible"] == [] and "h100-one" in _ineligible(body)
    async with (
        aiohttp.ClientSession() as session,
        session.delete(
            f"{service.url}/api/deployments/{first['id']}", headers={"Authorization": f"Bearer {API_TOKEN}"}
        ) as response,
    ):
        assert response.status == 202
    status, third = await service.post("/api/deployments", deploy, API_TOKEN)
    assert status == 201 and third["gpus"] == ["GPU-one-0"]  # released, and the index knows it
    assert service.cache.inventory_reads == 1  # reservations alone never re-read the servers


async def test_agents_appear_change_and_drop_out(fleet_service: FleetService) -> None:
    service = fleet_service
    assert set(_eligible(await service.eligibility(gpus=1))) == {"h100-one"}
    agent = ONE_GPU_FLEET["servers"][0] | {"name": "agent-a"}
    agent["gpus"] = [gpu | {"uuid": "GPU-a-0"} for gpu in agent["gpus"]]
    status, _ = await service.post("/api/servers", agent, AGENT_TOKEN)
    assert status == 200
    assert _eligible(await service.eligibility(gpus=1)) == {"h100-one": ["GPU-one-0"], "agent-a": ["GPU-a-0"]}
    second_gpu = agent["gpus"][0] | {"index": 1, "uuid": "GPU-a-1"}
    status, _ = await service.post(
        "/api/servers/agent-a/heartbeat", {"gpus": [*agent["gpus"], second_gpu]}, AGENT_TOKEN
    )
    assert status == 200
    assert _eligible(await service.eligibility(gpus=2)) == {"agent-a": ["GPU-a-0", "GPU-a-1"]}
    stale_after = service.app[SERVICES].settings.stale_after_seconds
    # Both sides of the threshold: silent a little less than stale_after_seconds, it stays...
    service.clock.now += stale_after - 10
    assert "agent-a" in _eligible(await service.eligibility(gpus=1))
    # ...a little more (its last heartbeat, held in memory, is now older than the threshold), it drops out.
    service.clock.now += 20
    assert set(_eligible(await service.eligibility(gpus=1))) == {"h100-one"}
    assert "agent-a" not in {s["name"] for s in (await service.get("/api/servers"))["servers"]}
    status, _ = await service.post("/api/servers/agent-a/heartbeat", {}, AGENT_TOKEN)
    assert status == 200
    assert set(_eligible(await service.eligibility(gpus=1))) == {"h100-one", "agent-a"}  # back at once


def test_many_small_updates_match_a_fresh_build() -> None:
    """Copy-on-write updates (reservations, servers leaving and joining) give a rebuild's answers."""
    fleet = {server.name: server for server in _many(400)}
    index = FleetIndex.build(fleet.values())
    before = index.view()
    requests = (DeployRequest(gpus=1), DeployRequest(gpus=2, labels={"zone": "c"}), DeployRequest(cpus=3))
    for request in requests:  # verdicts kept per shape from here on must stay right after updates
        decide(cuda_image("12.2.2"), request, index)
    names = sorted(fleet)
    for step in range(60):
        name = names[(step * 37) % len(names)]
        server = fleet[name]
        if step % 7 == 3:
            index.remove([name])
            del fleet[name]
            names.remove(name)
            continue
        if step % 11 == 5:  # a new server in a new label set and shape
            extra = server.model_copy(update={"name": f"z-new-{step}", "labels": {"zone": "c"}, "cpus": 3})
            index.update([extra])
            fleet[extra.name] = extra
            names.append(extra.name)
            continue
        busy = [gpu.uuid for gpu in server.gpus[: (step % 4)]]
        fleet[name] = server.model_copy(update={"gpus_in_use": busy})
        index.update([fleet[name]])
    fresh = FleetIndex.build(fleet.values())
    for request in (
        DeployRequest(gpus=1),
        DeployRequest(gpus=2, labels={"zone": "c"}),
        DeployRequest(cpus=3),
    ):
        assert decide(cuda_image("12.2.2"), request, index) == decide(cuda_image("12.2.2"), request, fresh)
    assert index.view() is not before and sum(map(len, before.shape_names)) == 400  # old view untouched


def test_one_decisive_reason_per_server_in_the_summary_all_of_them_behind_explain_all() -> None:
    """The issue's example: a musl GPU image asked for H100s. Each server is summarised once, by
    the reason that decides it; explain=all keeps every reason, that one first."""
    request = DeployRequest(gpus=1, gpu_models=["h100"], min_gpu_memory="40Gi")
    decision = decide(cuda_image("12.2.2", libc="musl"), request, FLEET)
    a100 = reasons_of(decision, "a100-40-a")
    assert a100[0] == "image uses musl libc with GPUs; server has no musl GPU support"
    assert "4 free NVIDIA A100-SXM4-40GB: model NVIDIA A100-SXM4-40GB is not h100" in a100[1:]
    assert reasons_of(decision, "cpu-1") == ["no NVIDIA driver"]
    body = answer(decision, AnswerOptions())
    counted = {item["reason"]: item["count"] for item in body["ineligible_by_reason"]}
    assert sum(counted.values()) == body["ineligible_count"] == len(FLEET) - body["eligible_count"]
    for server in FLEET:  # one unit per quantity, never `MiB < requested 40Gi`
        for reason in (
            reasons_of(decision, server.name) if server.name not in eligible_names(decision) else []
        ):
            assert not ("MiB" in reason and "GiB" in reason) and "Gi " not in reason + " ", reason


@pytest.mark.parametrize(
    ("have_mib", "need", "shown"),
    [
        (23034, "40Gi", "GPU memory 22.49 GiB < requested 40 GiB"),
        (512, "1000Mi", "GPU memory 512 MiB < requested 1000 MiB"),
    ],
)
def test_gpu_memory_reasons_use_one_unit_and_never_read_equal(have_mib: int, need: str, shown: str) -> None:
    (template,) = [server for server in FLEET if server.name == "l4-edge"]
    data = template.model_dump()
    data["gpus"] = [{**gpu, "memory_mib": have_mib} for gpu in data["gpus"]]
    server = Server.model_validate(data)
    decision = decide(cuda_image("12.2.2"), DeployRequest(gpus=1, min_gpu_memory=need), [server])
    assert any(reason.endswith(shown) for reason in reasons_of(decision, "l4-edge")), decision.ineligible


def test_sizes_never_read_equal_in_a_reason() -> None:
    from placement.query import _fmt_sizes

    gib = 1024**3
    assert _fmt_sizes(gib * 16, gib * 64) == ("16 GiB", "64 GiB")
    assert _fmt_sizes(40959 * 1024**2, 40 * gib) == ("39.99 GiB", "40 GiB")  # not "40 < 40"
    assert _fmt_sizes(40 * gib, 40 * gib + 1) == ("40 GiB", "40.01 GiB")
    assert _fmt_sizes(100 * 1024**2, 200 * 1024**2) == ("100 MiB", "200 MiB")


def test_gpus_asked_for_a_cpu_image_are_said_to_sit_idle() -> None:
    cpu = decide(cpu_image("linux/amd64"), DeployRequest(gpus=1), FLEET)
    body = answer(cpu, AnswerOptions())
    assert body["image_needs_gpu"] is False and body["eligible_count"] > 0
    (hint,) = body["hints"]
    assert (
        hint.startswith("shows no sign of using a GPU:") and "1 GPU(s) reserved for it would sit idle" in hint
    )
    assert answer(decide(cpu_image("linux/amd64"), DeployRequest(), FLEET), AnswerOptions())["hints"] == []
    gpu = answer(decide(cuda_image("12.2.2"), DeployRequest(gpus=1), FLEET), AnswerOptions())
    assert gpu["image_needs_gpu"] is True and gpu["hints"] == []
    EligibilityAnswer.model_validate(body)
