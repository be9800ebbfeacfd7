"""The answer to one eligibility query: verdicts per server shape, grouped into buckets, paged.

Pure and immutable once built. `decide` (placement.decide) fills a `Decision` with one `Bucket` per
server shape (or shape and label set) and its verdict; the Decision ranks and pages single
servers only when a caller asks for them, so a page costs O(shapes + page), whatever the fleet size.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import itemgetter

from typing_extensions import TypedDict

from placement.image_needs import GpuUse

SortKey = tuple[int, int, int, float, int]  # rank, spare GPUs, GPU MiB assigned, spare CPUs, memory
NO_KEY: SortKey = (0, 0, 0, 0.0, 0)
# (reasons, GPU picks as (group position, count), sort key, platform, score, why it passes) for one
# server shape
ShapeResult = tuple[tuple[str, ...], tuple[tuple[int, int], ...], SortKey, str, float, tuple[str, ...]]
# The GPU part of a shape's verdict (placement.query): (reasons, GPU picks, rank, spare GPUs, GPU MiB
# assigned, score, why it passes)
GpuPart = tuple[tuple[str, ...], tuple[tuple[int, int], ...], int, int, int, float, tuple[str, ...]]


class EligibleServer(TypedDict):
    server: str
    gpus: list[str]
    score: float
    platform: str
    why: list[str]


class IneligibleServer(TypedDict):
    server: str
    reasons: list[str]


@dataclass(frozen=True, slots=True)
class Bucket:
    """Servers that get one verdict: a shape, or a shape and label set when the request has labels."""

    result: ShapeResult
    names: Sequence[str]  # name order; shared with the index view, never modified
    groups: Sequence[tuple[tuple[int, tuple[str, ...]], ...]]  # free GPUs per server, aligned with names
    reasons: tuple[str, ...]

    @property
    def key(self) -> SortKey:
        return self.result[2]

    def entry(self, position: int) -> EligibleServer:
        _, picks, _, platform, score, why = self.result
        free = self.groups[position]
        gpus = [uuid for group, count in picks for uuid in free[group][1][:count]]
        return {
            "server": self.names[position],
            "gpus": gpus,
            "score": score,
            "platform": platform,
            "why": list(why),
        }


def _named(names: Sequence[str], number: int, start: int) -> Iterator[tuple[str, int, int]]:
    """(name, bucket number, position) from `start` on: one bucket's stream for a merge by name."""
    for position in range(start, len(names)):
        yield names[position], number, position


def _first_name(bucket: Bucket) -> str:
    return bucket.names[0]


class ReasonSummary(TypedDict):
    reason: str
    count: int
    examples: list[str]


Cursor = tuple[SortKey, str]  # (rank key, server name) of the last server a page listed


