"""The packages read top-down: no arrow runs back up between them, the job runtime (jobs/) never
imports web/, `gpubadge worker` loads no HTTP code, route modules never import each other, and
only entry points import web/app.py.

Read from the source (no import runs), so a new arrow fails here before anyone has to find it;
the worker's loaded modules are read from a real `gpubadge worker` process.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROUTES = ROOT / "web" / "routes"
ENTRY_POINTS = {"web/commands.py"}  # `gpubadge serve` builds the application; nothing else may
# What each package may import of ours: every arrow points down this list, none back up.
ALLOWED = {
    "scanner": set[str](),
    "placement": {"scanner"},
    "store": {"scanner"},
    "jobs": {"scanner", "placement", "store"},
    "web": {"scanner", "placement", "store", "jobs"},
    "agent": {"placement"},
    "gpubadge": {"scanner", "placement", "store", "jobs", "web", "agent"},
}


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_route_modules_import_no_other_route_module() -> None:
    modules = sorted(ROUTES.glob("*.py"))
    assert len(modules) > 5  # the check reads the route modules where they are
    arrows = [
        f"{path.name} imports {name}"
        for path in modules
        for name in sorted(imported_modules(path))
        if name.startswith("web.routes.") and name != f"web.routes.{path.stem}"
    ]
    assert arrows == []


def test_only_entry_points_import_the_application() -> None:
    importers = sorted(
        str(path.relative_to(ROOT))
        for folder in ALLOWED
        for path in (ROOT / folder).rglob("*.py")
        if path.name != "app.py" and "web.app" in imported_modules(path)
    )
    assert set(importers) <= ENTRY_POINTS
    assert "web/commands.py" in importers  # the check sees the one real entry point


def test_the_service_goes_through_the_stores_front_door() -> None:
    """jobs/ and web/ reach the store through `AsyncStore`'s methods, `run` and `blocking`, never its
    engine (`store.backend`): what the facade adds (events after commits, the thread hop) holds."""
    uses = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for folder in ("jobs", "web")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "backend"
    ]
    assert uses == []


def test_package_arrows_point_one_way() -> None:
    arrows = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for package, allowed in ALLOWED.items()
        for path in (ROOT / package).rglob("*.py")
        for name in imported_modules(path)
        if name.split(".")[0] in set(ALLOWED) - allowed - {package}
    )
    assert arrows == []
    # the check sees real arrows where they are allowed
    assert "jobs.intake" in imported_modules(ROOT / "web" / "state.py")


def test_the_job_runtime_imports_no_http() -> None:
    """jobs/ is what `gpubadge worker` runs: no web/ module and no aiohttp server code, at any depth
    of its code (a function-level import included)."""
    modules = sorted((ROOT / "jobs").rglob("*.py"))
    assert len(modules) > 5
    http = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in modules
        for name in sorted(imported_modules(path))
        if name.split(".")[0] == "web" or name == "aiohttp.web" or name.startswith("aiohttp.web_")
    ]
    assert http == []


WORKER_PROBE = """
import json, logging, os, signal, sys

class StopOnceRunning(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("scan worker "):
            os.kill(os.getpid(), signal.SIGTERM)

logger = logging.getLogger("jobs.worker_process")
logger.setLevel(logging.INFO)
logger.addHandler(StopOnceRunning())
from gpubadge.cli import main

code = main(["worker", "--db", sys.argv[1], "--concurrency", "1"])
loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("web", "jobs", "aiohttp"))
print(json.dumps({"code": code, "loaded": loaded}))
"""


def test_gpubadge_worker_loads_no_web_module_and_no_http_server(tmp_path: Path) -> None:
    """A real `gpubadge worker` (store opened, workers claiming, drained on SIGTERM) ends having
    loaded the job runtime and aiohttp's client, and nothing of web/ or aiohttp's server."""
    env = {**os.environ, "GPUBADGE_CONFIG": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", WORKER_PROBE, str(tmp_path / "worker.db")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["code"] == 0, result.stderr
    loaded = outcome["loaded"]
    assert "jobs.worker_process" in loaded and "jobs.workers" in loaded  # the probe saw the runtime run
    assert "aiohttp.client" in loaded  # and the registry client, which is aiohttp's
    assert [name for name in loaded if name == "web" or name.startswith(("web.", "aiohttp.web"))] == []


def room_arrows(package: str) -> dict[str, set[str]]:
    """Arrows between `package`'s rooms, a subpackage counting as one room (docs/architecture.md)."""
    arrows: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        if path == ROOT / package / "__init__.py":
            continue
        here = ".".join(path.relative_to(ROOT).with_suffix("").parts[:2])
        targets = {
            ".".join(name.split(".")[:2]) for name in imported_modules(path) if name.startswith(f"{package}.")
        }
        arrows.setdefault(here, set()).update(targets - {here})
    return arrows


@pytest.mark.parametrize("package", ["web", "jobs"])
def test_rooms_form_no_circle(package: str) -> None:
    """Grouping modules into rooms (web/guards, web/views, web/fleet) must not make a circle between
    rooms: each room stands on a floor above everything it imports."""
    arrows = room_arrows(package)
    assert len(arrows) > 5
    done: set[str] = set()

    def circle_from(room: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        if room in path:
            return (*path[path.index(room) :], room)
        if room in done:
            return None
        for target in sorted(arrows.get(room, ())):
            found = circle_from(target, (*path, room))
            if found:
                return found
        done.add(room)
        return None

    circles = [circle for room in sorted(arrows) if (circle := circle_from(room, ()))]
    assert circles == []
