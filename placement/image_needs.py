"""What an image needs to run, in the one vocabulary every surface speaks. Pure.

Three facts, read of each platform (`scanner.models.GpuFacts`):

* **declared GPU**: the config asks for an NVIDIA GPU (`NVIDIA_*` variables or labels: `required`);
* **carried CUDA**: CUDA found in the layers (torch, NVIDIA's wheels, toolkits, GPU code: `inferred`),
  declared or not;
* **runs on a CPU too?**: yes, unless it declares a GPU.

`gpu` says them in one word, and the images list, its filters and legend, the image page, the
JSON API, `gpubadge scan` (table and `--json`) and the eligibility answer all use it:

* `required`: it declares an NVIDIA GPU, so it needs one (badge "NVIDIA GPU");
* `optional`: it declares none but carries CUDA, like PyTorch's and TensorFlow's CUDA builds, which
  also run on a CPU: placement puts it on any server when no GPU is asked for, and on a GPU only
  with a driver for its CUDA (badge "GPU optional");
* `none`: it declares no GPU and carries no CUDA (badge "CPU only").

The driver it needs is placement's own answer, never a second copy of a rule: the image's
`NVIDIA_REQUIRE_*` evaluated as NVIDIA's runtime evaluates them (`placement.nvidia_require`, brand
exceptions included) and the carried CUDA's floor (`placement.cuda_needs`), probed on the drivers
NVIDIA shipped with each CUDA toolkit (`cuda_needs.TOOLKIT_DRIVERS`) and on the driver branches the
image's brand exceptions name. `driver` is the lowest driver that runs it on any GPU brand;
`exceptions` are the older drivers that run it only on some brands (NVIDIA's forward-compatibility
clauses, `brand=tesla,driver>=470,driver<471`). Where its code runs by compute capability is
`cuda_needs.summary`. PTX JIT floors depend on the GPU, so they stay in the per-server answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, Field

from placement import cuda_needs
from placement.nvidia_require import DeviceFacts, ImageRequirements, compare_version
from scanner.models import GpuFacts, ImageReport, InferredCuda, PlatformReport

GpuUse = Literal["required", "optional", "none"]

# One word for each answer, and what it means: the badge, the legend and the filter say these.
GPU_WORDS: dict[GpuUse, str] = {"required": "NVIDIA GPU", "optional": "GPU optional", "none": "CPU only"}
GPU_MEANINGS: dict[GpuUse, str] = {
    "required": "declares an NVIDIA GPU (NVIDIA_* variables or labels): it needs one to run",
    "optional": "declares no GPU but carries CUDA (a CUDA build, such as PyTorch's): it runs on a CPU, and"
    " on an NVIDIA GPU when given one, with a driver for that CUDA",
    "none": "declares no GPU and carries no CUDA: it runs on a CPU",
}
_STRENGTH: dict[GpuUse, int] = {"none": 0, "optional": 1, "required": 2}
# A brand no requirement names: the runtime's brand clauses are false for it, as for most GPUs.
_NO_BRAND = "unlisted"


def gpu_use(declared: bool, carried: bool) -> GpuUse:
    """The one word for a declared GPU and carried CUDA (see the module docstring)."""
    if declared:
        return "required"
    return "optional" if carried else "none"


def carries_cuda(gpu: GpuFacts) -> bool:
    """CUDA was found in the layers (the scan's deep walk: `GpuFacts.inferred`, which any GPU code
    found sets too); the same test the listing's filters and badges make."""
    return gpu.inferred is not None


def strongest(uses: Iterable[GpuUse]) -> GpuUse:
    """An image's answer from its platforms': a GPU any platform needs is needed."""
    return max(uses, key=_STRENGTH.__getitem__, default="none")


