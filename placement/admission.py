"""Kubernetes admission for GPU images: pure decisions over a Pod and the stored reports.

`review_pod` answers, for one Pod, what a validating webhook says (allowed, a message
naming the image and the evidence, warnings) and what a mutating webhook adds (a JSONPatch
built from placement's `kubernetes` export). It does no I/O: the web layer looks the images
up in the store first.

Node reachability is judged from the pod's `nodeSelector` and required node affinity
against the labels NVIDIA GPU Feature Discovery (GFD) writes:
`nvidia.com/cuda.runtime-version.{major,minor,full}` (the CUDA level the driver supports),
`nvidia.com/cuda.driver-version.{major,minor,revision,full}` and
`nvidia.com/gpu.compute.{major,minor}`, plus the deprecated `nvidia.com/cuda.driver.*` /
`cuda.runtime.*` spellings, and `kubernetes.io/arch`. A term (terms are ORed, expressions
ANDed, as the scheduler does) is refused only when *every* value its expressions allow
fails the image's requirement, evaluated with NVIDIA's own rules (placement.nvidia_require):
a label the term does not constrain is unknown, and an unknown value satisfies the runtime,
so the check errs towards admitting. GFD has no brand label, so `brand=` factors never deny.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from placement.cuda_needs import declared_vs_carried
from placement.exports import export_constraints
from placement.exports.core import KnownGpu
from placement.gpu_code import Rule
from placement.image_facts import ImageFacts
from placement.mig import profile_from_resource
from placement.nvidia_require import DeviceFacts, ImageRequirements, Verdict
from placement.request import DeployRequest
from scanner.facts.require_grammar import digits_value
from scanner.models import ImageReport, Platform, PlatformReport

GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"  # the device plugin's mixed strategy: nvidia.com/mig-1g.10gb
ARCH_LABEL = "kubernetes.io/arch"
AdmissionMode = Literal["warn", "deny"]

# dimension -> label spellings for each version component, and the `.full` label(s)
_COMPONENT_LABELS: dict[str, tuple[tuple[str, ...], ...]] = {
    "cuda": (
        ("nvidia.com/cuda.runtime-version.major", "nvidia.com/cuda.runtime.major"),
        ("nvidia.com/cuda.runtime-version.minor", "nvidia.com/cuda.runtime.minor"),
    ),
    "driver": (
        ("nvidia.com/cuda.driver-version.major", "nvidia.com/cuda.driver.major"),
        ("nvidia.com/cuda.driver-version.minor", "nvidia.com/cuda.driver.minor"),
        ("nvidia.com/cuda.driver-version.revision", "nvidia.com/cuda.driver.rev"),
    ),
    "arch": (("nvidia.com/gpu.compute.major",), ("nvidia.com/gpu.compute.minor",)),
}
_FULL_LABELS = {
    "cuda": "nvidia.com/cuda.runtime-version.full",
    "driver": "nvidia.com/cuda.driver-version.full",
}
_INTEGER = re.compile(r"^[+-]?[0-9]+$")  # Go's ParseInt, which the scheduler uses for Gt/Lt
_HIGH = 99_999  # stands for "unbounded above" when a component has no upper limit
_MAX_CANDIDATES = 4096
_MAX_WARNINGS = 20


# --- the Pod, as much of it as admission reads (Kubernetes core/v1 field names) ---------------


class _K8s(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResourceRequirements(_K8s):
    limits: dict[str, Any] = Field(default_factory=dict)
    requests: dict[str, Any] = Field(default_factory=dict)


class Container(_K8s):
    name: str
    image: str | None = None
    resources: ResourceRequirements | None = None


class NodeSelectorRequirement(_K8s):
    key: str
    operator: str
    values: list[str] = Field(default_factory=list)


class NodeSelectorTerm(_K8s):
    match_expressions: list[NodeSelectorRequirement] = Field(default_factory=list, alias="matchExpressions")
    match_fields: list[NodeSelectorRequirement] = Field(default_factory=list, alias="matchFields")


class NodeSelector(_K8s):
    node_selector_terms: list[NodeSelectorTerm] = Field(default_factory=list, alias="nodeSelectorTerms")


class NodeAffinity(_K8s):
    required: NodeSelector | None = Field(
        default=None, alias="requiredDuringSchedulingIgnoredDuringExecution"
    )


class Affinity(_K8s):
    node_affinity: NodeAffinity | None = Field(default=None, alias="nodeAffinity")


class PodSpec(_K8s):
    containers: list[Container] = Field(default_factory=list)
    init_containers: list[Container] = Field(default_factory=list, alias="initContainers")
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    affinity: Affinity | None = None
    resource_claims: list[dict[str, Any]] = Field(default_factory=list, alias="resourceClaims")


class Pod(_K8s):
    spec: PodSpec


# --- answers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerRef:
    kind: Literal["containers", "initContainers"]
    index: int
    container: Container

    @property
    def label(self) -> str:
        kind = "init container" if self.kind == "initContainers" else "container"
        return f"{kind} {self.container.name!r}"


@dataclass
class Review:
    allowed: bool = True
    denials: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    patch: list[dict[str, Any]] = field(default_factory=list)

    @property
    def message(self) -> str:
        return "; ".join(self.denials)


def containers_of(pod: Pod) -> list[ContainerRef]:
    return [
        *(ContainerRef("initContainers", i, c) for i, c in enumerate(pod.spec.init_containers)),
        *(ContainerRef("containers", i, c) for i, c in enumerate(pod.spec.containers)),
    ]


def gpu_resources(container: Container) -> set[str]:
    """The NVIDIA GPU resources a container names: nvidia.com/gpu and MIG devices under the mixed
    strategy (nvidia.com/mig-1g.10gb, ...), in limits (where extended resources must be) or requests."""
    resources = container.resources
    if resources is None:
        return set()
    return {
        name
        for name in (*resources.limits, *resources.requests)
        if name == GPU_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX)
    }


def gpu_count(container: Container) -> int:
    """GPUs and MIG devices the container asks for (nvidia.com/gpu, nvidia.com/mig-*); 0 when absent or bad."""
    return _requested(container, gpu_resources(container))


def mig_device_count(container: Container) -> int:
    """MIG devices the container asks for under the mixed strategy (every nvidia.com/mig-* resource)."""
    return _requested(container, gpu_resources(container) - {GPU_RESOURCE})


def _requested(container: Container, names: set[str]) -> int:
    """The sum of the container's limits (else requests) of `names`; a value that is not a count is 0."""
    resources = container.resources
    if resources is None:
        return 0
    total = 0
    for name in names:
        value = resources.limits.get(name, resources.requests.get(name))
        try:
            total += max(0, int(str(value))) if value is not None else 0
        except ValueError:
            continue
    return total


