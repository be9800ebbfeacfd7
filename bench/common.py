"""Shared measuring tools for the benchmarks: CPU accounting, percentiles, pushes, result rows.

Client CPU is taken from `getrusage(RUSAGE_CHILDREN)` deltas (so process start is
included, exactly as a user pays it), the registry's own CPU from /proc/<pid>/stat.
Setup (building and pushing images) is never inside a measured window.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fixtures.oci import push_layout

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Figure:
    """One measured line of the results table. `ratio` is peer/ours (bigger is better for us)."""

    section: str
    name: str
    ours: str
    peer: str = ""
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""


@dataclass
class Results:
    figures: list[Figure] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def add(self, figure: Figure) -> None:
        self.figures.append(figure)
        print(f"  {figure.name}: ours={figure.ours} peer={figure.peer or '-'} {_verdict(figure)}", flush=True)

    def detail(self, line: str) -> None:
        self.details.append(line)
        print(f"  {line}", flush=True)


def run_section(run_all: Callable[[Results, bool], None], doc: str | None) -> None:
    """`python3 -m bench.<section> [--quick]`: one section alone, as `bench.run --only` runs it,
    except that `gpubadge` is this checkout run by this interpreter (no `installed_copy`)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    run_all(Results(), parser.parse_args().quick)


def _verdict(figure: Figure) -> str:
    if figure.met is None:
        return ""
    return "MET" if figure.met else "MISSED"


