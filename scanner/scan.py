"""One scan, end to end: reference -> registry -> GPU and libc analysis -> report -> store.

This is the only place that combines I/O with the pure cores. It spends as few
requests as the budget allows (HEAD, manifest, config per platform), reuses a
stored report when the digest is already known, and reads layers top-down only
until the libc verdict is decided, sharing each layer's evidence through the
store so a common base layer is read once across all images.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scanner.facts.badges import badges, cuda_mismatch
from scanner.facts.gpu import gpu_facts
from scanner.layers.limits import LimitExceeded, scan_too_slow
from scanner.layers.tarstream import AnalysisCrashed, LayerError
from scanner.models import GpuFacts, ImageReport, LayerInfo, LibcVerdict, Platform, PlatformReport
from scanner.registry.client import RegistryClient
from scanner.registry.descriptors import Descriptor, Manifest
from scanner.registry.errors import RegistryError
from scanner.registry.reference import Reference, ReferenceError, parse_reference
from scanner.settings import ScannerSettings

if TYPE_CHECKING:
    from scanner.cache import ScanCache
    from scanner.layers.analysis import AnalysisPool
    from scanner.layers.deep import DeepReader
    from scanner.layers.reader import LayerReader

log = logging.getLogger(__name__)

ATTESTATION_PLATFORM = Platform(os="unknown", architecture="unknown")


class ScanError(Exception):
    """A scan could not finish; the message is safe to show to users."""


class NotAnImage(ScanError):
    """The manifest is an artifact (an attestation, a signature, a Helm chart), not a runnable image."""


def _is_layer(media_type: str) -> bool:
    return "tar" in media_type or media_type.endswith("rootfs.diff.tar.gzip")


@dataclass(frozen=True)
class ScanOptions:
    platform: Platform | None = None
    config_only: bool = False
    force: bool = False  # ignore a stored report for the same digest


def _is_attestation(descriptor: Descriptor) -> bool:
    """Buildkit attestations and other non-runnable entries of an index."""
    if descriptor.platform is not None and descriptor.platform == ATTESTATION_PLATFORM:
        return True
    return descriptor.annotations.get("vnd.docker.reference.type") == "attestation-manifest"


def _reusable(stored: ImageReport | None, options: ScanOptions) -> bool:
    if stored is None or options.force:
        return False
    return not (stored.config_only and not options.config_only)


def _filter_platforms(report: ImageReport, wanted: Platform | None) -> ImageReport:
    if wanted is None:
        return report
    kept = [p for p in report.platforms if wanted.matches(Platform.parse(p.platform))]
    return report.model_copy(update={"platforms": kept})


class Scanner:
    """Scans references with one registry client and (optionally) one store."""

    def __init__(
        self,
        client: RegistryClient,
        store: ScanCache | None = None,
        settings: ScannerSettings | None = None,
        *,
        on_result: Callable[[ImageReport], None] | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.settings = settings or ScannerSettings()
        self._layers: LayerReader | None = None
        self._deep: DeepReader | None = None
        self._pool: AnalysisPool | None = None
        self.on_result = on_result

    @property
    def layers(self) -> LayerReader:
        """The layer reader, built on first use: config-only scans never load the tar and libc code."""
        if self._layers is None:
            from scanner.layers.analysis import AnalysisPool
            from scanner.layers.reader import LayerReader

            self._pool = AnalysisPool(self.settings.analysis_processes)
            self._layers = LayerReader(
                self.client, self.store, limits=self.settings.analysis_limits(), pool=self._pool
            )
        return self._layers

    @property
    def deep(self) -> DeepReader:
        """The deep-scan reader (CUDA found in layers), built on first use."""
        if self._deep is None:
            from scanner.layers.deep import DeepReader

            self.layers  # noqa: B018  (builds the shared analysis pool)
            assert self._pool is not None
            self._deep = DeepReader(self.client, self.store, self.settings.deep_scan_limits(), self._pool)
        return self._deep

    def deep_progress(self) -> dict[str, str]:
        """Running deep scans, by reference: "deep scan: 2 of 5 layers, 812 of 4810 MiB"."""
        if self._deep is None:
            return {}
        return {reference: progress.describe() for reference, progress in self._deep.progress.items()}

    def _wants_deep(self, gpu: GpuFacts) -> bool:
        """GPUBADGE_DEEP_SCAN: `auto` deep-scans images that declare no NVIDIA signal."""
        mode = self.settings.deep_scan
        return mode == "always" or (mode == "auto" and not gpu.required)

    async def close(self) -> None:
        """Stop the analysis processes, if any were started."""
        if self._pool is not None:
            await self._pool.close()

    async def scan(self, text: str, options: ScanOptions | None = None) -> ImageReport:
        """Scan one reference. Never raises for bad input: the report carries the error."""
        options = options or ScanOptions()
        try:
            reference = parse_reference(text)
        except ReferenceError as exc:
            return ImageReport(reference=text, error=str(exc))
        with self.client.track() as stats:
            scan_timeout = asyncio.timeout(self.settings.max_scan_seconds)
            try:
                async with scan_timeout:
                    report = await self._scan(reference, options)
            except TimeoutError as exc:
                if not scan_timeout.expired():
                    report = self._failed(reference, f"timed out: {exc}")
                else:
                    report = self._failed(reference, str(scan_too_slow(self.settings.max_scan_seconds)))
                    report.retryable = False
            except LimitExceeded as exc:
                report = self._failed(reference, str(exc))
                report.retryable = False  # the same bytes cross the same bound every time
            except RegistryError as exc:
                report = self._failed(reference, str(exc))
            except NotAnImage as exc:
                report = self._failed(reference, str(exc))
                report.not_an_image = True
                report.retryable = False
            except ScanError as exc:
                report = self._failed(reference, str(exc))
            except AnalysisCrashed as exc:  # retryable: a fresh analysis process takes over
                report = self._failed(reference, f"layer analysis: {exc}")
            except LayerError as exc:
                report = self._failed(reference, f"corrupt layer: {exc}")
            except Exception as exc:  # keep the service up whatever a registry sends
                log.exception("unexpected error scanning %s", reference)
                report = self._failed(reference, f"internal error: {type(exc).__name__}: {exc}")
        report.requests = stats.requests
        if self.on_result:
            self.on_result(report)
        return report

    def _failed(self, reference: Reference, error: str) -> ImageReport:
        return ImageReport(
            reference=str(reference),
            error=error,
            registry=reference.registry,
            repository=reference.repository,
            tag=reference.tag,
            digest=reference.digest,
        )

    async def _scan(self, reference: Reference, options: ScanOptions) -> ImageReport:
        digest = reference.digest
        media_type: str | None = None
        if digest is None and self.store is None:
            # Nothing stored to reuse, so a HEAD would be one request for nothing: GET by tag.
            return await self._scan_manifest(reference, await self.client.manifest(reference), None, options)
        if digest is None:
            head = await self.client.resolve(reference)
            digest, media_type = head.digest, head.media_type
        stored = await self.store.report(digest) if self.store else None
        if stored is not None and _reusable(stored, options):
            await self._remember_tag(reference, digest)
            reused = stored.model_copy(
                update={"reference": str(reference), "tag": reference.tag, "cached": True}
            )
            return _filter_platforms(reused, options.platform)

        child = await self._stored_platform(digest, options)
        if child is not None:
            # A platform of an index we already scanned (the child events of a multi-arch push).
            return ImageReport(
                reference=str(reference),
                digest=digest,
                platforms=[child],
                registry=reference.registry,
                repository=reference.repository,
                tag=reference.tag,
                cached=True,
            )

        return await self._scan_manifest(
            reference, await self.client.manifest(reference, digest), media_type, options
        )

    async def _scan_manifest(
        self, reference: Reference, manifest: Manifest, media_type: str | None, options: ScanOptions
    ) -> ImageReport:
        if manifest.is_index:
            platforms = await self._scan_index(reference, manifest, options)
        else:
            platforms = [await self._scan_image(reference, manifest, options, None)]
        report = ImageReport(
            reference=str(reference),
            digest=manifest.digest,
            platforms=platforms,
            registry=reference.registry,
            repository=reference.repository,
            tag=reference.tag,
            media_type=media_type or manifest.media_type,
            config_only=options.config_only,
        )
        if self.store is not None:
            if options.platform is None or not manifest.is_index:
                await self.store.save_report(report)
            await self._remember_tag(reference, manifest.digest)
        return report

    async def _stored_platform(self, digest: str, options: ScanOptions) -> PlatformReport | None:
        """A platform image already scanned (e.g. as part of its index) that answers `options`.

        A stored libc flavour of `unknown` comes from a config-only scan or from layers that could
        not be read, so a full scan reads the layers again rather than reuse it.
        """
        if self.store is None or options.force:
            return None
        stored = await self.store.platform_report(digest)
        if stored is None or not (options.config_only or stored.libc.flavour != "unknown"):
            return None
        return stored

    async def _remember_tag(self, reference: Reference, digest: str) -> None:
        if self.store is not None and reference.tag:
            await self.store.record_tag(reference.registry, reference.repository, reference.tag, digest)

    async def _scan_index(
        self, reference: Reference, index: Manifest, options: ScanOptions
    ) -> list[PlatformReport]:
        children = [child for child in index.manifests if not _is_attestation(child)]
        if options.platform is not None:
            children = [c for c in children if c.platform and options.platform.matches(c.platform)]
            if not children:
                available = ", ".join(str(c.platform) for c in index.manifests if c.platform)
                raise ScanError(f"no platform {options.platform} in the index (available: {available})")
        if not children:
            raise ScanError("the index lists no runnable platform images")

        async def one(child: Descriptor) -> PlatformReport:
            cached = await self._stored_platform(child.digest, options)
            if cached is not None:
                return cached
            manifest = await self.client.manifest(reference, child.digest)
            if manifest.is_index:
                raise ScanError(f"nested index {child.digest} is not supported")
            return await self._scan_image(reference, manifest, options, child.platform)

        return list(await asyncio.gather(*(one(child) for child in children)))

    async def _scan_image(
        self,
        reference: Reference,
        manifest: Manifest,
        options: ScanOptions,
        platform: Platform | None,
    ) -> PlatformReport:
        config_descriptor = manifest.config
        artifacts = sorted({d.media_type for d in manifest.layers if not _is_layer(d.media_type)})
        if artifacts:
            raise NotAnImage(
                f"{manifest.digest} is not a container image (layers of type {', '.join(artifacts)})"
            )
        raw = await self.client.blob(reference, config_descriptor.digest, self.settings.max_config_bytes)
        config = _parse_config(raw)
        platform = platform or Platform(
            os=str(config.get("os") or "linux"),
            architecture=str(config.get("architecture") or "amd64"),
            variant=config.get("variant") or None,
        )
        gpu = gpu_facts(config)
        layers = manifest.layers
        warnings = [f"{issue.variable} does not parse: {issue.error}" for issue in gpu.requirement_errors]
        if options.config_only:
            libc = LibcVerdict(layers_total=len(layers), bytes_total=sum(layer.size for layer in layers))
        else:
            libc, layer_warnings = await self.layers.libc_verdict(reference, layers, platform.architecture)
            warnings.extend(layer_warnings)
            if self._wants_deep(gpu):
                deep = await self.deep.scan(reference, layers)
                gpu = gpu.model_copy(update={"inferred": deep.inferred, "archs": deep.archs})
                warnings.extend(deep.warnings)
                mismatch = cuda_mismatch(gpu)
                if mismatch:
                    warnings.append(mismatch)
        return PlatformReport(
            platform=str(platform),
            digest=manifest.digest,
            config_digest=config_descriptor.digest,
            gpu=gpu,
            libc=libc,
            badges=badges(gpu, libc),
            layers=[LayerInfo(digest=d.digest, size=d.size, media_type=d.media_type) for d in layers],
            warnings=warnings,
            created=config.get("created") if isinstance(config.get("created"), str) else None,
        )


def _parse_config(raw: bytes) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ScanError(f"image config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ScanError("image config is not a JSON object")
    return config


async def scan_many(
    scanner: Scanner,
    references: Sequence[str],
    options: ScanOptions,
    concurrency: int,
    on_done: Callable[[int, ImageReport], None] | None = None,
) -> list[ImageReport]:
    """Scan references concurrently (bounded), returning reports in input order."""
    semaphore = asyncio.Semaphore(max(1, concurrency))
    results: list[ImageReport | None] = [None] * len(references)

    async def run(position: int, text: str) -> None:
        async with semaphore:
            report = await scanner.scan(text, options)
        results[position] = report
        if on_done:
            on_done(position, report)

    await asyncio.gather(*(run(i, text) for i, text in enumerate(references)))
    return [r for r in results if r is not None]
