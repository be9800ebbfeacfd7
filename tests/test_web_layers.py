"""web/ reads top-down: route modules never import each other, and only entry points import web/app.py.

Read from the source (no import runs), so a new arrow fails here before anyone has to find it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUTES = ROOT / "web" / "routes"
ENTRY_POINTS = {"web/commands.py"}  # `gpubadge serve` builds the application; nothing else may


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
        for folder in ("web", "gpubadge", "agent", "placement", "scanner", "store")
        for path in (ROOT / folder).rglob("*.py")
        if path.name != "app.py" and "web.app" in imported_modules(path)
    )
    assert set(importers) <= ENTRY_POINTS
    assert "web/commands.py" in importers  # the check sees the one real entry point


def test_the_service_goes_through_the_stores_front_door() -> None:
    """web/ reaches the store through `AsyncStore`'s methods, `run` and `blocking`, never its
    engine (`store.backend`): what the facade adds (events after commits, the thread hop) holds."""
    uses = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted((ROOT / "web").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "backend"
    ]
    assert uses == []