@dataclass
class CpuWindow:
    """CPU and wall time spent between `start` and `stop`."""

    wall_s: float = 0.0
    children_cpu_s: float = 0.0
    watched_cpu_s: float = 0.0  # the watched process (e.g. the registry), from /proc


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a running process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant (from /proc's children lists)."""
    found = [pid]
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            found.extend(process_tree(int(child)))
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process tree so far: every live process's utime + stime, plus what each reaped of
    its children (cutime + cstime), so a child that exits and is reaped stays counted."""
    total = 0
    for member in process_tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(value) for value in fields[11:15])
    return total / CLOCK_TICKS


def tree_wakeups(pid: int) -> int:
    """How often the threads of a process tree have gone to sleep so far (the sum of their
    voluntary context switches): each one is a wake-up later, which on a VM costs far more CPU
    than the work many of them wake for (`wakeup_cpu_seconds`). Threads that exited are not counted."""
    total = 0
    for member in process_tree(pid):
        try:
            tasks = list(Path(f"/proc/{member}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                status = (task / "status").read_text()
            except OSError:
                continue
            total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def wakeup_cpu_seconds(period: float = 0.01, seconds: float = 1.0) -> float:
    """This host's CPU per wake-up of an idle thread: a thread sleeping `period` at a time for
    `seconds`, its CPU (the kernel's exact runtime, /proc schedstat) over the wake-ups. Bare metal
    gives a few microseconds; a VM that halts idle vCPUs gives hundreds."""
    schedstat = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")

    def runtime() -> int:
        try:
            return int(schedstat.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    wakeups = max(1, int(seconds / period))
    before = runtime()
    for _ in range(wakeups):
        time.sleep(period)
    return (runtime() - before) / 1e9 / wakeups


def tree_cpu_by_process(pid: int) -> dict[int, tuple[str, float]]:
    """Each live process of a tree: (its command line, its CPU so far: utime + stime + what it
    reaped of its children), by pid. Subtract two of these to split a window's CPU by process."""
    found: dict[int, tuple[str, float]] = {}
    for member in process_tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            command = (
                Path(f"/proc/{member}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
        found[member] = (command, sum(int(value) for value in fields[11:15]) / CLOCK_TICKS)
    return found


def cpu_by_role(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """A window's CPU of a gpubadge process tree by role: `serve` (the API and intake), `worker`
    (scan processes), `analysis` (their layer parsers); a process that started meanwhile counts whole."""
    roles: dict[str, float] = {}
    for pid, (command, cpu) in after.items():
        role = (
            "analysis"
            if "scanner.layers.analysis" in command
            else "worker"
            if " worker" in command
            else "serve"
        )
        earlier = before.get(pid)
        spent = cpu - (earlier[1] if earlier is not None and earlier[0] == command else 0.0)
        roles[role] = roles.get(role, 0.0) + spent
    return roles


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@contextmanager
def measure(watch_pid: int | None = None) -> Iterator[CpuWindow]:
    """Wall time, CPU of child processes reaped inside the block, and CPU of `watch_pid`."""
    window = CpuWindow()
    watched = process_cpu_seconds(watch_pid) if watch_pid else 0.0
    children = children_cpu_seconds()
    started = time.perf_counter()
    try:
        yield window
    finally:
        window.wall_s = time.perf_counter() - started
        window.children_cpu_s = children_cpu_seconds() - children
        if watch_pid:
            window.watched_cpu_s = process_cpu_seconds(watch_pid) - watched


@contextmanager
def temporary_sqlite_store(prefix: str) -> Iterator[Any]:
    """A `SqliteStore` on a fresh file in a temporary directory, closed and removed afterwards."""
    from store.sqlite import SqliteStore

    with tempfile.TemporaryDirectory(prefix=prefix) as root:
        store = SqliteStore(Path(root) / "store.db")
        try:
            yield store
        finally:
            store.close()


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1); the honest choice for small samples."""
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered))))
    return ordered[rank - 1]


def push_tags(layout: Path, tags: Sequence[str], destination_repo: str, parallel: int = 6) -> float:
    """Push `layout:tag` to `destination_repo:tag` for each tag with skopeo; returns seconds taken."""
    started = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lambda tag: push_with_retry(layout, tag, f"{destination_repo}:{tag}"), tags))
    return time.perf_counter() - started


def push_with_retry(layout: Path, tag: str, destination: str, attempts: int = 3) -> None:
    """skopeo push; concurrent pushes of one shared blob into one repository occasionally fail
    (the registry's upload race), so a failed push is retried and its error shown."""
    for attempt in range(1, attempts + 1):
        try:
            push_layout(layout, tag, destination, timeout=600)
            return
        except subprocess.CalledProcessError as exc:
            error = (exc.stderr or b"").decode(errors="replace").strip()[-300:]
            print(f"  skopeo push of {destination} failed (attempt {attempt}): {error}", flush=True)
            if attempt == attempts:
                raise


# The `gpubadge` program of the copy `bench.run` installs (`installed_copy`), for every child.
INSTALLED_PROGRAM_ENV = "GPUBADGE_BENCH_PROGRAM"


def gpubadge_command(*args: str) -> list[str]:
    """`gpubadge ...` as a user runs it: the installed copy's program where `bench.run` made one
    (`installed_copy`), else this checkout run by this interpreter."""
    program = os.environ.get(INSTALLED_PROGRAM_ENV)
    return [program, *args] if program else [sys.executable, "-m", "gpubadge.cli", *args]


@contextmanager
def installed_copy() -> Iterator[str]:
    """gpubadge installed as the Dockerfile installs it: a virtualenv with `pip install
    '.[uvloop]'` of this checkout (its bytecode compiled, no editable-install hook, no `.pth`
    of the machine's own interpreter). Yields what the results should say of it; `gpubadge_command`
    runs its program meanwhile. Where the install fails (no package index), this checkout with
    this interpreter is measured, and the yielded text says so."""
    with tempfile.TemporaryDirectory(prefix="gpubadge-bench-venv-") as directory:
        venv = Path(directory)
        started = time.perf_counter()
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
            subprocess.run(
                [str(venv / "bin" / "pip"), "install", "--quiet", f"{REPO_ROOT}[uvloop]"],
                check=True,
                capture_output=True,
                timeout=900,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            error = exc.stderr.decode(errors="replace").strip()[-300:] if exc.stderr else str(exc)
            print(f"installing gpubadge in a virtualenv failed; measuring this checkout: {error}", flush=True)
            yield f"this checkout, run by {sys.executable} (installing a copy failed: {error[-120:]})"
            return
        os.environ[INSTALLED_PROGRAM_ENV] = str(venv / "bin" / "gpubadge")
        took = time.perf_counter() - started
        try:
            yield (
                "`gpubadge scan` runs the copy installed as the Dockerfile installs it (a virtualenv,"
                f" `pip install '.[uvloop]'`, {took:.0f} s, not measured); the service's processes"
                " (`serve`, `worker`) run this checkout"
            )
        finally:
            del os.environ[INSTALLED_PROGRAM_ENV]


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kib / 1024 / 1024:.1f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return f"{os.cpu_count()} cores ({cpu}){memory}, Linux {platform.release()}, Python {platform.python_version()}"


def tool_versions() -> str:
    versions = []
    for command in (["skopeo", "--version"], ["docker-registry", "--version"]):
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip()
            versions.append(out.splitlines()[0] if out else command[0])
        except (OSError, subprocess.SubprocessError):
            versions.append(f"{command[0]}: not found")
    return "; ".join(versions)


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def ratio(peer: float, ours: float) -> float | None:
    return peer / ours if ours > 0 else None
