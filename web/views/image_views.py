"""View models of the image and scan pages: plain objects built by pure functions from reports,
rows and jobs, for the templates (badges, requirements, platforms, tag history, jobs, filters)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from placement import cuda_needs, gpu_code
from placement.image_needs import (
    GPU_MEANINGS,
    GPU_WORDS,
    GpuUse,
    PlatformNeeds,
    carries_cuda,
    gpu_use,
    platform_needs,
)
from scanner.facts.badges import LAYER_STATE_BADGES, LIBC_BADGES
from scanner.facts.require_grammar import describe_condition, parse_requirement_lenient
from scanner.models import PlatformReport
from scanner.redaction import redact_secrets
from scanner.registry.reference import ReferenceError, parse_reference
from store import ImageRow, Job, TagEvent
from store.queries import SEARCH_MAX_CHARS, ScanVerdict
from web.views.templating import image_url

MAX_PAGE = 1_000_000


_PLAIN_ERRORS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"; the limit is .* \(GPUBADGE_[A-Z_]+\)$"),
        "The image crosses one of the scanner's limits (named beside); it is not scanned again.",
    ),
    (
        re.compile(r"not on the allowlist", re.I),
        "This registry is not on the allowlist (GPUBADGE_REGISTRIES).",
    ),
    (
        re.compile(r"not found|manifest_unknown|name_unknown", re.I),
        "The registry has no such image: the tag or digest does not exist (deleted, or misspelt).",
    ),
    (
        re.compile(r"access denied|unauthori[sz]ed|denied", re.I),
        "The registry refused access: configure credentials for it, or check they are still valid.",
    ),
    (re.compile(r"rate limited|429", re.I), "The registry rate-limited us; try again later."),
    (re.compile(r"timed out|timeout", re.I), "The registry did not answer in time."),
    (
        re.compile(r"refused|cannot connect|connection|unreachable|name resolution", re.I),
        "The registry could not be reached.",
    ),
    (re.compile(r"server error|5\d\d", re.I), "The registry failed with a server error."),
    (re.compile(r"digest", re.I), "The registry sent content that does not match its digest."),
    (re.compile(r"too large|larger than", re.I), "The image is larger than the scan limits allow."),
    (
        re.compile(r"platform|index|manifest|config", re.I),
        "The image's manifest or config is not something we can read.",
    ),
)


def explain_error(message: str | None) -> str:
    """One plain sentence for a scan error; the exact message is shown beside it."""
    if not message:
        return "The scan failed without a message."
    for pattern, sentence in _PLAIN_ERRORS:
        if pattern.search(message):
            return sentence
    return "The scan failed."


@dataclass(frozen=True)
class BadgeView:
    """One coloured pill: `kind` picks its colour (see the legend)."""

    text: str
    kind: str


def _gpu_badge(use: GpuUse) -> BadgeView:
    return BadgeView(GPU_WORDS[use], {"required": "gpu", "optional": "optional", "none": "cpu"}[use])


# The vocabulary of placement.image_needs: the GPU answer first, then the CUDA declared and carried.
LEGEND = (
    (_gpu_badge("required"), GPU_MEANINGS["required"]),
    (_gpu_badge("optional"), GPU_MEANINGS["optional"]),
    (_gpu_badge("none"), GPU_MEANINGS["none"]),
    (BadgeView("CUDA 12.2", "cuda"), "the CUDA it declares (CUDA_VERSION, NVIDIA_REQUIRE_CUDA)"),
    (
        BadgeView("CUDA 12.1 inside", "inferred"),
        "the CUDA it carries in its layers (torch, NVIDIA wheels, toolkits, GPU code), declared or not",
    ),
    (
        BadgeView("carries a newer CUDA than declared: needs its driver", "warn"),
        "the layers carry a newer CUDA than the config declares (torch cu130 on a 12.8 base): the newer CUDA's"
        " driver floor applies",
    ),
    (
        BadgeView("carries an older CUDA than declared", "warn"),
        "the layers carry an older CUDA than the config declares: the declaration decides the driver",
    ),
    (BadgeView("glibc", "glibc"), "GNU C library (Debian, Ubuntu, RHEL…)"),
    (BadgeView("musl", "musl"), "musl C library (Alpine…)"),
    (BadgeView("no libc", "nolibc"), "static binaries or scratch: no C library"),
    (BadgeView("requirement error", "warn"), "an NVIDIA_REQUIRE_* value the runtime would reject"),
    (BadgeView("libc unknown", "unknown"), "the scan could not tell"),
)


_NAMED_BADGES = {
    "nvidia-gpu": _gpu_badge("required"),
    "require-disabled": BadgeView("require disabled", "info"),
    "requirement-error": BadgeView("requirement error", "warn"),
    "glibc": BadgeView("glibc", "glibc"),
    "musl": BadgeView("musl", "musl"),
    "no-libc": BadgeView("no libc", "nolibc"),
    "libc-unknown": BadgeView("libc unknown", "unknown"),
    "libc-pending": BadgeView("reading layers", "unknown"),
    "libc-not-analysed": BadgeView("layers not analysed", "info"),
    "musl-also": BadgeView("musl also", "musl"),
    "cuda-inferred": BadgeView("CUDA inside", "inferred"),
    "cuda-mismatch": BadgeView("carries an older CUDA than declared", "warn"),
    "cuda-newer-inside": BadgeView("carries a newer CUDA than declared: needs its driver", "warn"),
}


def badge_view(name: str) -> BadgeView:
    """A badge name from scanner/badges.py (`cuda-12.2`) as the UI shows it (`CUDA 12.2`)."""
    if name in _NAMED_BADGES:
        return _NAMED_BADGES[name]
    if name.startswith("cuda-") and name.endswith("-inferred"):
        return BadgeView(f"CUDA {name.removeprefix('cuda-').removesuffix('-inferred')} inside", "inferred")
    if name.startswith("cuda-"):
        return BadgeView(f"CUDA {name.removeprefix('cuda-')}", "cuda")
    return _NAMED_BADGES.get(name, BadgeView(name, "info"))


def platform_badges(report: PlatformReport) -> list[BadgeView]:
    """A platform's badges: its GPU answer first (placement.image_needs), then what the scan named."""
    use = gpu_use(report.gpu.required, carries_cuda(report.gpu))
    return [_gpu_badge(use), *(badge_view(name) for name in report.badges if name != "nvidia-gpu")]


