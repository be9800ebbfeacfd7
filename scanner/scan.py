"""One scan, end to end: reference -> registry -> config facts, published -> layer verdicts -> report.

The scan drives the pure cores (`scanner.facts`, `scanner.layers`) with the registry client and
the store's `ScanCache`, in two phases (the layer fetching itself is `scanner.layer_reader`;
publishing a finished report as a referrer is `scanner.publish`, which the service calls):

1. **Config facts.** HEAD for a tag the store has seen (a stored digest then costs nothing
   more; a tag never seen is fetched at once), the manifest, and for every
   platform its manifest and config: GPU signals, requirements, environment, platform. With
   `publish_facts` the report is stored at once with `pending=True`, so the GPU badge of a
   multi-GB image shows within moments of its push, while its layers are still being read. A job
   whose layers are small (`QUICK_READ_BYTES`) stores its facts with the store's next write
   instead (`StoreScanCache`, within 50 ms): its final report usually comes first and takes their
   place, and the scan commits once.
2. **Layer verdicts.** For the platforms whose layers are read (`scanner.facts.platforms`:
   linux platforms a GPU fleet runs, by default), `scanner.layer_reader` streams each layer not
   already known once, into one walk for every consumer (libc; the CUDA and GPU code the image
   carries, for every image under the default `GPUBADGE_DEEP_SCAN=always`), under one set of bounds. Other platforms get `state: not_analysed` with the
   reason; foreign and non-distributable layers are never fetched and are named.

A platform's failure stays on that platform (`PlatformReport.error`): one Windows entry, one
hostile layer or one unreachable blob never takes the other platforms' answers with it. Only
when no platform could be read at all does the report itself fail.

A pending report names the scan job reading its layers (`PlatformReport.pending_scan`, from
`ScanOptions.job`). Another scan of the same image takes it as its answer only while that job holds
a live lease (`ScanCache.scan_in_flight`): the job will complete it. A read that was interrupted
(pre-empted, its worker killed or cut off, a shutdown that ended mid-read) leaves a pending report
whose job no longer runs, or runs again as this very scan: then the layers are read again.
`ScanOptions.force` (a rescan) reuses nothing stored, and nothing stored by an older analysis
(`PlatformReport.analysis` below `ANALYSIS_VERSION`) is reused either: after an upgrade, each image is
read again at its next scan (its layers' evidence comes from the cache while its schema stands).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scanner.facts.badges import badges, cuda_mismatch
from scanner.facts.gpu import gpu_facts
from scanner.facts.platforms import PlatformPolicy, with_fleet
from scanner.layers.cuda_evidence import with_triton_config
from scanner.layers.cuda_jit_tools import with_jit_tools
from scanner.layers.errors import AnalysisCrashed, LayerError
from scanner.layers.limits import INLINE_OUTCOMES, LimitExceeded, scan_too_slow
from scanner.models import GpuFacts, ImageReport, LayerInfo, LibcVerdict, Platform, PlatformReport
from scanner.registry.descriptors import Descriptor, Manifest, is_attestation, is_layer
from scanner.registry.errors import RegistryError
from scanner.registry.reference import Reference, ReferenceError, parse_reference
from scanner.registry.stats import RequestStats
from scanner.settings import ScannerSettings

if TYPE_CHECKING:
    from scanner.cache import ScanCache
    from scanner.layer_reader import LayerProgress, LayerReader
    from scanner.layers.analysis import AnalysisPool
    from scanner.registry.client import RegistryClient

log = logging.getLogger(__name__)

FleetArchitectures = Callable[[], Awaitable[Collection[str]]]
# A job's layers up to this size (compressed, all platforms) are read in moments: its config facts
# then wait for the store's next write rather than a commit of their own (`_scan_manifest`).
QUICK_READ_BYTES = 16 << 20


class ScanError(Exception):
    """A scan could not finish; the message is safe to show to users."""


class NotAnImage(ScanError):
    """The manifest is an artifact (an attestation, a signature, a Helm chart), not a runnable image."""


class PlatformMissing(ScanError):
    """The image has no platform that `--platform` (ScanOptions.platform) asks for: asking again
    cannot change that."""


@dataclass(frozen=True)
class ScanOptions:
    platform: Platform | None = None
    config_only: bool = False
    force: bool = False  # ignore a stored report for the same digest (a rescan)
    job: str | None = None  # the scan job this scan runs as (the service's workers hold its lease)
    # called once, when the config facts are published (`publish_facts`: the pending report is
    # stored, or for a job with small layers queued to commit with the store's next write) and the
    # layers are still to be read; the service's workers free a slot on it
    on_facts: Callable[[], None] | None = field(default=None, compare=False)
    # what the store held for the reference's digest (as an image, as a platform), read by the caller
    # just before (the service's workers read it with the job's claim); None: the scan reads it
    stored: tuple[ImageReport | None, PlatformReport | None] | None = field(default=None, compare=False)


@dataclass
class _Facts:
    """Phase 1's answer for one platform image, and what phase 2 needs to read its layers."""

    report: PlatformReport
    layers: list[Descriptor]
    read_layers: bool
    retryable: bool = False  # the platform's error (if any) may pass on another try