class DriverNeed(BaseModel):
    """The driver an image platform needs, as placement judges it on any GPU."""

    floor: str | None = Field(
        default=None, description="the lowest driver that runs it on any GPU brand; null: no floor, or none"
    )
    reason: str = Field(description="what sets the floor, in words")
    exceptions: list[str] = Field(
        default_factory=list,
        description="older drivers that run it on some GPU brands only (NVIDIA_REQUIRE_CUDA's brand exceptions)",
    )
    runs: bool = Field(
        default=True, description="false when no driver runs it (an unsatisfiable requirement)"
    )


class PlatformNeeds(BaseModel):
    """One platform in the vocabulary (module docstring)."""

    platform: str
    gpu: GpuUse
    runs_on_cpu: bool
    declared_cuda: str | None = Field(
        default=None, description="CUDA_VERSION / NVIDIA_REQUIRE_CUDA's version"
    )
    carried_cuda: str | None = Field(default=None, description="the newest CUDA found in its layers")
    carried_by: str | None = Field(default=None, description="the evidence that set carried_cuda")
    cuda: str | None = Field(default=None, description="the CUDA it needs: the newest declared or carried")
    driver: DriverNeed | None = Field(default=None, description="null for a CPU-only platform")
    gpu_code: str | None = Field(default=None, description="where its GPU code runs (placement.gpu_code)")
    headline: str = Field(description="the answer in one sentence")


class ImageNeeds(BaseModel):
    """The image's answer: the strongest of its runnable platforms', each platform beside."""

    gpu: GpuUse
    runs_on_cpu: bool
    declared_cuda: list[str] = Field(default_factory=list)
    carried_cuda: list[str] = Field(default_factory=list)
    driver_floor: str | None = Field(
        default=None, description="the highest of its platforms' driver floors (any GPU brand)"
    )
    headline: str
    platforms: list[PlatformNeeds] = Field(default_factory=list)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else 0 for part in text.split("."))


@lru_cache(maxsize=1024)
def driver_cuda(driver: str) -> str | None:
    """The CUDA version a driver supports (what NVML reports): the newest toolkit whose own driver
    (`cuda_needs.TOOLKIT_DRIVERS`) it is at least."""
    supported = [
        toolkit for toolkit, own in cuda_needs.TOOLKIT_DRIVERS.items() if compare_version(driver, ">=", own)
    ]
    if not supported:
        return None
    major, minor = max(supported)
    return f"{major}.{minor}"


def _branches(requirements: ImageRequirements) -> dict[str, list[int]]:
    """The driver branches each brand's exception clauses name (`brand=tesla,driver>=470,driver<471`)."""
    found: dict[str, list[int]] = {}
    for _, expression in requirements.expressions:
        for term in expression.alternatives:
            brands = [c.value.lower() for c in term.conditions if c.key == "brand" and c.op == "="]
            lows = [
                int(c.value.split(".")[0])
                for c in term.conditions
                if c.key == "driver" and c.op in (">=", ">") and c.value.split(".")[0].isdigit()
            ]
            for brand in brands:
                for low in lows:
                    if low not in found.setdefault(brand, []):
                        found[brand].append(low)
    return found


def _probe_drivers(requirements: ImageRequirements | None, carried_floor: str | None) -> list[str]:
    """The drivers to try: each toolkit's own (what `cuda>=X.Y` asks of a driver's CUDA), the carried
    CUDA's floor, and every driver version the requirement names."""
    found = set(cuda_needs.TOOLKIT_DRIVERS.values())
    if carried_floor:
        found.add(carried_floor)
    if requirements is not None:
        found |= {
            c.value
            for _, expression in requirements.expressions
            for c in expression.conditions
            if c.key == "driver" and c.op in (">=", "=") and c.valid and c.value.replace(".", "").isdigit()
        }
    return sorted(found, key=_version)


def _lowest(probes: Sequence[str], passes: Callable[[str], bool]) -> str | None:
    """The lowest probe from which every newer one passes too (None: the newest fails)."""
    floor: str | None = None
    for driver in reversed(probes):
        if not passes(driver):
            break
        floor = driver
    return floor


