"""Constraints as a Kubernetes node affinity over GPU Feature Discovery labels, plus resources.

Version ranges become ORed node selector terms made only of integer `Gt`/`Lt` on the split
version labels (`>= X` is `Gt X-1`; `= X` is `Gt X-1` and `Lt X+1`): `In` would compare strings,
and GFD writes revisions zero-padded (`02` is not `2`). Every term repeats every other
requirement it is ANDed with. Brand and model clauses become `nvidia.com/gpu.product` lists from
the known fleet (GFD has no brand label); when nothing can be eligible, one term that no node
matches. Node names are never used.

MIG, as NVIDIA's device plugin and GFD expose it: a whole-GPU request adds
`nvidia.com/gpu.slices.gi DoesNotExist`: under the single strategy a node whose GPUs are in MIG
mode offers its MIG devices as `nvidia.com/gpu`, and GFD then labels their slice counts there
(under mixed, `nvidia.com/gpu` counts only GPUs out of MIG mode). A request for MIG devices is answered
for the mixed strategy (`resources` ask for `nvidia.com/mig-<profile>`, the terms require
`nvidia.com/mig.strategy=mixed` and, for brand or model clauses, `nvidia.com/mig-<profile>.product`)
and, in `single_strategy`, for the single one (`nvidia.com/gpu` on nodes labelled
`nvidia.com/mig.strategy=single` that have MIG devices (`nvidia.com/gpu.slices.gi`), the profile
and parent product in `nvidia.com/gpu.product`'s
`<product>-MIG-<profile>` and the device memory in `nvidia.com/gpu.memory`). Compute capability
and driver labels are the parent GPU's under both strategies.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from itertools import product
from typing import Any

from placement.exports.core import Bound, Constraints, Interval, MigChoice, PlatformConstraints, Term
from placement.mig import kubernetes_name, resource_name

DRIVER_LABELS = (
    "nvidia.com/cuda.driver-version.major",
    "nvidia.com/cuda.driver-version.minor",
    "nvidia.com/cuda.driver-version.revision",
)
CUDA_LABELS = ("nvidia.com/cuda.runtime-version.major", "nvidia.com/cuda.runtime-version.minor")
CC_LABELS = ("nvidia.com/gpu.compute.major", "nvidia.com/gpu.compute.minor")
PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
ARCH_LABEL = "kubernetes.io/arch"
GPU_RESOURCE = "nvidia.com/gpu"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
MIG_SLICES_LABEL = "nvidia.com/gpu.slices.gi"  # single strategy: the MIG devices' GPU-instance slices
_LABELS = {"driver": DRIVER_LABELS, "cuda": CUDA_LABELS, "cc": CC_LABELS}
_GFD_DROP = re.compile(r"[^A-Za-z0-9\-_. ]")
_SPACES = re.compile(r"\s+")

Requirement = dict[str, Any]  # a core/v1 NodeSelectorRequirement
Alternative = list[Requirement]  # one NodeSelectorTerm's matchExpressions


def gfd_product(nvml_name: str) -> str:
    """GFD's `nvidia.com/gpu.product` for an NVML name: odd characters dropped, spaces to dashes."""
    return _SPACES.sub("-", _GFD_DROP.sub("", nvml_name).strip())


def gfd_mig_product(parent: str, profile: str) -> str:
    """GFD's product label for a MIG device: `NVIDIA-A100-SXM4-80GB-MIG-1g.10gb` (`+me` as `.me`)."""
    return f"{gfd_product(parent)}-MIG-{kubernetes_name(profile)}"


def _gt(key: str, value: int) -> Requirement:
    return {"key": key, "operator": "Gt", "values": [str(value)]}


def _lt(key: str, value: int) -> Requirement:
    return {"key": key, "operator": "Lt", "values": [str(value)]}


def _equal(keys: Sequence[str], parts: Sequence[int]) -> Alternative:
    found: Alternative = []
    for key, part in zip(keys, parts, strict=False):
        found += [_gt(key, part - 1), _lt(key, part + 1)]
    return found


def _fit(bound: Bound, width: int, lower: bool) -> Bound:
    """A bound with more parts than the labels have, as the same set of `width`-part versions."""
    if len(bound.version) <= width:
        return bound
    head = bound.version[:width]  # the dropped parts are not all zero (versions are canonical)
    return Bound(head, False) if lower else Bound(head, True)


def _at_least(keys: Sequence[str], bound: Bound) -> list[Alternative]:
    """Lexicographic `version >= bound` (or `>`) over split version labels, as ORed alternatives."""
    parts = bound.version
    if not parts:
        if bound.inclusive:
            return [[]]
        parts, bound = (0,), Bound((0,), False)
    alternatives = [[*_equal(keys, parts[:i]), _gt(keys[i], parts[i])] for i in range(len(parts) - 1)]
    last = len(parts) - 1
    prefix = _equal(keys, parts[:last])
    if bound.inclusive:
        alternatives.append([*prefix, _gt(keys[last], parts[last] - 1)])
        return alternatives
    alternatives.append([*prefix, _gt(keys[last], parts[last])])
    # Strictly above: equal so far, then any later part above zero (missing parts count as zero).
    for extra in range(len(parts), len(keys)):
        zeros = [requirement for key in keys[len(parts) : extra] for requirement in _equal([key], [0])]
        alternatives.append([*_equal(keys, parts), *zeros, _gt(keys[extra], 0)])
    return alternatives


