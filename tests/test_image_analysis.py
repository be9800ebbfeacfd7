"""One walk per layer for every consumer (scanner.layers.image.ImageAnalysis), without I/O.

Each layer is fed once: from the cache, through one walk, or skipped. These tests drive the
analysis the way the reader does and check which consumers each walk carries, what the cache
entry holds afterwards, and that a cached layer never leaks into the next one.
"""

from __future__ import annotations

import gzip
import random
import time

import pytest

from fixtures.catalog import alpine_base, app_layer, ubuntu_base
from fixtures.oci import LAYER_MEDIA_TYPES, LayerSpec, file, tar_bytes, whiteout
from scanner.layers.image import CachedLayer, ImageAnalysis
from scanner.layers.libc_paths import LayerEvidence
from scanner.layers.limits import AnalysisLimits, LimitExceeded

GZIP = LAYER_MEDIA_TYPES["gzip"]
SITE = "/usr/local/lib/python3.11/site-packages"
TORCH = "__version__ = '2.3.0+cu121'\ncuda: Optional[str] = '12.1'\n"


def blob(layer: LayerSpec) -> bytes:
    return gzip.compress(tar_bytes(layer.entries))


def analysis(layers: int, *, cuda: bool, limits: AnalysisLimits | None = None) -> ImageAnalysis:
    return ImageAnalysis("amd64", layers, limits or AnalysisLimits(), time.monotonic() + 60, cuda=cuda)


def read(image: ImageAnalysis, data: bytes, chunk: int = 4096) -> tuple[str, list[str]]:
    """Stream one layer through `image`; its cache entry and the consumers its walk carried."""
    walk = image.begin_layer(GZIP)
    consumers = [type(collector).__name__ for collector in walk.collectors]
    for start in range(0, len(data), chunk):
        if not walk.feed(data[start : start + chunk]):
            break
    else:
        walk.close()
    return image.finish_layer().evidence_json, consumers


def torch_layer() -> LayerSpec:
    return LayerSpec([file(f"{SITE}/torch/version.py", TORCH)])


def test_without_cuda_one_walk_carries_libc_and_stops_when_decided() -> None:
    image = analysis(2, cuda=False)
    entry, consumers = read(image, blob(alpine_base()))
    assert consumers == ["LayerCollector"]
    assert image.done  # musl decided in the top layer: the lower one is never read
    assert image.verdict(bytes_read=0, bytes_total=0).libc.flavour == "musl"
    assert CachedLayer.parse(entry).cuda is None


def test_with_cuda_every_layer_is_walked_once_for_both_consumers() -> None:
    image = analysis(2, cuda=True)
    top, consumers = read(image, blob(torch_layer()))
    assert consumers == ["LayerCollector", "CudaEntryCollector"]
    base, consumers = read(image, blob(ubuntu_base()))
    assert consumers == ["LayerCollector", "CudaEntryCollector"]
    verdict = image.verdict(bytes_read=0, bytes_total=0)
    assert (
        verdict.libc.flavour == "glibc" and verdict.inferred is not None and verdict.inferred.cuda == "12.1"
    )
    for entry in (top, base):  # both consumers' evidence, complete, in one cache entry per layer
        cached = CachedLayer.parse(entry)
        assert cached.libc is not None and cached.libc.complete
        assert cached.cuda is not None and cached.cuda.complete


def test_libc_rides_along_after_its_verdict_while_cuda_reads_the_layer_whole() -> None:
    image = analysis(2, cuda=True)
    read(image, blob(alpine_base()))  # decides musl in the top layer
    assert image.libc.decided and not image.done  # CUDA can still sit in the lower layer
    entry, consumers = read(image, blob(torch_layer()))
    assert consumers == ["LayerCollector", "CudaEntryCollector"]
    cached = CachedLayer.parse(entry)
    assert cached.libc is not None and cached.libc.complete  # for the next image sharing the layer
    assert image.verdict(bytes_read=0, bytes_total=0).libc.flavour == "musl"