def _exception_words(exceptions: dict[int, list[str]], shown: int = 3) -> list[str]:
    """ "driver 470 or 525 on geforce, nvidia, tesla and 7 more brands": branches grouped by the
    brands that have them."""
    by_brands: dict[tuple[str, ...], list[int]] = {}
    for low, names in sorted(exceptions.items()):
        by_brands.setdefault(tuple(sorted(names)), []).append(low)
    words = []
    for brands, lows in by_brands.items():
        named = ", ".join(brands[:shown]) + (
            f" and {len(brands) - shown} more brand{'s' if len(brands) - shown > 1 else ''}"
            if len(brands) > shown
            else ""
        )
        branches = [str(low) for low in lows]
        listed = ", ".join(branches[:-1]) + " or " + branches[-1] if len(branches) > 1 else branches[0]
        words.append(f"driver {listed} on {named}")
    return words


@lru_cache(maxsize=4096)
def _driver_need(
    requirement_texts: tuple[tuple[str, str], ...], disabled: bool, error: str | None, carried: str | None
) -> DriverNeed:
    if error is not None:
        return DriverNeed(reason=f"its requirement cannot be evaluated: {error}", runs=False)
    requirements = None if disabled else ImageRequirements.from_texts(requirement_texts)
    carried_facts = GpuFacts(inferred=InferredCuda(cuda=carried)) if carried else None
    carried_rule = cuda_needs.driver_floor(carried) if carried else None

    checked: dict[tuple[str, str], bool] = {}

    def required(driver: str, brand: str = _NO_BRAND) -> bool:
        if requirements is None:
            return True
        ok = checked.get((driver, brand))
        if ok is None:
            ok = checked[driver, brand] = requirements.satisfied(
                DeviceFacts(driver_cuda(driver), driver, None, brand)
            )
        return ok

    def loads(driver: str) -> bool:
        return carried_facts is None or not cuda_needs.gpu_reasons(
            carried_facts, None, driver, driver_cuda(driver)
        )

    probes = _probe_drivers(requirements, carried_rule[0] if carried_rule else None)
    floor = _lowest(probes, lambda driver: required(driver) and loads(driver))
    exceptions: dict[int, list[str]] = {}
    for brand, lows in sorted(_branches(requirements).items() if requirements is not None else ()):
        for low in lows:
            probe = f"{low}.999.99"  # the newest driver of branch `low`
            if floor is not None and compare_version(probe, ">=", floor):
                continue
            if required(probe, brand) and loads(probe) and not required(probe):
                exceptions.setdefault(low, []).append(brand)
    listed = _exception_words(exceptions)
    if floor is None:
        newest = probes[-1]
        return DriverNeed(
            reason=f"no driver up to {newest} (CUDA {driver_cuda(newest)}) satisfies its requirement",
            exceptions=listed,
            runs=bool(listed),
        )
    reasons = []
    asked = _lowest(probes, required)
    if asked is not None and asked == floor and floor != probes[0]:
        reasons.append(f"its requirement asks for a driver of CUDA {driver_cuda(floor)}: {floor}")
    if carried_rule is not None and carried_rule[0] == floor:
        reasons.append(f"it carries CUDA {carried}: {carried_rule[1]}")
    if floor == probes[0]:
        return DriverNeed(reason="no requirement sets a driver floor", exceptions=listed)
    return DriverNeed(
        floor=floor,
        reason="; ".join(reasons) or f"driver {floor} is the first that runs it",
        exceptions=listed,
    )


def driver_need(gpu: GpuFacts) -> DriverNeed:
    """The driver a platform needs on any GPU, and the older ones its brand exceptions allow."""
    requirements = ImageRequirements.from_gpu_facts(gpu)
    texts = tuple((variable, expression.text) for variable, expression in requirements.expressions)
    carried = gpu.inferred.cuda if gpu.inferred is not None else None
    return _driver_need(texts, requirements.disabled, requirements.error, carried)


