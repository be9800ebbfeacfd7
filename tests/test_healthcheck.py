"""`gpubadge healthcheck` (the image's HEALTHCHECK) without Docker: which process, which port, what verdict.

tests/test_image.py proves it inside the image through Docker's own health status; these pin down
the resolution (role, flags, settings, /proc) and run it against real serve and worker processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.registry import free_port
from fixtures.service import run_role_process, run_service_process
from gpubadge.healthcheck import gpubadge_command, main_command, probe_for
from tests.test_scale_out import wait_until

SCRIPT = "/opt/gpubadge/bin/gpubadge"


def healthcheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "healthcheck", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_gpubadge_command_is_found_behind_its_interpreter_or_python_m() -> None:
    assert gpubadge_command(["/opt/gpubadge/bin/python3", SCRIPT, "worker", "--metrics-port", "9090"]) == [
        "worker",
        "--metrics-port",
        "9090",
    ]
    assert gpubadge_command([SCRIPT, "serve"]) == ["serve"]
    assert gpubadge_command(["python3", "-m", "gpubadge.cli", "agent"]) == ["agent"]
    assert gpubadge_command(["/sbin/docker-init", "--", SCRIPT, "serve"]) == ["serve"]
    assert gpubadge_command(["sleep", "60"]) is None


def test_the_main_process_is_the_lowest_pid_running_a_role_never_the_probe_itself() -> None:
    processes = [
        (40, ["python3", SCRIPT, "healthcheck"]),
        (1, ["/sbin/docker-init", "--", "sh"]),  # `docker run --init IMAGE sh -c ...`: not gpubadge
        (7, ["python3", SCRIPT, "worker", "--metrics-port", "9091"]),
        (9, ["python3", SCRIPT, "serve"]),
    ]
    assert main_command(processes, own_pid=40) == ["worker", "--metrics-port", "9091"]
    assert main_command([(40, ["python3", SCRIPT, "healthcheck"])], own_pid=41) is None


def test_serves_worker_processes_are_never_the_main_process() -> None:
    """`serve` starts its scans' worker processes as `worker --supervised worker-N` (issue 44): the
    container's probe is still serve's port, whatever the pids."""
    processes = [
        (3, ["python3", "-m", "gpubadge.cli", "worker", "--supervised", "worker-1", "--log-level", "INFO"]),
        (5, ["python3", SCRIPT, "serve", "--port", "8085"]),
        (6, ["python3", "-m", "gpubadge.cli", "worker", "--supervised", "worker-2", "--no-sweep"]),
    ]
    assert main_command(processes, own_pid=40) == ["serve", "--port", "8085"]


def test_ports_resolve_as_each_role_resolves_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUBADGE_PORT", "9000")
    monkeypatch.setenv("GPUBADGE_HOST", "0.0.0.0")
    assert probe_for(["serve"]).url == "http://127.0.0.1:9000/healthz"
    assert probe_for(["serve", "--port", "9100", "--workers", "0"]).url == "http://127.0.0.1:9100/healthz"
    assert probe_for(["serve", "--host", "::1"]).url == "http://[::1]:9000/healthz"
    assert probe_for(["worker", "--metrics-port", "9090"]).url == "http://127.0.0.1:9090/healthz"
    for role in (["worker", "--concurrency", "4"], ["agent", "--service", "http://x"], ["db", "upgrade"]):
        probe = probe_for(role)
        assert probe.url is None and "nothing to probe" in probe.reason


def test_a_real_serve_and_worker_are_healthy_on_their_own_ports_and_a_dead_one_is_not(tmp_path: Path) -> None:
    with run_service_process(tmp_path / "serve.db") as service:
        port = service.url.rsplit(":", 1)[1]
        ok = healthcheck("serve", env={"GPUBADGE_PORT": port})
        assert ok.returncode == 0 and f":{port}/healthz" in ok.stdout, ok.stderr
        # the image's old defect: a fixed :8080 while the service listens elsewhere
        wrong = healthcheck("serve", "--port", str(free_port()))
        assert wrong.returncode == 1 and "Connection refused" in wrong.stderr
    metrics = free_port()
    args = ("worker", "--metrics-port", str(metrics))
    with run_role_process(args, tmp_path / "worker.db", {}, tmp_path / "worker.log"):
        wait_until(lambda: healthcheck(*args).returncode == 0, 60, "the worker's /healthz answering")
    assert healthcheck(*args).returncode == 1  # the worker is gone: unhealthy


def test_the_main_process_comes_from_proc(tmp_path: Path) -> None:
    """With no arguments the command line is read from /proc/PID/cmdline (NUL-separated)."""
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "cmdline").write_bytes(b"/opt/gpubadge/bin/python3\0" + SCRIPT.encode() + b"\0agent\0")
    (tmp_path / "self").mkdir()
    from gpubadge.healthcheck import main

    assert main([], proc=tmp_path) == 0
    (tmp_path / "1" / "cmdline").write_bytes(b"sleep\x0060\0")
    assert main([], proc=tmp_path) == 1
