"""Placement while an image's layers are still being read: it answers from the config facts and
says, per platform, what is pending and what it could change. Pure."""

from __future__ import annotations

from placement.decide import decide
from placement.exports import export_constraints
from placement.image_facts import ImageFacts, PlatformFacts
from placement.request import DeployRequest
from scanner.models import GpuFacts, LibcVerdict
from tests.test_export_kubernetes import IMAGES, KNOWN, KNOWN_FLEET


def with_libc(image: ImageFacts, libc: LibcVerdict) -> ImageFacts:
    return image.model_copy(
        update={"platforms": [p.model_copy(update={"libc": libc}) for p in image.platforms]}
    )


def test_a_pending_gpu_image_is_placed_on_its_config_facts_and_says_so() -> None:
    pending = with_libc(IMAGES["cuda-12.2"], LibcVerdict(state="pending"))
    decision = decide(pending, DeployRequest(gpus=1), KNOWN_FLEET)
    (note,) = decision.pending
    assert note.startswith("linux/amd64: layers still being read") and "musl" in note
    assert "CUDA inside" not in note  # the config already says it needs a GPU
    final = decide(
        with_libc(IMAGES["cuda-12.2"], LibcVerdict(flavour="glibc")), DeployRequest(gpus=1), KNOWN_FLEET
    )
    assert final.pending == [] and final.eligible_count == decision.eligible_count


def test_a_pending_cpu_image_may_still_turn_out_to_carry_cuda() -> None:
    image = ImageFacts(
        platforms=[
            PlatformFacts(
                platform="linux/amd64",
                architecture="amd64",
                gpu=GpuFacts(),
                libc=LibcVerdict(state="pending"),
            ),
            PlatformFacts(
                platform="linux/s390x",
                architecture="s390x",
                libc=LibcVerdict(state="not_analysed", reason="x"),
            ),
        ]
    )
    (note,) = image.pending  # a platform left out is not pending: nothing more is coming for it
    assert "CUDA inside" in note


def test_the_scheduler_exports_note_a_pending_read() -> None:
    pending = with_libc(IMAGES["cuda-12.2"], LibcVerdict(state="pending"))
    body = export_constraints(pending, DeployRequest(gpus=1), KNOWN, "kubernetes")
    assert any("still being read" in note for note in body["notes"])
    done = export_constraints(IMAGES["cuda-12.2"], DeployRequest(gpus=1), KNOWN, "kubernetes")
    assert not any("still being read" in note for note in done["notes"])