def gpu_evidence(report: ImageReport) -> str | None:
    """Why the image needs a GPU, in the scanner's words; None if nothing says it does.

    Declared (the config's NVIDIA variables) first; else CUDA inferred from the layers, where the
    scanner records it (`gpu.inferred`, read duck-typed so reports without it still work).
    """
    if report.gpu_required:
        signals = sorted({signal for p in report.platforms if p.gpu.required for signal in p.gpu.signals})
        return ", ".join(signals) if signals else "NVIDIA GPU variables in the image config"
    for platform in report.platforms:
        inferred = getattr(platform.gpu, "inferred", None)
        cuda = getattr(inferred, "cuda", None)
        if cuda:
            set_by = getattr(inferred, "set_by", None)
            evidence = (
                [str(set_by)] if set_by else [str(item) for item in getattr(inferred, "evidence", [])[:2]]
            )
            detail = f": {'; '.join(evidence)}" if evidence else ""
            return f"CUDA {cuda} inferred from its layers{detail}"
    return None


def review_pod(
    pod: Pod,
    reports: Mapping[str, ImageReport | None],
    *,
    mode: AdmissionMode = "deny",
    mutate: bool = False,
    fleet: Sequence[KnownGpu] = (),
    gpu_code_rule: Rule = "dispatch",
) -> Review:
    """Check every container image gpubadge has a report for; `reports` maps image text -> report.

    With `mutate`, also build the patch from the `kubernetes` export; `fleet` (the GPU products
    gpubadge knows) turns brand clauses into product lists there.
    """
    review = Review()
    terms = reachable_terms(pod.spec)
    claims = bool(pod.spec.resource_claims)
    gpu_containers: list[tuple[ContainerRef, ImageReport]] = []
    for ref in containers_of(pod):
        image = ref.container.image or ""
        report = reports.get(image)
        if report is None:
            review.warnings.append(
                f"gpubadge has not scanned {image or '(no image)'} ({ref.label}); not checked"
            )
            continue
        if report.pending:
            review.warnings.append(
                f"{image} ({ref.label}): its layers are still being read; checked on its config facts only"
            )
        evidence = gpu_evidence(report)
        if evidence is None:
            continue
        gpu_containers.append((ref, report))
        for platform in report.platforms:
            disagreement = declared_vs_carried(platform.gpu)
            if disagreement is not None:
                review.warnings.append(f"{image} ({ref.label}): {disagreement}")
                break
        if gpu_count(ref.container) == 0 and not mutate:
            problem = (
                f"{ref.label} runs {image}, which needs an NVIDIA GPU ({evidence}), "
                f"but requests no {GPU_RESOURCE} (nor a MIG device, {MIG_RESOURCE_PREFIX}<profile>)"
            )
            if claims:
                review.warnings.append(
                    f"{problem}; the pod has resourceClaims (DRA), so it may get one there"
                )
            elif mode == "deny":
                review.denials.append(problem)
            else:
                review.warnings.append(problem)
        slices = mig_device_count(ref.container)
        if slices > 1:
            review.warnings.append(
                f"{ref.label} runs {image} on {slices} MIG devices: a CUDA process enumerates one MIG device"
                " (NVIDIA's MIG user guide), so they serve as many processes, each started with one MIG UUID"
                " in CUDA_VISIBLE_DEVICES"
            )
        unreachable = unreachable_reason(report, terms)
        if unreachable is not None:
            review.denials.append(f"{ref.label} runs {image}: {unreachable}")
    if mutate:
        review.denials.clear()  # the validating webhook decides; the mutating one only adds
        review.patch, notes = gpu_patch(pod, gpu_containers, fleet, gpu_code_rule)
        review.warnings.extend(notes)
    review.allowed = not review.denials
    review.warnings = [_short(w) for w in review.warnings[:_MAX_WARNINGS]]
    return review


