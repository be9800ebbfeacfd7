"""Constraints as a Kubernetes node affinity over GPU Feature Discovery labels, plus resources.

Version ranges become ORed node selector terms made only of integer `Gt`/`Lt` on the split
version labels (`>= X` is `Gt X-1`; `= X` is `Gt X-1` and `Lt X+1`): `In` would compare strings,
and GFD writes revisions zero-padded (`02` is not `2`). Every term repeats every other
requirement it is ANDed with. Brand and model clauses become `nvidia.com/gpu.product` lists from
the known fleet (GFD has no brand label); when nothing can be eligible, one term that no node
matches. Node names are never used.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from itertools import product
from typing import Any

from placement.exports.core import Bound, Constraints, Interval, PlatformConstraints, Term

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
_LABELS = {"driver": DRIVER_LABELS, "cuda": CUDA_LABELS, "cc": CC_LABELS}
_GFD_DROP = re.compile(r"[^A-Za-z0-9\-_. ]")
_SPACES = re.compile(r"\s+")

Requirement = dict[str, Any]  # a core/v1 NodeSelectorRequirement
Alternative = list[Requirement]  # one NodeSelectorTerm's matchExpressions


def gfd_product(nvml_name: str) -> str:
    """GFD's `nvidia.com/gpu.product` for an NVML name: odd characters dropped, spaces to dashes."""
    return _SPACES.sub("-", _GFD_DROP.sub("", nvml_name).strip())


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
    term: Term, platform: PlatformConstraints, extra: Alternative
) -> tuple[list[Alternative], bool]:
    parts: list[list[Alternative]] = []
    revision = False
    for dimension, interval in term.versions:
        alternatives, reads_revision = _interval(dimension, interval)
        parts.append(alternatives)
        revision = revision or reads_revision
    common: Alternative = [*extra]
    if platform.gpus > 0 and platform.min_memory_mib is not None:
        common.append(_gt(MEMORY_LABEL, platform.min_memory_mib - 1))
    if term.products is not None:
        values = sorted(
            {value for name in term.products for value in (gfd_product(name), gfd_product(name) + "-SHARED")}
        )
        common.append({"key": PRODUCT_LABEL, "operator": "In", "values": values})
    return [
        [*common, *(r for alternative in combo for r in alternative)] for combo in product(*parts)
    ], revision


UNMATCHABLE: Alternative = [
    {"key": PRODUCT_LABEL, "operator": "Exists"},
    {"key": PRODUCT_LABEL, "operator": "DoesNotExist"},
]


def export(constraints: Constraints) -> dict[str, Any]:
    """`{"affinity", "resources", "notes"}` for the Pod spec of a Deployment, Job or Pod."""
    notes = list(constraints.notes)
    terms: list[Alternative] = []
    revision = False
    gpus = max((platform.gpus for platform in constraints.platforms), default=0)
    labels: Alternative = [
        {"key": key, "operator": "In", "values": [value]}
        for key, value in sorted(constraints.request.labels.items())
    ]
    if labels:
        notes.append("gpubadge server labels are required as node labels of the same name and value")
    for platform in constraints.platforms:
        extra = [{"key": ARCH_LABEL, "operator": "In", "values": [platform.architecture]}, *labels]
        for term in platform.terms:
            alternatives, reads_revision = _term_alternatives(term, platform, extra)
            revision = revision or reads_revision
            for alternative in alternatives:
                if alternative not in terms:
                    terms.append(alternative)
    if not terms:
        terms = [UNMATCHABLE]
    if revision:
        notes.append(
            "an upper bound on the driver's revision cannot match a node whose driver version has two "
            "parts (GFD writes an empty revision label): such nodes are not selected"
        )
    if any(term.products is not None for platform in constraints.platforms for term in platform.terms):
        notes.append(
            "MIG-partitioned nodes (nvidia.com/gpu.product ending in -MIG-<profile>) are not in the "
            "product lists"
        )
    if gpus > 0:
        notes.append(
            f"{GPU_RESOURCE}: {gpus} in resources.limits enforces the GPU count; the device plugin "
            "assigns free GPUs (nvidia.com/gpu.count counts every GPU, free or not)"
        )
    resources: dict[str, Any] = {}
    if gpus > 0:
        resources["limits"] = {GPU_RESOURCE: gpus}
    requests = {}
    if constraints.request.cpus is not None:
        requests["cpu"] = _cpu(constraints.request.cpus)
    if constraints.request.memory is not None:
        requests["memory"] = _quantity(constraints.request.memory)
    if requests:
        resources["requests"] = requests
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    # Fresh dicts per term: terms repeat requirements, and a shared object would
                    # come out of a YAML dump as an anchor and aliases.
                    "nodeSelectorTerms": [{"matchExpressions": copy.deepcopy(term)} for term in terms]
                }
            }
        },
        "resources": resources,
        "notes": notes,
    }


def _cpu(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def _quantity(value: int) -> str:
    for unit, size in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if value % size == 0:
            return f"{value // size}{unit}"
    return str(value)