def test_a_cached_layer_covers_it_and_the_next_layer_starts_clean() -> None:
    """The fault this guards against: a cached top layer's flags leaking into the next walk."""
    first = analysis(2, cuda=True)
    app_entry, _ = read(first, blob(app_layer()))
    second = analysis(2, cuda=False)
    assert second.use_cached(app_entry) is True  # libc evidence complete: no read
    _, consumers = read(second, blob(alpine_base()))
    assert consumers == ["LayerCollector"]
    verdict = second.verdict(bytes_read=0, bytes_total=0).libc
    assert verdict.flavour == "musl" and verdict.layers_read == 2


def test_a_cache_entry_that_misses_one_consumer_reads_only_for_it_and_merges() -> None:
    libc_only = analysis(2, cuda=False)
    entry, _ = read(libc_only, blob(LayerSpec([file("etc/hostname", "x"), *torch_layer().entries])))
    assert CachedLayer.parse(entry).cuda is None
    deep = analysis(2, cuda=True)
    assert deep.use_cached(entry) is False  # libc covered, CUDA not: read for CUDA alone
    merged, consumers = read(deep, blob(LayerSpec([file("etc/hostname", "x"), *torch_layer().entries])))
    assert consumers == ["CudaEntryCollector"]
    cached = CachedLayer.parse(merged)
    assert (
        cached.libc is not None and cached.libc.complete and cached.cuda is not None and cached.cuda.complete
    )


def test_an_early_stop_caches_partial_evidence_that_a_deep_read_completes() -> None:
    noisy = LayerSpec([*alpine_base().entries, file("srv/noise", random.Random(1).randbytes(2 << 20))])
    data = blob(noisy)
    libc_only = analysis(1, cuda=False)
    partial, _ = read(libc_only, data)
    cached = CachedLayer.parse(partial)
    assert cached.libc is not None and not cached.libc.complete  # stopped past the verdict
    deep = analysis(1, cuda=True)
    assert deep.use_cached(partial) is False
    complete, consumers = read(deep, data)
    assert consumers == ["LayerCollector", "CudaEntryCollector"]
    libc = CachedLayer.parse(complete).libc
    assert libc is not None and libc.complete


def test_skipped_layers_count_as_unread() -> None:
    image = analysis(2, cuda=True)
    read(image, blob(LayerSpec([file("app/main.py", "print()")])))
    image.skip_layer()  # a foreign base layer: never fetched
    verdict = image.verdict(bytes_read=0, bytes_total=0)
    assert verdict.libc.flavour == "unknown" and verdict.libc.evidence == "not every layer could be read"


def test_whiteouts_above_hide_cuda_below_through_the_one_index() -> None:
    image = analysis(2, cuda=True)
    read(image, blob(LayerSpec([whiteout(f"{SITE}/torch")])))
    read(image, blob(torch_layer()))
    assert image.verdict(bytes_read=0, bytes_total=0).inferred is None


def test_a_legacy_libc_only_cache_entry_is_still_used() -> None:
    legacy = LayerEvidence(complete=True).model_dump_json()  # written before the one walk
    assert CachedLayer.parse(legacy).libc is not None
    assert CachedLayer.parse("not json").libc is None


@pytest.mark.parametrize("cuda", [False, True])
def test_every_walk_is_under_the_image_bounds(cuda: bool) -> None:
    """The consumers share one budget: the image's decompressed bytes bound any walk, libc or CUDA."""
    image = analysis(1, cuda=cuda, limits=AnalysisLimits(max_image_bytes=64 << 10))
    walk = image.begin_layer(GZIP)
    with pytest.raises(LimitExceeded, match=r"\(GPUBADGE_MAX_IMAGE_BYTES\)$"):
        walk.feed(blob(LayerSpec([file("big", bytes(1 << 20))])))
    image.fail_layer()