class Decision:
    """Eligible servers best fit first (with the GPU UUIDs to reserve), every other server with reasons.

    Pages (`page`) and summaries (`ineligible_summary`) cost O(shapes + page), whatever the fleet
    size; `eligible` and `ineligible` list every server (O(servers)) for callers that want all.
    Ranking is a total order on (rank key, server name), so a cursor stays meaningful when the
    fleet changes between pages: the next page starts after the last server listed.
    """

    __slots__ = (
        "_refused",
        "_summaries",
        "_tiers",
        "eligible_count",
        "hints",
        "image_gpu",
        "image_needs_gpu",
        "ineligible_count",
        "pending",
        "warnings",
    )

    def __init__(
        self,
        eligible: list[Bucket],
        refused: list[Bucket],
        warnings: list[str],
        hints: list[str] | None = None,
        pending: list[str] | None = None,
        *,
        image_gpu: GpuUse = "none",
    ) -> None:
        self.pending = pending or []
        self.image_gpu = image_gpu  # placement.image_needs' answer for the image judged
        self.image_needs_gpu = image_gpu == "required"
        tiers: dict[SortKey, list[Bucket]] = {}
        for bucket in eligible:
            tiers.setdefault(bucket.key, []).append(bucket)
        self._tiers = sorted(tiers.items(), key=lambda tier: tier[0])
        self._refused = refused
        self._summaries: dict[int, list[ReasonSummary]] = {}
        self.warnings = warnings
        self.hints = hints or []  # e.g. CUDA found in the layers of a CPU request (placement.cuda_needs)
        self.eligible_count = sum(len(bucket.names) for bucket in eligible)
        self.ineligible_count = sum(len(bucket.names) for bucket in refused)

    def _ranked(self, after: Cursor | None = None) -> Iterator[tuple[Bucket, int]]:
        """(bucket, position) of each eligible server in rank order, starting after `after`."""
        for key, buckets in self._tiers:
            if after is not None and key < after[0]:
                continue
            starts = [
                bisect_right(bucket.names, after[1]) if after is not None and key == after[0] else 0
                for bucket in buckets
            ]
            if len(buckets) == 1:
                bucket = buckets[0]
                yield from ((bucket, position) for position in range(starts[0], len(bucket.names)))
                continue
            streams = [
                _named(bucket.names, number, start)
                for number, (bucket, start) in enumerate(zip(buckets, starts, strict=True))
            ]
            for _, number, position in heapq.merge(*streams):
                yield buckets[number], position

    def page(self, limit: int, after: Cursor | None = None) -> tuple[list[EligibleServer], Cursor | None]:
        """Up to `limit` eligible servers after `after`, and the cursor for the next page (None: done)."""
        listed: list[EligibleServer] = []
        last: tuple[Bucket, int] | None = None
        ranked = self._ranked(after)
        for bucket, position in islice(ranked, limit):
            listed.append(bucket.entry(position))
            last = bucket, position
        if last is None or next(ranked, None) is None:
            return listed, None
        return listed, (last[0].key, last[0].names[last[1]])

    @property
    def eligible(self) -> list[EligibleServer]:
        """Every eligible server, best first."""
        return [bucket.entry(position) for bucket, position in self._ranked()]

    @property
    def ineligible(self) -> list[IneligibleServer]:
        """Every other server in name order, each with every reason, the decisive one first."""
        listed = [
            (name, reasons)
            for bucket in self._refused
            for reasons in (list(bucket.reasons),)
            for name in bucket.names
        ]
        listed.sort(key=itemgetter(0))
        return [{"server": name, "reasons": reasons} for name, reasons in listed]

    def ineligible_summary(self, examples: int = 3) -> list[ReasonSummary]:
        """Each decisive reason once (a server's first: see `ineligible` for all of them), with how
        many servers it rules out and the first few by name; most first. The counts add up to
        `ineligible_count`: every server is counted once.

        Computed once per Decision and examples count (a Decision is immutable); callers get copies.
        """
        summary = self._summaries.get(examples)
        if summary is None:
            summary = self._summaries[examples] = self._summarise(examples)
        return [
            {"reason": i["reason"], "count": i["count"], "examples": list(i["examples"])} for i in summary
        ]

    def _summarise(self, examples: int) -> list[ReasonSummary]:
        by_reasons: dict[tuple[str, ...], list[Bucket]] = {}
        for bucket in self._refused:  # many buckets share their reasons: group them first
            by_reasons.setdefault(bucket.reasons, []).append(bucket)
        counts: dict[str, int] = {}
        holders: dict[str, list[Bucket]] = {}
        for reasons, buckets in by_reasons.items():
            size = sum(len(bucket.names) for bucket in buckets)
            reason = reasons[0]  # each server once, under its decisive reason
            counts[reason] = counts.get(reason, 0) + size
            holders.setdefault(reason, []).extend(buckets)
        summary: list[ReasonSummary] = []
        for reason, count in counts.items():
            # The first names overall lie in the buckets whose first names are the first.
            first = heapq.nsmallest(examples, holders[reason], key=_first_name)
            names = list(islice(heapq.merge(*(bucket.names for bucket in first)), examples))
            summary.append({"reason": reason, "count": count, "examples": names})
        summary.sort(key=lambda item: (-item["count"], item["reason"]))
        return summary

    def __eq__(self, other: object) -> bool:
        """Same servers listed the same way (O(servers): for tests and tools, not hot paths)."""
        if not isinstance(other, Decision):
            return NotImplemented
        return (self.eligible, self.ineligible, self.warnings) == (
            other.eligible,
            other.ineligible,
            other.warnings,
        )

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value object: equality only

    @property
    def best(self) -> EligibleServer | None:
        """The best-fit eligible server, if any."""
        listed, _ = self.page(1)
        return listed[0] if listed else None
