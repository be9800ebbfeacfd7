"""Push -> badge at the registry's pace: a small push burst, the bench's own measure, CI-loose bounds.

A real registry (Debian's docker-registry) notifies two endpoints, each with its own one-at-a-time
queue: a null receiver that only records arrivals (the floor) and `gpubadge serve` as a child
process with its default settings. 40 images are pushed by 10 concurrent skopeo clients, and a
client long-polls each badge, as `bench.push_burst_bench` does with 200 pushes by 50 (the real
target, within 100 ms of the floor, is judged there on a quiet machine). Here the bounds only
catch a gross regression (workers left idle, a lost wake-up, a badge waiting for its layers).
"""

from __future__ import annotations

from pathlib import Path

from bench.common import percentile
from bench.push_burst_bench import BurstFigures, measure_burst

LOOSE_P50 = 3.0  # seconds behind the null receiver, at most
LOOSE_P99 = 6.0


async def test_a_push_burst_badges_every_image_close_to_the_registrys_pace(tmp_path: Path) -> None:
    figures = BurstFigures(images=40, clients=10)
    floor, badge, _, _, breakdown = await measure_burst(figures, tmp_path)
    assert len(badge) == len(floor) == figures.images  # every push delivered, every badge visible
    assert len(breakdown.delivered) == figures.images  # one job committed per push
    behind_p50 = percentile(badge, 0.5) - percentile(floor, 0.5)
    behind_p99 = percentile(badge, 0.99) - percentile(floor, 0.99)
    print(
        f"push -> badge behind the null receiver: p50 {behind_p50 * 1000:.0f} ms, p99 {behind_p99 * 1000:.0f} ms"
    )
    assert behind_p50 < LOOSE_P50 and behind_p99 < LOOSE_P99, (behind_p50, behind_p99)
