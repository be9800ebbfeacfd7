"""Run every benchmark, print one table of figures and ratios, and write bench/RESULTS.md.

    python3 -m bench.run            # full workloads (about 16 minutes on 2 cores, 6 of them `scale`)
    python3 -m bench.run --quick    # smaller workloads, prints only (unless --output)
    python3 -m bench.run --only scan,placement

These are measurements, not tests: nothing here asserts, and pytest never collects it.
Ratios are peer/ours, so 4.0x means gpubadge needed a quarter of what the peer tool did.
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import (
    cpu_split_bench,
    deep_bench,
    export_bench,
    fleet_bench,
    gpu_code_bench,
    hostile_bench,
    index_bench,
    job_lookup_bench,
    push_burst_bench,
    real_images_bench,
    registry_request_bench,
    repository_scale_bench,
    scale_bench,
    scan_bench,
    service_bench,
    slow_clients_bench,
    starvation_bench,
    webhook_cpu_bench,
)
from bench.common import (
    REPO_ROOT,
    Figure,
    Results,
    installed_copy,
    machine_description,
    today,
    tool_versions,
)

SECTIONS = (
    "real",
    "scan",
    "service",
    "webhook",
    "registry",
    "burst",
    "cpusplit",
    "hostile",
    "gpucode",
    "index",
    "deep",
    "placement",
    "ui",
    "scale",
    "joblookup",
    "repository",
    "starvation",
    "slowclients",
    "export",
    "fleet",
)


def run_child(results: Results, section: str, module: str, *args: str) -> list[str]:
    """Run a benchmark module in its own process (a clean heap and GC); its stdout lines.

    A failure becomes a 'failed' figure for the section and an empty list.
    """
    completed = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if completed.returncode != 0:
        results.add(Figure(section, module, "failed", note=completed.stderr.strip()[-300:]))
        return []
    return completed.stdout.splitlines()


def run_placement(results: Results, quick: bool) -> None:
    """bench/placement_bench.py in a child process: HTTP and function-only p99 at 100 .. 100,000 servers.

    The target (issue 13): over HTTP, the 10,000-server p99 within 4x of the 100-server p99 and
    under 25 ms, in one run.
    """
    args = ["--quick"] if quick else []
    print(f"placement: bench.placement_bench {' '.join(args)}", flush=True)
    output = run_child(results, "placement", "bench.placement_bench", *args)
    figures: dict[str, dict[int, tuple[float, float]]] = {}
    for line in output:
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        kind = line.split(" ", 1)[0]
        if kind.startswith(("http", "function")) and fields.get("request") == "gpu-image":
            pair = (float(fields["p50_ms"]), float(fields["p99_ms"]))
            figures.setdefault(kind, {})[int(fields["servers"])] = pair
        results.detail(f"placement: {line}")
    http, function = figures.get("http", {}), figures.get("function", {})
    http_new, function_new = figures.get("http-new-form", {}), figures.get("function-new-form", {})
    base = http.get(100)
    for count in sorted(http):
        p50, p99 = http[count]
        fn = function.get(count)
        growth = p99 / base[1] if base else None
        met = None
        target = ""
        if count == 10_000 and growth is not None:
            target = "p99 < 25 ms and <= 4x the 100-server p99"
            met = p99 < 25 and growth <= 4
        results.add(
            Figure(
                "placement",
                f"POST /api/eligibility over HTTP, GPU image, {count:,} servers",
                f"p50 {p50:.2f} ms, p99 {p99:.2f} ms"
                + (f" ({growth:.2f}x the 100-server p99)" if growth is not None and count != 100 else ""),
                target=target,
                met=met,
                note="; ".join(
                    f"{label}: p50 {pair[0]:.2f} ms, p99 {pair[1]:.2f} ms"
                    for label, pair in (
                        ("function only", fn),
                        ("a new query form each time, over HTTP", http_new.get(count)),
                        ("a new query form each time, function only", function_new.get(count)),
                    )
                    if pair is not None
                ),
            )
        )


def run_ui(results: Results, quick: bool) -> None:
    """bench/ui_bench.py in a child process: page render time with 10,000 images (target < 100 ms)."""
    rounds = "5" if quick else "20"
    print("ui: bench.ui_bench, 10000 images", flush=True)
    for line in run_child(results, "ui", "bench.ui_bench", "10000", rounds):
        match = re.match(r"^(\S+): median ([\d.]+) ms, p95 ([\d.]+) ms$", line)
        if not match:
            continue
        page, median, p95 = match.group(1), float(match.group(2)), float(match.group(3))
        results.add(
            Figure(
                "ui",
                f"render {page}, 10,000 images",
                f"median {median:.1f} ms, p95 {p95:.1f} ms",
                target="< 100 ms",
                met=p95 < 100,
            )
        )


def format_table(figures: list[Figure]) -> str:
    header = "| section | figure | gpubadge | peer | ratio (peer/ours) | target | met |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for figure in figures:
        shown_ratio = f"{figure.ratio:.1f}x" if figure.ratio is not None else ""
        met = "" if figure.met is None else ("yes" if figure.met else "**no**")
        ours = figure.ours + (f" ({figure.note})" if figure.note else "")
        lines.append(
            f"| {figure.section} | {figure.name} | {ours} | {figure.peer} | {shown_ratio} | {figure.target} | {met} |"
        )
    return "\n".join(lines)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def write_results(path: Path, results: Results, header: dict[str, str], commentary: str) -> None:
    body = [
        "# Benchmark results",
        "",
        "Measured by `python3 -m bench.run` (bench/run.py). Ratios are peer/ours: bigger is better for gpubadge.",
        "",
        *(f"- **{key}:** {value}" for key, value in header.items()),
        "",
        format_table(results.figures),
        "",
        "## Details",
        "",
        *(f"- {line}" for line in results.details),
        "",
    ]
    if commentary:
        body += ["## Notes", "", commentary.strip(), ""]
    path.write_text("\n".join(body))


def compile_package() -> None:
    """Write the package's bytecode before anything is timed, as `pip install` (and the image's
    build) does: in an editable checkout with PYTHONDONTWRITEBYTECODE set, every `gpubadge`
    process would otherwise compile its modules from source, a cost users never pay."""
    root = Path(__file__).resolve().parent.parent
    for package in ("scanner", "store", "placement", "web", "agent", "gpubadge"):
        compileall.compile_dir(root / package, quiet=1)


def main() -> int:
    parser = argparse.ArgumentParser(description="Run gpubadge's benchmarks side by side with peer tools.")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a couple of minutes)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    parser.add_argument(
        "--output", type=Path, help="write the results here (default: bench/RESULTS.md unless --quick)"
    )
    parser.add_argument(
        "--notes", type=Path, help="a Markdown file appended as the Notes section (analysis of the figures)"
    )
    args = parser.parse_args()
    wanted = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = wanted - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s): {', '.join(sorted(unknown))}")

    results = Results()
    compile_package()
    with installed_copy() as measured_copy:
        started = time.perf_counter()
        load_before = load_average()
        run_sections(results, wanted, args.quick)
        elapsed = time.perf_counter() - started

    print()
    print(format_table(results.figures))
    header = {
        "Date": today(),
        "Machine": machine_description(),
        "Tools": tool_versions(),
        "gpubadge": measured_copy,
        "Mode": ("quick" if args.quick else "full")
        + f", sections: {', '.join(s for s in SECTIONS if s in wanted)}",
        "Load average (1/5/15 min) before / after": f"{load_before} / {load_average()} "
        "(other work on the machine shares the cores and inflates wall-time figures)",
        "Run time": f"{elapsed:.0f} s",
    }
    output = args.output or (None if args.quick else Path(__file__).with_name("RESULTS.md"))
    if output is not None:
        commentary = args.notes.read_text() if args.notes else ""
        write_results(output, results, header, commentary)
        print(f"\nwrote {os.path.relpath(output)}")
    return 0


def run_sections(results: Results, wanted: set[str], quick: bool) -> None:
    """The sections asked for, in the order of `SECTIONS`."""
    runners: dict[str, Callable[[Results, bool], None]] = {
        "real": real_images_bench.run_all,
        "scan": scan_bench.run_all,
        "service": service_bench.run_all,
        "webhook": webhook_cpu_bench.run_all,
        "registry": registry_request_bench.run_all,
        "burst": push_burst_bench.run_all,
        "cpusplit": cpu_split_bench.run_all,
        "hostile": hostile_bench.run_all,
        "gpucode": gpu_code_bench.run_all,
        "index": index_bench.run_all,
        "deep": deep_bench.run_all,
        "placement": run_placement,
        "ui": run_ui,
        "scale": scale_bench.run_all,
        "joblookup": job_lookup_bench.run_all,
        "repository": repository_scale_bench.run_all,
        "starvation": starvation_bench.run_all,
        "slowclients": slow_clients_bench.run_all,
        "export": export_bench.run_all,
        "fleet": fleet_bench.run_all,
    }
    for section in SECTIONS:
        if section in wanted:
            runners[section](results, quick)


if __name__ == "__main__":
    raise SystemExit(main())
