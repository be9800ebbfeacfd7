"""What placement reads of an image: its runnable platforms and their GPU and libc facts.

Pure: built from a scanner `ImageReport` (`ImageFacts.from_report`); the decision, the exports and
admission all judge these facts, never the report itself.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from placement.image_needs import GpuUse, carries_cuda, gpu_use, strongest
from scanner.models import ANALYSIS_VERSION, GpuFacts, ImageReport, LibcVerdict, Platform


class PlatformFacts(BaseModel):
    """One platform of an image: what placement needs from its PlatformReport."""

    platform: str
    architecture: str
    gpu: GpuFacts = Field(default_factory=GpuFacts)
    libc: LibcVerdict = Field(default_factory=LibcVerdict)
    analysis: int = Field(
        default=ANALYSIS_VERSION, description="the analysis that read it (`PlatformReport.analysis`)"
    )


class ImageFacts(BaseModel):
    """An image's per-platform facts (built from a scanner ImageReport)."""

    reference: str | None = None
    platforms: list[PlatformFacts] = Field(default_factory=list)

    @classmethod
    def from_report(cls, report: ImageReport) -> ImageFacts:
        platforms = []
        for item in report.platforms:
            try:
                platform = Platform.parse(item.platform)
            except ValueError:
                continue
            if platform.os != "linux" or platform.architecture == "unknown":
                continue  # attestation manifests and other non-runnable entries
            platforms.append(
                PlatformFacts(
                    platform=item.platform,
                    architecture=platform.architecture,
                    gpu=item.gpu,
                    libc=item.libc,
                    analysis=item.analysis,
                )
            )
        return cls(reference=report.reference, platforms=platforms)

    @property
    def gpu_required(self) -> bool:
        return any(p.gpu.required for p in self.platforms)

    @property
    def gpu_use(self) -> GpuUse:
        """placement.image_needs' answer: `required` (a platform declares an NVIDIA GPU), `optional`
        (none declares one, and CUDA was found in the layers: it runs on a CPU too) or `none`. An
        image whose layers are still being read and declares none is `none` so far (`pending`
        says what could change)."""
        return strongest(gpu_use(p.gpu.required, carries_cuda(p.gpu)) for p in self.platforms)

    def idle_gpus_hint(self, gpus_requested: int | None, mig_devices: int = 0) -> str | None:
        """The hint for GPUs (or MIG devices) asked for an image that shows no sign of using one
        (they would idle)."""
        if not (gpus_requested or mig_devices) or self.gpu_use != "none" or not self.platforms:
            return None
        so_far = " so far (its layers are still being read)" if self.pending else ""
        if gpus_requested:
            reserved, leave = f"{gpus_requested} GPU(s)", "gpus"
        else:
            reserved, leave = f"{mig_devices} MIG device(s)", "mig_devices and mig_profiles"
        return (
            f"shows no sign of using a GPU{so_far}: no NVIDIA or CUDA settings in its config, no CUDA"
            f" in its layers; the {reserved} reserved for it would sit idle (leave {leave}"
            " out to place it on any server)"
        )

    def mig_devices_hint(self, mig_devices: int) -> str | None:
        """The hint for more than one MIG device asked for an image that uses a GPU: one CUDA process
        sees one of them. Like every hint, it reads after "the image"."""
        if mig_devices < 2 or self.gpu_use == "none" or not self.platforms:
            return None
        return (
            f"needs a process per MIG device to use all {mig_devices}: a CUDA process enumerates one MIG"
            " device, however many its container is given (NVIDIA's MIG user guide), so start each with one"
            " MIG UUID in CUDA_VISIBLE_DEVICES"
        )

    @property
    def outdated(self) -> list[str]:
        """A warning per platform read by an older analysis than this service runs: facts that newer
        judges read are missing from it (a run-time compiler, an optional extension), so a verdict on
        it may be wrong either way until the image is scanned again."""
        return [
            f"{platform.platform}: read by an older gpubadge analysis ({platform.analysis}; this service"
            f" runs {ANALYSIS_VERSION}), so what newer judges read is missing and a verdict may be wrong;"
            " scan it again (POST /api/scans with rescan: true, or ask with the API token)"
            for platform in self.platforms
            if platform.analysis < ANALYSIS_VERSION
        ]

    @property
    def pending(self) -> list[str]:
        """What is not judged yet because the image's layers are still being read, per platform.

        Placement answers from the config facts meanwhile, and says what could still change: a musl
        libc (then a GPU image also needs a server with musl GPU support) and, for an image that
        declares no GPU, CUDA found inside (then it needs a GPU and a driver for that CUDA).
        """
        found = []
        for platform in self.platforms:
            if platform.libc.state != "pending":
                continue
            could = ["the libc (a musl image would also need musl GPU support)"]
            if not platform.gpu.required:
                could.append("CUDA inside (found CUDA would need a GPU and a driver for it)")
            found.append(f"{platform.platform}: layers still being read: {'; '.join(could)}")
        return found
