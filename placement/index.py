"""The fleet prepared for queries: GPUs grouped into classes, servers into shapes, and its caches.

Pure. `FleetIndex.build` derives each server once (GPUs, and the MIG devices of GPUs in MIG mode,
grouped into classes of identical facts; a GPU in MIG mode is never a unit of its own,
servers into shapes that get identical verdicts); `update` and `remove` keep it current server by
server, copy-on-write, so a query already reading a view is unaffected. The index also keeps the
last `QUERY_FORMS_KEPT` query forms' shape verdicts and decisions, and the last `GPU_FORMS_KEPT` GPU
forms' GPU parts, which questions differing only in CPUs, memory or labels share (placement.decide
and placement.query read them).
Built for fleets of 100,000 servers: a query's cost grows with the number of shapes, not servers.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TypeVar

from placement.decision import Decision, GpuPart, ShapeResult
from placement.inventory import Server

QUERY_FORMS_KEPT = 64  # query forms (image facts + request) whose verdicts an index keeps
GPU_FORMS_KEPT = 16  # GPU forms (placement.query.gpu_form) whose GPU parts an index keeps
_K = TypeVar("_K")
_V = TypeVar("_V")


@dataclass(frozen=True, slots=True)
class GpuClass:
    """Units that are the same for placement: whole GPUs of the same product, memory, CC, brand and
    host driver, or MIG devices of the same profile (and memory and SMs) on such a parent GPU.

    For a MIG device, `name`, `compute_capability` and `brand` are its parent's (the image's
    requirements apply to the parent) and `memory_mib` is the device's own.
    """

    name: str
    memory_mib: int
    compute_capability: str
    brand: str
    driver: str | None
    cuda: str | None
    mig_profile: str | None = None  # None: a whole GPU
    multiprocessors: int = 0  # a MIG device's SMs (0 for a whole GPU: NVML's count is not read)
    parent_memory_mib: int = 0  # a MIG device's parent GPU memory
    decoders: int | None = None  # a MIG device's video decoders (NVDEC); None: not known, or a whole GPU

    @property
    def label(self) -> str:
        """`NVIDIA H100 80GB HBM3`, or `NVIDIA H100 80GB HBM3 MIG 1g.10gb` as NVML names a MIG device."""
        return self.name if self.mig_profile is None else f"{self.name} MIG {self.mig_profile}"


# GpuClass's fields, in order: what makes two units the same for placement
ClassKey = tuple[str, int, str, str, str | None, str | None, str | None, int, int, int | None]


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
    total_gpus: int  # every GPU, in MIG mode or not
    busy_gpus: int  # whole GPUs (not in MIG mode) reserved or busy
    groups: tuple[tuple[int, tuple[str, ...]], ...]  # (class id, free GPU or MIG device UUIDs in index order)
    runtime_modes: tuple[str, ...] = ()  # how Docker can hand it GPUs: nvidia runtime, --gpus, CDI
    shape: int = 0  # servers with the same shape get the same verdict; labels and names aside
    label_set: int = 0  # servers with the same labels get the same label verdict
    mig_gpus: int = 0  # GPUs in MIG mode (never handed out whole)
    mig_devices: int = 0  # their MIG devices
    busy_mig_devices: int = 0  # MIG devices reserved or busy (all of a parent that is itself in use)


@dataclass(slots=True)
class IndexView:
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
    # How `shape_gpu` numbers GPU sub-shapes: views of one epoch (a build, and the updates after it)
    # number them alike, so GPU parts kept by number (`FleetIndex.gpu_parts`) hold across them.
    gpu_epoch: int = 0
    # The GPU classes free on its servers with NVIDIA's driver, by CPU architecture (`present_classes`).
    classes_present: dict[str, frozenset[int]] | None = None


def present_classes(view: IndexView) -> dict[str, frozenset[int]]:
    """The GPU classes free on `view`'s servers that have NVIDIA's driver, by CPU architecture:
    worked out at the first call for each view (views never change), one pass over its shapes."""
    if view.classes_present is None:
        found: dict[str, set[int]] = {}
        for entry, names in zip(view.shape_entries, view.shape_names, strict=True):
            if names and entry.driver is not None:
                found.setdefault(entry.arch, set()).update(class_id for class_id, _ in entry.groups)
        view.classes_present = {arch: frozenset(ids) for arch, ids in found.items()}
    return view.classes_present


_gpu_position = attrgetter("index")


def _bounded_put(kept: dict[_K, _V], key: _K, value: _V, limit: int = QUERY_FORMS_KEPT) -> None:
    """`kept[key] = value`, dropping the oldest entries beyond `limit`.

    Safe from several threads (dict operations are atomic); a race only costs a recomputation.
    """
    while len(kept) >= limit:
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
        entry.mig_gpus,
        entry.mig_devices,
        entry.busy_mig_devices,
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
    _class_ids: dict[ClassKey, int] = field(default_factory=dict)
    _shape_ids: dict[tuple[object, ...], int] = field(default_factory=dict)
    _label_ids: dict[tuple[tuple[str, str], ...], int] = field(default_factory=dict)
    _view: IndexView | None = None
    # How the view numbers shapes, combinations and GPU sub-shapes; kept so updates extend it.
    _dense: dict[int, int] = field(default_factory=dict)
    _combo_ids: dict[tuple[int, int], int] = field(default_factory=dict)
    _gpu_ids: dict[tuple[object, ...], int] = field(default_factory=dict)
    _empty_lists: int = 0  # shape/combination lists emptied by updates, compacted by a rebuild
    _shape_results: dict[tuple[str, str], dict[int, ShapeResult]] = field(default_factory=dict)
    _decisions: dict[tuple[str, str], tuple[IndexView, Decision]] = field(default_factory=dict)
    _gpu_epoch: int = 0  # bumped whenever `_gpu_ids` starts afresh
    _gpu_parts: dict[tuple[int, str], dict[tuple[str, int], GpuPart]] = field(default_factory=dict)

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

    def kept_decision(self, query: tuple[str, str], view: IndexView) -> Decision | None:
        """The Decision for this query form if it was made on `view` (the index unchanged since)."""
        kept = self._decisions.get(query)
        return kept[1] if kept is not None and kept[0] is view else None

    def keep_decision(self, query: tuple[str, str], view: IndexView, decision: Decision) -> None:
        _bounded_put(self._decisions, query, (view, decision))

    def gpu_parts(self, view: IndexView, gpu_form: str) -> dict[tuple[str, int], GpuPart]:
        """GPU parts of verdicts already worked out for this GPU form (placement.query.gpu_form), by
        (platform, GPU sub-shape number as `view` gives it), for the last few forms. A GPU sub-shape's
        number stands for the same GPUs, driver and counts for as long as its epoch; a part never goes
        stale. Safe from several threads, as `shape_results`."""
        key = (view.gpu_epoch, gpu_form)
        found = self._gpu_parts.get(key)
        if found is None:
            found = {}
            _bounded_put(self._gpu_parts, key, found, GPU_FORMS_KEPT)
        return found

    def shape_results(self, query: tuple[str, str]) -> dict[int, ShapeResult]:
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
        self._view = IndexView(
            shape_entries,
            shape_names,
            shape_groups,
            combos,
            combo_names,
            combo_groups,
            shape_gpu,
            self._gpu_epoch,
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
        busy_gpus = mig_gpus = mig_devices = busy_mig_devices = 0
        class_ids = self._class_ids
        grouped: dict[int, list[str]] = {}
        for gpu in gpus:
            uuid = gpu.uuid
            if gpu.mig:
                # Never a unit of its own: its MIG devices are (all busy while the parent is in use).
                mig_gpus += 1
                parent_busy = uuid in busy
                devices = gpu.mig_devices
                for device in sorted(devices, key=_gpu_position) if len(devices) > 1 else devices:
                    mig_devices += 1
                    if parent_busy or device.uuid in busy:
                        busy_mig_devices += 1
                        continue
                    key: ClassKey = (
                        gpu.name,
                        device.memory_mib,
                        gpu.compute_capability,
                        gpu.brand,
                        driver,
                        cuda,
                        device.profile,
                        device.multiprocessors,
                        gpu.memory_mib,
                        device.decoders,
                    )
                    class_id = class_ids.get(key)
                    if class_id is None:
                        class_id = class_ids[key] = len(self.classes)
                        self.classes.append(GpuClass(*key))
                    grouped.setdefault(class_id, []).append(device.uuid)
                continue
            if uuid in busy:
                busy_gpus += 1
                continue
            key = (
                gpu.name,
                gpu.memory_mib,
                gpu.compute_capability,
                gpu.brand,
                driver,
                cuda,
                None,
                0,
                0,
                None,
            )
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
            mig_gpus,
            mig_devices,
            busy_mig_devices,
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
            mig_gpus,
            mig_devices,
            busy_mig_devices,
        )

    def view(self) -> IndexView:
        """The grouped lists a query reads (a snapshot: updates replace it, never change it)."""
        if self._view is None:
            self._view = self._build_view()
        return self._view

    def _build_view(self) -> IndexView:
        """Every list derived afresh (built, after large changes, or to drop emptied lists)."""
        self._dense, self._combo_ids, self._gpu_ids, self._empty_lists = {}, {}, {}, 0
        self._gpu_epoch += 1
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
        return IndexView(
            shape_entries=shape_entries,
            shape_names=shape_names,
            shape_groups=shape_groups,
            combos=list(self._combo_ids),
            combo_names=combo_names,
            combo_groups=combo_groups,
            shape_gpu=shape_gpu,
            gpu_epoch=self._gpu_epoch,
        )
