"""Which servers can run an image for a deploy request, best fit first, and why the others cannot.

Pure: facts + request + inventory in, a Decision out. Built for fleets of 100,000 servers: the
inventory is indexed once (`FleetIndex`: GPUs grouped into classes of identical facts, servers
into shapes that get identical verdicts), kept current server by server, and a query evaluates
each shape once. Its cost grows with the number of distinct shapes, not servers; the Decision
lists single servers only for the page a caller asks for (or all of them when asked to).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter, itemgetter
from typing import TypeVar

from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from placement import cuda_needs
from placement.gpus import matches_model, memory_satisfies, runtime_brands
from placement.inventory import Server
from placement.nvidia_require import DeviceFacts, ImageRequirements, Verdict, compare_version
from placement.request import DeployRequest
from scanner.models import GpuFacts, ImageReport, LibcVerdict, Platform

_GIB = 1024**3
QUERY_FORMS_KEPT = 64  # query forms (image facts + request) whose verdicts an index keeps
_K = TypeVar("_K")
_V = TypeVar("_V")
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

    @property
    def needs_gpu(self) -> bool:
        """Whether a platform uses an NVIDIA GPU: it declares one (NVIDIA/CUDA settings in its
        config) or CUDA was found in its layers. False for a CPU image, and for one whose layers
        are still being read and declares none (`pending` says what could change)."""
        return any(p.gpu.required or p.gpu.inferred is not None for p in self.platforms)

    def idle_gpus_hint(self, gpus_requested: int | None) -> str | None:
        """The hint for GPUs asked for an image that shows no sign of using one (they would idle)."""
        if not gpus_requested or self.needs_gpu or not self.platforms:
            return None
        so_far = " so far (its layers are still being read)" if self.pending else ""
        return (
            f"shows no sign of using a GPU{so_far}: no NVIDIA or CUDA settings in its config, no CUDA"
            f" in its layers; the {gpus_requested} GPU(s) reserved for it would sit idle (leave gpus"
            " out to place it on any server)"
        )

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


class EligibleServer(TypedDict):
    server: str
    gpus: list[str]
    score: float
    platform: str


class IneligibleServer(TypedDict):
    server: str
    reasons: list[str]


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
    runtime_modes: tuple[str, ...] = ()  # how Docker can hand it GPUs: nvidia runtime, --gpus, CDI
    shape: int = 0  # servers with the same shape get the same verdict; labels and names aside
    label_set: int = 0  # servers with the same labels get the same label verdict


@dataclass(slots=True)
class _View:
    """Servers grouped the way a query reads them; rebuilt only after the index changes.

    A query judges each shape once (and each label set once); the servers of a shape, or of a
    (shape, label set) combination, are kept as name-ordered lists that a Decision shares, so a
    query never walks the servers one by one.
    """

    shape_entries: list[ServerEntry]  # one representative per dense shape
    shape_names: list[list[str]]  # server names per dense shape, name order
    shape_groups: list[list[tuple[tuple[int, tuple[str, ...]], ...]]]  # their free GPUs, aligned
    combos: list[tuple[int, int]]  # (dense shape, label-set id) per combination present
    combo_names: list[list[str]]
    combo_groups: list[list[tuple[tuple[int, tuple[str, ...]], ...]]]
    # GPU sub-shape per dense shape: shapes that differ only in arch, CPUs or memory share one, and
    # with it the GPU part of their verdict (the expensive part) within a query.
    shape_gpu: list[int]


_gpu_position = attrgetter("index")


def _bounded_put(kept: dict[_K, _V], key: _K, value: _V) -> None:
    """`kept[key] = value`, dropping the oldest entries beyond QUERY_FORMS_KEPT.

    Safe from several threads (dict operations are atomic); a race only costs a recomputation.
    """
    while len(kept) >= QUERY_FORMS_KEPT:
        try:
            oldest = next(iter(kept))
        except (StopIteration, RuntimeError):  # emptied or changed by another thread
            break
        kept.pop(oldest, None)
    kept[key] = value


def _gpu_key(entry: ServerEntry) -> tuple[object, ...]:
    """Everything the GPU part of a verdict reads: shapes with the same key share that part."""
    return (
        entry.driver,
        entry.cuda,
        entry.musl,
        entry.total_gpus,
        entry.busy_gpus,
        tuple((class_id, len(uuids)) for class_id, uuids in entry.groups),
        entry.runtime_modes,
    )


@dataclass(slots=True)
class FleetIndex:
    """Servers flattened for fast queries; cheap to keep current with `update` and `remove`.

    `build` derives each server once (GPUs grouped into classes of identical facts, servers into
    shapes that get identical verdicts). A service keeps one index and replaces only the servers
    whose inventory or GPUs in use changed, instead of rebuilding 10,000 entries per request.
    """

    entries: dict[str, ServerEntry] = field(default_factory=dict)  # by server name
    classes: list[GpuClass] = field(default_factory=list)
    shape_count: int = 0  # shapes ever seen; present ones are in the view
    label_sets: list[dict[str, str]] = field(default_factory=list)
    _class_ids: dict[tuple[str, int, str, str, str | None, str | None], int] = field(default_factory=dict)
    _shape_ids: dict[tuple[object, ...], int] = field(default_factory=dict)
    _label_ids: dict[tuple[tuple[str, str], ...], int] = field(default_factory=dict)
    _view: _View | None = None
    # How the view numbers shapes, combinations and GPU sub-shapes; kept so updates extend it.
    _dense: dict[int, int] = field(default_factory=dict)
    _combo_ids: dict[tuple[int, int], int] = field(default_factory=dict)
    _gpu_ids: dict[tuple[object, ...], int] = field(default_factory=dict)
    _empty_lists: int = 0  # shape/combination lists emptied by updates, compacted by a rebuild
    _shape_results: dict[tuple[str, str], dict[int, _ShapeResult]] = field(default_factory=dict)
    _decisions: dict[tuple[str, str], tuple[_View, Decision]] = field(default_factory=dict)

    @classmethod
    def build(cls, servers: Iterable[Server]) -> FleetIndex:
        """Derive every server and the query view (10,000 servers: about 100 ms on one core)."""
        index = cls()
        index.entries = {server.name: index._entry(server) for server in servers}
        index.view()
        return index

    def update(self, servers: Iterable[Server]) -> None:
        """Add servers, or replace the entries of servers with the same name (inventory or GPUs in use).

        The view is updated copy-on-write: only the lists of the shapes (and label sets) the
        servers leave or join are copied, so a reservation costs O(shapes + servers of those
        shapes), not a rebuild, and a query already running on the previous view is unaffected.
        """
        fresh = [self._entry(server) for server in servers]
        if fresh:
            self._change({entry.name for entry in fresh}, fresh)

    def remove(self, names: Iterable[str]) -> None:
        """Drop servers (e.g. agents that went silent)."""
        gone = {name for name in names if name in self.entries}
        if gone:
            self._change(gone, [])

    def kept_decision(self, query: tuple[str, str], view: _View) -> Decision | None:
        """The Decision for this query form if it was made on `view` (the index unchanged since)."""
        kept = self._decisions.get(query)
        return kept[1] if kept is not None and kept[0] is view else None

    def keep_decision(self, query: tuple[str, str], view: _View, decision: Decision) -> None:
        _bounded_put(self._decisions, query, (view, decision))

    def shape_results(self, query: tuple[str, str]) -> dict[int, _ShapeResult]:
        """Shape verdicts already computed for this query form, by shape id (the last few forms).

        A verdict never goes stale: a server whose facts change gets another shape id. Safe from
        several threads (dict operations are atomic); an eviction race only costs a recomputation.
        """
        found = self._shape_results.get(query)
        if found is None:
            found = {}
            _bounded_put(self._shape_results, query, found)
        return found

    @property
    def servers(self) -> list[Server]:
        """Every server, in name order."""
        return [self.entries[name].server for name in sorted(self.entries)]

    def server(self, name: str) -> Server | None:
        entry = self.entries.get(name)
        return entry.server if entry is not None else None

    def _change(self, names: set[str], fresh: list[ServerEntry]) -> None:
        view = self._view
        if view is None or len(names) > max(64, len(self.entries) // 8):
            for name in names:
                self.entries.pop(name, None)
            self.entries.update((entry.name, entry) for entry in fresh)
            self._view = self._build_view()  # replaced in one step: a reader never sees None
            return
        shape_entries = list(view.shape_entries)
        shape_names, shape_groups = list(view.shape_names), list(view.shape_groups)
        combos, combo_names, combo_groups = list(view.combos), list(view.combo_names), list(view.combo_groups)
        shape_gpu = list(view.shape_gpu)
        copied: set[tuple[str, int]] = set()

        def own(kind: str, number: int) -> tuple[list[str], list[tuple[tuple[int, tuple[str, ...]], ...]]]:
            """This update's private copy of one shape's (or combination's) lists."""
            names_of, groups_of = (
                (shape_names, shape_groups) if kind == "shape" else (combo_names, combo_groups)
            )
            if (kind, number) not in copied:
                copied.add((kind, number))
                names_of[number] = list(names_of[number])
                groups_of[number] = list(groups_of[number])
            return names_of[number], groups_of[number]

        for name in names:
            old = self.entries.pop(name, None)
            if old is None:
                continue
            old_shape = self._dense[old.shape]
            old_combo = self._combo_ids[(old_shape, old.label_set)]
            for kind, number in (("shape", old_shape), ("combo", old_combo)):
                member_names, member_groups = own(kind, number)
                position = bisect_left(member_names, name)
                del member_names[position], member_groups[position]
                self._empty_lists += not member_names
        for entry in fresh:
            self.entries[entry.name] = entry
            known = self._dense.get(entry.shape)
            if known is None:
                known = self._dense[entry.shape] = len(shape_entries)
                shape_entries.append(entry)
                shape_names.append([])
                shape_groups.append([])
                shape_gpu.append(self._gpu_ids.setdefault(_gpu_key(entry), len(self._gpu_ids)))
            combo = self._combo_ids.get((known, entry.label_set))
            if combo is None:
                combo = self._combo_ids[(known, entry.label_set)] = len(combos)
                combos.append((known, entry.label_set))
                combo_names.append([])
                combo_groups.append([])
            for kind, number in (("shape", known), ("combo", combo)):
                member_names, member_groups = own(kind, number)
                self._empty_lists -= not member_names
                position = bisect_left(member_names, entry.name)
                member_names.insert(position, entry.name)
                member_groups.insert(position, entry.groups)
        self._view = _View(
            shape_entries, shape_names, shape_groups, combos, combo_names, combo_groups, shape_gpu
        )
        if self._empty_lists > len(shape_entries) + len(combos):  # mostly dead lists: compact
            self._view = self._build_view()

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
        modes = tuple(sorted(server.runtime_modes))
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
            modes,
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
            modes,
            shape,
            label_set,
        )

    def view(self) -> _View:
        """The grouped lists a query reads (a snapshot: updates replace it, never change it)."""
        if self._view is None:
            self._view = self._build_view()
        return self._view

    def _build_view(self) -> _View:
        """Every list derived afresh (built, after large changes, or to drop emptied lists)."""
        self._dense, self._combo_ids, self._gpu_ids, self._empty_lists = {}, {}, {}, 0
        shape_entries: list[ServerEntry] = []
        shape_names: list[list[str]] = []
        shape_groups: list[list[tuple[tuple[int, tuple[str, ...]], ...]]] = []
        combo_names: list[list[str]] = []
        combo_groups: list[list[tuple[tuple[int, tuple[str, ...]], ...]]] = []
        for name in sorted(self.entries):  # name order, so every list below is in name order too
            entry = self.entries[name]
            shape = self._dense.get(entry.shape)
            if shape is None:
                shape = self._dense[entry.shape] = len(shape_entries)
                shape_entries.append(entry)
                shape_names.append([])
                shape_groups.append([])
            shape_names[shape].append(name)
            shape_groups[shape].append(entry.groups)
            combo = self._combo_ids.setdefault((shape, entry.label_set), len(self._combo_ids))
            if combo == len(combo_names):
                combo_names.append([])
                combo_groups.append([])
            combo_names[combo].append(name)
            combo_groups[combo].append(entry.groups)
        shape_gpu = [self._gpu_ids.setdefault(_gpu_key(entry), len(self._gpu_ids)) for entry in shape_entries]
        return _View(
            shape_entries=shape_entries,
            shape_names=shape_names,
            shape_groups=shape_groups,
            combos=list(self._combo_ids),
            combo_names=combo_names,
            combo_groups=combo_groups,
            shape_gpu=shape_gpu,
        )


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
    """The major of the CUDA the image needs: the newest it declares or carries (placement.cuda_needs)."""
    text = cuda_needs.needed_cuda(facts) or facts.env.get("CUDA_VERSION", "")
    head = text.lstrip("v").split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _fmt_sizes(have: int, need: int) -> tuple[str, str]:
    """`have` and `need` (bytes; have < need) in one unit, GiB from 1 GiB on, else MiB: what a
    server has rounded down, what a request needs rounded up (2 decimals), so have < need still
    reads so (never `40 GiB < requested 40 GiB`)."""
    unit, size = ("GiB", _GIB) if need >= _GIB else ("MiB", 1024**2)
    shown_have = math.floor(have * 100 / size) / 100
    shown_need = math.ceil(need * 100 / size) / 100
    return f"{shown_have:g} {unit}", f"{shown_need:g} {unit}"


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
            has, wants = _fmt_sizes(gpu.memory_mib * 1024**2, request.min_gpu_memory)
            reasons.append(f"GPU memory {has} < requested {wants}")
        cc = gpu.compute_capability or None
        if request.min_compute_capability is not None:
            if cc is None:
                reasons.append("compute capability unknown; request needs " + request.min_compute_capability)
            elif not compare_version(cc, ">=", request.min_compute_capability):
                reasons.append(f"compute capability {cc} < requested {request.min_compute_capability}")
        reasons.extend(self._gpu_rules(plan, gpu, cc))
        reasons.extend(self._requirement_reasons(plan, gpu, cc))
        verdict = (not reasons, rank, tuple(reasons))
        plan.verdicts[class_id] = verdict
        return verdict

    @staticmethod
    def _gpu_rules(plan: _Plan, gpu: GpuClass, cc: str | None) -> list[str]:
        """Image rules beyond NVIDIA_REQUIRE_* that read one GPU class (e.g. CUDA 13's arch floor).

        The place for rules on what an image's CUDA needs from a GPU; evaluated once per GPU class
        and query, so a rule may be as slow as it likes.
        """
        if (
            plan.cuda_major is not None
            and plan.cuda_major >= 13
            and cc
            and not compare_version(cc, ">=", "7.5")
        ):
            return [
                f"CUDA {plan.cuda_major} image needs compute capability 7.5 or newer "
                f"(CUDA 13 dropped Maxwell, Pascal and Volta); this GPU has {cc}"
            ]
        if plan.inferred is not None:  # the CUDA and GPU code the image carries (placement.cuda_needs)
            return cuda_needs.gpu_reasons(plan.inferred, cc, gpu.driver)
        return []

    def caveats(self) -> list[str]:
        """NVIDIA libraries of the image lacking code for a GPU class it is eligible on (placement.gpu_code)."""
        found: list[str] = []
        for plan in self.plans.values():
            if plan.inferred is None:
                continue
            for class_id, (usable, _, _) in sorted(plan.verdicts.items()):
                gpu = self.index.classes[class_id]
                if usable and gpu.compute_capability:
                    for caveat in cuda_needs.gpu_caveats(plan.inferred, gpu.compute_capability):
                        found.append(f"on {gpu.name} (compute capability {gpu.compute_capability}): {caveat}")
        return found

    @staticmethod
    def _shape_rules(plan: _Plan, entry: ServerEntry) -> list[str]:
        """Image rules beyond NVIDIA_REQUIRE_* that read a server's driver (e.g. a driver floor).

        Called once per GPU sub-shape and query for a GPU image, with a representative server:
        read only what `_gpu_key` keys on (driver, driver CUDA, musl, GPU classes and counts,
        runtime modes).
        """
        return []

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
            # Decisive first: the image cannot run on this architecture at all; then what the GPU
            # side says (itself decisive first); then the CPUs and memory a bigger server would add.
            reasons: list[str] = []
            if arch_reason is not None:
                reasons.append(arch_reason)
            reasons.extend(gpu_reasons)
            if cpus is not None and cpus_short:
                reasons.append(f"has {_fmt_cpus(entry.cpus)} CPUs, request needs {_fmt_cpus(cpus)}")
            if memory is not None and memory_short:
                has, wants = _fmt_sizes(entry.memory, memory)
                reasons.append(f"has {has} memory, request needs {wants}")
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
                # A server without NVIDIA's driver: that says it all (no musl, requirement or
                # GPU-count reason after it).
                return ("no NVIDIA driver",), (), 0, 0, 0, 0.0
            if request.min_driver is not None and not compare_version(entry.driver, ">=", request.min_driver):
                reasons.append(f"driver {entry.driver} < requested {request.min_driver}")
            if plan.requirements.error is not None:
                reasons.append(f"image requirement cannot be evaluated: {plan.requirements.error}")
            if plan.musl and plan.gpu_image and not entry.musl:
                reasons.append("image uses musl libc with GPUs; server has no musl GPU support")
            reasons.extend(self._shape_rules(plan, entry))
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
                    count_reason = f"needs {needed} free GPU(s), has {detail}"
                else:
                    count_reason = f"needs {needed} suitable free GPU(s), has {available} ({detail})"
                class_reasons = [
                    f"{count} free {self.index.classes[class_id].name}: {line}"
                    for class_id, count, why in refused
                    for line in why
                ]
                # With no suitable GPU at all, why the GPUs it has do not suit is decisive (the
                # count follows from it); with some, too few of them is.
                if available == 0:
                    reasons.extend([*class_reasons, count_reason])
                else:
                    reasons.extend([count_reason, *class_reasons])
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
    spare GPUs left on the server, then the least GPU memory that still suffices, then fewest spare
    CPUs, then name. The work is per server shape (and label set), never per server: the Decision
    holds the servers of each shape as shared lists and lists single servers only when asked.
    Pure: reads the index, changes nothing (an index shared with other threads may be read
    concurrently as long as its `view()` was built before).
    """
    index = inventory if isinstance(inventory, FleetIndex) else FleetIndex.build(inventory)
    view = index.view()
    form = (image.model_dump_json(), request.model_dump_json())
    # The same question on the same view has the same (immutable) answer.
    kept = index.kept_decision(form, view)
    if kept is not None:
        return kept
    query = _Query(image, request, index)
    # A shape's verdict depends on the shape and the query only, so it is kept per query form
    # (image facts and request) and shape id: after a fleet change, only shapes new to it are judged.
    known = index.shape_results(form)
    results = []
    for entry, gpu_shape in zip(view.shape_entries, view.shape_gpu, strict=True):
        result = known.get(entry.shape)
        if result is None:
            result = known[entry.shape] = query.evaluate(entry, gpu_shape)
        results.append(result)
    labels = list(request.labels.items())
    eligible: list[_Bucket] = []
    refused: list[_Bucket] = []
    if labels:
        missing = [_label_reasons(have, labels) for have in index.label_sets]
        for combo, (shape, label_set) in enumerate(view.combos):
            if not view.combo_names[combo]:
                continue  # every server left this combination since the view was built
            result = results[shape]
            reasons = (*result[0], *missing[label_set])
            bucket = _Bucket(result, view.combo_names[combo], view.combo_groups[combo], reasons)
            (refused if reasons else eligible).append(bucket)
    else:
        for shape, result in enumerate(results):
            if not view.shape_names[shape]:
                continue
            bucket = _Bucket(result, view.shape_names[shape], view.shape_groups[shape], result[0])
            (refused if result[0] else eligible).append(bucket)
    warnings = list(dict.fromkeys(w for plan in query.plans.values() for w in plan.requirements.warnings))
    warnings += [caveat for caveat in dict.fromkeys(query.caveats()) if caveat not in warnings]
    hints = [
        hint
        for hint in (
            cuda_needs.hint([platform.gpu for platform in image.platforms], request.gpus),
            image.idle_gpus_hint(request.gpus),
        )
        if hint
    ]
    decision = Decision(eligible, refused, warnings, hints, image.pending, image_needs_gpu=image.needs_gpu)
    index.keep_decision(form, view, decision)
    return decision


@dataclass(frozen=True, slots=True)
class _Bucket:
    """Servers that get one verdict: a shape, or a shape and label set when the request has labels."""

    result: _ShapeResult
    names: Sequence[str]  # name order; shared with the index view, never modified
    groups: Sequence[tuple[tuple[int, tuple[str, ...]], ...]]  # free GPUs per server, aligned with names
    reasons: tuple[str, ...]

    @property
    def key(self) -> SortKey:
        return self.result[2]

    def entry(self, position: int) -> EligibleServer:
        _, picks, _, platform, score = self.result
        free = self.groups[position]
        gpus = [uuid for group, count in picks for uuid in free[group][1][:count]]
        return {"server": self.names[position], "gpus": gpus, "score": score, "platform": platform}


def _named(names: Sequence[str], number: int, start: int) -> Iterator[tuple[str, int, int]]:
    """(name, bucket number, position) from `start` on: one bucket's stream for a merge by name."""
    for position in range(start, len(names)):
        yield names[position], number, position


