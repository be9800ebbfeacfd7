"""Placement of MIG devices: a mixed fleet from an inventory file (fixtures/fleet_mig.yaml) and from
agents (through the NVML stand-in), requests for whole GPUs and for each profile, reservations
released and re-used, in the index and in the store."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.host import build_server
from agent.nvml import read_nvml
from placement.decide import decide
from placement.image_facts import ImageFacts
from placement.index import FleetIndex
from placement.inventory import Server, parse_inventory
from placement.request import DeployRequest
from scanner.models import GpuFacts, ImageReport, InferredCuda, PlatformReport
from store import GpuTaken, SqliteStore, queries
from tests.fake_pynvml import FakeNvml, a100_40gb_mig, h100, h200_mig

FLEET_FILE = Path(__file__).resolve().parent.parent / "fixtures" / "fleet_mig.yaml"
FLEET = parse_inventory(FLEET_FILE.read_text()).servers
BY_NAME = {server.name: server for server in FLEET}


def image(requirement: str = "cuda>=12.2", cuda: str = "12.2") -> ImageFacts:
    env = {"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VERSION": cuda, "NVIDIA_REQUIRE_CUDA": requirement}
    gpu = GpuFacts(required=True, cuda_version=cuda, env=env)
    platform = PlatformReport(platform="linux/amd64", digest="sha256:" + "7" * 64, gpu=gpu)
    return ImageFacts.from_report(ImageReport(reference="example/mig:1", platforms=[platform]))


def profile_of(uuid: str) -> str:
    return next(d.profile for s in FLEET for g in s.gpus for d in g.mig_devices if d.uuid == uuid)


def reasons(request: DeployRequest, facts: ImageFacts | None = None) -> dict[str, list[str]]:
    decision = decide(facts or image(), request, FLEET)
    return {entry["server"]: entry["reasons"] for entry in decision.ineligible}


def test_the_inventory_file_describes_mig_layouts() -> None:
    a100 = BY_NAME["a100-80-mig"]
    assert [gpu.mig for gpu in a100.gpus] == [True, True]
    assert [d.profile for d in a100.gpus[1].mig_devices] == ["3g.40gb", "4g.40gb"]
    assert a100.free_gpus == []  # never handed out whole
    half = BY_NAME["h100-half-mig"]
    assert [gpu.uuid for gpu in half.free_gpus] == ["GPU-7c2d9100-0000-4b20-8000-000000000000"]
    assert len(half.device_uuids) == 2 + 4
    with pytest.raises(ValueError, match="is not a MIG profile"):
        parse_inventory(
            "servers: [{name: x, gpus: [{index: 0, uuid: G, name: n, mig: true, mig_devices: "
            "[{index: 0, uuid: M, profile: huge}]}]}]"
        )
    too_many = [{"index": i, "uuid": f"MIG-{i}", "profile": "1g.5gb"} for i in range(17)]
    with pytest.raises(ValidationError, match="at most 16"):
        Server.model_validate(
            {"name": "x", "gpus": [{"index": 0, "uuid": "G", "name": "n", "mig_devices": too_many}]}
        )


def test_whole_gpus_never_come_from_a_gpu_in_mig_mode() -> None:
    decision = decide(image(), DeployRequest(gpus=1), FLEET)
    assert {e["server"]: e["gpus"] for e in decision.eligible} == {
        "h100-half-mig": ["GPU-7c2d9100-0000-4b20-8000-000000000000"],
        "a100-40-whole": ["GPU-9a4e1040-0000-4d40-8000-000000000000"],
    }
    why = reasons(DeployRequest(gpus=1))
    # The decisive reason is the same from server to server (summaries group them); the counts follow.
    assert why == {
        "a100-80-mig": [
            "2 GPUs in MIG mode, none whole",
            "2 GPUs in MIG mode: 7 × 1g.10gb, 1 × 3g.40gb, 1 × 4g.40gb free of 9 MIG device(s)",
        ],
        "h200-mig": ["GPU in MIG mode, none whole", "GPU in MIG mode: 7 × 1g.18gb free of 7 MIG device(s)"],
        "b200-mig": ["GPU in MIG mode, none whole", "GPU in MIG mode: 7 × 1g.23gb free of 7 MIG device(s)"],
        "h100-mig-unconfigured": ["GPU in MIG mode, none whole", "GPU in MIG mode: no MIG device configured"],
    }
    two = reasons(DeployRequest(gpus=2))["h100-half-mig"]
    assert two == [
        "needs 2 free GPU(s), has 1 free of 1",
        "GPU in MIG mode, never whole: 2 × 1g.10gb, 1 × 2g.20gb, 1 × 3g.40gb free of 4 MIG device(s)",
    ]
    summary = decide(image(), DeployRequest(gpus=1), FLEET).ineligible_summary()
    assert {item["reason"]: item["count"] for item in summary} == {
        "GPU in MIG mode, none whole": 3,
        "2 GPUs in MIG mode, none whole": 1,
    }


PROFILES = sorted({d.profile for s in FLEET for g in s.gpus for d in g.mig_devices})


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_goes_where_it_is_free(profile: str) -> None:
    facts = image("cuda>=12.0")
    decision = decide(facts, DeployRequest(mig_profiles=[profile]), FLEET)
    having = {s.name for s in FLEET for g in s.gpus for d in g.mig_devices if d.profile == profile}
    assert {e["server"] for e in decision.eligible} == having
    for entry in decision.eligible:
        (uuid,) = entry["gpus"]
        assert uuid.startswith("MIG-") and profile_of(uuid) == profile
    for server, why in reasons(DeployRequest(mig_profiles=[profile]), facts).items():
        assert server not in having
        if BY_NAME[server].gpus and not any(g.mig for g in BY_NAME[server].gpus):
            assert why == [
                f"needs 1 MIG device(s), has {len(BY_NAME[server].gpus)} whole GPU(s), none in MIG mode"
            ]
        else:
            assert why[0] == f"needs 1 free {profile} MIG device(s), has 0"
            assert "MIG mode: " in why[1] and f"{profile} free" not in why[1]


def test_minimum_memory_takes_the_smallest_device_that_suffices() -> None:
    decision = decide(image(), DeployRequest(mig_devices=1, min_gpu_memory="30Gi"), FLEET)
    picked = {e["server"]: [profile_of(u) for u in e["gpus"]] for e in decision.eligible}
    assert picked == {"a100-80-mig": ["3g.40gb"], "h100-half-mig": ["3g.40gb"]}
    two = decide(image(), DeployRequest(mig_devices=3, min_gpu_memory="9Gi"), FLEET)
    best = two.best
    assert best is not None and best["server"] == "h100-half-mig"  # fewest devices left idle
    assert [profile_of(u) for u in best["gpus"]] == ["1g.10gb", "1g.10gb", "2g.20gb"]
    h200 = reasons(DeployRequest(mig_devices=1, min_gpu_memory="30Gi"))["h200-mig"]
    assert h200[0] == "7 free NVIDIA H200 MIG 1g.18gb: MIG device memory 16 GiB < requested 30 GiB"


def test_image_requirements_apply_to_the_parent_gpu() -> None:
    hopper = decide(image("arch>=9.0"), DeployRequest(mig_devices=1), FLEET)
    assert {e["server"] for e in hopper.eligible} == {"h100-half-mig", "h200-mig", "b200-mig"}
    why = reasons(DeployRequest(mig_devices=1), image("arch>=9.0"))["a100-80-mig"]
    assert (
        why[0]
        == "7 free NVIDIA A100-SXM4-80GB MIG 1g.10gb: NVIDIA_REQUIRE_CUDA: compute capability 8.0 < arch>=9.0"
    )
    cuda13 = decide(image("cuda>=13.0", "13.0"), DeployRequest(mig_devices=1), FLEET)
    assert {e["server"] for e in cuda13.eligible} == {"h200-mig", "b200-mig"}  # drivers with CUDA 13.0
    h200 = decide(image(), DeployRequest(mig_devices=2, gpu_models=["h200"]), FLEET)
    assert [e["server"] for e in h200.eligible] == ["h200-mig"]


def facts_of(gpu: GpuFacts) -> ImageFacts:
    platform = PlatformReport(platform="linux/amd64", digest="sha256:" + "8" * 64, gpu=gpu)
    return ImageFacts.from_report(ImageReport(reference="example/other:1", platforms=[platform]))


def test_hints_count_mig_devices_as_the_gpus_asked_for() -> None:
    """MIG devices asked for are GPUs asked for: an image that carries CUDA is not told to ask for
    gpus, and one that shows no sign of a GPU is told its MIG devices would idle. More than one MIG
    device for a GPU image says what CUDA does with them: a process enumerates one."""
    carried = facts_of(GpuFacts(required=False, inferred=InferredCuda(cuda="12.1", sources=["torch 2.3.0"])))
    assert decide(carried, DeployRequest(), FLEET).hints == [
        "carries CUDA 12.1 (torch 2.3.0): ask for gpus to run it on a GPU"
    ]
    assert decide(carried, DeployRequest(mig_devices=1), FLEET).hints == []
    assert decide(carried, DeployRequest(mig_profiles=["1g.10gb"]), FLEET).hints == []
    cpu = facts_of(GpuFacts(required=False))
    (idle,) = decide(cpu, DeployRequest(mig_devices=2), FLEET).hints
    assert (
        "the 2 MIG device(s) reserved for it would sit idle (leave mig_devices and mig_profiles out" in idle
    )
    (whole,) = decide(cpu, DeployRequest(gpus=2), FLEET).hints
    assert "the 2 GPU(s) reserved for it would sit idle (leave gpus out" in whole
    (spread,) = decide(image(), DeployRequest(mig_devices=3, min_gpu_memory="9Gi"), FLEET).hints
    assert spread.startswith("needs a process per MIG device to use all 3: a CUDA process enumerates one MIG")
    assert decide(image(), DeployRequest(mig_devices=1), FLEET).hints == []
    assert len(decide(carried, DeployRequest(mig_devices=2), FLEET).hints) == 1  # it uses CUDA: spread


def test_requests_ask_for_one_kind() -> None:
    with pytest.raises(ValidationError, match="not both"):
        DeployRequest(gpus=1, mig_profiles=["1g.10gb"])
    with pytest.raises(ValidationError, match="not a MIG profile"):
        DeployRequest(mig_profiles=["10gb"])
    assert DeployRequest(mig_profiles=["MIG 1G.10GB", "1g.10gb"]).mig_profiles == ["1g.10gb"]
    assert DeployRequest.parse_any({"mig_devices": 2}).slices_needed == 2
    # A GPU image asking for MIG devices gets no whole GPU by default.
    assert all(
        g.startswith("MIG-")
        for e in decide(image(), DeployRequest(mig_devices=1), FLEET).eligible
        for g in e["gpus"]
    )


def agent_server(name: str, *gpus: object) -> Server:
    facts = read_nvml(FakeNvml(gpus=list(gpus), driver_version="580.65.06", cuda_version=13000))  # type: ignore[arg-type]
    return build_server(name, facts, ["runtime"], arch="x86_64", cpus=32, memory=1 << 38)


def test_an_image_that_asks_for_video_is_warned_of_mig_devices_without_a_decoder() -> None:
    """NVML counts each MIG device's video decoders (sharedDecoderCount): an A100-40GB's 1g.5gb has
    none, its 1g.5gb+me one (NVIDIA's MIG user guide, as the stand-in's profiles hold them). An image
    whose NVIDIA_DRIVER_CAPABILITIES asks for `video` (NGC's PyTorch and Triton images do) is still
    placed there, and the answer says that GPU decoding fails on the 1g.5gb devices."""
    server = agent_server(
        "agent-a100",
        a100_40gb_mig("GPU-a1000000-0000-4000-8000-000000000000", ["1g.5gb+me", "1g.5gb", "3g.20gb"]),
    )
    decoders = {device.profile: device.decoders for gpu in server.gpus for device in gpu.mig_devices}
    assert decoders == {"1g.5gb+me": 1, "1g.5gb": 0, "3g.20gb": 2}
    video = image()
    env = {**video.platforms[0].gpu.env, "NVIDIA_DRIVER_CAPABILITIES": "compute,utility,video"}
    gpu = video.platforms[0].gpu.model_copy(
        update={"env": env, "driver_capabilities": "compute,utility,video"}
    )
    video = ImageFacts.from_report(
        ImageReport(
            reference="example/video:1",
            platforms=[PlatformReport(platform="linux/amd64", digest="sha256:" + "9" * 64, gpu=gpu)],
        )
    )
    decision = decide(video, DeployRequest(mig_devices=1), [server])
    assert decision.eligible_count == 1
    (warning,) = [w for w in decision.warnings if "video decoder" in w]
    assert warning.startswith("on NVIDIA A100-SXM4-40GB MIG 1g.5gb: no video decoder (NVDEC)")
    assert not [w for w in decide(image(), DeployRequest(mig_devices=1), [server]).warnings if "video" in w]
    for other in (DeployRequest(mig_profiles=["3g.20gb"]), DeployRequest(gpus=1)):
        assert not [w for w in decide(video, other, [server]).warnings if "video" in w]
    everything = env | {"NVIDIA_DRIVER_CAPABILITIES": "all"}
    gpu_all = gpu.model_copy(update={"env": everything, "driver_capabilities": "all"})
    facts_all = ImageFacts.from_report(
        ImageReport(
            reference="example/video:2",
            platforms=[PlatformReport(platform="linux/amd64", digest="sha256:" + "a" * 64, gpu=gpu_all)],
        )
    )
    assert [w for w in decide(facts_all, DeployRequest(mig_devices=1), [server]).warnings if "video" in w]
    # an inventory file that does not say how many decoders a MIG device has: nothing is claimed
    assert not [w for w in decide(video, DeployRequest(mig_devices=1), FLEET).warnings if "video" in w]


def test_a_warning_stays_in_the_answer_after_the_fleet_changes() -> None:
    """The index keeps each question's shape verdicts across fleet changes, and judges only the shapes
    new to it when the question comes again. The warnings of the answer (here: MIG devices with no
    video decoder, for an image that asks for `video`) come from the GPU classes judged, so the
    answer after a change must judge the classes of the kept shapes too: it is the answer a fresh
    index gives, warnings included."""
    server = agent_server(
        "agent-a100",
        a100_40gb_mig("GPU-a1000000-0000-4000-8000-000000000000", ["1g.5gb+me", "1g.5gb", "3g.20gb"]),
    )
    other = agent_server(
        "agent-b100", a100_40gb_mig("GPU-b1000000-0000-4000-8000-000000000000", ["3g.20gb", "3g.20gb"])
    )
    base = image()
    env = {**base.platforms[0].gpu.env, "NVIDIA_DRIVER_CAPABILITIES": "compute,utility,video"}
    gpu = base.platforms[0].gpu.model_copy(
        update={"env": env, "driver_capabilities": "compute,utility,video"}
    )
    video = ImageFacts.from_report(
        ImageReport(
            reference="example/video:1",
            platforms=[PlatformReport(platform="linux/amd64", digest="sha256:" + "9" * 64, gpu=gpu)],
        )
    )
    request = DeployRequest(mig_devices=1)
    index = FleetIndex.build([server])
    first = decide(video, request, index)
    assert [w for w in first.warnings if "video decoder" in w]
    index.update([other])  # agent-a100's shape is kept; only agent-b100's is new
    after = decide(video, request, index)
    assert after.warnings == first.warnings
    assert after == decide(video, request, FleetIndex.build([server, other]))
    # another question of the same GPU form: its GPU parts are the kept ones, its warnings the same
    fewer_cpus = DeployRequest(mig_devices=1, cpus=4)
    assert decide(video, fewer_cpus, index).warnings == first.warnings


def test_reservations_are_per_mig_device_and_are_released_and_reused() -> None:
    server = agent_server(
        "agent-a100",
        a100_40gb_mig("GPU-a1000000-0000-4000-8000-000000000000"),
        h100("GPU-b1000000-0000-4000-8000-000000000000"),
    )
    index = FleetIndex.build([server])
    request = DeployRequest(mig_profiles=["1g.5gb"])
    taken: list[str] = []
    for _ in range(7):
        best = decide(image(), request, index).best
        assert best is not None
        taken.extend(best["gpus"])
        index.update([server.model_copy(update={"gpus_in_use": list(taken)})])
    assert len(set(taken)) == 7 and set(taken) == set(server.device_uuids[1:8])
    assert decide(image(), request, index).ineligible == [
        {
            "server": "agent-a100",
            "reasons": [
                "needs 1 free 1g.5gb MIG device(s), has 0",
                "GPU in MIG mode: all 7 MIG device(s) in use",
            ],
        }
    ]
    # The whole H100 is still free for a whole-GPU request; the A100 in MIG mode never is.
    whole = decide(image(), DeployRequest(gpus=1), index).best
    assert whole is not None and whole["gpus"] == ["GPU-b1000000-0000-4000-8000-000000000000"]
    released = taken.pop(3)
    index.update([server.model_copy(update={"gpus_in_use": list(taken)})])
    again = decide(image(), request, index).best
    assert again is not None and again["gpus"] == [released]
    # A parent in use (reserved whole before MIG mode was turned on) takes its MIG devices with it.
    index.update([server.model_copy(update={"gpus_in_use": [server.gpus[0].uuid]})])
    assert decide(image(), request, index).best is None


def test_the_store_reserves_releases_and_reuses_mig_device_uuids(tmp_path: Path) -> None:
    server = agent_server("agent-h200", h200_mig("GPU-c2000000-0000-4000-8000-000000000000"))
    first, second = server.gpus[0].mig_devices[0].uuid, server.gpus[0].mig_devices[1].uuid
    store = SqliteStore(tmp_path / "mig.db")
    try:
        store.create_deployment("d1", server.name, [first, second], '{"id": "d1"}')
        with pytest.raises(GpuTaken, match=second):
            store.create_deployment("d2", server.name, [second], '{"id": "d2"}')
        assert store.run(queries.reserved_gpus) == {first: "d1", second: "d1"}
        store.run(queries.update_deployment, "d1", '{"id": "d1"}', state="exited", release=True)
        assert store.run(queries.reserved_gpus) == {}
        store.create_deployment("d3", server.name, [second], '{"id": "d3"}')
        assert store.run(queries.reserved_gpus) == {second: "d3"}
    finally:
        store.close()