@dataclass(frozen=True)
class _Run:
    """One scan's deadline (a `time.monotonic()` value) and its request counts so far."""

    deadline: float
    stats: RequestStats


def _reusable(stored: ImageReport | None, options: ScanOptions) -> bool:
    if stored is None or options.force or stored.pending:
        return False
    if any(platform.error for platform in stored.platforms):
        return False  # an unreachable blob or a crashed analysis: try those platforms again
    if any(platform.outdated for platform in stored.platforms):
        return False  # read by an older analysis: read again, for what newer judges read
    return not (stored.config_only and not options.config_only)


def _filter_platforms(report: ImageReport, wanted: Platform | None) -> ImageReport:
    """The stored report's platforms that `wanted` asks for; PlatformMissing when it has none."""
    if wanted is None:
        return report
    kept = [p for p in report.platforms if wanted.matches(Platform.parse(p.platform))]
    if not kept:
        available = ", ".join(p.platform for p in report.platforms if not p.platform.startswith("unknown"))
        raise PlatformMissing(f"no platform {wanted} in this image (it has {available or 'none'})")
    return report.model_copy(update={"platforms": kept})


def _layer_error(exc: BaseException) -> tuple[str, bool]:
    """A layer-phase failure in words, and whether trying again may give another answer."""
    if isinstance(exc, LimitExceeded):
        return str(exc), False  # the same bytes cross the same bound every time
    if isinstance(exc, RegistryError):
        return str(exc), exc.retryable
    if isinstance(exc, AnalysisCrashed):  # a fresh analysis process takes over
        return f"layer analysis: {exc}", True
    if isinstance(exc, LayerError):
        return f"corrupt layer: {exc}", False
    return f"internal error: {type(exc).__name__}: {exc}", True


