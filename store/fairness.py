"""Which registries the next claims go to: fair share, as a pure function both engines call.

A claim must never let one registry hold every worker while another has ready jobs. The
backends read, inside their claim transaction, each registry that has ready jobs and is not
cooling down, with its running count across every worker and when a job of it was last
claimed (both persisted, so every worker process sees the same picture); `plan_claims`
then hands out the free slots one at a time, each to the registry with the fewest jobs in
flight, the least recently claimed first among equals, skipping registries at their cap.
So claims rotate across registries (round robin when they are equally busy), and a slow
registry, whose jobs stay running longest, is the last to get another slot.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RegistryTurn:
    """A registry with ready jobs, as a claim sees it."""

    registry: str
    ready: int  # its jobs ready to run now
    running: int  # its jobs in flight now, every worker counted
    last_claimed: str | None  # sortable stamp of its last claim (ISO text); None: never claimed


def plan_claims(turns: Iterable[RegistryTurn], limit: int, per_registry: int | None) -> list[str]:
    """Up to `limit` registry names, one per slot to fill, in the order the slots go to them.

    A name appears as often as that registry gets a job; the caller claims that many of its
    oldest ready jobs, and asks again (without it) where it had fewer ready than planned.
    """
    heap: list[tuple[int, int, str, str]] = []
    left: dict[str, int] = {}
    for turn in turns:
        if turn.ready <= 0 or (per_registry is not None and turn.running >= per_registry):
            continue
        left[turn.registry] = turn.ready
        # never claimed first (0), then the oldest claim; the name breaks ties deterministically
        never = 0 if turn.last_claimed is None else 1
        heap.append((turn.running, never, turn.last_claimed or "", turn.registry))
    heapq.heapify(heap)
    plan: list[str] = []
    while heap and len(plan) < limit:
        running, _, _, registry = heapq.heappop(heap)
        plan.append(registry)
        running += 1
        left[registry] -= 1
        if left[registry] > 0 and (per_registry is None or running < per_registry):
            # claimed just now: after every registry with as many in flight that waited longer
            heapq.heappush(heap, (running, 2, f"{len(plan):012d}", registry))
    return plan


def claim_order(plan: list[str]) -> list[str]:
    """The registries of `plan`, each once, ordered by its last slot: the order to stamp them
    `last_claimed`, so the next claim (in any process) goes on from where this one stopped."""
    last = {registry: position for position, registry in enumerate(plan)}
    return sorted(last, key=last.__getitem__)