def _first_name(bucket: _Bucket) -> str:
    return bucket.names[0]


class ReasonSummary(TypedDict):
    reason: str
    count: int
    examples: list[str]


Cursor = tuple[SortKey, str]  # (rank key, server name) of the last server a page listed


class Decision:
    """Eligible servers best fit first (with the GPU UUIDs to reserve), every other server with reasons.

    Pages (`page`) and summaries (`ineligible_summary`) cost O(shapes + page), whatever the fleet
    size; `eligible` and `ineligible` list every server (O(servers)) for callers that want all.
    Ranking is a total order on (rank key, server name), so a cursor stays meaningful when the
    fleet changes between pages: the next page starts after the last server listed.
    """

    __slots__ = (
        "_refused",
        "_summaries",
        "_tiers",
        "eligible_count",
        "hints",
        "image_needs_gpu",
        "ineligible_count",
        "pending",
        "warnings",
    )

    def __init__(
        self,
        eligible: list[_Bucket],
        refused: list[_Bucket],
        warnings: list[str],
        hints: list[str] | None = None,
        pending: list[str] | None = None,
        *,
        image_needs_gpu: bool = False,
    ) -> None:
        self.pending = pending or []
        self.image_needs_gpu = image_needs_gpu  # ImageFacts.needs_gpu of the image judged
        tiers: dict[SortKey, list[_Bucket]] = {}
        for bucket in eligible:
            tiers.setdefault(bucket.key, []).append(bucket)
        self._tiers = sorted(tiers.items(), key=lambda tier: tier[0])
        self._refused = refused
        self._summaries: dict[int, list[ReasonSummary]] = {}
        self.warnings = warnings
        self.hints = hints or []  # e.g. CUDA found in the layers of a CPU request (placement.cuda_needs)
        self.eligible_count = sum(len(bucket.names) for bucket in eligible)
        self.ineligible_count = sum(len(bucket.names) for bucket in refused)

    def _ranked(self, after: Cursor | None = None) -> Iterator[tuple[_Bucket, int]]:
        """(bucket, position) of each eligible server in rank order, starting after `after`."""
        for key, buckets in self._tiers:
            if after is not None and key < after[0]:
                continue
            starts = [
                bisect_right(bucket.names, after[1]) if after is not None and key == after[0] else 0
                for bucket in buckets
            ]
            if len(buckets) == 1:
                bucket = buckets[0]
                yield from ((bucket, position) for position in range(starts[0], len(bucket.names)))
                continue
            streams = [
                _named(bucket.names, number, start)
                for number, (bucket, start) in enumerate(zip(buckets, starts, strict=True))
            ]
            for _, number, position in heapq.merge(*streams):
                yield buckets[number], position

    def page(self, limit: int, after: Cursor | None = None) -> tuple[list[EligibleServer], Cursor | None]:
        """Up to `limit` eligible servers after `after`, and the cursor for the next page (None: done)."""
        listed: list[EligibleServer] = []
        last: tuple[_Bucket, int] | None = None
        ranked = self._ranked(after)
        for bucket, position in islice(ranked, limit):
            listed.append(bucket.entry(position))
            last = bucket, position
        if last is None or next(ranked, None) is None:
            return listed, None
        return listed, (last[0].key, last[0].names[last[1]])

    @property
    def eligible(self) -> list[EligibleServer]:
        """Every eligible server, best first."""
        return [bucket.entry(position) for bucket, position in self._ranked()]

    @property
    def ineligible(self) -> list[IneligibleServer]:
        """Every other server in name order, each with every reason, the decisive one first."""
        listed = [
            (name, reasons)
            for bucket in self._refused
            for reasons in (list(bucket.reasons),)
            for name in bucket.names
        ]
        listed.sort(key=itemgetter(0))
        return [{"server": name, "reasons": reasons} for name, reasons in listed]

    def ineligible_summary(self, examples: int = 3) -> list[ReasonSummary]:
        """Each decisive reason once (a server's first: see `ineligible` for all of them), with how
        many servers it rules out and the first few by name; most first. The counts add up to
        `ineligible_count`: every server is counted once.

        Computed once per Decision and examples count (a Decision is immutable); callers get copies.
        """
        summary = self._summaries.get(examples)
        if summary is None:
            summary = self._summaries[examples] = self._summarise(examples)
        return [
            {"reason": i["reason"], "count": i["count"], "examples": list(i["examples"])} for i in summary
        ]

    def _summarise(self, examples: int) -> list[ReasonSummary]:
        by_reasons: dict[tuple[str, ...], list[_Bucket]] = {}
        for bucket in self._refused:  # many buckets share their reasons: group them first
            by_reasons.setdefault(bucket.reasons, []).append(bucket)
        counts: dict[str, int] = {}
        holders: dict[str, list[_Bucket]] = {}
        for reasons, buckets in by_reasons.items():
            size = sum(len(bucket.names) for bucket in buckets)
            reason = reasons[0]  # each server once, under its decisive reason
            counts[reason] = counts.get(reason, 0) + size
            holders.setdefault(reason, []).extend(buckets)
        summary: list[ReasonSummary] = []
        for reason, count in counts.items():
            # The first names overall lie in the buckets whose first names are the first.
            first = heapq.nsmallest(examples, holders[reason], key=_first_name)
            names = list(islice(heapq.merge(*(bucket.names for bucket in first)), examples))
            summary.append({"reason": reason, "count": count, "examples": names})
        summary.sort(key=lambda item: (-item["count"], item["reason"]))
        return summary

    def __eq__(self, other: object) -> bool:
        """Same servers listed the same way (O(servers): for tests and tools, not hot paths)."""
        if not isinstance(other, Decision):
            return NotImplemented
        return (self.eligible, self.ineligible, self.warnings) == (
            other.eligible,
            other.ineligible,
            other.warnings,
        )

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value object: equality only

    @property
    def best(self) -> EligibleServer | None:
        """The best-fit eligible server, if any."""
        listed, _ = self.page(1)
        return listed[0] if listed else None


def _label_reasons(have: dict[str, str], wanted: list[tuple[str, str]]) -> list[str]:
    reasons = []
    for label, value in wanted:
        current = have.get(label)
        if current != value:
            suffix = f" (server has {label}={current})" if current is not None else ""
            reasons.append(f"label {label}={value} missing{suffix}")
    return reasons
