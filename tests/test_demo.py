"""`make run`'s demo (fixtures/demo.py) as a user meets it: it starts, its sample images show the
headline findings, the "Try it" commands it prints (README's tour) work, referrers and compat
included; Ctrl-C stops it within seconds at any moment and leaves no process or temporary
directory behind; a taken port or a service that cannot start is said in one line that names
GPUBADGE_PORT, and the log with the reason is kept."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fixtures.registry import free_port
from fixtures.service import run_service_process
from tests.test_service_e2e import by_ref, call

REPO_ROOT = Path(__file__).resolve().parents[1]
STOP_SECONDS = 20.0  # Ctrl-C to a stopped demo, its service and registry included


def tour_commands(printed: str) -> list[str]:
    """The shell commands of the printed tour: its indented lines, continuations joined."""
    lines = printed.split("Try it, in another shell:\n", 1)[1].split("\nand browse", 1)[0].splitlines()
    commands: list[str] = []
    for line in lines:
        text = line.strip()
        if commands and commands[-1].endswith("\\"):
            commands[-1] = commands[-1][:-1] + " " + text
        else:
            commands.append(text)
    return commands


def ignore_sigint() -> None:
    """What a non-interactive shell does to a background job (`make run &` in CI, as `.ci/run`'s suite
    ran this test): SIGINT ignored, inherited through exec, and kept as ignored by Python."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass
