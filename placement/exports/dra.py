"""Constraints as a Kubernetes DRA ResourceClaimTemplate for NVIDIA's `gpu.nvidia.com` devices.

The NVIDIA DRA driver publishes `driverVersion`, `cudaDriverVersion` and `cudaComputeCapability`
as semver attributes (`550.107.02` as `550.107.2`), `productName` and `brand` as strings, and
memory as a device capacity. CEL's one-argument `semver()` accepts only canonical `X.Y.Z`, so
every version is written that way. A claim cannot say which CPU architecture the node has: a
`kubernetes.io/arch` node affinity comes with it.

A request for MIG devices claims devices of class `mig.nvidia.com` (type `mig`): the driver
publishes them with their `profile`, their parent's `productName` and version attributes, and
their own `memory` and `multiprocessors` capacities, so the same CEL applies, plus the profiles
named. Whole GPUs are claimed from `gpu.nvidia.com` (type `gpu`), which has no MIG device in it.
"""

from __future__ import annotations

import re
from typing import Any

from placement.exports.core import Bound, Constraints, Interval, PlatformConstraints, Term

DOMAIN = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
MIG_DEVICE_CLASS = "mig.nvidia.com"
_ATTRIBUTE = {"driver": "driverVersion", "cuda": "cudaDriverVersion", "cc": "cudaComputeCapability"}
_NAME = re.compile(r"[^a-z0-9-]+")


def semver(bound: Bound, lower: bool) -> tuple[str, bool]:
    """`X.Y.Z` and inclusiveness for a bound; parts past the third make the bound strict/loose."""
    parts = bound.version
    inclusive = bound.inclusive
    if len(parts) > 3:
        parts, inclusive = parts[:3], not lower  # dropped parts are not all zero
    padded = (*parts, 0, 0, 0)[:3]
    return ".".join(str(part) for part in padded), inclusive


def _string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _interval(dimension: str, interval: Interval) -> list[str]:
    attribute = f"device.attributes['{DOMAIN}'].{_ATTRIBUTE[dimension]}"
    found = []
    if interval.low is not None:
        version, inclusive = semver(interval.low, True)
        found.append(f"{attribute}.compareTo(semver('{version}')) {'>=' if inclusive else '>'} 0")
    if interval.high is not None:
        version, inclusive = semver(interval.high, False)
        found.append(f"{attribute}.compareTo(semver('{version}')) {'<=' if inclusive else '<'} 0")
    return found


def term_expression(term: Term, platform: PlatformConstraints) -> str:
    parts = [piece for dimension, interval in term.versions for piece in _interval(dimension, interval)]
    if term.products is not None:
        names = ", ".join(_string(name) for name in sorted(term.products))
        parts.append(f"device.attributes['{DOMAIN}'].productName in [{names}]")
    if platform.mig_devices and platform.mig_profiles:
        names = ", ".join(_string(profile) for profile in platform.mig_profiles)
        parts.append(f"device.attributes['{DOMAIN}'].profile in [{names}]")
    if platform.min_memory_mib is not None:
        parts.append(
            f"device.capacity['{DOMAIN}'].memory.compareTo(quantity('{platform.min_memory_mib}Mi')) >= 0"
        )
    return " && ".join(parts) if parts else "true"


def export(constraints: Constraints) -> dict[str, Any]:
    """`{"resourceClaimTemplate", "affinity", "notes"}`; the template is None when no GPU is needed."""
    notes = list(constraints.notes)
    gpu_platforms = [platform for platform in constraints.platforms if platform.wants_gpu]
    mig = any(platform.mig_devices for platform in gpu_platforms)
    alternatives: list[str] = []
    for platform in gpu_platforms:
        for term in platform.terms:
            expression = term_expression(term, platform)
            if expression not in alternatives:
                alternatives.append(expression)
    if len({tuple(map(str, p.terms)) for p in gpu_platforms}) > 1:
        notes.append(
            "the image's platforms demand different GPUs; a claim cannot see the CPU architecture, so it "
            "accepts what any platform accepts"
        )
    if any(t.products is not None for p in gpu_platforms for t in p.terms):
        notes.append(
            "brand and model clauses became productName lists from the known fleet (one source of truth "
            "with gpubadge's eligibility)"
        )
    if not alternatives:
        expression = "false"
    elif len(alternatives) == 1:
        expression = alternatives[0]
    else:
        expression = " || ".join(f"({alternative})" for alternative in alternatives)
    template = None
    if gpu_platforms:
        name = (
            _NAME.sub("-", (constraints.image or "image").lower().rsplit("/", 1)[-1]).strip("-")[:50]
            or "image"
        )
        kind = "mig" if mig else "gpu"
        if mig:
            notes.append(
                f"MIG devices are claimed from {MIG_DEVICE_CLASS}: their productName and versions are the "
                "parent GPU's, memory their own"
            )
        template = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": f"{name}-{kind}"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": kind,
                                "exactly": {
                                    "deviceClassName": MIG_DEVICE_CLASS if mig else DEVICE_CLASS,
                                    "allocationMode": "ExactCount",
                                    "count": max(p.mig_devices if mig else p.gpus for p in gpu_platforms),
                                    "selectors": [{"cel": {"expression": expression}}],
                                },
                            }
                        ]
                    }
                }
            },
        }
    else:
        notes.append("no GPU is requested: no claim")
    archs = sorted({platform.architecture for platform in constraints.platforms if platform.terms})
    expressions: list[dict[str, Any]] = [
        {"key": "kubernetes.io/arch", "operator": "In", "values": archs or ["none"]}
    ]
    expressions += [
        {"key": key, "operator": "In", "values": [value]}
        for key, value in sorted(constraints.request.labels.items())
    ]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": expressions}]
            }
        }
    }
    return {"resourceClaimTemplate": template, "affinity": affinity, "notes": notes}
