"""Pure: what a stored report and a server become in the export file, and what each column means.

The export is for people who query with SQL and explore in Datasette, so each row is flat
(no JSON to unpack for the common questions) and each table has one job:

- `images`: one row per manifest digest (an index or a single-platform manifest);
- `platforms`: one row per platform image of an image (unique on digest and platform), keyed
  by an integer `id` so the link tables stay small;
- `env`: the NVIDIA_* and CUDA_* variables of each platform's config, one row per variable;
- `layers`: one row per layer digest, shared by every image that carries it, and
  `platform_layers`, which links layers to platforms in manifest order;
- `servers`: the fleet, one row per GPU (a server without a GPU gets one row without one).

`COLUMNS` (name -> SQLite type and description, in column order) is the single source of the
table definitions and of the Datasette metadata's column descriptions, so the two never drift.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from scanner.facts.badges import libc_label
from scanner.models import ImageReport, PlatformReport

Row = dict[str, Any]

# Increase when a table changes shape: an export of another format is rebuilt, not patched.
FORMAT = "gpubadge-export"
FORMAT_VERSION = 1

COLUMNS: dict[str, dict[str, tuple[type, str]]] = {
    "images": {
        "digest": (str, "manifest digest (an image index or a single-platform manifest)"),
        "reference": (str, "the reference that was scanned, as given"),
        "registry": (str, "registry host"),
        "repository": (str, "repository path in the registry"),
        "tag": (str, "tag of the scanned reference, if it named one"),
        "media_type": (str, "manifest media type"),
        "scanned_at": (str, "when the scan finished (UTC, ISO 8601)"),
        "gpu_required": (int, "1 when any platform asks for an NVIDIA GPU, else 0"),
        "pending": (int, "1 while the layer verdicts (libc, inferred CUDA) were still being read"),
        "platform_count": (int, "number of platform images"),
        "bytes_fetched": (int, "bytes the registry sent for this scan"),
    },
    "platforms": {
        "id": (int, "row id (env and platform_layers link here); unique per (digest, platform)"),
        "digest": (str, "the image's manifest digest (images.digest)"),
        "platform": (str, "os/architecture[/variant]"),
        "platform_digest": (str, "digest of this platform's own manifest"),
        "config_digest": (str, "digest of the platform's config"),
        "gpu_required": (int, "1 when the config asks for an NVIDIA GPU, else 0"),
        "cuda_version": (str, "CUDA major.minor the config declares"),
        "requirement": (str, "NVIDIA_REQUIRE_* values, '; '-separated, as NVIDIA's runtime reads them"),
        "effective_requirement": (str, "what NVIDIA's runtime hook checks (legacy CUDA_VERSION included)"),
        "libc": (
            str,
            "glibc, musl, none (static or scratch), unknown; or pending / not_analysed when the"
            " layers were not (yet) read",
        ),
        "libc_reason": (str, "why the layers are not analysed, when they are not"),
        "distro": (str, "distribution from os-release"),
        "musl_also": (int, "1 when a musl loader sits beside glibc"),
        "inferred_cuda": (
            str,
            "the newest CUDA the layers carry (GPUBADGE_DEEP_SCAN), declared image or not",
        ),
        "inferred_set_by": (str, "the evidence that set inferred_cuda: '<path>: <what it says>'"),
        "inferred_sources": (str, "kinds of evidence for inferred_cuda (torch, conda, elf, ...)"),
        "archs": (str, "SASS architectures of the GPU code CUDA loads, space-separated (80 86 90)"),
        "ptx_archs": (str, "PTX architectures of the GPU code CUDA loads, space-separated"),
        "badges": (str, "badge names, space-separated"),
        "layer_count": (int, "layers in the platform's manifest"),
        "layers_read": (int, "layers read for the libc verdict"),
        "bytes_fetched": (int, "compressed bytes the registry sent for this platform"),
        "created": (str, "the config's creation time"),
        "error": (str, "why this platform has no full answer, if it has none"),
    },
    "env": {
        "platform_id": (int, "platforms.id"),
        "digest": (str, "images.digest"),
        "name": (str, "variable name (NVIDIA_* and CUDA_*)"),
        "value": (str, "its value in the config"),
    },
    "layers": {
        "digest": (str, "layer blob digest"),
        "size": (int, "compressed size in bytes"),
        "media_type": (str, "layer media type"),
        "skipped": (str, "why the layer is never fetched (foreign or non-distributable), else null"),
    },
    "platform_layers": {
        "platform_id": (int, "platforms.id"),
        "position": (int, "0 is the base layer"),
        "layer_digest": (str, "layers.digest"),
    },
    "servers": {
        "id": (str, "the GPU's UUID, or the server name for a server without GPUs"),
        "server": (str, "server name"),
        "arch": (str, "CPU architecture"),
        "driver_version": (str, "NVIDIA driver version"),
        "cuda_driver_version": (str, "highest CUDA version the driver supports"),
        "gpu_index": (int, "GPU index on the server"),
        "gpu_uuid": (str, "GPU UUID"),
        "gpu_name": (str, "GPU model"),
        "memory_mib": (int, "GPU memory in MiB"),
        "compute_capability": (str, "compute capability, e.g. 8.0"),
        "mig": (int, "1 when MIG mode is on"),
        "registered_at": (str, "when its agent registered (UTC); null for a server of the inventory file"),
        "last_heartbeat": (
            str,
            "its agent's latest heartbeat (UTC); null for a server of the inventory file",
        ),
    },
}

PRIMARY_KEYS: dict[str, str | tuple[str, ...]] = {
    "images": "digest",
    "platforms": "id",
    "env": ("platform_id", "name"),
    "layers": "digest",
    "platform_layers": ("platform_id", "position"),
    "servers": "id",
}

FOREIGN_KEYS: dict[str, list[tuple[str, str, str]]] = {
    "platforms": [("digest", "images", "digest")],
    "env": [("platform_id", "platforms", "id"), ("digest", "images", "digest")],
    "platform_layers": [("platform_id", "platforms", "id"), ("layer_digest", "layers", "digest")],
}

# What people filter and join by (a foreign key column is indexed too, for the per-digest replace);
# platforms' natural key (digest, platform) is a unique index.
INDEXES: dict[str, list[list[str]]] = {
    "images": [["registry", "repository"], ["scanned_at"], ["gpu_required"]],
    "platforms": [["gpu_required", "libc"], ["cuda_version"], ["libc"]],
    "env": [["digest"], ["name", "value"]],
    "platform_layers": [["layer_digest"]],
    "servers": [["server"]],
}

FULL_TEXT = {"images": ["reference", "repository"]}

UNIQUE_INDEXES: dict[str, list[list[str]]] = {"platforms": [["digest", "platform"]]}


def _space(values: list[str] | tuple[str, ...] | None) -> str | None:
    return " ".join(values) if values else None


def image_rows(report: ImageReport, ids: Iterator[int]) -> dict[str, list[Row]]:
    """The rows of one stored report, by table; platform ids are drawn from `ids`.

    `layers` rows may repeat across images (the writer keeps one per digest)."""
    digest = report.digest or ""
    tables: dict[str, list[Row]] = {name: [] for name in ("images", "platforms", "env", "layers")}
    tables["platform_layers"] = []
    tables["images"].append(
        {
            "digest": digest,
            "reference": report.reference,
            "registry": report.registry,
            "repository": report.repository,
            "tag": report.tag,
            "media_type": report.media_type,
            "scanned_at": report.scanned_at.isoformat(timespec="microseconds"),
            "gpu_required": int(report.gpu_required),
            "pending": int(report.pending),
            "platform_count": len(report.platforms),
            "bytes_fetched": report.bytes_fetched,
        }
    )
    seen: set[str] = set()
    for platform in report.platforms:
        if platform.platform in seen:  # one row per platform; a repeated one adds nothing new
            continue
        seen.add(platform.platform)
        key = next(ids)
        tables["platforms"].append(_platform_row(digest, key, platform))
        tables["env"].extend(
            {"platform_id": key, "digest": digest, "name": name, "value": value}
            for name, value in sorted(platform.gpu.env.items())
        )
        skipped = {layer.digest: layer.reason for layer in platform.skipped_layers}
        for position, layer in enumerate(platform.layers):
            tables["layers"].append(
                {
                    "digest": layer.digest,
                    "size": layer.size,
                    "media_type": layer.media_type,
                    "skipped": skipped.get(layer.digest),
                }
            )
            tables["platform_layers"].append(
                {"platform_id": key, "position": position, "layer_digest": layer.digest}
            )
    return tables


def _platform_row(digest: str, key: int, platform: PlatformReport) -> Row:
    gpu, libc = platform.gpu, platform.libc
    inferred, archs = gpu.inferred, gpu.archs
    return {
        "id": key,
        "digest": digest,
        "platform": platform.platform,
        "platform_digest": platform.digest,
        "config_digest": platform.config_digest,
        "gpu_required": int(gpu.required),
        "cuda_version": gpu.cuda_version,
        "requirement": "; ".join(gpu.requirements) or None,
        "effective_requirement": "; ".join(gpu.effective_requirements) or None,
        "libc": libc_label(libc),
        "libc_reason": libc.reason,
        "distro": libc.distro,
        "musl_also": int(libc.musl_also),
        "inferred_cuda": inferred.cuda if inferred else None,
        "inferred_set_by": inferred.set_by if inferred else None,
        "inferred_sources": _space(inferred.sources) if inferred else None,
        "archs": _space(archs.sass) if archs else None,
        "ptx_archs": _space(archs.ptx) if archs else None,
        "badges": _space(platform.badges),
        "layer_count": len(platform.layers),
        "layers_read": libc.layers_read,
        "bytes_fetched": platform.bytes_fetched,
        "created": platform.created,
        "error": platform.error,
    }


def server_rows(inventory_json: str, registered_at: str | None, last_heartbeat: str | None) -> list[Row]:
    """One row per GPU of a stored server inventory (placement's `Server` document, read as JSON:
    store/ does not import placement/); one GPU-less row for a server without GPUs."""
    server: dict[str, Any] = json.loads(inventory_json)
    name = str(server.get("name", ""))
    common = {
        "server": name,
        "arch": server.get("arch"),
        "driver_version": server.get("driver_version"),
        "cuda_driver_version": server.get("cuda_driver_version"),
        "registered_at": registered_at,
        "last_heartbeat": last_heartbeat,
    }
    gpus: list[dict[str, Any]] = server.get("gpus") or []
    if not gpus:
        return [{"id": name, **common}]
    return [
        {
            "id": gpu.get("uuid") or f"{name}/{gpu.get('index')}",
            **common,
            "gpu_index": gpu.get("index"),
            "gpu_uuid": gpu.get("uuid"),
            "gpu_name": gpu.get("name"),
            "memory_mib": gpu.get("memory_mib"),
            "compute_capability": gpu.get("compute_capability"),
            "mig": int(bool(gpu.get("mig"))),
        }
        for gpu in gpus
    ]


TITLES = {
    "images": "Images",
    "platforms": "Platform images",
    "env": "NVIDIA and CUDA environment",
    "layers": "Layers",
    "platform_layers": "Layers of each platform",
    "servers": "GPU servers (one row per GPU)",
}
FACETS = {
    "images": ["gpu_required", "registry", "repository"],
    "platforms": ["gpu_required", "libc", "cuda_version", "platform"],
    "env": ["name"],
    "layers": ["skipped", "media_type"],
    "servers": ["gpu_name", "compute_capability", "driver_version"],
}
QUERIES = {
    "layers_shared_by_gpu_images": {
        "title": "Layers shared by the most GPU images",
        "sql": "SELECT pl.layer_digest, l.size, count(DISTINCT p.digest) AS gpu_images\n"
        "FROM platform_layers pl\n"
        "JOIN platforms p ON p.id = pl.platform_id\n"
        "JOIN layers l ON l.digest = pl.layer_digest\n"
        "WHERE p.gpu_required = 1\n"
        "GROUP BY pl.layer_digest ORDER BY gpu_images DESC, l.size DESC LIMIT 100",
    },
    "bytes_by_registry": {
        "title": "Bytes fetched per registry",
        "sql": "SELECT registry, count(*) AS images, sum(bytes_fetched) AS bytes_fetched\n"
        "FROM images GROUP BY registry ORDER BY bytes_fetched DESC",
    },
}


METADATA_TITLE = "gpubadge: which images need an NVIDIA GPU"
METADATA_MARK = "gpubadge_export"


def datasette_metadata(database: str) -> dict[str, Any]:
    """Datasette's metadata for an export opened as `database` (the file name without `.db`)."""
    tables: dict[str, Any] = {
        name: {
            "title": TITLES[name],
            "columns": {column: description for column, (_, description) in columns.items()},
            **({"facets": FACETS[name]} if name in FACETS else {}),
        }
        for name, columns in COLUMNS.items()
    }
    tables["images"]["label_column"] = "reference"
    tables["images"]["sort_desc"] = "scanned_at"
    tables["images"]["fts_table"] = "images_fts"
    tables["gpubadge_export"] = {"hidden": True}
    return {
        "title": METADATA_TITLE,
        "description": "Every stored gpubadge report, exported by `gpubadge export sqlite`.",
        "databases": {database: {"tables": tables, "queries": QUERIES}},
        # The mark by which a later export knows this sidecar is its own to replace (Datasette
        # ignores keys it does not know).
        METADATA_MARK: {"format": FORMAT, "version": FORMAT_VERSION},
    }
