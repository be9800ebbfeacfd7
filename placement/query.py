"""One eligibility query compiled against a fleet index: per-platform plans, GPU-class and shape verdicts.

Pure. `Query` prepares what each image platform demands once (`Plan`), then judges each GPU class
once (`class_verdict`), the GPU part once per GPU sub-shape and each server shape once (`evaluate`),
with every reason worded for the person deploying. placement.decide runs it over an index's view.

A request asks for whole GPUs or for MIG devices (`DeployRequest.slices_needed`), never both: a
whole-GPU request never gets a GPU in MIG mode, a MIG request only the MIG devices of GPUs in MIG
mode, judged by their parent's compute capability, brand and driver and by their own profile and
memory. A server that has only the other kind says so: "GPU in MIG mode, none whole", then
"GPU in MIG mode: 7 × 1g.10gb free of 7 MIG device(s)" (the decisive reason stays the same from
server to server, so summaries group them; the counts follow).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from placement import cuda_needs
from placement.decision import NO_KEY, GpuPart, ShapeResult
from placement.gpu_code import Rule
from placement.gpus import MEMORY_TOLERANCE, matches_model, memory_satisfies, runtime_brands
from placement.image_facts import ImageFacts
from placement.index import FleetIndex, GpuClass, IndexView, ServerEntry, present_classes
from placement.mig import count_profiles
from placement.nvidia_require import DeviceFacts, ImageRequirements, Verdict, compare_version
from placement.request import DeployRequest
from placement.sizes import compared_sizes, size_text
from scanner.models import GpuFacts

_GIB = 1024**3
# The request's fields that only the per-shape CPU, memory and label checks read: a question that
# differs from another in these alone shares its GPU parts (`gpu_form`).
_NOT_GPU_FIELDS = frozenset({"cpus", "memory", "labels"})


@dataclass(slots=True)
class Plan:
    """What one image platform demands, prepared once per query."""

    platform: str
    requirements: ImageRequirements
    gpu_image: bool
    musl: bool
    cuda_major: int | None
    needed: int  # whole GPUs
    slices: int = 0  # MIG devices (a request asks for one kind or the other)
    verdicts: dict[int, tuple[bool, int, tuple[str, ...]]] = field(default_factory=dict)
    passes: dict[int, tuple[str, ...]] = field(default_factory=dict)  # why each usable GPU class suits
    inferred: GpuFacts | None = None  # CUDA found in the layers: driver floor and archs per GPU
    rule: Rule = "dispatch"  # how the image's GPU code is judged (placement.gpu_code)
    video: bool = False  # NVIDIA_DRIVER_CAPABILITIES asks for `video` (or `all`): NVDEC and NVENC libraries


def _cuda_major(facts: GpuFacts) -> int | None:
    """The major of the CUDA the image needs: the newest it declares or carries (placement.cuda_needs)."""
    text = cuda_needs.needed_cuda(facts) or facts.env.get("CUDA_VERSION", "")
    head = text.lstrip("v").split(".", 1)[0]
    return int(head) if head.isdigit() else None


def asks_for_video(facts: GpuFacts) -> bool:
    """Whether the image's NVIDIA_DRIVER_CAPABILITIES includes `video` (or `all`): the runtime then mounts
    the video decode and encode libraries, which need the GPU's (or MIG device's) media engines."""
    text = facts.driver_capabilities or ""
    return bool({part.strip().lower() for part in text.split(",")} & {"video", "all"})


def _fmt_sizes(have: int, need: int) -> tuple[str, str]:
    """`have` and `need` (bytes; have < need) in one unit (placement.sizes.compared_sizes)."""
    return compared_sizes(have, need)


def _fmt_cpus(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def gpu_form(image: ImageFacts, request: DeployRequest) -> str:
    """What the GPU part of every verdict reads of a question: each platform's GPU facts and libc (all a
    `Plan` is made of) and the request less its CPU, memory and label fields. Questions of one GPU
    form share their GPU parts in the index (`FleetIndex.gpu_parts`)."""
    platforms = [
        [
            platform.architecture,
            platform.platform,
            platform.libc.flavour,
            platform.gpu.model_dump(mode="json"),
        ]
        for platform in image.platforms
    ]
    return json.dumps([platforms, request.model_dump(mode="json", exclude=set(_NOT_GPU_FIELDS))])


class Query:
    """One image and request judged against one index: verdicts cached per GPU class, GPU sub-shape and arch.

    With `view`, the GPU parts come from, and go to, the index's store for the question's GPU form
    (`gpu_form`), so a question that differs from an earlier one only in CPUs, memory or labels judges
    no GPU sub-shape again."""

    def __init__(
        self, image: ImageFacts, request: DeployRequest, index: FleetIndex, view: IndexView | None = None
    ) -> None:
        self.request = request
        self.index = index
        self.plans: dict[str, Plan] = {}
        for platform in image.platforms:
            if platform.architecture in self.plans:
                continue
            gpu_image = platform.gpu.required
            slices = request.slices_needed
            needed = request.gpus if request.gpus is not None else (1 if gpu_image and not slices else 0)
            self.plans[platform.architecture] = Plan(
                platform=platform.platform,
                requirements=ImageRequirements.from_gpu_facts(platform.gpu),
                gpu_image=gpu_image,
                musl=platform.libc.flavour == "musl",
                cuda_major=_cuda_major(platform.gpu),
                needed=needed,
                slices=slices,
                inferred=platform.gpu if platform.gpu.inferred or platform.gpu.archs else None,
                rule=request.gpu_code_rule or "dispatch",
                video=asks_for_video(platform.gpu),
            )
        self.platform_names = ", ".join(p.platform for p in image.platforms) or "none"
        self.models = list(request.gpu_models)
        self.profiles = frozenset(request.mig_profiles)
        self.ordered = request.gpu_model_order == "ordered"
        self.arch_plans: dict[str, tuple[Plan | None, str | None]] = {}
        self._mig_texts: dict[tuple[tuple[tuple[str, int], ...], int, int, bool], str] = {}
        self.gpu_parts: dict[tuple[str, int], GpuPart] = (
            index.gpu_parts(view, gpu_form(image, request)) if view is not None else {}
        )

    def class_verdict(self, plan: Plan, class_id: int) -> tuple[bool, int, tuple[str, ...]]:
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
            what = "GPU" if gpu.mig_profile is None else "MIG device"
            reasons.append(f"{what} memory {has} < requested {wants}")
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
        if not reasons:
            plan.passes[class_id] = self._class_passes(plan, gpu, cc)
        return verdict

    def _class_passes(self, plan: Plan, gpu: GpuClass, cc: str | None) -> tuple[str, ...]:
        """Why a usable GPU class suits, in words: what was asked of it, the image's requirement (the
        alternative that holds, brand exceptions named), the carried CUDA's driver and GPU code."""
        request = self.request
        lines: list[str] = []
        if self.models:
            wanted = next(w for w in self.models if matches_model(gpu.name, w))
            lines.append(f"{gpu.name} is a {wanted}")
        if request.min_gpu_memory is not None:
            has, wants = gpu.memory_mib * 1024**2, request.min_gpu_memory
            compared = ">=" if has >= wants else f"within {MEMORY_TOLERANCE:.0%} of"  # NVML totals run short
            lines.append(f"GPU memory {size_text(has)} {compared} requested {size_text(wants, 'up')}")
        if request.min_compute_capability is not None and cc:
            lines.append(f"compute capability {cc} >= requested {request.min_compute_capability}")
        if (
            plan.requirements.error is None
            and not plan.requirements.disabled
            and plan.requirements.expressions
        ):
            brand = (runtime_brands(gpu.brand) or (None,))[0]
            lines.extend(plan.requirements.passes_by(DeviceFacts(gpu.cuda, gpu.driver, cc, brand)))
        if plan.cuda_major is not None and plan.cuda_major >= 13 and cc:
            lines.append(f"compute capability {cc} >= 7.5, which CUDA {plan.cuda_major} needs")
        if plan.inferred is not None:
            lines.extend(cuda_needs.gpu_passes(plan.inferred, cc, gpu.driver, gpu.cuda, plan.rule))
        return tuple(lines)

    @staticmethod
    def _gpu_rules(plan: Plan, gpu: GpuClass, cc: str | None) -> list[str]:
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
            return cuda_needs.gpu_reasons(plan.inferred, cc, gpu.driver, gpu.cuda, plan.rule)
        return []

    def caveats(self) -> list[str]:
        """What the image runs without on each GPU class it is eligible on ("runs; without ...":
        extensions used on other hardware, optional packages, NVIDIA libraries; placement.gpu_code),
        and the MIG devices with no video decoder for an image that asks for the `video` capability."""
        found: list[str] = []
        for plan in self.plans.values():
            decodes = plan.video and plan.slices > 0
            for class_id, (usable, _, _) in sorted(plan.verdicts.items()):
                if not usable:
                    continue
                gpu = self.index.classes[class_id]
                if decodes and gpu.decoders == 0 and (not self.profiles or gpu.mig_profile in self.profiles):
                    found.append(
                        f"on {gpu.label}: no video decoder (NVDEC) in this MIG device; the image asks for the"
                        " video driver capability (NVIDIA_DRIVER_CAPABILITIES), and decoding on the GPU fails"
                        " there (a profile with media engines, +me, has one)"
                    )
                if plan.inferred is not None and gpu.compute_capability:
                    for caveat in cuda_needs.gpu_caveats(plan.inferred, gpu.compute_capability, plan.rule):
                        found.append(
                            f"on {gpu.label} (compute capability {gpu.compute_capability}): runs; without {caveat}"
                        )
        return found

    def judge_present_classes(self, view: IndexView) -> None:
        """Judge every GPU class that `evaluate` would judge on the servers of `view`, as a query that
        reuses shape verdicts or GPU parts kept from earlier questions must (placement.decide):
        `caveats` reads the class verdicts, so it then covers the GPU classes of every server in the
        answer, not only of the shapes and GPU sub-shapes this query judged itself."""
        classes = self.index.classes
        for arch_name, class_ids in present_classes(view).items():
            arch = self.arch_plans.get(arch_name)
            if arch is None:
                arch = self.arch_plans[arch_name] = self._arch_plan(arch_name)
            plan = arch[0]
            if plan is None:
                continue
            slices = plan.slices > 0
            if (plan.slices if slices else plan.needed) <= 0:
                continue
            for class_id in sorted(class_ids):
                profile = classes[class_id].mig_profile
                if (profile is not None) != slices:
                    continue
                if profile is not None and self.profiles and profile not in self.profiles:
                    continue
                if class_id not in plan.verdicts:
                    self.class_verdict(plan, class_id)

    @staticmethod
    def _shape_rules(plan: Plan, entry: ServerEntry) -> list[str]:
        """Image rules beyond NVIDIA_REQUIRE_* that read a server's driver (e.g. a driver floor).

        Called once per GPU sub-shape and query for a GPU image, with a representative server:
        read only what `_gpu_key` keys on (driver, driver CUDA, musl, GPU classes and counts,
        runtime modes).
        """
        return []

    @staticmethod
    def _requirement_reasons(plan: Plan, gpu: GpuClass, cc: str | None) -> list[str]:
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

    def evaluate(self, entry: ServerEntry, gpu_shape: int) -> ShapeResult:
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
            return (arch_reason,), (), NO_KEY, "", 0.0, ()
        cpus = self.request.cpus
        memory = self.request.memory
        cpus_short = cpus is not None and entry.cpus < cpus
        memory_short = memory is not None and entry.memory < memory
        # Without GPUs in play the GPU part reads no plan, so every platform shares one entry.
        key = (plan.platform if plan.gpu_image or plan.needed or plan.slices else "", gpu_shape)
        gpu = self.gpu_parts.get(key)
        if gpu is None:
            gpu = self.gpu_parts[key] = self._gpu_part(plan, entry)
        gpu_reasons, picks, rank, spare_gpus, memory_mib, score, gpu_why = gpu
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
            return tuple(reasons), (), NO_KEY, plan.platform, 0.0, ()
        spare_cpus = entry.cpus - (cpus or 0)
        why = [f"CPU architecture {entry.arch}: the image's {plan.platform}", *gpu_why]
        if cpus is not None:
            why.append(f"has {_fmt_cpus(entry.cpus)} CPUs, request needs {_fmt_cpus(cpus)}")
        if memory is not None:
            why.append(f"has {size_text(entry.memory)} memory, request needs {size_text(memory, 'up')}")
        return (
            (),
            picks,
            (rank, spare_gpus, memory_mib, float(spare_cpus), entry.memory),
            plan.platform,
            score,
            tuple(why),
        )

    def _arch_plan(self, arch: str) -> tuple[Plan | None, str | None]:
        """The plan servers of `arch` are judged by, and the reason when the image lacks that arch."""
        plan = self.plans.get(arch)
        if plan is not None:
            return plan, None
        reason = f"CPU architecture {arch} is not among the image's platforms ({self.platform_names})"
        return next(iter(self.plans.values()), None), reason

    def _gpu_part(self, plan: Plan, entry: ServerEntry) -> GpuPart:
        """Driver, image-requirement and GPU-availability verdict, with the picks when it passes."""
        request = self.request
        reasons: list[str] = []
        why: list[str] = []
        slices = plan.slices > 0
        units = plan.slices if slices else plan.needed  # whole GPUs or MIG devices, never both
        if plan.gpu_image or units > 0:
            if entry.driver is None:
                # A server without NVIDIA's driver: that says it all (no musl, requirement or
                # GPU-count reason after it).
                return ("no NVIDIA driver",), (), 0, 0, 0, 0.0, ()
            if request.min_driver is not None and not compare_version(entry.driver, ">=", request.min_driver):
                reasons.append(f"driver {entry.driver} < requested {request.min_driver}")
            if plan.requirements.error is not None:
                reasons.append(f"image requirement cannot be evaluated: {plan.requirements.error}")
            if plan.musl and plan.gpu_image and not entry.musl:
                reasons.append("image uses musl libc with GPUs; server has no musl GPU support")
            reasons.extend(self._shape_rules(plan, entry))
        picks: list[tuple[int, int]] = []  # (position in entry.groups, how many units to take)
        picked = 0
        memory_mib = 0
        rank = 0
        free_total = 0  # free units of the kind asked for
        if units > 0:
            usable: list[tuple[int, int, int, int]] = []  # (rank, MiB, group position, free count)
            refused: list[tuple[int, int, tuple[str, ...]]] = []
            mig_free: list[tuple[int, int]] = []  # (class id, count) of free MIG devices, for the reasons
            available = wanted = 0  # suitable units; units of the kind (and profile) asked for
            verdicts = plan.verdicts
            classes = self.index.classes
            profiles = self.profiles
            for position, (class_id, uuids) in enumerate(entry.groups):
                count = len(uuids)
                profile = classes[class_id].mig_profile
                if profile is not None:
                    mig_free.append((class_id, count))
                if (profile is not None) != slices:
                    continue
                free_total += count
                if profile is not None and profiles and profile not in profiles:
                    continue  # another profile: counted in the reasons' summary, never refused one by one
                wanted += count
                judged = verdicts.get(class_id) or self.class_verdict(plan, class_id)
                if judged[0]:
                    usable.append((judged[1], classes[class_id].memory_mib, position, count))
                    available += count
                else:
                    refused.append((class_id, count, judged[2]))
            if available < units:
                count_reasons = (
                    self._slices_reasons(entry, units, available, wanted, mig_free)
                    if slices
                    else self._whole_reasons(entry, units, available, free_total, mig_free)
                )
                class_reasons = [
                    f"{count} free {self.index.classes[class_id].label}: {line}"
                    for class_id, count, said in refused
                    for line in said
                ]
                # With no suitable unit at all, why the ones it has do not suit is decisive (the
                # count follows from it); with some, too few of them is.
                if available == 0 and class_reasons:
                    reasons.extend([*class_reasons, *count_reasons])
                else:
                    reasons.extend([*count_reasons, *class_reasons])
            elif not reasons:
                if len(usable) > 1:
                    usable.sort()
                picked_classes: list[int] = []
                for class_rank, mib, position, free in usable:
                    take = min(free, units - picked)
                    picks.append((position, take))
                    picked_classes.append(entry.groups[position][0])
                    picked += take
                    memory_mib += mib * take
                    rank = max(rank, class_rank)
                    if picked == units:
                        break
                for class_id in dict.fromkeys(picked_classes):
                    gpu = self.index.classes[class_id]
                    why.extend(f"{gpu.label}: {line}" for line in plan.passes.get(class_id, ()))
        elif plan.gpu_image and entry.driver is not None and not plan.requirements.disabled:
            # No GPU assigned: the runtime checks once without a device (arch/brand are then true).
            facts = DeviceFacts(entry.cuda, entry.driver, device_visible=False)
            verdict = plan.requirements.check(facts)
            if not verdict.ok:
                reasons.extend(verdict.failed or (verdict.message,))
            else:
                why.append("no GPU asked for: the runtime checks the driver alone")
                why.extend(plan.requirements.passes_by(facts))
        elif units == 0:
            why.append(
                "no GPU asked for, and the image carries CUDA but declares no GPU: it runs on the CPUs"
                if plan.inferred is not None and plan.inferred.inferred is not None
                else "no GPU asked for, and the image declares none: it runs on the CPUs"
            )
        if reasons:
            return tuple(reasons), (), 0, 0, 0, 0.0, ()
        if units == 0:
            free_total = sum(
                len(uuids)
                for class_id, uuids in entry.groups
                if self.index.classes[class_id].mig_profile is None
            )
        if units and request.min_driver is not None:
            why.insert(0, f"driver {entry.driver} >= requested {request.min_driver}")
        if plan.musl and plan.gpu_image:
            why.append("the server has musl GPU support, which a musl image needs")
        spare = free_total - units
        return (), tuple(picks), rank, spare, memory_mib, round(1.0 / (1 + rank + spare), 4), tuple(why)

    def _mig_detail(
        self, entry: ServerEntry, mig_free: list[tuple[int, int]], whole_too: bool = False
    ) -> str:
        """`GPU in MIG mode: 7 × 1g.10gb free of 7 MIG device(s)`; worded once per query for each
        composition of free profiles (servers of many shapes share one). Kept apart from the decisive
        reason, so that reason stays the same across servers and summaries group them."""
        counts: dict[str, int] = {}
        classes = self.index.classes
        for class_id, count in mig_free:
            profile = classes[class_id].mig_profile or ""
            counts[profile] = counts.get(profile, 0) + count
        key = (tuple(counts.items()), entry.mig_gpus, entry.mig_devices, whole_too)
        text = self._mig_texts.get(key)
        if text is None:
            gpus = _mig_gpus(entry.mig_gpus) + (", never whole" if whole_too else "")
            if counts:
                text = f"{gpus}: {count_profiles(counts)} free of {entry.mig_devices} MIG device(s)"
            elif entry.mig_devices:
                text = f"{gpus}: all {entry.mig_devices} MIG device(s) in use"
            else:
                text = f"{gpus}: no MIG device configured"
            self._mig_texts[key] = text
        return text

    def _whole_reasons(
        self, entry: ServerEntry, needed: int, available: int, free: int, mig_free: list[tuple[int, int]]
    ) -> list[str]:
        """Too few whole GPUs; GPUs in MIG mode are named (in a reason of their own), never counted."""
        whole = entry.total_gpus - entry.mig_gpus
        if entry.mig_gpus and whole == 0:
            return [f"{_mig_gpus(entry.mig_gpus)}, none whole", self._mig_detail(entry, mig_free)]
        detail = f"{free} free of {whole}"
        if entry.busy_gpus:
            detail += f", {entry.busy_gpus} in use"
        if free == available:
            decisive = f"needs {needed} free GPU(s), has {detail}"
        else:
            decisive = f"needs {needed} suitable free GPU(s), has {available} ({detail})"
        return [decisive, self._mig_detail(entry, mig_free, whole_too=True)] if entry.mig_gpus else [decisive]

    def _slices_reasons(
        self, entry: ServerEntry, needed: int, available: int, wanted: int, mig_free: list[tuple[int, int]]
    ) -> list[str]:
        """Too few MIG devices: no GPU in MIG mode, none of the profile, or too few suitable free ones."""
        if entry.mig_gpus == 0:
            whole = f"{entry.total_gpus} whole GPU(s), none in MIG mode" if entry.total_gpus else "no GPU"
            return [f"needs {needed} MIG device(s), has {whole}"]
        kind = f"{' or '.join(sorted(self.profiles))} MIG device(s)" if self.profiles else "MIG device(s)"
        suitable = "" if wanted == available else "suitable "
        return [f"needs {needed} {suitable}free {kind}, has {available}", self._mig_detail(entry, mig_free)]


def _mig_gpus(count: int) -> str:
    return "GPU in MIG mode" if count == 1 else f"{count} GPUs in MIG mode"