def _at_most(keys: Sequence[str], bound: Bound) -> tuple[list[Alternative], bool]:
    """Lexicographic `version <= bound` (or `<`); True when it reads an empty (two-part) revision."""
    parts = bound.version
    if not parts:
        if bound.inclusive:  # <= 0: every part zero
            return [[requirement for key in keys for requirement in _equal([key], [0])]], True
        return [], False  # < 0: nothing
    alternatives = [[*_equal(keys, parts[:i]), _lt(keys[i], parts[i])] for i in range(len(parts))]
    if not bound.inclusive:
        return alternatives, False
    # Equal up to the bound's parts, and every further part zero.
    zeros = [requirement for key in keys[len(parts) :] for requirement in _equal([key], [0])]
    alternatives.append([*_equal(keys, parts), *zeros])
    return alternatives, bool(zeros) or len(parts) == len(keys)


def _interval(dimension: str, interval: Interval) -> tuple[list[Alternative], bool]:
    keys = _LABELS[dimension]
    low: list[Alternative] = [[]]
    high: list[Alternative] = [[]]
    revision = False
    if interval.low is not None:
        low = _at_least(keys, _fit(interval.low, len(keys), True))
    if interval.high is not None:
        high, revision = _at_most(keys, _fit(interval.high, len(keys), False))
    return [[*a, *b] for a, b in product(low, high)], revision and dimension == "driver"


def _term_alternatives(
    term: Term, platform: PlatformConstraints, extra: Alternative, mode: str, profile: str | None
) -> tuple[list[Alternative], bool]:
    """`mode`: `whole` GPUs, or MIG devices under the `mixed` or `single` strategy (`profile`: the
    mixed strategy's one profile)."""
    parts: list[list[Alternative]] = []
    revision = False
    for dimension, interval in term.versions:
        alternatives, reads_revision = _interval(dimension, interval)
        parts.append(alternatives)
        revision = revision or reads_revision
    common: Alternative = [*extra]
    if mode == "whole":
        if platform.gpus > 0:
            common.append({"key": MIG_SLICES_LABEL, "operator": "DoesNotExist"})
            if platform.min_memory_mib is not None:
                common.append(_gt(MEMORY_LABEL, platform.min_memory_mib - 1))
        if term.products is not None:
            values = sorted(
                {
                    value
                    for name in term.products
                    for value in (gfd_product(name), gfd_product(name) + "-SHARED")
                }
            )
            common.append({"key": PRODUCT_LABEL, "operator": "In", "values": values})
    elif mode == "mixed":
        assert profile is not None
        common.append({"key": MIG_STRATEGY_LABEL, "operator": "In", "values": ["mixed"]})
        if term.products is not None:
            choices = [c for c in platform.choices_for(term) if c.profile == profile]
            if not choices:
                return [], revision
            key = f"{resource_name(profile)}.product"
            common.append({"key": key, "operator": "In", "values": _mig_products(choices)})
    else:
        common.append({"key": MIG_STRATEGY_LABEL, "operator": "In", "values": ["single"]})
        common.append({"key": MIG_SLICES_LABEL, "operator": "Exists"})
        if platform.mig_profiles or term.products is not None:
            choices = platform.choices_for(term)
            if not choices:
                return [], revision
            common.append({"key": PRODUCT_LABEL, "operator": "In", "values": _mig_products(choices)})
        if platform.min_memory_mib is not None:
            common.append(_gt(MEMORY_LABEL, platform.min_memory_mib - 1))  # per MIG device here
    return [
        [*common, *(r for alternative in combo for r in alternative)] for combo in product(*parts)
    ], revision


def _mig_products(choices: Sequence[MigChoice]) -> list[str]:
    return sorted({gfd_mig_product(choice.product, choice.profile) for choice in choices})


UNMATCHABLE: Alternative = [
    {"key": PRODUCT_LABEL, "operator": "Exists"},
    {"key": PRODUCT_LABEL, "operator": "DoesNotExist"},
]


