"""Push -> badge at the registry's pace, and the intake never waits behind scans: the bench's own
measures (bench/push_burst_bench.py) on small bursts, with CI-safe bounds.

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
from bench.push_burst_bench import BurstFigures, measure_burst, measure_intake

LOOSE_P50 = 3.0  # seconds behind the null receiver, at most
LOOSE_P99 = 6.0


async def test_a_push_burst_badges_every_image_close_to_the_registrys_pace(tmp_path: Path) -> None:
    figures = BurstFigures(images=40, clients=10)
    run = await measure_burst(figures, tmp_path)
    assert len(run.badge) == len(run.floor) == figures.images  # every push delivered, every badge visible
    assert len(run.delivered) == figures.images  # one job committed per push
    behind_p50 = percentile(run.badge, 0.5) - percentile(run.floor, 0.5)
    behind_p99 = percentile(run.badge, 0.99) - percentile(run.floor, 0.99)
    print(
        f"push -> badge behind the null receiver: p50 {behind_p50 * 1000:.0f} ms, p99 {behind_p99 * 1000:.0f} ms"
    )
    assert behind_p50 < LOOSE_P50 and behind_p99 < LOOSE_P99, (behind_p50, behind_p99)


# Issue 44, point 1: each delivery answered within 1.2x the null receiver's time, whatever the scans
# do. The real target is the bench's; here an absolute margin (the durable commit the null receiver
# does not make, and a shared 2-core host's noise) keeps the check safe on CI while it still catches
# a delivery that waits behind scans: on 6350297, scans sharing the intake's interpreter and SQLite's
# writer, the answers' median was 3-5x the null receiver's (+4.5 to +6 ms) and the registry's time
# per delivery 2.7-3.8x.
ANSWER_MARGIN_P50 = 0.0015  # seconds above 1.2x the null receiver's
ANSWER_MARGIN_P90 = 0.005
CYCLE_MARGIN_P50 = 0.0015


async def test_the_intake_answers_at_the_null_receivers_pace_while_scans_run(tmp_path: Path) -> None:
    """A real registry notifies the null receiver and `gpubadge serve` (its defaults) through the bench's
    timing relay; the measured deliveries (120 manifests PUT by 6 clients, each a distinct image to
    scan) arrive while the scans of 60 images pushed just before run."""
    run = await measure_intake(180, 6, tmp_path, count_cpu=False)
    assert run.scans_during > 0  # scans were claimed and running while the measured deliveries came
    assert len(run.deliveries["gpubadge"]) == len(run.deliveries["null"]) == run.images
    assert all(delivery.status == 202 for delivery in run.deliveries["gpubadge"])
    ours, null = run.answers("gpubadge"), run.answers("null")
    ours_cycle, null_cycle = percentile(run.cycles("gpubadge"), 0.5), percentile(run.cycles("null"), 0.5)
    print(
        f"answers p50 {percentile(ours, 0.5) * 1000:.2f} ms vs null {percentile(null, 0.5) * 1000:.2f} ms;"
        f" p90 {percentile(ours, 0.9) * 1000:.2f} vs {percentile(null, 0.9) * 1000:.2f} ms; registry's time per"
        f" delivery while backed up {ours_cycle * 1000:.2f} vs {null_cycle * 1000:.2f} ms; {run.scans_during} scans"
    )
    assert percentile(ours, 0.5) <= 1.2 * percentile(null, 0.5) + ANSWER_MARGIN_P50
    assert percentile(ours, 0.9) <= 1.2 * percentile(null, 0.9) + ANSWER_MARGIN_P90
    assert ours_cycle <= 1.2 * null_cycle + CYCLE_MARGIN_P50
