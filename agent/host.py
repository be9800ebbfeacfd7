"""This host as a `Server`: NVML facts, CPU facts, and which NVIDIA modes Docker offers.

`detect_runtime_modes` and `build_server` are pure over their inputs (`docker info`
as a dict, a PATH lookup, CDI spec directories), so they are tested without a host.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from agent.nvml import NvmlFacts
from placement.inventory import RuntimeMode, Server, parse_inventory

log = logging.getLogger(__name__)

DEFAULT_CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
# Docker's `--gpus` / DeviceRequest(driver="nvidia") works when the toolkit's hook or CLI is on PATH.
TOOLKIT_BINARIES = ("nvidia-container-runtime-hook", "nvidia-container-cli")
NVIDIA_CDI_KIND = "nvidia.com/gpu"


def _cdi_spec_kind(path: Path) -> str | None:
    try:
        data = yaml.safe_load(path.read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    kind = data.get("kind") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None


def has_nvidia_cdi_spec(directories: Iterable[Path]) -> bool:
    """True when any CDI spec (*.json, *.yaml, *.yml) in `directories` declares nvidia.com/gpu devices."""
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.suffix in {".json", ".yaml", ".yml"} and _cdi_spec_kind(path) == NVIDIA_CDI_KIND:
                return True
    return False


def detect_runtime_modes(
    docker_info: Mapping[str, Any],
    which: Callable[[str], str | None] = shutil.which,
    cdi_dirs: Iterable[Path] | None = None,
) -> list[RuntimeMode]:
    """The NVIDIA modes this Docker engine offers, preferred first: runtime, device-requests, cdi."""
    modes: list[RuntimeMode] = []
    runtimes = docker_info.get("Runtimes") or {}
    has_runtime = "nvidia" in runtimes
    if has_runtime:
        modes.append("runtime")
    if has_runtime or any(which(binary) for binary in TOOLKIT_BINARIES):
        modes.append("device-requests")
    directories = (
        cdi_dirs
        if cdi_dirs is not None
        else [Path(d) for d in docker_info.get("CDISpecDirs") or []] or list(DEFAULT_CDI_DIRS)
    )
    if has_nvidia_cdi_spec(directories):
        modes.append("cdi")
    return modes


def merge_runtime_modes(engine: list[RuntimeMode] | None, declared: list[RuntimeMode]) -> list[RuntimeMode]:
    """What an inventory file declares, added to what the Docker engine offers (engine's order first).

    The file supplies what NVML cannot see; it never hides the engine: a file without
    `runtime_modes` still gets the engine's `nvidia` runtime. `engine` is None when the engine
    could not be asked, and then the file's modes are all there is.
    """
    modes = list(engine or [])
    modes.extend(mode for mode in declared if mode not in modes)
    return modes


def host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 0


def build_server(
    name: str,
    facts: NvmlFacts,
    runtime_modes: list[RuntimeMode],
    arch: str | None = None,
    cpus: int | None = None,
    memory: int | None = None,
) -> Server:
    """Assemble the registration body; a host without GPUs becomes a CPU server (no driver facts)."""
    return Server(
        name=name,
        arch=arch or platform.machine(),
        cpus=cpus if cpus is not None else (os.cpu_count() or 0),
        memory=memory if memory is not None else host_memory_bytes(),
        driver_version=facts.driver_version if facts.gpus else None,
        cuda_driver_version=facts.cuda_driver_version if facts.gpus else None,
        runtime_modes=runtime_modes if facts.gpus else [],
        gpus=facts.gpus,
        source="agent",
    )


def load_server_file(path: Path, name: str | None = None) -> Server:
    """Read one server (the `Server` shape, YAML or JSON) from an inventory-style file.

    A file holding `{"servers": [one]}` is accepted too. `name`, when given, overrides the file's.
    """
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if (isinstance(data, dict) and "servers" in data) or isinstance(data, list):
        servers = parse_inventory(text).servers
        if len(servers) != 1:
            raise ValueError(f"{path}: expected exactly one server, found {len(servers)}")
        server = servers[0]
    else:
        fields = dict(data or {})
        if name:
            fields["name"] = name
        server = Server.model_validate(fields)
    updates: dict[str, Any] = {"source": "agent"}
    if name:
        updates["name"] = name
    return server.model_copy(update=updates)