class Scanner:
    """Scans references with one registry client and (optionally) one store.

    `publish_facts`: store each report as soon as its config facts are known (`pending=True`),
    before its layers are read; the service does, a one-shot CLI run need not.
    `fleet_architectures`: the architectures of the known servers, added to the platforms whose
    layers are read by default.
    """

    def __init__(
        self,
        client: RegistryClient,
        store: ScanCache | None = None,
        settings: ScannerSettings | None = None,
        *,
        on_result: Callable[[ImageReport], None] | None = None,
        publish_facts: bool = False,
        fleet_architectures: FleetArchitectures | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.settings = settings or ScannerSettings()
        self.policy = self.settings.platform_policy()
        self.publish_facts = publish_facts
        self.fleet_architectures = fleet_architectures
        self._reader: LayerReader | None = None
        self._pool: AnalysisPool | None = None
        # Images analysed inline, by outcome, counted by the layer reader (read by /metrics).
        self.inline_analyses = dict.fromkeys(INLINE_OUTCOMES, 0)
        self.on_result = on_result
        self.progress: dict[
            tuple[str, str], LayerProgress
        ] = {}  # (reference, platform) -> its read, while it runs

    @property
    def layers(self) -> LayerReader:
        """The layer reader, built on first use: config-only scans never load the tar and analysis code."""
        if self._reader is None:
            from scanner.layer_reader import LayerReader
            from scanner.layers.analysis import AnalysisPool

            self._pool = AnalysisPool(
                self.settings.analysis_processes, memory_bytes=self.settings.analysis_memory_bytes
            )
            self._reader = LayerReader(
                self.client,
                self.store,
                self.settings.analysis_limits(),
                self._pool,
                self.settings.inline_budget(),
                self.inline_analyses,
            )
        return self._reader

    async def start_analysis(self) -> None:
        """Start the analysis processes now rather than at the first layer read: a process that
        scans all day pays their start (an interpreter and the walk's modules) before its first
        image, not in the middle of a burst."""
        _ = self.layers  # builds the pool
        assert self._pool is not None
        await self._pool.start()

    def layer_progress(self) -> dict[str, str]:
        """Layer reads running now, by reference: "linux/amd64: reading layers: 2 of 5, 812 of 4810 MiB"."""
        found: dict[str, list[str]] = {}
        for (reference, platform), progress in self.progress.items():
            found.setdefault(reference, []).append(f"{platform}: {progress.describe()}")
        return {reference: "; ".join(parts) for reference, parts in found.items()}

    def _wants_deep(self, gpu: GpuFacts) -> bool:
        """GPUBADGE_DEEP_SCAN: `always` (the default) reads every image's carried CUDA and GPU code;
        `auto` only that of images that declare no NVIDIA signal; `never` none."""
        mode = self.settings.deep_scan
        return mode == "always" or (mode == "auto" and not gpu.required)

    async def close(self) -> None:
        """Stop the analysis processes, if any were started."""
        if self._pool is not None:
            await self._pool.close()

    async def _policy(self) -> PlatformPolicy:
        if self.fleet_architectures is None:
            return self.policy
        try:
            return with_fleet(self.policy, await self.fleet_architectures())
        except Exception:  # the fleet's store being down must not stop scans: the default still holds
            log.warning("cannot read the fleet's architectures; using the default platforms", exc_info=True)
            return self.policy

    async def scan(self, text: str, options: ScanOptions | None = None) -> ImageReport:
        """Scan one reference. Never raises for bad input: the report carries the error."""
        options = options or ScanOptions()
        try:
            reference = parse_reference(text)
        except ReferenceError as exc:  # the same text fails to parse every time
            return ImageReport(reference=text, error=str(exc), retryable=False)
        with self.client.track() as stats:
            deadline = time.monotonic() + self.settings.max_scan_seconds
            try:
                async with asyncio.timeout_at(deadline):
                    report = await self._scan(reference, options, _Run(deadline, stats))
            except TimeoutError:
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
            except PlatformMissing as exc:
                report = self._failed(reference, str(exc))
                report.retryable = False
            except ScanError as exc:
                report = self._failed(reference, str(exc))
            except Exception as exc:  # keep the service up whatever a registry sends
                log.exception("unexpected error scanning %s", reference)
                report = self._failed(reference, f"internal error: {type(exc).__name__}: {exc}")
        report.requests = stats.requests
        report.bytes_fetched = stats.bytes_received
        if report.error is not None or any(platform.error for platform in report.platforms):
            # the registry asked to be left alone for a while: the caller may put the work back
            left = self.client.cool_down_left(reference.api_host)
            report.retry_after = left if left > 0 else None
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

    async def _scan(self, reference: Reference, options: ScanOptions, run: _Run) -> ImageReport:
        digest = reference.digest
        media_type: str | None = None
        if digest is None and self.store is None:
            # Nothing stored to reuse, so a HEAD would be one request for nothing: GET by tag.
            manifest = await self.client.manifest(reference)
            return await self._scan_manifest(reference, manifest, None, options, run)
        fetched: Manifest | None = None
        if (
            digest is None
            and self.store is not None
            and reference.tag
            and await self.store.resolve_tag(reference.registry, reference.repository, reference.tag) is None
        ):
            # A tag the store has not seen: it is scanned whatever its digest turns out to be (or
            # its stored report reused), so a HEAD would only precede the GET: GET by tag.
            fetched = await self.client.manifest(reference)
            digest = fetched.digest
        if digest is None:
            head = await self.client.resolve(reference)
            digest, media_type = head.digest, head.media_type
        # one read: the digest stored as an image, and as one platform of an index (or the caller's)
        if options.stored is not None and digest == reference.digest:
            stored, as_platform = options.stored
        else:
            stored, as_platform = await self.store.stored(digest) if self.store else (None, None)
        if stored is not None and _reusable(stored, options):
            await self._remember_tag(reference, digest)
            reused = stored.model_copy(
                update={"reference": str(reference), "tag": reference.tag, "cached": True}
            )
            return _filter_platforms(reused, options.platform)

        policy = await self._policy()
        live = await self._read_elsewhere(as_platform, options)
        child = self._usable_platform(as_platform, options, policy, None, accept_pending=live)
        if child is not None:
            # A platform of an index already scanned, or being scanned now by a live scan (the child
            # events of a multi-arch push, or the same image pushed under another tag): the scan that
            # reads it gives the answer; reading it again would only repeat it. A tag still points here.
            await self._remember_tag(reference, digest)
            return ImageReport(
                reference=str(reference),
                digest=digest,
                platforms=[child],
                registry=reference.registry,
                repository=reference.repository,
                tag=reference.tag,
                cached=True,
                pending=child.libc.state == "pending",
            )
        manifest = fetched or await self.client.manifest(reference, digest)
        return await self._scan_manifest(reference, manifest, media_type, options, run, policy)

    async def _scan_manifest(
        self,
        reference: Reference,
        manifest: Manifest,
        media_type: str | None,
        options: ScanOptions,
        run: _Run,
        policy: PlatformPolicy | None = None,
    ) -> ImageReport:
        policy = policy or await self._policy()
        if manifest.is_index:
            entries = await self._index_facts(reference, manifest, options, policy)
        else:
            entries = [await self._image_facts(reference, manifest, options, policy, None)]
        report = ImageReport(
            reference=str(reference),
            digest=manifest.digest,
            platforms=[entry.report if isinstance(entry, _Facts) else entry for entry in entries],
            registry=reference.registry,
            repository=reference.repository,
            tag=reference.tag,
            media_type=media_type or manifest.media_type,
            config_only=options.config_only,
        )
        to_read = [(position, entry) for position, entry in enumerate(entries) if isinstance(entry, _Facts)]
        to_read = [(position, entry) for position, entry in to_read if entry.read_layers]
        storable = self.store is not None and (options.platform is None or not manifest.is_index)
        if to_read:
            report.pending = True
            for position, _ in to_read:
                report.platforms[position].pending_scan = options.job
            if storable and self.publish_facts:
                to_fetch = sum(entry.report.libc.bytes_total for _, entry in to_read)
                if options.job is not None and to_fetch <= QUICK_READ_BYTES:
                    # Layers read in moments: the facts go with the store's next write, and the final
                    # report usually takes their place. The report goes on changing here: a copy goes.
                    facts = report.model_copy(update={"platforms": list(report.platforms)})
                    await self._save(reference, facts, with_next_write=True)
                else:  # the pending badge is what users see while the layers are read: stored now
                    await self._save(reference, report)
                if options.on_facts is not None:
                    options.on_facts()
            results = await asyncio.gather(
                *(self._layer_verdicts(reference, entry, run.deadline) for _, entry in to_read)
            )
            for (position, _), verdicts in zip(to_read, results, strict=True):
                entries[position] = verdicts
                report.platforms[position] = verdicts.report
            report.pending = False
        unread = [p for p in report.platforms if p.config_digest is None and p.error]
        if unread and len(unread) == len(report.platforms):  # not one platform's config could be read
            first = unread[0]
            raise ScanError(first.error if len(unread) == 1 else f"{first.platform}: {first.error}")
        failed = [entry for entry in entries if isinstance(entry, _Facts) and entry.report.error]
        report.retryable = any(entry.retryable for entry in failed) if failed else True
        report.requests, report.bytes_fetched = run.stats.requests, run.stats.bytes_received
        if storable:  # a job's report commits with the job's end, which its worker writes next
            await self._save(reference, report, with_next_write=options.job is not None)
        elif self.store is not None:
            await self._remember_tag(reference, manifest.digest)
        return report

    async def _save(
        self, reference: Reference, report: ImageReport, *, with_next_write: bool = False
    ) -> None:
        """Store the report; the store remembers its tag in the same write, so the long polls that
        storing it wakes find the tag pointing at it."""
        assert self.store is not None and report.digest is not None and report.tag == reference.tag
        await self.store.save_report(report, with_next_write=with_next_write)

    async def _read_elsewhere(self, stored: PlatformReport | None, options: ScanOptions) -> bool:
        """Whether the pending `stored` platform is being read right now by another scan: one whose job
        holds a live lease. A report pending from this very job (run again after an interruption), from
        a job whose lease lapsed or that ended, or from before reports named their job, is not."""
        if stored is None or stored.libc.state != "pending" or self.store is None or options.force:
            return False
        job = stored.pending_scan
        if job is None or job == options.job:
            return False
        return await self.store.scan_in_flight(job)

    async def _stored_platform(
        self,
        digest: str,
        options: ScanOptions,
        policy: PlatformPolicy,
        platform: Platform | None,
        *,
        accept_pending: bool = False,
    ) -> PlatformReport | None:
        """A platform image already scanned (e.g. as part of its index) that answers `options`.

        Reused when nothing failed on it, this analysis read it (`PlatformReport.outdated`), and its
        layers were read if they are to be read now; one
        whose layers are being read right now by a live scan only with `accept_pending`. A libc
        flavour of `unknown` comes from layers that could not be read (or a report stored before
        layer states existed), so a scan that reads layers reads them again.
        """
        if self.store is None or options.force:
            return None
        stored = await self.store.platform_report(digest)
        return self._usable_platform(stored, options, policy, platform, accept_pending=accept_pending)

    @staticmethod
    def _usable_platform(
        stored: PlatformReport | None,
        options: ScanOptions,
        policy: PlatformPolicy,
        platform: Platform | None,
        *,
        accept_pending: bool = False,
    ) -> PlatformReport | None:
        """`stored` when it answers `options` (see `_stored_platform`), else None."""
        if stored is None or stored.error or options.force or stored.outdated:
            return None
        if stored.libc.state == "pending":
            return stored if accept_pending else None
        if options.config_only:
            return stored
        try:
            platform = platform or Platform.parse(stored.platform)
        except ValueError:
            return None
        wants_layers = policy.not_analysed_because(platform, options.platform) is None
        if wants_layers and (stored.libc.state != "analysed" or stored.libc.flavour == "unknown"):
            return None
        return stored

    async def _remember_tag(self, reference: Reference, digest: str) -> None:
        if self.store is not None and reference.tag:
            await self.store.record_tag(reference.registry, reference.repository, reference.tag, digest)

    async def _index_facts(
        self, reference: Reference, index: Manifest, options: ScanOptions, policy: PlatformPolicy
    ) -> list[_Facts | PlatformReport]:
        children = [child for child in index.manifests if not is_attestation(child)]
        if options.platform is not None:
            children = [c for c in children if c.platform and options.platform.matches(c.platform)]
            if not children:
                available = ", ".join(
                    str(c.platform) for c in index.manifests if c.platform and not is_attestation(c)
                )
                raise PlatformMissing(f"no platform {options.platform} in this image (it has {available})")
        if not children:
            raise ScanError("the index lists no runnable platform images")
        if len(children) > self.settings.max_index_children:  # refused before any child is read
            raise LimitExceeded(
                f"the index lists {len(children):,} platform images",
                self.settings.max_index_children,
                "max_index_children",
            )

        async def one(child: Descriptor) -> _Facts | PlatformReport:
            try:
                cached = await self._stored_platform(child.digest, options, policy, child.platform)
                if cached is not None:
                    return cached
                manifest = await self.client.manifest(reference, child.digest)
                if manifest.is_index:
                    raise ScanError(f"nested index {child.digest} is not supported")
                return await self._image_facts(reference, manifest, options, policy, child.platform)
            except (RegistryError, ScanError, LimitExceeded) as exc:
                # This platform's answer only: the others stand (a multi-OS index never fails for one).
                failed = PlatformReport(
                    platform=str(child.platform or "unknown/unknown"),
                    digest=child.digest,
                    error=str(exc),
                    libc=LibcVerdict(state="not_analysed", reason="the platform image could not be read"),
                )
                return _Facts(failed, [], read_layers=False, retryable=getattr(exc, "retryable", False))

        return list(await asyncio.gather(*(one(child) for child in children)))

    async def _image_facts(
        self,
        reference: Reference,
        manifest: Manifest,
        options: ScanOptions,
        policy: PlatformPolicy,
        platform: Platform | None,
    ) -> _Facts:
        config_descriptor = manifest.config
        layers = manifest.layers
        artifacts = sorted({d.media_type for d in layers if not is_layer(d.media_type)})
        if artifacts:
            raise NotAnImage(
                f"{manifest.digest} is not a container image (layers of type {', '.join(artifacts)})"
            )
        raw = await self.client.blob(reference, config_descriptor.digest, self.settings.max_config_bytes)
        config = _parse_config(raw)
        single = platform is None  # a single-platform image, not one child of an index
        platform = platform or Platform(
            os=str(config.get("os") or "linux"),
            architecture=str(config.get("architecture") or "amd64"),
            variant=config.get("variant") or None,
        )
        if single and options.platform is not None and not options.platform.matches(platform):
            raise PlatformMissing(f"no platform {options.platform} in this image (it has {platform} only)")
        gpu = gpu_facts(config)
        warnings = [f"{issue.variable} does not parse: {issue.error}" for issue in gpu.requirement_errors]
        reason = (
            "config-only scan"
            if options.config_only
            else policy.not_analysed_because(platform, options.platform)
        )
        error: str | None = None
        if reason is None and len(layers) > self.settings.max_layers:  # refused before any read
            error = str(
                LimitExceeded(f"image has {len(layers):,} layers", self.settings.max_layers, "max_layers")
            )
        libc = LibcVerdict(
            state="not_analysed" if reason is not None else "analysed" if error else "pending",
            reason=reason,
            layers_total=len(layers),
            bytes_total=sum(layer.size for layer in layers),
        )
        report = PlatformReport(
            platform=str(platform),
            digest=manifest.digest,
            config_digest=config_descriptor.digest,
            gpu=gpu,
            libc=libc,
            badges=badges(gpu, libc),
            layers=[LayerInfo(digest=d.digest, size=d.size, media_type=d.media_type) for d in layers],
            warnings=warnings,
            created=config.get("created") if isinstance(config.get("created"), str) else None,
            bytes_fetched=len(manifest.raw) + len(raw),
            error=error,
        )
        return _Facts(report, layers, read_layers=reason is None and error is None)

    async def _layer_verdicts(self, reference: Reference, facts: _Facts, deadline: float) -> _Facts:
        """Phase 2 for one platform image: its layer verdicts, or its error, never an exception."""
        from scanner.layer_reader import LayerProgress

        base = facts.report
        platform = Platform.parse(base.platform)
        gpu = base.gpu
        deep = self._wants_deep(gpu)
        progress = LayerProgress(layers_total=len(facts.layers), bytes_total=base.libc.bytes_total)
        key = (str(reference), base.platform)
        self.progress[key] = progress
        error: str | None = None
        retryable = False
        warnings = list(base.warnings)
        try:
            async with asyncio.timeout_at(deadline):
                verdict = await self.layers.analyse(
                    reference,
                    facts.layers,
                    platform.architecture,
                    cuda=deep,
                    deadline=deadline,
                    progress=progress,
                    overrides=gpu.build_overrides,
                )
        except TimeoutError:
            error, verdict = str(scan_too_slow(self.settings.max_scan_seconds)), None
        except Exception as exc:
            (error, retryable), verdict = _layer_error(exc), None
            if not isinstance(exc, LimitExceeded | RegistryError | LayerError):
                log.exception("unexpected error reading the layers of %s (%s)", reference, base.platform)
        finally:
            if self.progress.get(key) is progress:
                del self.progress[key]
        if verdict is None:
            libc = LibcVerdict(
                flavour="unknown",
                evidence=None,
                layers_read=progress.layers_done,
                layers_total=len(facts.layers),
                bytes_read=progress.bytes_fetched,
                bytes_total=base.libc.bytes_total,
            )
        else:
            libc = verdict.libc
            warnings += [f"deep scan: {warning}" for warning in verdict.warnings]
            if deep:
                archs = verdict.archs
                if archs is not None:
                    archs = with_jit_tools(with_triton_config(archs, gpu), gpu)
                gpu = gpu.model_copy(update={"inferred": verdict.inferred, "archs": archs})
                mismatch = cuda_mismatch(gpu)
                if mismatch:
                    warnings.append(mismatch)
        warnings += [
            f"layer {skipped.digest[:19]} not fetched: {skipped.reason}" for skipped in progress.skipped
        ]
        report = base.model_copy(
            update={
                "gpu": gpu,
                "libc": libc,
                "badges": badges(gpu, libc),
                "warnings": warnings,
                "error": error,
                "skipped_layers": progress.skipped,
                "bytes_fetched": base.bytes_fetched + progress.bytes_fetched,
                "pending_scan": None,
            }
        )
        return _Facts(report, facts.layers, read_layers=False, retryable=retryable)


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