# Platform badges a listing row adds to what its columns say: the findings of the layers.
_FINDINGS = (
    "cuda-newer-inside",
    "cuda-mismatch",
    "requirement-error",
    "require-disabled",
    "musl-also",
    "cuda-inferred",
)


def _carried(badges: Sequence[str]) -> list[str]:
    return [name for name in badges if name.startswith("cuda-") and name.endswith("-inferred")]


def row_gpu(row: ImageRow) -> GpuUse:
    """A listing row's GPU answer: declared (the row's column) and carried (its platforms' badges)."""
    return gpu_use(row.gpu_required, bool(row.carried_cuda or _carried(row.platform_badges)))


def row_carried_cuda(row: ImageRow) -> list[str]:
    """The CUDA versions a listing row's platforms carry: the store's column, else (a report stored
    before the column held them) its `cuda-12.1-inferred` badges."""
    return row.carried_cuda or [
        name.removeprefix("cuda-").removesuffix("-inferred")
        for name in _carried(row.platform_badges)
        if name != "cuda-inferred"
    ]


def row_badges(row: ImageRow) -> list[BadgeView]:
    """The GPU answer (NVIDIA GPU, GPU optional or CPU only), the declared CUDA, the CUDA the layers
    carry, warnings, then the libc."""
    inferred = [name for name in _carried(row.platform_badges) if name != "cuda-inferred"]
    names = [f"cuda-{version}" for version in row.cuda_versions]
    names += inferred or [name for name in row.platform_badges if name == "cuda-inferred"]
    names += [name for name in _FINDINGS if name in row.platform_badges and name not in names]
    names += [
        LIBC_BADGES.get(label) or LAYER_STATE_BADGES.get(label, "libc-unknown") for label in row.libc_flavours
    ]
    return [_gpu_badge(row_gpu(row)), *(badge_view(name) for name in dict.fromkeys(names))]


