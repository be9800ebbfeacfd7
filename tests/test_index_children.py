"""An index's children are bounded by a setting and cost the same each, however many (issue 43, point 10).

An index listing more platform images than `max_index_children` is refused before any child is read,
with an error naming the setting, for good. Below the bound, the platforms of one index that share a
layer wait their turn for it one at a time: before, every read of the shared layer woke every scan
waiting for it, so 8,000 children cost 101 s of the service's CPU, growing as their square
(bench/index_bench.py has the figures at 1,000, 4,000 and 8,000 children).
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import pstats
import time
from collections.abc import AsyncIterator, Sequence

from fixtures.oci import ImageSpec, LayerSpec, fake_elf, file
from fixtures.registry import LocalRegistry
from scanner.layer_reader import LayerProgress, LayerReader
from scanner.layers.analysis import LayerOutcome
from scanner.layers.image import ImageVerdict
from scanner.layers.limits import AnalysisLimits
from scanner.models import LibcVerdict
from scanner.registry.client import RegistryClient
from scanner.registry.descriptors import Descriptor
from scanner.registry.reference import parse_reference
from scanner.scan import Scanner
from scanner.settings import ScannerSettings
from tests.conftest import Pusher

GLIBC_LOADER = "/lib64/ld-linux-x86-64.so.2"


def children(count: int) -> list[ImageSpec]:
    layer = LayerSpec([file("/bin/sh", fake_elf(GLIBC_LOADER), mode=0o755)])
    return [ImageSpec([layer], env={"CHILD": str(number)}) for number in range(count)]


async def scan(reference: str, **overrides: object):  # type: ignore[no-untyped-def]
    values: dict[str, object] = {"docker_config": None, "retries": 2, "analysis_processes": 1}
    values.update(overrides)
    settings = ScannerSettings(**values)  # type: ignore[arg-type]
    async with RegistryClient(settings) as client:
        scanner = Scanner(client, None, settings)
        try:
            return await scanner.scan(reference)
        finally:
            await scanner.close()


async def test_an_index_past_the_bound_is_refused_naming_it(push: Pusher, registry: LocalRegistry) -> None:
    """Five platform images against a bound of four: refused after reading the index alone, for good;
    with the bound at five, all five are read."""
    push(children(5), "wide/five:1")
    reference = f"{registry.host}/wide/five:1"
    refused = await scan(reference, max_index_children=4)
    assert refused.error == "the index lists 5 platform images; the limit is 4 (GPUBADGE_MAX_INDEX_CHILDREN)"
    assert refused.retryable is False and refused.platforms == []
    assert refused.requests <= 2  # the tag's manifest (and its HEAD): no child was read
    read = await scan(reference, max_index_children=5)
    assert read.error is None and len(read.platforms) == 5
    assert {p.libc.flavour for p in read.platforms} == {"glibc"}


# -- one shared layer, many platform images: each waits its turn once


class _Stream:
    bytes_received = 4
    bytes_read = 4

    async def _chunks(self) -> AsyncIterator[bytes]:
        yield b"data"

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()


class _Client:
    reads = 0

    @contextlib.asynccontextmanager
    async def stream_blob(self, *_: object, **__: object) -> AsyncIterator[_Stream]:
        self.reads += 1
        await asyncio.sleep(0.01)  # the registry sends the layer meanwhile
        yield _Stream()


class _Store:
    """The layer cache as the service's store answers it: a hop off the loop per call."""

    def __init__(self) -> None:
        self.entries: dict[str, str] = {}

    async def layer_evidence(self, digest: str) -> str | None:
        await asyncio.sleep(0)
        return self.entries.get(digest)

    async def layer_evidences(self, digests: Sequence[str]) -> dict[str, str]:
        await asyncio.sleep(0)
        return {digest: self.entries[digest] for digest in digests if digest in self.entries}

    async def save_layer_evidence(self, digest: str, evidence_json: str) -> None:
        await asyncio.sleep(0)
        self.entries[digest] = evidence_json


class _Session:
    """An analysis process's session: every request is a round trip."""

    done = False

    async def use_cached(self, evidence_json: str) -> bool:
        await asyncio.sleep(0)
        return True

    async def read_layer(self, chunks: AsyncIterator[bytes], media_type: str) -> LayerOutcome:
        read = sum([len(chunk) async for chunk in chunks])
        return LayerOutcome("{}", True, read)

    async def skip_layer(self) -> None:
        pass

    async def verdict(self, bytes_read: int, bytes_total: int) -> ImageVerdict:
        await asyncio.sleep(0)
        return ImageVerdict(libc=LibcVerdict(flavour="glibc"))

    def close(self) -> None:
        pass


class _Pool:
    async def open(self, *_: object, **__: object) -> _Session:
        return _Session()


async def _shared_layer_calls(images: int) -> tuple[int, int]:
    """Function calls to analyse `images` platform images sharing one layer at once, and blob reads."""
    client = _Client()
    reader = LayerReader(client, _Store(), AnalysisLimits(), _Pool())  # type: ignore[arg-type]
    layer = Descriptor("application/vnd.oci.image.layer.v1.tar+gzip", "sha256:" + "a" * 64, 4)
    reference = parse_reference("registry.example/wide/shared:1")

    async def one() -> ImageVerdict:
        progress = LayerProgress(layers_total=1, bytes_total=4)
        return await reader.analyse(
            reference, [layer], "amd64", cuda=True, deadline=time.monotonic() + 60, progress=progress
        )

    profile = cProfile.Profile()
    profile.enable()
    verdicts = await asyncio.gather(*(one() for _ in range(images)))
    profile.disable()
    assert {v.libc.flavour for v in verdicts} == {"glibc"}
    calls = int(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]
    return calls, client.reads


async def test_platforms_sharing_a_layer_cost_the_same_each_however_many() -> None:
    """300 and 1,200 platform images sharing one layer: it is read once, and the work per image stays
    the same (before: every read of it woke every waiting scan, work growing as the square)."""
    small, small_reads = await _shared_layer_calls(300)
    large, large_reads = await _shared_layer_calls(1200)
    assert small_reads == large_reads == 1
    per_small, per_large = small / 300, large / 1200
    assert per_large < 1.5 * per_small, (per_small, per_large)
