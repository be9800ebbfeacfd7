"""Which servers can run an image for a deploy request, best fit first, and why the others cannot.

Pure: facts + request + inventory in, a Decision out. Built for 10,000-server fleets per query:
the inventory is indexed once (`FleetIndex`, GPUs grouped into classes of identical facts), the
image's requirements are parsed once per query, every GPU-class verdict is computed once per
query, and the loop over servers touches plain Python objects only (no pydantic validation).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from placement.gpus import matches_model, memory_satisfies, runtime_brands
from placement.inventory import Server
from placement.request import DeployRequest
from placement.requirements import DeviceFacts, ImageRequirements, Verdict, compare_version
from scanner.models import GpuFacts, ImageReport, LibcVerdict, Platform

_GIB = 1024**3
SortKey = tuple[int, int, int, float, int]  # rank, spare GPUs, GPU MiB assigned, spare CPUs, memory
_NO_KEY: SortKey = (0, 0, 0, 0.0, 0)
# (reasons, GPU picks as (group position, count), sort key, platform, score) for one server shape
_ShapeResult = tuple[tuple[str, ...], tuple[tuple[int, int], ...], SortKey, str, float]


class PlatformFacts(BaseModel):
    """One platform of an image: what placement needs from its PlatformReport."""

    platform: str
    architecture: str
    gpu: GpuFacts = Field(default_factory=GpuFacts)
    libc: LibcVerdict = Field(default_factory=LibcVerdict)


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
                    platform=item.platform, architecture=platform.architecture, gpu=item.gpu, libc=item.libc
                )
            )
        return cls(reference=report.reference, platforms=platforms)

    @property
    def gpu_required(self) -> bool:
        return any(p.gpu.required for p in self.platforms)


class EligibleServer(TypedDict):
    server: str
    gpus: list[str]
    score: float
    platform: str


class IneligibleServer(TypedDict):
    server: str
    reasons: list[str]


class Decision(BaseModel):
    """Eligible servers best-fit first, with the GPU UUIDs to reserve; every other server with reasons."""

    eligible: list[EligibleServer] = Field(default_factory=list)
    ineligible: list[IneligibleServer] = Field(default_factory=list)


# --- the prepared inventory --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuClass:
    """GPUs that are the same for placement: same product, memory, CC, brand, and host driver."""

    name: str
    memory_mib: int
    compute_capability: str
    brand: str
    driver: str | None
    cuda: str | None


@dataclass(slots=True)
class ServerEntry:
    server: Server
    name: str
    arch: str
    cpus: int
    memory: int
    labels: dict[str, str]
    musl: bool
    driver: str | None
    cuda: str | None
    total_gpus: int
    busy_gpus: int
    groups: tuple[tuple[int, tuple[str, ...]], ...]  # (GPU class id, free UUIDs in index order)
    shape: int = 0  # servers with the same shape get the same verdict; labels and names aside


@dataclass(slots=True)
class FleetIndex:
    """Servers flattened for fast queries. Rebuild (or `build` again) when the inventory changes."""

    entries: list[ServerEntry] = field(default_factory=list)
    classes: list[GpuClass] = field(default_factory=list)
    shape_count: int = 0

    @classmethod
    def build(cls, servers: Sequence[Server]) -> FleetIndex:
        index = cls()
        class_ids: dict[GpuClass, int] = {}
        shape_ids: dict[tuple[object, ...], int] = {}
        for server in servers:
            busy = set(server.gpus_in_use)
            grouped: dict[int, list[str]] = {}
            for gpu in sorted(server.gpus, key=lambda g: g.index):
                if gpu.uuid in busy:
                    continue
                key = GpuClass(
                    gpu.name,
                    gpu.memory_mib,
                    gpu.compute_capability,
                    gpu.brand,
                    server.driver_version or None,
                    server.cuda_driver_version or None,
                )
                class_id = class_ids.setdefault(key, len(class_ids))
                if class_id == len(index.classes):
                    index.classes.append(key)
                grouped.setdefault(class_id, []).append(gpu.uuid)
            index.entries.append(
                ServerEntry(
                    server=server,
                    name=server.name,
                    arch=server.arch,
                    cpus=server.cpus,
                    memory=server.memory,
                    labels=server.labels,
                    musl=server.musl,
                    driver=server.driver_version or None,
                    cuda=server.cuda_driver_version or None,
                    total_gpus=len(server.gpus),
                    busy_gpus=sum(1 for g in server.gpus if g.uuid in busy),
                    groups=tuple((cid, tuple(uuids)) for cid, uuids in grouped.items()),
                )
            )
            entry = index.entries[-1]
            shape = (
                entry.arch,
                entry.cpus,
                entry.memory,
                entry.musl,
                entry.driver,
                entry.cuda,
                entry.total_gpus,
                entry.busy_gpus,
                tuple((cid, len(uuids)) for cid, uuids in entry.groups),
            )
            entry.shape = shape_ids.setdefault(shape, len(shape_ids))
        index.shape_count = len(shape_ids)
        index.entries.sort(key=lambda entry: entry.name)  # stable output order, whatever the input order
        return index


# --- one query ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Plan:
    """What one image platform demands, prepared once per query."""

    platform: str
    requirements: ImageRequirements
    gpu_image: bool
    musl: bool
    cuda_major: int | None
    needed: int
    verdicts: dict[int, tuple[bool, int, tuple[str, ...]]] = field(default_factory=dict)


def _cuda_major(facts: GpuFacts) -> int | None:
    text = facts.cuda_version or facts.env.get("CUDA_VERSION", "")
    head = text.lstrip("v").split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _fmt_bytes(value: int) -> str:
    if value % _GIB == 0:
        return f"{value // _GIB}Gi"
    if value % 1024**2 == 0:
        return f"{value // 1024**2}Mi"
    return f"{value} bytes"


def _fmt_cpus(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


class _Query:
    def __init__(self, image: ImageFacts, request: DeployRequest, index: FleetIndex) -> None:
        self.request = request
        self.index = index
        self.plans: dict[str, _Plan] = {}
        for platform in image.platforms:
            if platform.architecture in self.plans:
                continue
            gpu_image = platform.gpu.required
            needed = request.gpus if request.gpus is not None else (1 if gpu_image else 0)
            self.plans[platform.architecture] = _Plan(
                platform=platform.platform,
                requirements=ImageRequirements.from_gpu_facts(platform.gpu),
                gpu_image=gpu_image,
                musl=platform.libc.flavour == "musl",
                cuda_major=_cuda_major(platform.gpu),
                needed=needed,
            )
        self.platform_names = ", ".join(p.platform for p in image.platforms) or "none"
        self.models = list(request.gpu_models)
        self.ordered = request.gpu_model_order == "ordered"

    def class_verdict(self, plan: _Plan, class_id: int) -> tuple[bool, int, tuple[str, ...]]:
        """(usable, preference rank, reasons) for one GPU class, computed once per query."""
        cached = plan.verdicts.get(class_id)
        if cached is not None:
            return cached
        gpu = self.index.classes[class_id]
        request = self.request
        reasons: list[str] = []
        rank = 0
        if self.models:
            hits = [i for i, wanted in enumerate(self.models) if matches_model(gpu.name, wanted)]
            if not hits:
                reasons.append(f"model {gpu.name} is not {' or '.join(self.models)}")
            elif self.ordered:
                rank = hits[0]
        if request.min_gpu_memory is not None and not memory_satisfies(
            gpu.memory_mib, request.min_gpu_memory
        ):
            reasons.append(f"memory {gpu.memory_mib} MiB < requested {_fmt_bytes(request.min_gpu_memory)}")
        cc = gpu.compute_capability or None
        if request.min_compute_capability is not None:
            if cc is None:
                reasons.append("compute capability unknown; request needs " + request.min_compute_capability)
            elif not compare_version(cc, ">=", request.min_compute_capability):
                reasons.append(f"compute capability {cc} < requested {request.min_compute_capability}")
        if (
            plan.cuda_major is not None
            and plan.cuda_major >= 13
            and cc
            and not compare_version(cc, ">=", "7.5")
        ):
            reasons.append(
                f"CUDA {plan.cuda_major} image needs compute capability 7.5 or newer "
                f"(CUDA 13 dropped Maxwell, Pascal and Volta); this GPU has {cc}"
            )
        reasons.extend(self._requirement_reasons(plan, gpu, cc))
        verdict = (not reasons, rank, tuple(reasons))
        plan.verdicts[class_id] = verdict
        return verdict

    @staticmethod
    def _requirement_reasons(plan: _Plan, gpu: GpuClass, cc: str | None) -> list[str]:
        if plan.requirements.error is not None or plan.requirements.disabled:
            return []  # an unparsable image is reported once per server, not per GPU
        brands = runtime_brands(gpu.brand) or (None,)
        for position, brand in enumerate(brands):
            verdict: Verdict = plan.requirements.check(DeviceFacts(gpu.cuda, gpu.driver, cc, brand))
            if not verdict.ok:
                suffix = ""
                if position > 0:
                    suffix = f" (older libnvidia-container reports brand {brand} for this {brands[0]} GPU)"
                return [line + suffix for line in verdict.failed] or [verdict.message]
        return []

    def evaluate(self, entry: ServerEntry) -> _ShapeResult:
        """Everything but labels for one server; valid for every server of the same shape."""
        request = self.request
        reasons: list[str] = []
        plan = self.plans.get(entry.arch)
        if plan is None:
            reasons.append(
                f"CPU architecture {entry.arch} is not among the image's platforms ({self.platform_names})"
            )
            if not self.plans:
                return tuple(reasons), (), _NO_KEY, "", 0.0
            plan = next(iter(self.plans.values()))
        if request.cpus is not None and entry.cpus < request.cpus:
            reasons.append(f"has {entry.cpus} CPUs, request needs {_fmt_cpus(request.cpus)}")
        if request.memory is not None and entry.memory < request.memory:
            reasons.append(
                f"has {_fmt_bytes(entry.memory)} memory, request needs {_fmt_bytes(request.memory)}"
            )
        needed = plan.needed
        uses_nvidia = plan.gpu_image or needed > 0
        if uses_nvidia:
            if entry.driver is None:
                reasons.append("no NVIDIA driver")
            elif request.min_driver is not None and not compare_version(
                entry.driver, ">=", request.min_driver
            ):
                reasons.append(f"driver {entry.driver} < requested {request.min_driver}")
            if plan.requirements.error is not None:
                reasons.append(f"image requirement cannot be evaluated: {plan.requirements.error}")
            if plan.musl and plan.gpu_image and not entry.musl:
                reasons.append("image uses musl libc with GPUs; server has no musl GPU support")
        picks: list[tuple[int, int]] = []  # (position in entry.groups, how many GPUs to take)
        picked = 0
        memory_mib = 0
        rank = 0
        if needed > 0:
            usable: list[tuple[int, int, int, int]] = []  # (rank, MiB, group position, free count)
            refused: list[tuple[int, int, tuple[str, ...]]] = []
            for position, (class_id, uuids) in enumerate(entry.groups):
                ok, class_rank, why = self.class_verdict(plan, class_id)
                if ok:
                    usable.append((class_rank, self.index.classes[class_id].memory_mib, position, len(uuids)))
                else:
                    refused.append((class_id, len(uuids), why))
            available = sum(item[3] for item in usable)
            if available < needed:
                free = available + sum(n for _, n, _ in refused)
                detail = f"{free} free of {entry.total_gpus}"
                if entry.busy_gpus:
                    detail += f", {entry.busy_gpus} in use"
                if free == available:
                    reasons.append(f"needs {needed} free GPU(s), has {detail}")
                else:
                    reasons.append(f"needs {needed} suitable free GPU(s), has {available} ({detail})")
                for class_id, count, why in refused:
                    name = self.index.classes[class_id].name
                    reasons.extend(f"{count} free {name}: {line}" for line in why)
            elif not reasons:
                usable.sort()
                for class_rank, mib, position, free in usable:
                    take = min(free, needed - picked)
                    picks.append((position, take))
                    picked += take
                    memory_mib += mib * take
                    rank = max(rank, class_rank)
                    if picked == needed:
                        break
        elif plan.gpu_image and entry.driver is not None and not plan.requirements.disabled:
            # No GPU assigned: the runtime checks once without a device (arch/brand are then true).
            verdict = plan.requirements.check(DeviceFacts(entry.cuda, entry.driver, device_visible=False))
            if not verdict.ok:
                reasons.extend(verdict.failed or (verdict.message,))
        if reasons:
            return tuple(reasons), (), _NO_KEY, plan.platform, 0.0
        free_total = sum(len(u) for _, u in entry.groups)
        spare_gpus = free_total - needed
        spare_cpus = entry.cpus - (request.cpus or 0)
        key: SortKey = (rank, spare_gpus, memory_mib, float(spare_cpus), entry.memory)
        return (), tuple(picks), key, plan.platform, round(1.0 / (1 + rank + spare_gpus), 4)


def decide(image: ImageFacts, request: DeployRequest, inventory: Sequence[Server] | FleetIndex) -> Decision:
    """Rank the servers that can run `image` for `request`; explain every server that cannot.

    Ranking is best fit: preferred model first (when `gpu_model_order` is 'ordered'), then fewest
    spare GPUs left on the server, then the least GPU memory that still suffices, then fewest spare CPUs.
    """
    index = inventory if isinstance(inventory, FleetIndex) else FleetIndex.build(inventory)
    query = _Query(image, request, index)
    labels = list(request.labels.items())
    # The loop allocates a few acyclic objects per server; a cyclic-GC pass triggered mid-query would
    # walk the whole heap (the inventory included) and dominate p99, so it waits until we are done.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _decide(query, index, labels)
    finally:
        if paused:
            gc.enable()


def _decide(query: _Query, index: FleetIndex, labels: list[tuple[str, str]]) -> Decision:
    """One pass over the servers (in name order); servers of one shape share their verdict.

    Eligible servers are bucketed per shape, so ranking sorts shapes, not servers: equal-key
    shapes keep name order inside each shape. Ineligible servers of one shape share one reasons
    list (treat Decision as read-only).
    """
    results: list[_ShapeResult | None] = [None] * index.shape_count
    shared_reasons: list[list[str] | None] = [None] * index.shape_count
    buckets: dict[int, list[EligibleServer]] = {}
    ineligible: list[IneligibleServer] = []
    for entry in index.entries:
        shape = entry.shape
        result = results[shape]
        if result is None:
            result = results[shape] = query.evaluate(entry)
        reasons = result[0]
        if labels:
            missing = _label_reasons(entry.labels, labels)
            if missing:
                ineligible.append({"server": entry.name, "reasons": [*reasons, *missing]})
                continue
        if reasons:
            listed = shared_reasons[shape]
            if listed is None:
                listed = shared_reasons[shape] = list(reasons)
            ineligible.append({"server": entry.name, "reasons": listed})
            continue
        picks = result[1]
        if len(picks) == 1:  # the common case: every GPU from one class
            position, count = picks[0]
            gpus = list(entry.groups[position][1][:count])
        else:
            gpus = [uuid for position, count in picks for uuid in entry.groups[position][1][:count]]
        bucket = buckets.get(shape)
        if bucket is None:
            bucket = buckets[shape] = []
        bucket.append({"server": entry.name, "gpus": gpus, "score": result[4], "platform": result[3]})
    order = sorted(buckets, key=lambda shape: (_key_of(results[shape]), buckets[shape][0]["server"]))
    eligible = [item for shape in order for item in buckets[shape]]
    return Decision.model_construct(eligible=eligible, ineligible=ineligible)


def _key_of(result: _ShapeResult | None) -> SortKey:
    return result[2] if result is not None else _NO_KEY


def _label_reasons(have: dict[str, str], wanted: list[tuple[str, str]]) -> list[str]:
    reasons = []
    for label, value in wanted:
        current = have.get(label)
        if current != value:
            suffix = f" (server has {label}={current})" if current is not None else ""
            reasons.append(f"label {label}={value} missing{suffix}")
    return reasons