class Demo:
    process: subprocess.Popen[str]
    tmp: Path
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    printed: str = ""

    def until(self, text: str, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.printed:
            try:
                self.printed += self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {text!r} in {timeout} s:\n{self.printed}") from None
        return self.printed

    def stopped(self, timeout: float = STOP_SECONDS) -> int:
        """The exit status, once the demo and everything it started are gone (bounded)."""
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the demo still runs {timeout} s after Ctrl-C:\n{self.printed}") from None
        deadline = time.monotonic() + timeout
        while (left := leftovers(self.tmp)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"still running after the demo exited: {left}"
        self.printed += "".join(iter_queue(self.lines))
        return code


def iter_queue(lines: queue.Queue[str]) -> Iterator[str]:
    while True:
        try:
            yield lines.get_nowait()
        except queue.Empty:
            return


def leftovers(tmp: Path) -> list[str]:
    """Processes the demo started and left (the service and registry: their command lines or
    environment name the demo's directory under `tmp`), as `pid command`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        zombie = stat.rsplit(")", 1)[-1].split()[0] == "Z"
        if f"{tmp}/".encode() in text and not zombie and b"pytest" not in text:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name} {command[:120]}")
    return found


@pytest.fixture
def start_demo(tmp_path: Path) -> Iterator[Callable[..., Demo]]:
    started: list[Demo] = []

    def start(*, port: int = 0, env: dict[str, str] | None = None, **popen: object) -> Demo:
        full = {key: value for key, value in os.environ.items() if not key.startswith("GPUBADGE")}
        full |= {
            "GPUBADGE_PORT": str(port),
            "TMPDIR": str(tmp_path),
            "PYTHONPATH": str(REPO_ROOT),
            **(env or {}),
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "fixtures.demo"],
            cwd=REPO_ROOT,
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **popen,  # type: ignore[call-overload]
        )
        demo = Demo(process, tmp_path)
        threading.Thread(
            target=lambda: [demo.lines.put(line) for line in process.stdout or ()], daemon=True
        ).start()
        started.append(demo)
        return demo

    yield start
    for demo in started:  # a failed test still leaves nothing running
        if demo.process.poll() is None:
            demo.process.terminate()
            try:
                demo.process.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                demo.process.kill()


def test_make_run_demo_shows_the_findings_and_its_tour_works(
    tmp_path: Path, start_demo: Callable[..., Demo]
) -> None:
    demo = start_demo()
    printed = demo.until("Ctrl-C to stop.")
    found = re.search(r"export GPUBADGE=(\S+) REGISTRY=(\S+)", printed)
    assert found, printed
    service, registry = found.groups()
    expected = {
        "samples/pip-torch:2.3": "cuda-12.1-inferred",  # CUDA found in the layers, none declared
        "samples/cuda-newer-inside:11.8": "cuda-newer-inside",  # carries 12.4, declares 11.8: named so
        "samples/bad-require:12.2": "requirement-error",
    }
    for name, badge in expected.items():
        reply = by_ref(service, f"{registry}/{name}", wait=60)
        assert reply.status == 200, (name, reply.text)
        assert badge in reply.body["platforms"][0]["badges"], (name, reply.body["platforms"][0]["badges"])

    shell_env = {
        **{key: value for key, value in os.environ.items() if not key.startswith("GPUBADGE")},
        "PYTHONPATH": str(REPO_ROOT),
        "GPUBADGE_DB": str(tmp_path / "cli.db"),
    }
    prefix = f"gpubadge() {{ '{sys.executable}' -m gpubadge.cli \"$@\"; }}; "  # this checkout's CLI
    outputs = {}
    for command in tour_commands(printed):
        if command.startswith("export "):
            prefix += command + "; "
            continue
        done = subprocess.run(
            ["bash", "-c", prefix + command], env=shell_env, capture_output=True, text=True, timeout=120
        )
        # compat exits 3 when some node is not compatible: the sample fleet's CPU servers are not
        allowed = (0, 3) if " compat " in command else (0,)
        assert done.returncode in allowed, (command, done.stdout, done.stderr)
        outputs[command.split()[1] if command.startswith("gpubadge") else command[:40]] = done.stdout
    scan, eligible, referrers, compat = (outputs[k] for k in ("scan", "eligible", "referrers", "compat"))
    curls = [text for key, text in outputs.items() if key.startswith("curl")]
    eligibility, hook = curls
    assert "pip-torch" in scan and "optional" in scan and "12.1 (carried)" in scan and ">=525.60.13" in scan
    assert "GPU optional" in eligible and "eligible" in eligible  # $GPUBADGE is the service: no --service
    assert '"eligible_count"' in eligibility and '"image_gpu": "required"' in eligibility
    assert '"why": [' in eligibility  # eligible servers say why they pass
    assert "report" in referrers and "nfd" in referrers  # the demo attached both
    assert "compatible" in compat and "nvidia-gpu" in compat
    assert '"accepted": 1' in hook
    # Agents need a token (none: 401); the one the demo prints registers a server.
    joined = re.search(r"gpubadge agent --service \S+ --token (\S+)", printed)
    assert joined, printed
    server = {"name": "demo-node", "gpus": []}
    assert call("POST", f"{service}/api/servers", server).status == 401
    registered = call("POST", f"{service}/api/servers", server, {"Authorization": f"Bearer {joined[1]}"})
    assert registered.status == 200, registered.text

    demo.process.send_signal(signal.SIGINT)  # Ctrl-C, to the demo alone
    assert demo.stopped() == 0, demo.printed
    assert list(tmp_path.glob("gpubadge-*")) == [], list(tmp_path.iterdir())


def test_ctrl_c_stops_a_demo_started_with_sigint_ignored(
    tmp_path: Path, start_demo: Callable[..., Demo]
) -> None:
    """Started as a background job of a non-interactive shell starts it (`make run &` in CI: SIGINT
    ignored, inherited, kept by Python): the state in which the old demo slept in signal.pause() for
    ever, its service and registry stopped by the same Ctrl-C and never reaped."""
    demo = start_demo(preexec_fn=ignore_sigint, start_new_session=True)
    demo.until("Ctrl-C to stop.")
    os.killpg(demo.process.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
    assert demo.stopped() == 0, demo.printed
    assert list(tmp_path.glob("gpubadge-*")) == []


def test_ctrl_c_while_the_samples_are_pushed_stops_everything(
    tmp_path: Path, start_demo: Callable[..., Demo]
) -> None:
    """Ctrl-C at a terminal reaches the whole process group (the demo, its service, its registry,
    a skopeo push under way) at any moment: all stop within seconds, nothing is left."""
    demo = start_demo(start_new_session=True)
    demo.until("pushed ")
    started = time.monotonic()
    os.killpg(demo.process.pid, signal.SIGINT)
    assert demo.stopped() == 0, demo.printed
    assert time.monotonic() - started < STOP_SECONDS
    assert list(tmp_path.glob("gpubadge-*")) == []


def test_make_run_names_a_taken_port_and_refuses_another_gpubadge(
    tmp_path: Path, start_demo: Callable[..., Demo]
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        demo = start_demo(port=port)
        assert demo.stopped() == 1
    line = demo.printed.strip()
    assert line.count("\n") == 0 and f"port {port}" in line and "GPUBADGE_PORT=" in line, line
    assert "Traceback" not in demo.printed

    other = free_port()
    elsewhere = Path(tempfile.mkdtemp(prefix="gpubadge-other-"))  # not under tmp_path: not the demo's
    with run_service_process(elsewhere / "other.db", port=other):
        demo = start_demo(port=other)
        assert demo.stopped() == 1
    assert f"another gpubadge already answers at http://127.0.0.1:{other}" in demo.printed
    assert "Ctrl-C to stop." not in demo.printed and "pushed" not in demo.printed  # the tour never went there
    assert list(tmp_path.glob("gpubadge-*")) == []
    shutil.rmtree(elsewhere, ignore_errors=True)


def test_make_run_keeps_the_log_that_says_why_the_service_did_not_start(
    tmp_path: Path, start_demo: Callable[..., Demo]
) -> None:
    demo = start_demo(env={"GPUBADGE_WORKERS": "lots"})  # a setting `serve` refuses
    assert demo.stopped() == 1
    assert "gpubadge serve did not start on port" in demo.printed and "GPUBADGE_PORT" in demo.printed
    assert "invalid settings" in demo.printed and "Traceback" not in demo.printed, demo.printed
    (kept,) = tmp_path.glob("gpubadge-demo-*")  # the log stays, with the reason in it
    assert "invalid settings" in (kept / "service.log").read_text()
    assert str(kept) in demo.printed