@dataclass(frozen=True)
class ImageRowView:
    name: str  # registry/repository, whole (the link's title and what a copy takes)
    registry: str
    repository: str
    url: str
    digest: str
    tags: list[tuple[str, str]]
    badges: list[BadgeView]
    platforms: list[str]
    distro: str | None
    scanned_at: str
    other_names: list[tuple[str, str]] = field(default_factory=list)  # (name, page) of its other names


def image_row_view(row: ImageRow) -> ImageRowView:
    name = f"{row.registry}/{row.repository}"
    url = image_url(f"{name}:{row.tags[0]}") if row.tags else image_url(f"{name}@{row.digest}")
    return ImageRowView(
        name=name,
        registry=row.registry,
        repository=row.repository,
        url=url,
        digest=row.digest,
        tags=[(tag, image_url(f"{name}:{tag}")) for tag in row.tags],
        badges=row_badges(row),
        platforms=row.platforms,
        distro=row.distro,
        scanned_at=row.scanned_at,
        other_names=[(other, image_url(other)) for other in row.other_names],
    )


@dataclass(frozen=True)
class ConditionView:
    words: str
    text: str
    error: str | None


@dataclass(frozen=True)
class RequirementView:
    """One NVIDIA_REQUIRE_* variable: any one alternative must hold, all conditions within it.

    `summary`: one line for a value made of a main condition and many `brand=` exceptions (the
    official CUDA images carry up to 21 clauses); the page then shows the raw value and every
    alternative one click away."""

    variable: str
    value: str
    alternatives: list[list[ConditionView]]
    errors: list[str]
    derived: bool = False
    summary: str | None = None


BRAND_SUMMARY_MIN_CLAUSES = 3  # fewer alternatives read well in full


def _brand_summary(variable: str, alternatives: Sequence[Sequence[Any]]) -> str | None:
    """ "Needs CUDA >= 12.8; or, with an older driver, one of 20 brand exceptions (tesla, nvidia, ...:
    drivers 470, 535, 550)", for a requirement whose alternatives beyond the first are brand clauses."""
    if len(alternatives) < BRAND_SUMMARY_MIN_CLAUSES or variable != "NVIDIA_REQUIRE_CUDA":
        return None
    main = [term for term in alternatives if not any(c.key == "brand" for c in term)]
    exceptions = [term for term in alternatives if any(c.key == "brand" for c in term)]
    if len(main) != 1 or len(exceptions) < BRAND_SUMMARY_MIN_CLAUSES - 1:
        return None
    if any(c.error for term in alternatives for c in term):
        return None
    brands = sorted({c.value for term in exceptions for c in term if c.key == "brand"})
    drivers = sorted(
        {
            c.value.split(".")[0]
            for term in exceptions
            for c in term
            if c.key == "driver" and c.op in (">=", ">")
        },
        key=lambda v: int(v) if v.isdigit() else 0,
    )
    needs = " and ".join(describe_condition(c) for c in main[0]) or "nothing"
    shown = ", ".join(brands[:4]) + (f" and {len(brands) - 4} more" if len(brands) > 4 else "")
    driver_text = f": drivers {', '.join(drivers)}" if drivers else ""
    return f"Needs {needs}; or, on an older driver, one of {len(exceptions)} brand exceptions ({shown}{driver_text})"


def requirement_view(variable: str, value: str, *, derived: bool = False) -> RequirementView:
    expression = parse_requirement_lenient(value)
    alternatives = [
        [
            ConditionView(
                words=condition.text if condition.error else describe_condition(condition),
                text=condition.text,
                error=condition.error,
            )
            for condition in term.conditions
        ]
        for term in expression.alternatives
    ]
    summary = _brand_summary(variable, [term.conditions for term in expression.alternatives])
    return RequirementView(variable, value, alternatives, list(expression.errors), derived, summary)


def gpu_code_glance(report: PlatformReport) -> list[str]:
    """Where the image's GPU code runs (placement.gpu_code), then each NVIDIA library lacking code."""
    archs = report.gpu.archs
    if archs is None or not archs.files:
        return []
    return [cuda_needs.summary(report.gpu) or gpu_code.summary(archs), *gpu_code.caveats(archs)]


@dataclass(frozen=True)
class GenerationView:
    """One row of the image page's table of GPU generations."""

    cc: str
    architecture: str
    status: str  # runs, runs without, does not run
    decided_by: list[str]
    driver: str | None


