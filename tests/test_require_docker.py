"""Docker tests skip where Docker cannot run, but fail when `make test` has promised Docker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REQUIRE_DOCKER_ENV, REQUIRE_SYSTEM_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
# The children run pytest with the plugins the suite uses and no others: the installed ones load
# hypothesis and schemathesis at start-up, 4 s of a child's 5 on a slow host.
CHILD_PYTEST = [
    sys.executable,
    "-m",
    "pytest",
    "-q",
    "-p",
    "no:cacheprovider",
    "-p",
    "pytest_asyncio.plugin",
    "-p",
    "pytest_timeout",
]


def child_env(without: str) -> dict[str, str]:
    """This process's environment less `without`, with pytest's plugin autoload off (CHILD_PYTEST)."""
    env = {key: value for key, value in os.environ.items() if key != without}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


USES_DOCKERD = """
from fixtures.dockerd import LocalDockerd


def test_needs_docker(dockerd: LocalDockerd) -> None:
    assert dockerd.host
"""


def run_without_runc(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess[str]:
    """pytest in a child whose PATH has no runc, so the dockerd fixture cannot start an engine."""
    (tmp_path / "test_uses_dockerd.py").write_text(USES_DOCKERD)
    env = child_env(REQUIRE_DOCKER_ENV)
    env.update({"PATH": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)})
    if require is not None:
        env[REQUIRE_DOCKER_ENV] = require
    return subprocess.run(
        [
            *CHILD_PYTEST,
            "-p",
            "tests.conftest",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_uses_dockerd.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(("require", "fails"), [(None, False), ("1", True)])
def test_missing_docker_fails_only_when_required(tmp_path: Path, require: str | None, fails: bool) -> None:
    result = run_without_runc(tmp_path, require)
    output = result.stdout + result.stderr
    if fails:
        assert result.returncode != 0, output
        assert "1 error" in output and f"{REQUIRE_DOCKER_ENV} is set" in output, output
    else:
        assert result.returncode == 0 and "1 skipped" in output, output


@pytest.mark.parametrize(("require", "fails"), [(None, False), ("1", True)])
def test_the_image_test_needs_debootstrap_and_says_so(
    tmp_path: Path, require: str | None, fails: bool
) -> None:
    """Everything tests/test_image.py needs but debootstrap: it skips naming it, or fails when required."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("runc", "make", "docker", "dockerd"):
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} is not installed")
        (bin_dir / tool).symlink_to(found)
    env = child_env(REQUIRE_DOCKER_ENV)
    env.update({"PATH": str(bin_dir), "PYTHONPATH": str(REPO_ROOT)})
    if require is not None:
        env[REQUIRE_DOCKER_ENV] = require
    result = subprocess.run(
        [*CHILD_PYTEST, "-rs", "tests/test_image.py"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert "debootstrap is not installed" in output, output
    if fails:
        assert result.returncode != 0 and f"{REQUIRE_DOCKER_ENV} is set" in output, output
    else:
        assert result.returncode == 0 and "skipped" in output and "error" not in output, output


# -- the rest of deps-system: PostgreSQL and gcc (GPUBADGE_REQUIRE_SYSTEM, set by `make test`)

WITHOUT_POSTGRES = """
import fixtures.postgres

fixtures.postgres.postgres_bin_dir = lambda: None  # as on a host without Debian's postgresql


def test_needs_postgres(postgres_url: str) -> None:
    assert postgres_url
"""


def run_child(tmp_path: Path, require: str | None, target: str, path: str | None = None) -> str:
    env = child_env(REQUIRE_SYSTEM_ENV)
    env["PYTHONPATH"] = str(REPO_ROOT)
    if path is not None:
        env["PATH"] = path
    if require is not None:
        env[REQUIRE_SYSTEM_ENV] = require
    command = [*CHILD_PYTEST, "-rs"]
    if target.startswith(str(tmp_path)):  # a test file of ours in tmp_path: the repository's fixtures
        command += ["-p", "tests.conftest", "--rootdir", str(tmp_path)]
    result = subprocess.run(
        [*command, target],
        cwd=tmp_path if target.startswith(str(tmp_path)) else REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    if require:
        assert result.returncode != 0 and f"{REQUIRE_SYSTEM_ENV} is set" in output, output
        assert "skipped" not in output, output
    else:
        assert result.returncode == 0 and "skipped" in output and "error" not in output, output
    return output


@pytest.mark.parametrize("require", [None, "1"])
def test_missing_postgres_fails_only_when_required(tmp_path: Path, require: str | None) -> None:
    (tmp_path / "test_uses_postgres.py").write_text(WITHOUT_POSTGRES)
    output = run_child(tmp_path, require, str(tmp_path / "test_uses_postgres.py"))
    assert "postgresql is not installed" in output, output


@pytest.mark.parametrize("require", [None, "1"])
def test_missing_gcc_fails_the_fatbin_tests_only_when_required(tmp_path: Path, require: str | None) -> None:
    """tests/test_fatbin.py links real binaries with gcc: without it they skip, or fail under make test."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()  # no gcc on this PATH
    target = f"{REPO_ROOT / 'tests' / 'test_fatbin.py'}::test_needed_names_are_exact"
    output = run_child(tmp_path, require, target, path=str(bin_dir))
    assert "gcc is not installed" in output, output
