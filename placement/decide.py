"""Which servers can run an image for a deploy request, best fit first, and why the others cannot.

Pure: facts + request + inventory in, a Decision out. Built for 10,000-server fleets per query:
the inventory is indexed once (`FleetIndex`, GPUs grouped into classes of identical facts), the
image's requirements are parsed once per query, every GPU-class verdict is computed once per
query, and the loop over servers touches plain Python objects only (no pydantic validation).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter

from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from placement import inferred
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
# (reasons, GPU picks, rank, spare GPUs, GPU MiB assigned, score) for one GPU sub-shape and plan
_GpuPart = tuple[tuple[str, ...], tuple[tuple[int, int], ...], int, int, int, float]


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
    hints: list[str] = Field(
        default_factory=list, description="e.g. CUDA found in the layers of a CPU request"
    )


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
    label_set: int = 0  # servers with the same labels get the same label verdict


@dataclass(slots=True)
class _View:
    """Flat per-position arrays (name order) that one query walks; rebuilt only after a change."""

    names: list[str]
    groups: list[tuple[tuple[int, tuple[str, ...]], ...]]
    shape_of: list[int]  # dense shape number per position
    shape_entries: list[ServerEntry]  # one representative per dense shape
    shape_members: list[list[int]]  # positions per dense shape, ascending (name order)
    # The same names, and the free UUIDs of each server's first GPU class, laid out per shape:
    # eligible servers are listed shape by shape, and reading memory in order is what makes it fast.
    shape_names: list[list[str]]
    shape_first_free: list[list[tuple[str, ...]]]
    label_of: list[int]  # label-set id per position
    combo_of: list[int]  # dense (shape, label set) number per position
    combos: list[tuple[int, int]]  # (dense shape, label-set id) per combo
    # GPU sub-shape per dense shape: shapes that differ only in arch, CPUs or memory share one, and
    # with it the GPU part of their verdict (the expensive part) within a query.
    shape_gpu: list[int]


_gpu_position = attrgetter("index")
_entry_name = attrgetter("name")


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Allocating 10,000s of acyclic objects must not trigger cyclic-GC passes over the whole heap."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _gpu_shapes(shape_entries: list[ServerEntry]) -> list[int]:
    """Dense GPU sub-shape number per shape: everything the GPU part of a verdict reads."""
    ids: dict[tuple[object, ...], int] = {}
    numbers = []
    for entry in shape_entries:
        key = (
            entry.driver,
            entry.cuda,
            entry.musl,
            entry.total_gpus,
            entry.busy_gpus,
            tuple((class_id, len(uuids)) for class_id, uuids in entry.groups),
        )
        numbers.append(ids.setdefault(key, len(ids)))
    return numbers


def _first_free(entry: ServerEntry) -> tuple[str, ...]:
    return tuple([uuid.encode().decode() for uuid in entry.groups[0][1]]) if entry.groups else ()


@dataclass(slots=True)
class FleetIndex:
    """Servers flattened for fast queries; cheap to keep current with `update` and `remove`.

    `build` derives each server once (GPUs grouped into classes of identical facts, servers into
    shapes that get identical verdicts). A service keeps one index and replaces only the servers
    whose inventory or GPUs in use changed, instead of rebuilding 10,000 entries per request.
    """

    entries: list[ServerEntry] = field(default_factory=list)
    classes: list[GpuClass] = field(default_factory=list)
    shape_count: int = 0  # shapes ever seen; present ones are in the view
    label_sets: list[dict[str, str]] = field(default_factory=list)
    _class_ids: dict[tuple[str, int, str, str, str | None, str | None], int] = field(default_factory=dict)
    _shape_ids: dict[tuple[object, ...], int] = field(default_factory=dict)
    _label_ids: dict[tuple[tuple[str, str], ...], int] = field(default_factory=dict)
    _view: _View | None = None

    @classmethod
    def build(cls, servers: Iterable[Server]) -> FleetIndex:
        """Derive every server and the query view (10,000 servers: well under 100 ms on one core)."""
        index = cls()
        with _gc_paused():
            index.entries = [index._entry(server) for server in servers]
            index.entries.sort(key=_entry_name)  # stable output order, whatever the input order
            index.view()
        return index

    def update(self, servers: Iterable[Server]) -> None:
        """Add servers, or replace the entries of servers with the same name (inventory or GPUs in use)."""
        with _gc_paused():
            fresh = {server.name: self._entry(server) for server in servers}
            if not fresh:
                return
            kept = [entry for entry in self.entries if entry.name not in fresh]
            kept.extend(fresh.values())
            kept.sort(key=_entry_name)
            self.entries = kept
            self._view = None
            self.view()

    def remove(self, names: Iterable[str]) -> None:
        """Drop servers (e.g. agents that went silent)."""
        gone = set(names)
        if gone:
            self.entries = [entry for entry in self.entries if entry.name not in gone]
            self._view = None

    @property
    def servers(self) -> list[Server]:
        return [entry.server for entry in self.entries]

    def _entry(self, server: Server) -> ServerEntry:
        """Derive one server: free GPUs grouped by class, its shape and label-set ids."""
        driver = server.driver_version or None
        cuda = server.cuda_driver_version or None
        gpus = server.gpus
        if len(gpus) > 1:
            gpus = sorted(gpus, key=_gpu_position)
        busy = set(server.gpus_in_use)
        busy_gpus = 0
        class_ids = self._class_ids
        grouped: dict[int, list[str]] = {}
        for gpu in gpus:
            uuid = gpu.uuid
            if uuid in busy:
                busy_gpus += 1
                continue
            key = (gpu.name, gpu.memory_mib, gpu.compute_capability, gpu.brand, driver, cuda)
            class_id = class_ids.get(key)
            if class_id is None:
                class_id = class_ids[key] = len(self.classes)
                self.classes.append(GpuClass(*key))
            members = grouped.get(class_id)
            if members is None:
                grouped[class_id] = [uuid]
            else:
                members.append(uuid)
        groups = tuple((class_id, tuple(uuids)) for class_id, uuids in grouped.items())
        shape_key = (
            server.arch,
            server.cpus,
            server.memory,
            server.musl,
            driver,
            cuda,
            len(gpus),
            busy_gpus,
            tuple((class_id, len(uuids)) for class_id, uuids in groups),
        )
        shape = self._shape_ids.get(shape_key)
        if shape is None:
            shape = self._shape_ids[shape_key] = len(self._shape_ids)
            self.shape_count = len(self._shape_ids)
        labels = server.labels
        label_key = tuple(labels.items()) if len(labels) < 2 else tuple(sorted(labels.items()))
        label_set = self._label_ids.get(label_key)
        if label_set is None:
            label_set = self._label_ids[label_key] = len(self.label_sets)
            self.label_sets.append(dict(label_key))
        return ServerEntry(
            server,
            server.name,
            server.arch,
            server.cpus,
            server.memory,
            labels,
            server.musl,
            driver,
            cuda,
            len(gpus),
            busy_gpus,
            groups,
            shape,
            label_set,
        )

    def view(self) -> _View:
        """The flat arrays a query walks, derived once per change of the index."""
        if self._view is not None:
            return self._view
        dense: dict[int, int] = {}
        combo_ids: dict[tuple[int, int], int] = {}
        shape_entries: list[ServerEntry] = []
        shape_members: list[list[int]] = []
        shape_of: list[int] = []
        combo_of: list[int] = []
        for position, entry in enumerate(self.entries):
            shape = dense.get(entry.shape)
            if shape is None:
                shape = dense[entry.shape] = len(shape_entries)
                shape_entries.append(entry)
                shape_members.append([])
            shape_members[shape].append(position)
            shape_of.append(shape)
            combo_key = (shape, entry.label_set)
            combo = combo_ids.get(combo_key)
            if combo is None:
                combo = combo_ids[combo_key] = len(combo_ids)
            combo_of.append(combo)
        # Names and UUIDs are copied (`.encode().decode()`: an equal string in a new object). A query
        # touches every name and the UUIDs it assigns; the originals lie scattered across the heap
        # among the pydantic inventory, and the cache misses cost more than the loop itself
        # (measured: 2.3 ms vs 0.3 ms to walk 10,000 names). Copies made together lie together.
        entries = self.entries
        self._view = _View(
            names=[entry.name.encode().decode() for entry in entries],
            groups=[entry.groups for entry in entries],
            shape_of=shape_of,
            shape_entries=shape_entries,
            shape_members=shape_members,
            shape_names=[[entries[p].name.encode().decode() for p in members] for members in shape_members],
            shape_first_free=[[_first_free(entries[p]) for p in members] for members in shape_members],
            label_of=[entry.label_set for entry in self.entries],
            combo_of=combo_of,
            combos=list(combo_ids),
            shape_gpu=_gpu_shapes(shape_entries),
        )
        return self._view


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
    inferred: GpuFacts | None = None  # CUDA found in the layers: driver floor and archs per GPU


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
                inferred=platform.gpu if platform.gpu.inferred or platform.gpu.archs else None,
            )
        self.platform_names = ", ".join(p.platform for p in image.platforms) or "none"
        self.models = list(request.gpu_models)
        self.ordered = request.gpu_model_order == "ordered"
        self.arch_plans: dict[str, tuple[_Plan | None, str | None]] = {}
        self.gpu_parts: dict[tuple[str, int], _GpuPart] = {}

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
        if plan.inferred is not None:
            reasons.extend(inferred.gpu_reasons(plan.inferred, cc, gpu.driver))
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

    def evaluate(self, entry: ServerEntry, gpu_shape: int) -> _ShapeResult:
        """Everything but labels for one server; valid for every server of the same shape.

        The GPU part (driver, image requirements, GPU picks) is shared by every shape with the same
        GPU sub-shape and platform plan, so it is computed once per query for all of them; only the
        architecture, CPU and memory checks are per shape.
        """
        arch = self.arch_plans.get(entry.arch)
        if arch is None:
            arch = self.arch_plans[entry.arch] = self._arch_plan(entry.arch)
        plan, arch_reason = arch
        if plan is None:  # the image has no platforms at all
            assert arch_reason is not None
            return (arch_reason,), (), _NO_KEY, "", 0.0
        cpus = self.request.cpus
        memory = self.request.memory
        cpus_short = cpus is not None and entry.cpus < cpus
        memory_short = memory is not None and entry.memory < memory
        # Without GPUs in play the GPU part reads no plan, so every platform shares one entry.
        key = (plan.platform if plan.gpu_image or plan.needed else "", gpu_shape)
        gpu = self.gpu_parts.get(key)
        if gpu is None:
            gpu = self.gpu_parts[key] = self._gpu_part(plan, entry)
        gpu_reasons, picks, rank, spare_gpus, memory_mib, score = gpu
        if arch_reason is not None or cpus_short or memory_short or gpu_reasons:
            reasons: list[str] = []
            if arch_reason is not None:
                reasons.append(arch_reason)
            if cpus is not None and cpus_short:
                reasons.append(f"has {entry.cpus} CPUs, request needs {_fmt_cpus(cpus)}")
            if memory is not None and memory_short:
                reasons.append(f"has {_fmt_bytes(entry.memory)} memory, request needs {_fmt_bytes(memory)}")
            reasons.extend(gpu_reasons)
            return tuple(reasons), (), _NO_KEY, plan.platform, 0.0
        spare_cpus = entry.cpus - (cpus or 0)
        return (
            (),
            picks,
            (rank, spare_gpus, memory_mib, float(spare_cpus), entry.memory),
            plan.platform,
            score,
        )

    def _arch_plan(self, arch: str) -> tuple[_Plan | None, str | None]:
        """The plan servers of `arch` are judged by, and the reason when the image lacks that arch."""
        plan = self.plans.get(arch)
        if plan is not None:
            return plan, None
        reason = f"CPU architecture {arch} is not among the image's platforms ({self.platform_names})"
        return next(iter(self.plans.values()), None), reason

    def _gpu_part(self, plan: _Plan, entry: ServerEntry) -> _GpuPart:
        """Driver, image-requirement and GPU-availability verdict, with the picks when it passes."""
        request = self.request
        reasons: list[str] = []
        needed = plan.needed
        if plan.gpu_image or needed > 0:
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
        free_total = 0
        if needed > 0:
            usable: list[tuple[int, int, int, int]] = []  # (rank, MiB, group position, free count)
            refused: list[tuple[int, int, tuple[str, ...]]] = []
            available = 0
            verdicts = plan.verdicts
            classes = self.index.classes
            for position, (class_id, uuids) in enumerate(entry.groups):
                count = len(uuids)
                free_total += count
                judged = verdicts.get(class_id) or self.class_verdict(plan, class_id)
                if judged[0]:
                    usable.append((judged[1], classes[class_id].memory_mib, position, count))
                    available += count
                else:
                    refused.append((class_id, count, judged[2]))
            if available < needed:
                free = free_total
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
                if len(usable) > 1:
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
            return tuple(reasons), (), 0, 0, 0, 0.0
        if needed == 0:
            free_total = sum(len(uuids) for _, uuids in entry.groups)
        spare_gpus = free_total - needed
        return (), tuple(picks), rank, spare_gpus, memory_mib, round(1.0 / (1 + rank + spare_gpus), 4)


def decide(image: ImageFacts, request: DeployRequest, inventory: Sequence[Server] | FleetIndex) -> Decision:
    """Rank the servers that can run `image` for `request`; explain every server that cannot.

    Ranking is best fit: preferred model first (when `gpu_model_order` is 'ordered'), then fewest
    spare GPUs left on the server, then the least GPU memory that still suffices, then fewest spare CPUs.
    """
    index = inventory if isinstance(inventory, FleetIndex) else FleetIndex.build(inventory)
    query = _Query(image, request, index)
    labels = list(request.labels.items())
    # The result allocates 10,000 small acyclic objects; a cyclic-GC pass triggered mid-query would
    # walk the whole heap (the inventory included) and dominate p99, so it waits until we are done.
    view = index.view()
    paused = gc.isenabled()  # inline rather than `with _gc_paused()`: a generator per query costs more
    gc.disable()
    try:
        decision = _decide(query, view, index, labels)
    finally:
        if paused:
            gc.enable()
    hint = inferred.hint([platform.gpu for platform in image.platforms], request.gpus)
    if hint is not None:
        decision.hints.append(hint)
    return decision


def _decide(query: _Query, view: _View, index: FleetIndex, labels: list[tuple[str, str]]) -> Decision:
    """Verdicts per shape, label verdicts per label set, then two comprehensions over the servers.

    Ranking sorts shapes, not servers: equal-key shapes keep name order inside each shape.
    Servers that share a shape and label set share one reasons list, and servers assigned no GPUs
    share one empty `gpus` list, within one Decision (treat Decision as read-only).
    """
    results = list(map(query.evaluate, view.shape_entries, view.shape_gpu))
    names = view.names
    if labels:
        missing = [_label_reasons(have, labels) for have in index.label_sets]
        combo_reasons: list[list[str] | None] = [
            [*results[shape][0], *missing[label_set]] if results[shape][0] or missing[label_set] else None
            for shape, label_set in view.combos
        ]
        reasons_at = list(map(combo_reasons.__getitem__, view.combo_of))
    else:
        shape_reasons = [list(result[0]) if result[0] else None for result in results]
        reasons_at = list(map(shape_reasons.__getitem__, view.shape_of))
    # compress() keeps the servers whose reasons list is non-empty, in name order, at C speed.
    ineligible: list[IneligibleServer] = [
        {"server": name, "reasons": reasons}  # type: ignore[typeddict-item]  # compress drops None
        for name, reasons in compress(zip(names, reasons_at, strict=True), reasons_at)
    ]
    buckets: list[tuple[SortKey, str, int, list[int] | None]] = []
    for shape, result in enumerate(results):
        if result[0]:
            continue
        members = view.shape_members[shape]
        kept: list[int] | None = None  # positions within the shape that pass the labels; None: all
        if labels:
            kept = [i for i, position in enumerate(members) if reasons_at[position] is None]
            if not kept:
                continue
        first = names[members[kept[0]]] if kept is not None else view.shape_names[shape][0]
        buckets.append((result[2], first, shape, kept))
    buckets.sort(key=lambda bucket: (bucket[0], bucket[1]))
    eligible: list[EligibleServer] = []
    no_gpus: list[str] = []  # one list for every server assigned no GPUs (a CPU image: 10,000 of them)
    for _, _, shape, kept in buckets:
        _, picks, _, platform, score = results[shape]
        shape_names = view.shape_names[shape]
        first_free = view.shape_first_free[shape]
        if kept is not None and len(kept) < len(shape_names):
            shape_names = [shape_names[i] for i in kept]
            first_free = [first_free[i] for i in kept]
        if not picks:
            eligible.extend(
                [
                    {"server": name, "gpus": no_gpus, "score": score, "platform": platform}
                    for name in shape_names
                ]
            )
        elif len(picks) == 1 and picks[0][0] == 0:  # the common case: every GPU from the first class
            count = picks[0][1]
            if count == 1:
                eligible.extend(
                    [
                        {"server": name, "gpus": [free[0]], "score": score, "platform": platform}
                        for name, free in zip(shape_names, first_free, strict=True)
                    ]
                )
            else:
                eligible.extend(
                    [
                        {"server": name, "gpus": list(free[:count]), "score": score, "platform": platform}
                        for name, free in zip(shape_names, first_free, strict=True)
                    ]
                )
        else:
            members = view.shape_members[shape]
            if kept is not None:
                members = [members[i] for i in kept]
            groups = view.groups
            eligible.extend(
                [
                    {
                        "server": names[m],
                        "gpus": [
                            uuid for position, count in picks for uuid in groups[m][position][1][:count]
                        ],
                        "score": score,
                        "platform": platform,
                    }
                    for m in members
                ]
            )
    return Decision.model_construct(eligible=eligible, ineligible=ineligible)


def _label_reasons(have: dict[str, str], wanted: list[tuple[str, str]]) -> list[str]:
    reasons = []
    for label, value in wanted:
        current = have.get(label)
        if current != value:
            suffix = f" (server has {label}={current})" if current is not None else ""
            reasons.append(f"label {label}={value} missing{suffix}")
    return reasons
