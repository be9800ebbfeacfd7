"""A node's features in NFD's shape: flags, attributes and instances. Pure.

Three sources give them:

- NFD's `NodeFeature` object (`nfd.k8s-sigs.io/v1alpha1`, what nfd-worker publishes; `kubectl get
  nodefeature -o yaml`), or a list of them for one node, merged as nfd-master merges them;
- the output of `nfd export features` (the bare `{flags, attributes, instances}`);
- a gpubadge server (a file inventory or an agent's heartbeat): `from_server` derives what NFD and
  GPU Feature Discovery would publish on it (see there for what is derived and how).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from placement.inventory import Server
from placement.nfd.schema import DEFAULT_LIMITS, DocumentLimits, SpecError, read_yaml_as_strings

NVIDIA_PCI_VENDOR = "10de"
PCI_CLASS_VGA = "0300"
PCI_CLASS_3D = "0302"
# Brands whose boards are 3D controllers (no display engine exposed): data-center and compute GPUs.
_COMPUTE_BRANDS = frozenset(
    {"tesla", "nvidia", "grid", "nvidia vapps", "nvidia vpc", "nvidia vcs", "nvidia vws"}
)
MAX_FEATURES_BYTES = 8 * 1024 * 1024  # a NodeFeature object is tens of KiB on a big node
DEFAULT_MAX_FEATURE_NODES = 1_000_000  # the setting nfd_max_feature_nodes: YAML nodes of one features file


class FeaturesError(ValueError):
    """The document is not a NodeFeature, a list of them, or `nfd export features` output."""


class _Nfd(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class FlagFeatureSet(_Nfd):
    elements: dict[str, Any] | None = None


class AttributeFeatureSet(_Nfd):
    elements: dict[str, str] | None = None


class InstanceFeature(_Nfd):
    attributes: dict[str, str] = Field(default_factory=dict)


class InstanceFeatureSet(_Nfd):
    elements: list[InstanceFeature] | None = None


class Features(_Nfd):
    """NFD's `Features`: the three kinds of feature sets, by feature name (`kernel.loadedmodule`)."""

    flags: dict[str, FlagFeatureSet] = Field(default_factory=dict)
    attributes: dict[str, AttributeFeatureSet] = Field(default_factory=dict)
    instances: dict[str, InstanceFeatureSet] = Field(default_factory=dict)

    def merged(self, other: Features) -> Features:
        """`other` added over this one, feature set by feature set (nfd-master's merge)."""
        return Features(
            flags={**self.flags, **other.flags},
            attributes={**self.attributes, **other.attributes},
            instances={**self.instances, **other.instances},
        )


class NodeFeatures(BaseModel):
    """Features of one node, with where they came from (for people)."""

    name: str
    source: str
    features: Features
    notes: list[str] = Field(default_factory=list)


def parse_node_features(
    text: str,
    name: str = "node",
    limits: DocumentLimits = DEFAULT_LIMITS,
    max_nodes: int = DEFAULT_MAX_FEATURE_NODES,
) -> NodeFeatures:
    """A NodeFeature object, a list of them (`kind: List` or NodeFeatureList), or `nfd export features`.

    JSON, else YAML read within `limits` (depth) and `max_nodes` (a big node's kernel.config alone
    is thousands of elements), numbers and booleans as the strings Go makes of them. Raises
    FeaturesError naming what is wrong, or the bound (its setting) a document goes past.
    """
    if len(text) > MAX_FEATURES_BYTES:
        raise FeaturesError(f"the document is {len(text):,} bytes; at most {MAX_FEATURES_BYTES:,} are read")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # YAML, or JSON nested too deep: the bounded reader says which
        try:
            data = read_yaml_as_strings(text, limits.model_copy(update={"max_nodes": max_nodes}))
        except SpecError as exc:
            raise FeaturesError(str(exc).replace("nfd_max_nodes", "nfd_max_feature_nodes")) from None
    if not isinstance(data, dict):
        raise FeaturesError("expected a NodeFeature object, a list of them, or `nfd export features` output")
    try:
        if isinstance(data.get("items"), list):
            objects = [item for item in data["items"] if isinstance(item, dict)]
            if not objects:
                raise FeaturesError("the list holds no NodeFeature object")
            features = Features()
            for item in objects:
                features = features.merged(_node_feature(item))
            return NodeFeatures(
                name=_node_name(objects[0]) or name, source="NodeFeature list", features=features
            )
        if data.get("kind") == "NodeFeature" or "spec" in data:
            return NodeFeatures(
                name=_node_name(data) or name, source="NodeFeature", features=_node_feature(data)
            )
        if {"flags", "attributes", "instances"} & data.keys():
            return NodeFeatures(
                name=name, source="nfd export features", features=Features.model_validate(data)
            )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise FeaturesError(f"{where}: {first['msg']}") from None
    raise FeaturesError("expected a NodeFeature object, a list of them, or `nfd export features` output")


