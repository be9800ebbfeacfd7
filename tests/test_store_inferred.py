"""The inferred-CUDA filter of the image listing, on SQLite and on PostgreSQL."""

from __future__ import annotations

from scanner.models import GpuFacts, ImageReport, InferredCuda, LibcVerdict, PlatformReport
from store import queries
from tests.conftest import OpenBackend


def report(name: str, digit: str, inferred: InferredCuda | None) -> ImageReport:
    platform = PlatformReport(
        platform="linux/amd64",
        digest="sha256:" + digit * 64,
        gpu=GpuFacts(inferred=inferred),
        libc=LibcVerdict(flavour="glibc"),
    )
    return ImageReport(
        reference=f"registry.example/{name}:1",
        digest="sha256:" + digit * 64,
        registry="registry.example",
        repository=name,
        tag="1",
        platforms=[platform],
    )


def test_inferred_filter(open_backend: OpenBackend) -> None:
    store = open_backend()
    store.run(
        queries.save_report, report("torch", "a", InferredCuda(cuda="12.1", evidence=["x: cuda = '12.1'"]))
    )
    store.run(queries.save_report, report("plain", "b", None))
    found, total = store.run(queries.list_images, inferred=True)
    assert [row.repository for row in found] == ["torch"] and total == 1
    found, _ = store.run(queries.list_images, inferred=False)
    assert [row.repository for row in found] == ["plain"]
    assert store.run(queries.list_images)[1] == 2