def _short(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- reachability --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One way to reach nodes: the nodeSelector ANDed with one required affinity term."""

    expressions: tuple[NodeSelectorRequirement, ...]
    text: str


def reachable_terms(spec: PodSpec) -> list[Term]:
    selector = [
        NodeSelectorRequirement(key=k, operator="In", values=[v]) for k, v in spec.node_selector.items()
    ]
    required = spec.affinity.node_affinity.required if spec.affinity and spec.affinity.node_affinity else None
    affinity_terms = required.node_selector_terms if required else []
    if not affinity_terms:
        if not selector:
            return []
        return [Term(tuple(selector), "nodeSelector " + _render(selector))]
    terms = []
    for number, term in enumerate(affinity_terms, 1):
        clause = f"node affinity term {number} ({_render(term.match_expressions) or 'no expressions'})"
        if selector:
            clause += " with nodeSelector " + _render(selector)
        terms.append(Term((*selector, *term.match_expressions), clause))
    return terms


def _render(expressions: Iterable[NodeSelectorRequirement]) -> str:
    parts = []
    for e in expressions:
        if e.operator in ("Exists", "DoesNotExist"):
            parts.append(f"{e.key} {e.operator}")
        elif e.operator == "In" and len(e.values) == 1:
            parts.append(f"{e.key}={e.values[0]}")
        else:
            parts.append(f"{e.key} {e.operator} [{', '.join(e.values)}]")
    return ", ".join(parts)


def unreachable_reason(report: ImageReport, terms: Sequence[Term]) -> str | None:
    """A message when every term can only reach nodes whose GFD labels fail the image; else None."""
    if not terms:
        return None
    reasons = []
    for term in terms:
        reason = _term_fails(report, term)
        if reason is None:
            return None
        reasons.append(f"{term.text}: {reason}")
    return "no node the pod may be scheduled on can run it: " + "; ".join(reasons)


def _term_fails(report: ImageReport, term: Term) -> str | None:
    """Why every node this term reaches fails the image, or None when some node might pass."""
    if any(e.operator == "In" and not e.values for e in term.expressions):
        return None  # an invalid term the API server refuses anyway
    arches = _allowed_arches(term)
    platforms = [p for p in report.platforms if _runnable(p)]
    if arches is not None:
        matching = [p for p in platforms if Platform.parse(p.platform).architecture in arches]
        if platforms and not matching:
            offered = ", ".join(sorted({Platform.parse(p.platform).architecture for p in platforms}))
            return f"it reaches only {ARCH_LABEL} {', '.join(sorted(arches))}, the image has {offered}"
        platforms = matching
    failures = []
    for platform in platforms:
        if not platform.gpu.required:
            return None
        requirements = ImageRequirements.from_gpu_facts(platform.gpu)
        verdict = _best_verdict(requirements, term)
        if verdict is None or verdict.ok:
            return None
        detail = f" ({'; '.join(verdict.failed[:2])})" if verdict.failed else ""
        failures.append(f"requirement {verdict.requirement or 'of the image'} fails{detail}")
    return "; ".join(dict.fromkeys(failures)) or None


def _runnable(platform: PlatformReport) -> bool:
    try:
        parsed = Platform.parse(platform.platform)
    except ValueError:
        return False
    return parsed.os == "linux" and parsed.architecture != "unknown"


def _allowed_arches(term: Term) -> set[str] | None:
    allowed: set[str] | None = None
    for e in term.expressions:
        if e.key == ARCH_LABEL and e.operator == "In":
            allowed = set(e.values) if allowed is None else allowed & set(e.values)
    return allowed


def _best_verdict(requirements: ImageRequirements, term: Term) -> Verdict | None:
    """Evaluate the requirement at every corner of what the term allows; a pass anywhere wins.

    Returns the verdict at the most favourable failing corner, or None when the candidates
    are too many to enumerate (then we do not deny).
    """
    if requirements.disabled or requirements.error is not None:
        return None
    thresholds = _thresholds(requirements)
    per_dimension = {dim: _candidates(dim, term, thresholds.get(dim, [])) for dim in _COMPONENT_LABELS}
    combos = 1
    for values in per_dimension.values():
        combos *= len(values)
    if combos > _MAX_CANDIDATES:
        return None
    last: Verdict | None = None
    for cuda, driver, arch in itertools.product(
        per_dimension["cuda"], per_dimension["driver"], per_dimension["arch"]
    ):
        verdict = requirements.check(DeviceFacts(cuda=cuda, driver=driver, arch=arch))
        if verdict.ok or verdict.outcome == "error":
            return verdict if verdict.ok else None
        last = verdict
    return last


def _thresholds(requirements: ImageRequirements) -> dict[str, list[tuple[int, ...]]]:
    found: dict[str, list[tuple[int, ...]]] = {}
    for _, expression in requirements.expressions:
        for condition in expression.conditions:
            if condition.key in _COMPONENT_LABELS:
                parts = condition.value.split(".")
                values = [digits_value(part) if part.isdigit() else None for part in parts]
                if all(value is not None for value in values):
                    found.setdefault(condition.key, []).append(tuple(value or 0 for value in values))
    return found


@dataclass
class _Component:
    values: set[int] | None = None  # from In: only these
    low: int | None = None
    high: int | None = None
    absent: bool = False  # DoesNotExist: the node carries no such label

    def constrained(self) -> bool:
        return self.values is not None or self.low is not None or self.high is not None or self.absent

    def allows(self, value: int) -> bool:
        if self.values is not None and value not in self.values:
            return False
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)


def _component(term: Term, spellings: tuple[str, ...]) -> _Component:
    component = _Component()
    for e in term.expressions:
        if e.key not in spellings:
            continue
        numbers = [int(v) for v in e.values if _INTEGER.match(v)]
        if e.operator == "In":
            allowed = set(numbers)
            component.values = allowed if component.values is None else component.values & allowed
        elif e.operator == "Gt" and len(numbers) == 1:
            component.low = max(
                numbers[0] + 1, component.low if component.low is not None else numbers[0] + 1
            )
        elif e.operator == "Lt" and len(numbers) == 1:
            component.high = min(
                numbers[0] - 1, component.high if component.high is not None else numbers[0] - 1
            )
        elif e.operator == "DoesNotExist":
            component.absent = True
    return component


def _candidates(dimension: str, term: Term, thresholds: list[tuple[int, ...]]) -> list[str | None]:
    """Host values to try for one dimension: None (unknown) when the term does not constrain it."""
    full = _FULL_LABELS.get(dimension)
    full_values: set[str] | None = None
    for e in term.expressions:
        if full is not None and e.key == full and e.operator == "In":
            full_values = set(e.values) if full_values is None else full_values & set(e.values)
    components = [_component(term, spellings) for spellings in _COMPONENT_LABELS[dimension]]
    if any(c.absent for c in components):
        return [None]  # nodes without GFD labels: nothing known, nothing denied
    if full_values is not None:
        listed: list[str | None] = [*sorted(full_values)]
        return listed or [None]
    if not any(c.constrained() for c in components):
        return [None]
    per_position: list[list[int]] = []
    for position, component in enumerate(components):
        points = {0, _HIGH}
        if component.values is not None:
            points = set(component.values)
        for bound in (component.low, component.high):
            if bound is not None:
                points.add(bound)
        for threshold in thresholds:
            if position < len(threshold):
                points |= {threshold[position], threshold[position] + 1, max(0, threshold[position] - 1)}
        kept = sorted(p for p in points if component.allows(p))
        if not kept:
            return [None]  # contradictory term: it reaches no node at all; not ours to judge
        per_position.append(kept)
    return [".".join(str(part) for part in combo) for combo in itertools.product(*per_position)]


# --- mutation ------------------------------------------------------------------------------------

_MAX_AFFINITY_TERMS = 64


def gpu_patch(
    pod: Pod,
    gpu_containers: Sequence[tuple[ContainerRef, ImageReport]],
    fleet: Sequence[KnownGpu] = (),
    gpu_code_rule: Rule = "dispatch",
) -> tuple[list[dict[str, Any]], list[str]]:
    """JSONPatch from placement's `kubernetes` export: GPU limits, and node affinity for the images.

    Pods that already say more are left alone: a container with any nvidia.com/gpu or MIG device
    resource keeps it,
    and a pod with required node affinity, or GPU labels in its nodeSelector, keeps its placement.
    Returns the patch and warnings (when no node can run an image, no affinity is added).
    """
    patch: list[dict[str, Any]] = []
    warnings: list[str] = []
    alternatives: list[list[dict[str, Any]]] | None = None
    for ref, report in gpu_containers:
        request = _request_of(ref.container).model_copy(update={"gpu_code_rule": gpu_code_rule})
        exported = export_constraints(ImageFacts.from_report(report), request, fleet, "kubernetes")
        container = ref.container
        if not gpu_resources(container) and gpu_count(container) == 0:
            count = exported.get("resources", {}).get("limits", {}).get(GPU_RESOURCE) or 1
            patch.append(_limit_operation(ref, str(count)))
        if not exported["satisfiable"]:
            warnings.append(f"gpubadge knows no node that can run {container.image}; no node affinity added")
            alternatives = []
            continue
        terms = [
            term["matchExpressions"]
            for term in exported["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]["nodeSelectorTerms"]
        ]
        alternatives = terms if alternatives is None else _and(alternatives, terms)
    spec = pod.spec
    says_more = (
        spec.affinity and spec.affinity.node_affinity and spec.affinity.node_affinity.required
    ) or any(key.startswith("nvidia.com/") for key in spec.node_selector)
    if alternatives and len(alternatives) > _MAX_AFFINITY_TERMS:
        warnings.append("the images' combined node affinity is too large to add; none added")
    elif alternatives and not says_more:
        required = {"nodeSelectorTerms": [{"matchExpressions": term} for term in alternatives]}
        if spec.affinity is None:
            value: dict[str, Any] = {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
            }
            patch.append({"op": "add", "path": "/spec/affinity", "value": value})
        elif spec.affinity.node_affinity is None:
            value = {"requiredDuringSchedulingIgnoredDuringExecution": required}
            patch.append({"op": "add", "path": "/spec/affinity/nodeAffinity", "value": value})
        else:
            path = "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution"
            patch.append({"op": "add", "path": path, "value": required})
    return patch, warnings


def _request_of(container: Container) -> DeployRequest:
    """What the container asks for, as placement's request: MIG devices of the profiles its
    nvidia.com/mig-* resources name (the mixed strategy), else whole GPUs."""
    profiles = [
        profile
        for name in sorted(gpu_resources(container))
        if (profile := profile_from_resource(name)) is not None
    ]
    if not profiles:
        return DeployRequest()
    return DeployRequest(mig_profiles=profiles, mig_devices=max(1, gpu_count(container)))


def _limit_operation(ref: ContainerRef, count: str) -> dict[str, Any]:
    container = ref.container
    base = f"/spec/{ref.kind}/{ref.index}/resources"
    if container.resources is None:
        return {"op": "add", "path": base, "value": {"limits": {GPU_RESOURCE: count}}}
    if not container.resources.limits:
        return {"op": "add", "path": f"{base}/limits", "value": {GPU_RESOURCE: count}}
    return {"op": "add", "path": f"{base}/limits/nvidia.com~1gpu", "value": count}


def _and(left: list[list[dict[str, Any]]], right: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Two ORs of ANDed expressions, ANDed: every pair of terms merged (duplicates dropped)."""
    merged = []
    for a, b in itertools.product(left, right):
        term = [*a, *(expression for expression in b if expression not in a)]
        if term not in merged:
            merged.append(term)
    return merged