def generations_view(report: PlatformReport, needs: PlatformNeeds) -> list[GenerationView]:
    """Where the platform's CUDA and GPU code run, a row per compute capability from 7.0
    (`placement.cuda_needs.generations`), each row's driver at least the image's own floor (the
    headline's); none for a platform that needs no GPU."""
    if needs.driver is None:
        return []
    return [
        GenerationView(f"{row.cc[0]}.{row.cc[1]}", row.architecture, row.status, row.decided_by, row.driver)
        for row in cuda_needs.generations(report.gpu, driver=needs.driver.floor)
    ]


@dataclass(frozen=True)
class PlatformView:
    report: PlatformReport
    badges: list[BadgeView]
    requirements: list[RequirementView]
    layers_read: int
    layers_total: int
    needs: PlatformNeeds  # the answer in placement.image_needs' vocabulary: the card's headline
    warnings: list[str] = field(default_factory=list)
    gpu_code: list[str] = field(default_factory=list)  # where the GPU code runs, then caveats
    generations: list[GenerationView] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # NVIDIA_/CUDA_ variables not shown as requirements


def platform_view(report: PlatformReport) -> PlatformView:
    gpu = report.gpu
    requirements = [
        requirement_view(name, value)
        for name, value in sorted(gpu.env.items())
        if name.startswith("NVIDIA_REQUIRE_")
    ]
    derived = [text for text in gpu.effective_requirements if text not in gpu.requirements]
    if gpu.legacy:
        requirements += [
            requirement_view("CUDA_VERSION (legacy image)", text, derived=True) for text in derived
        ]
    # A requirement's own parse errors show under it (RequirementView.errors); the warnings list
    # keeps what is said nowhere else, each once.
    shown = {error for r in requirements for error in r.errors}
    warnings = [
        f"{issue.variable}={issue.value!s}: {issue.error}"
        for issue in gpu.requirement_errors
        if issue.error not in shown and not any(issue.error in error for error in shown)
    ]
    warnings += [
        warning
        for warning in report.warnings
        if not any(error in warning for error in shown) and warning not in warnings
    ]
    if report.error:
        report = report.model_copy(update={"error": redact_secrets(report.error)})
    needs = platform_needs(report)
    return PlatformView(
        report=report,
        badges=platform_badges(report),
        requirements=requirements,
        layers_read=report.libc.layers_read,
        layers_total=report.libc.layers_total or len(report.layers),
        needs=needs,
        warnings=list(dict.fromkeys(warnings)),
        gpu_code=gpu_code_glance(report),
        generations=generations_view(report, needs),
        env={name: value for name, value in gpu.env.items() if not name.startswith("NVIDIA_REQUIRE_")},
    )


@dataclass(frozen=True)
class TagEventView:
    tag: str
    url: str
    digest: str
    first_seen: str
    last_seen: str
    gone_at: str | None
    current: bool


def tag_history_view(events: Sequence[TagEvent], name: str, digests: set[str]) -> list[TagEventView]:
    """The tag -> digest history of repository `name`; rows for this image are marked current."""
    return [
        TagEventView(
            e.tag,
            image_url(f"{name}:{e.tag}"),
            e.digest,
            e.first_seen,
            e.last_seen,
            e.gone_at,
            e.digest in digests,
        )
        for e in events
    ]


def short_reference(reference: str, digits: int = 12) -> str:
    """`reference` with its digest cut to `digits` hex digits and an ellipsis (the name and tag
    kept whole): what a table row shows, the full reference on hover and copy."""
    name, at, digest = reference.rpartition("@")
    algorithm, colon, hexdigits = digest.partition(":")
    if not at or not colon or len(hexdigits) <= digits:
        return reference
    return f"{name}@{algorithm}:{hexdigits[:digits]}…"


@dataclass(frozen=True)
class JobView:
    id: str
    reference: str
    url: str
    state: str
    attempts: str
    source: str
    created_at: str
    updated_at: str
    error: str | None
    explanation: str | None
    progress: str | None = None  # a running scan's layer read: layers and bytes so far
    verdict: list[BadgeView] = field(default_factory=list)  # a finished scan's answer, as the list shows it
    index: tuple[str, str, str] | None = (
        None  # (platform, index reference shortened, its page) for an index's child
    )
    not_an_image: bool = False  # finished, with nothing to badge (an attestation, a signature)

    @property
    def short(self) -> str:
        return short_reference(self.reference)