def _node_feature(data: dict[str, Any]) -> Features:
    kind = data.get("kind")
    if kind not in (None, "NodeFeature"):
        raise FeaturesError(f"kind {kind!r} is not NodeFeature")
    spec = data.get("spec")
    if not isinstance(spec, dict):
        raise FeaturesError("a NodeFeature needs spec.features")
    return Features.model_validate(spec.get("features") or {})


def _node_name(data: dict[str, Any]) -> str | None:
    metadata: dict[str, Any] = data["metadata"] if isinstance(data.get("metadata"), dict) else {}
    labels: dict[str, Any] = metadata["labels"] if isinstance(metadata.get("labels"), dict) else {}
    name = labels.get("nfd.node.kubernetes.io/node-name") or metadata.get("name")
    return str(name) if name else None


def gfd_labels(server: Server) -> dict[str, str]:
    """The GPU Feature Discovery labels this server would carry (GFD `internal/lm`), as far as known."""
    labels: dict[str, str] = {}
    if server.driver_version:
        parts = server.driver_version.split(".")
        labels["nvidia.com/cuda.driver-version.full"] = server.driver_version
        labels["nvidia.com/cuda.driver-version.major"] = parts[0]
        labels["nvidia.com/cuda.driver-version.minor"] = parts[1] if len(parts) > 1 else ""
        labels["nvidia.com/cuda.driver-version.revision"] = parts[2] if len(parts) > 2 else ""
    if server.cuda_driver_version:
        major, _, minor = server.cuda_driver_version.partition(".")
        labels["nvidia.com/cuda.runtime-version.full"] = server.cuda_driver_version
        labels["nvidia.com/cuda.runtime-version.major"] = major
        labels["nvidia.com/cuda.runtime-version.minor"] = minor.split(".")[0] if minor else "0"
    if server.gpus:
        first = server.gpus[0]
        labels["nvidia.com/gpu.count"] = str(len(server.gpus))
        labels["nvidia.com/gpu.product"] = first.name.replace(" ", "-")
        if first.memory_mib:
            labels["nvidia.com/gpu.memory"] = str(first.memory_mib)
        if first.compute_capability:
            major, _, minor = first.compute_capability.partition(".")
            labels["nvidia.com/gpu.compute.major"] = major
            labels["nvidia.com/gpu.compute.minor"] = minor or "0"
    return labels


def from_server(server: Server) -> NodeFeatures:
    """What NFD (with GFD's feature file) would publish on a gpubadge server, derived from its inventory.

    - `pci.device`: one instance per GPU, vendor `10de`. NVML does not report the PCI class, so it
      is derived from the brand: data-center brands (Tesla, NVIDIA, GRID/vGPU) are 3D controllers
      (`0302`), the others VGA controllers (`0300`). The notes say so.
    - `kernel.loadedmodule`: `nvidia` when the server reports a driver (NVML answered, so the
      module is loaded). `nvidia_uvm` and the others are not known and not invented.
    - `local.label`: the GFD labels its driver, CUDA and GPUs give (`gfd_labels`).
    - `system.osrelease` and `cpu`: not known, so absent (a rule on them does not match).
    """
    instances = [
        InstanceFeature(
            attributes={
                "vendor": NVIDIA_PCI_VENDOR,
                "class": PCI_CLASS_3D if gpu.brand.lower() in _COMPUTE_BRANDS else PCI_CLASS_VGA,
            }
        )
        for gpu in server.gpus
    ]
    features = Features(
        flags={
            "kernel.loadedmodule": FlagFeatureSet(elements={"nvidia": {}} if server.driver_version else {})
        },
        attributes={"local.label": AttributeFeatureSet(elements=gfd_labels(server))},
        instances={"pci.device": InstanceFeatureSet(elements=instances)},
    )
    notes = ["derived from gpubadge's inventory: PCI class from the GPU brand, GFD labels from NVML's facts"]
    return NodeFeatures(
        name=server.name, source=f"gpubadge {server.source} inventory", features=features, notes=notes
    )