def export(constraints: Constraints) -> dict[str, Any]:
    """`{"affinity", "resources", "notes"}` for the Pod spec of a Deployment, Job or Pod; a request
    for MIG devices adds `mig_strategy: mixed` and `single_strategy: {"affinity", "resources"}`."""
    notes = list(constraints.notes)
    gpus = max((platform.gpus for platform in constraints.platforms), default=0)
    slices = max((platform.mig_devices for platform in constraints.platforms), default=0)
    if not slices:
        affinity, revision = _affinity(constraints, "whole", None)
        body: dict[str, Any] = {
            "affinity": affinity,
            "resources": _resources(constraints, GPU_RESOURCE, gpus),
        }
        if any(term.products is not None for platform in constraints.platforms for term in platform.terms):
            notes.append(
                "MIG-partitioned nodes (nvidia.com/gpu.product ending in -MIG-<profile>) are not in the "
                "product lists"
            )
        if gpus > 0:
            notes.append(
                f"{GPU_RESOURCE}: {gpus} in resources.limits enforces the GPU count; the device plugin "
                "assigns free GPUs (nvidia.com/gpu.count counts every GPU, free or not); nodes labelled "
                f"{MIG_SLICES_LABEL} (single MIG strategy: their nvidia.com/gpu are MIG devices) are left out"
            )
    else:
        profile = _mixed_profile(constraints)
        if profile is None:
            mixed, revision = {"nodeAffinity": _required([UNMATCHABLE])}, False
            notes.append(
                "mixed strategy: no MIG profile to ask for (the known fleet has none this request "
                "accepts, and none is named): the terms match nothing"
            )
            resources = _resources(constraints, None, 0)
        else:
            mixed, revision = _affinity(constraints, "mixed", profile)
            resources = _resources(constraints, resource_name(profile), slices)
            others = sorted(
                {
                    c.profile
                    for platform in constraints.platforms
                    for c in platform.mig_choices
                    if c.profile != profile
                }
            )
            also = f"; {', '.join(resource_name(p) for p in others)} would also do" if others else ""
            notes.append(
                f"mixed strategy: {resource_name(profile)}: {slices} in resources.limits (a pod names one "
                f"MIG resource; the smallest that qualifies{also})"
            )
        single, single_revision = _affinity(constraints, "single", None)
        revision = revision or single_revision
        notes.append(
            f"single strategy (single_strategy): {GPU_RESOURCE}: {slices} on nodes labelled "
            f"{MIG_STRATEGY_LABEL}=single, the MIG profile and parent product in {PRODUCT_LABEL} "
            "(<product>-MIG-<profile>), device memory in nvidia.com/gpu.memory"
        )
        body = {
            "affinity": mixed,
            "resources": resources,
            "mig_strategy": "mixed",
            "single_strategy": {
                "affinity": single,
                "resources": _resources(constraints, GPU_RESOURCE, slices),
            },
        }
    labels = constraints.request.labels
    if labels:
        notes.insert(
            len(constraints.notes),
            "gpubadge server labels are required as node labels of the same name and value",
        )
    if revision:
        notes.insert(
            len(constraints.notes) + bool(labels),
            "an upper bound on the driver's revision cannot match a node whose driver version has two "
            "parts (GFD writes an empty revision label): such nodes are not selected",
        )
    body["notes"] = notes
    return body


def _mixed_profile(constraints: Constraints) -> str | None:
    """The one MIG resource a mixed-strategy pod asks for: the smallest known device that qualifies,
    else the first profile named."""
    for platform in constraints.platforms:
        if platform.mig_devices and platform.terms:
            for choice in platform.mig_choices:
                if any(choice in platform.choices_for(term) for term in platform.terms):
                    return choice.profile
    named = [profile for platform in constraints.platforms for profile in platform.mig_profiles]
    return named[0] if named else None


def _affinity(constraints: Constraints, mode: str, profile: str | None) -> tuple[dict[str, Any], bool]:
    terms: list[Alternative] = []
    revision = False
    labels: Alternative = [
        {"key": key, "operator": "In", "values": [value]}
        for key, value in sorted(constraints.request.labels.items())
    ]
    for platform in constraints.platforms:
        extra = [{"key": ARCH_LABEL, "operator": "In", "values": [platform.architecture]}, *labels]
        for term in platform.terms:
            alternatives, reads_revision = _term_alternatives(term, platform, extra, mode, profile)
            revision = revision or (reads_revision and bool(alternatives))
            for alternative in alternatives:
                if alternative not in terms:
                    terms.append(alternative)
    if not terms:
        terms = [UNMATCHABLE]
    return {"nodeAffinity": _required(terms)}, revision


def _required(terms: list[Alternative]) -> dict[str, Any]:
    # Fresh dicts per term: terms repeat requirements, and a shared object would come out of a
    # YAML dump as an anchor and aliases.
    return {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": copy.deepcopy(term)} for term in terms]
        }
    }


def _resources(constraints: Constraints, resource: str | None, count: int) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if resource is not None and count > 0:
        resources["limits"] = {resource: count}
    requests = {}
    if constraints.request.cpus is not None:
        requests["cpu"] = _cpu(constraints.request.cpus)
    if constraints.request.memory is not None:
        requests["memory"] = _quantity(constraints.request.memory)
    if requests:
        resources["requests"] = requests
    return resources


def _cpu(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def _quantity(value: int) -> str:
    for unit, size in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if value % size == 0:
            return f"{value // size}{unit}"
    return str(value)