def verdict_badges(verdict: ScanVerdict) -> list[BadgeView]:
    """A finished scan's answer: the GPU word, then what the scan named (CUDA, findings, libc)."""
    carried = bool(_carried(verdict.badges))
    names = [name for name in verdict.badges if name != "nvidia-gpu"]
    return [_gpu_badge(gpu_use(verdict.gpu_required, carried)), *(badge_view(name) for name in names)]


def job_view(
    job: Job, progress: Mapping[str, str] | None = None, verdicts: Mapping[str, ScanVerdict] | None = None
) -> JobView:
    """A job as the scans page shows it; `verdicts` (`queries.scan_verdicts`) adds what a finished
    scan found, and marks the platform manifests of an index as its children."""
    verdict = (verdicts or {}).get(job.result_digest or "")
    index = verdict.index if verdict is not None else None
    return JobView(
        id=job.id,
        reference=job.reference,
        url=image_url(job.reference),
        state=job.state,
        attempts=f"{job.attempts}/{job.max_attempts}",
        source=job.source or "",
        created_at=job.created_at,
        updated_at=job.updated_at,
        error=redact_secrets(job.error) if job.error else None,
        explanation=explain_error(job.error) if job.error else None,
        progress=progress_of(job.reference, progress) if progress and job.state == "running" else None,
        verdict=verdict_badges(verdict) if verdict is not None else [],
        index=(index.platform, short_reference(index.reference), image_url(index.reference))
        if index
        else None,
        not_an_image=job.state == "done" and job.result_digest is None,
    )


def progress_of(text: str, progress: Mapping[str, str]) -> str | None:
    """A running job's layer-read progress; the scanner keys it by the normalised reference."""
    try:
        return progress.get(str(parse_reference(text)))
    except ReferenceError:
        return None


@dataclass(frozen=True)
class ImageFilters:
    """The images page's GET form, validated: bad values fall back to "any" instead of failing."""

    gpu: str = ""
    libc: str = ""
    cuda: str = ""
    registry: str = ""
    q: str = ""
    page: int = 1

    # the vocabulary of placement.image_needs; `inferred` (any image carrying CUDA) is kept for old links
    GPU_CHOICES = ("", "gpu", "optional", "cpu", "inferred")
    LIBC_CHOICES = ("", "glibc", "musl", "none", "unknown")

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> ImageFilters:
        gpu = query.get("gpu", "")
        libc = query.get("libc", "")
        cuda = query.get("cuda", "").strip()
        try:
            page = max(1, min(MAX_PAGE, int(query.get("page", "1") or 1)))
        except ValueError:
            page = 1
        return cls(
            gpu=gpu if gpu in cls.GPU_CHOICES else "",
            libc=libc if libc in cls.LIBC_CHOICES else "",
            cuda=cuda if re.fullmatch(r"\d+(\.\d+)?", cuda) else "",
            registry=query.get("registry", "").strip(),
            q=query.get("q", "").strip()[:SEARCH_MAX_CHARS],
            page=page,
        )

    @property
    def active(self) -> bool:
        return any((self.gpu, self.libc, self.cuda, self.registry, self.q))

    def store_arguments(self) -> dict[str, Any]:
        return {
            "gpu": {"gpu": True, "optional": False, "cpu": False}.get(self.gpu),
            "inferred": {"optional": True, "cpu": False, "inferred": True}.get(self.gpu),
            "libc": self.libc or None,
            "cuda": self.cuda or None,
            "registry": self.registry or None,
            "query": self.q or None,
        }

    def page_url(self, page: int) -> str:
        params = {
            key: value
            for key, value in (
                ("gpu", self.gpu),
                ("libc", self.libc),
                ("cuda", self.cuda),
                ("registry", self.registry),
                ("q", self.q),
            )
            if value
        }
        if page > 1:
            params["page"] = str(page)
        return "/?" + urlencode(params) if params else "/"
