"""Wide indexes: what an index's children cost the service, against how many there are (issue 43, point 10).

    python3 -m bench.index_bench [--quick]

Setup (unmeasured): one linux/amd64 image is pushed with skopeo; then indexes of 1,000, 4,000 and
8,000 children (250, 500, 1,000 with --quick) are written to the registry: each child is that image's
manifest with an annotation of its own (so a digest of its own), put with plain HTTP PUTs (skopeo
pushes a thousand children in 80 s; the registry stores what it is given either way), and the index
last. `gpubadge serve` runs as a process with `GPUBADGE_MAX_INDEX_CHILDREN` raised above the widest
index, so every child is read.

Measured per index, through the API (POST /api/scans, then GET /api/scans/ID?wait=): the CPU of the
service process and of its analysis processes (from /proc), the wall time, the registry requests the
scan made (the report's `requests`) and the stored report's size; then CPU per child, which stays
flat when the cost grows linearly. Last, the widest index with the default bound: refused, naming it.
The peer is the same scan before issue 43 (run this module with that tree first on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from urllib.parse import quote

from bench.common import Figure, Results, process_cpu_seconds, run_section
from fixtures.oci import (
    OCI_INDEX,
    OCI_MANIFEST,
    ImageSpec,
    LayerSpec,
    fake_elf,
    file,
    push_image,
    sha256_digest,
)
from fixtures.registry import LocalRegistry, run_registry
from fixtures.service import run_service_process

SECTION = "index"
TOKEN = "bench-index-token"
GLIBC_LOADER = "/lib64/ld-linux-x86-64.so.2"


def _put(url: str, body: bytes, media_type: str) -> None:
    request = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": media_type})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def push_wide_index(registry: LocalRegistry, repository: str, children: int, workdir: Path) -> str:
    """An index of `children` linux/amd64 manifests (one image, each with its own annotation); its tag."""
    base = ImageSpec([LayerSpec([file("/bin/sh", fake_elf(GLIBC_LOADER), mode=0o755)])])
    digest = push_image(base, f"{registry.host}/{repository}:base", workdir)
    with urllib.request.urlopen(
        urllib.request.Request(
            f"{registry.url}/v2/{repository}/manifests/{digest}", headers={"Accept": OCI_MANIFEST}
        ),
        timeout=30,
    ) as response:
        manifest = json.loads(response.read())

    def child(number: int) -> dict[str, object]:
        body = json.dumps({**manifest, "annotations": {"bench.child": str(number)}}, sort_keys=True).encode()
        child_digest = sha256_digest(body)
        _put(f"{registry.url}/v2/{repository}/manifests/{child_digest}", body, OCI_MANIFEST)
        return {
            "mediaType": OCI_MANIFEST,
            "digest": child_digest,
            "size": len(body),
            "platform": {"os": "linux", "architecture": "amd64"},
        }

    with ThreadPoolExecutor(8) as pool:
        descriptors = list(pool.map(child, range(children)))
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": descriptors}).encode()
    tag = f"wide{children}"
    _put(f"{registry.url}/v2/{repository}/manifests/{tag}", index, OCI_INDEX)
    return f"{registry.host}/{repository}:{tag}"


def _call(
    method: str, url: str, body: dict[str, str] | None = None, timeout: float = 90
) -> dict[str, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer: dict[str, object] = json.loads(response.read())
    return answer


def _descendants(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                found.append(int(entry.name))
    return found


def _tree_cpu(pid: int) -> float:
    total = process_cpu_seconds(pid)
    for child in _descendants(pid):
        with suppress(OSError):  # it ended meanwhile
            total += process_cpu_seconds(child)
    return total


def scan_once(url: str, pid: int, reference: str) -> dict[str, float | str]:
    """One scan through the API: CPU of the service and its analysis processes, wall, the outcome."""
    cpu, started = _tree_cpu(pid), time.perf_counter()
    job = _call("POST", f"{url}/api/scans", {"ref": reference})
    while job["state"] in ("queued", "running"):
        job = _call("GET", f"{url}/api/scans/{job['id']}?wait=60")
    wall = time.perf_counter() - started
    spent = _tree_cpu(pid) - cpu
    outcome: dict[str, float | str] = {"cpu": spent, "wall": wall, "state": str(job["state"])}
    if job["state"] == "done":
        with urllib.request.urlopen(
            urllib.request.Request(
                f"{url}/api/images/by-ref?ref={quote(reference)}",
                headers={"Authorization": f"Bearer {TOKEN}"},
            ),
            timeout=90,
        ) as response:
            document = response.read()
        report = json.loads(document)
        outcome.update(size=len(document), requests=float(report.get("requests") or 0))
    else:
        outcome["error"] = str(job.get("error"))
    return outcome


@contextmanager
def service(registry: LocalRegistry, workdir: Path, max_children: int | None) -> Iterator[tuple[str, int]]:
    env = {
        "GPUBADGE_REGISTRIES": registry.host,
        "GPUBADGE_API_TOKEN": TOKEN,
        "GPUBADGE_PLATFORMS": "linux/amd64",
    }
    if max_children is not None:
        env["GPUBADGE_MAX_INDEX_CHILDREN"] = str(max_children)
    with run_service_process(workdir / f"svc{max_children}.db", env=env) as running:
        assert running.process is not None
        yield running.url, running.process.pid


def run_all(results: Results, quick: bool) -> None:
    sizes = (250, 500, 1000) if quick else (1000, 4000, 8000)
    tree = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or "."
    results.detail(f"tree: {tree}")
    with run_registry() as registry, tempfile.TemporaryDirectory() as temporary:
        workdir = Path(temporary)
        references = {}
        for size in sizes:
            started = time.perf_counter()
            references[size] = push_wide_index(registry, "bench/wide", size, workdir / f"push{size}")
            results.detail(f"pushed an index of {size:,} children in {time.perf_counter() - started:.1f} s")
        per_child = []
        with service(registry, workdir, max(sizes)) as (url, pid):
            for size in sizes:
                outcome = scan_once(url, pid, references[size])
                if outcome["state"] != "done":
                    results.detail(f"{size:,} children: {outcome['state']}: {outcome.get('error')}")
                    continue
                cpu = float(outcome["cpu"])
                per_child.append(cpu / size)
                results.add(
                    Figure(
                        SECTION,
                        f"index of {size:,} children",
                        f"{cpu:.1f} s CPU, {outcome['wall']:.1f} s, {int(float(outcome['requests'])):,} requests,"
                        f" report {int(float(outcome['size'])):,} B",
                        note=f"{1000 * cpu / size:.2f} ms CPU per child",
                    )
                )
        if per_child:
            results.detail(
                "CPU per child, smallest to widest index: "
                + ", ".join(f"{1000 * c:.2f} ms" for c in per_child)
            )
        with service(registry, workdir, None) as (url, pid):
            outcome = scan_once(url, pid, references[max(sizes)])
            results.add(
                Figure(
                    SECTION,
                    f"index of {max(sizes):,} children, default bound",
                    f"{outcome['state']} in {float(outcome['cpu']):.2f} s CPU",
                    note=str(outcome.get("error", ""))[:160],
                )
            )


if __name__ == "__main__":
    run_section(run_all, __doc__)