def _release(evidence: str | None) -> str | None:
    """ "torch 2.3.1+cu121" from "<path>: torch 2.3.1+cu121, cuda = '12.1'"."""
    if not evidence:
        return None
    said = evidence.rsplit(": ", 1)[-1]
    return said.split(", cuda = ", 1)[0]


def _driver_words(driver: DriverNeed) -> str:
    """ "driver ≥ 535.54.03, or driver 470 or 525 on geforce, … (brand exceptions)"."""
    if not driver.runs:
        return f"no driver: {driver.reason}"
    text = f"driver ≥ {driver.floor}" if driver.floor else "any NVIDIA driver"
    if driver.exceptions:
        text += f", or {'; or '.join(driver.exceptions)} (brand exceptions)"
    return text


def platform_needs(report: PlatformReport) -> PlatformNeeds:
    """One platform's answer (module docstring)."""
    gpu = report.gpu
    carried = carries_cuda(gpu)
    use = gpu_use(gpu.required, carried)
    inferred = gpu.inferred
    carried_cuda = inferred.cuda if inferred is not None else None
    driver = driver_need(gpu) if use != "none" else None
    code = cuda_needs.summary(gpu)
    facts = []
    if gpu.cuda_version:
        facts.append(f"declares CUDA {gpu.cuda_version}")
    if carried:
        source = _release(inferred.set_by if inferred is not None else None)
        facts.append(
            f"carries CUDA{f' {carried_cuda}' if carried_cuda else ''}" + (f" ({source})" if source else "")
        )
    if use == "required":
        assert driver is not None
        said = " and ".join(facts) if facts else f"declares one ({', '.join(gpu.signals) or 'NVIDIA labels'})"
        headline = f"Needs an NVIDIA GPU with {_driver_words(driver)}: it {said}"
    elif use == "optional":
        assert driver is not None
        headline = (
            f"Runs on a CPU, and on an NVIDIA GPU with {_driver_words(driver)}: it {' and '.join(facts)}"
            " and declares no GPU"
        )
    else:
        headline = "Runs on a CPU: it declares no GPU and carries no CUDA"
    return PlatformNeeds(
        platform=report.platform,
        gpu=use,
        runs_on_cpu=use != "required",
        declared_cuda=gpu.cuda_version,
        carried_cuda=carried_cuda,
        carried_by=inferred.set_by if inferred is not None else None,
        cuda=cuda_needs.needed_cuda(gpu),
        driver=driver,
        gpu_code=code,
        headline=headline,
    )


def _runnable(platforms: Sequence[PlatformReport]) -> list[PlatformReport]:
    """Platforms a server could run: not attestation manifests or other `unknown/unknown` entries."""
    return [p for p in platforms if not p.platform.startswith("unknown") and "/unknown" not in p.platform]


def image_needs(report: ImageReport) -> ImageNeeds:
    """The image's answer: the strongest of its platforms' (a GPU any platform needs is needed)."""
    platforms = [platform_needs(p) for p in _runnable(report.platforms)]
    use = strongest(p.gpu for p in platforms)
    floors = [p.driver.floor for p in platforms if p.driver is not None and p.driver.floor]
    floor = max(floors, key=_version) if floors else None
    declared = sorted({p.declared_cuda for p in platforms if p.declared_cuda}, key=_version)
    carried = sorted({p.carried_cuda for p in platforms if p.carried_cuda}, key=_version)
    distinct = list(dict.fromkeys(p.headline for p in platforms))
    headline = distinct[0] if len(distinct) == 1 else f"{GPU_WORDS[use]}: the platforms differ"
    if not platforms:
        headline = "No platform a server could run"
    return ImageNeeds(
        gpu=use,
        runs_on_cpu=use != "required",
        declared_cuda=declared,
        carried_cuda=carried,
        driver_floor=floor,
        headline=headline,
        platforms=platforms,
    )
