"""`make run`'s demo (fixtures/demo.py) as a user meets it: it starts, its sample images show the
headline findings, the "Try it" commands it prints (README's tour) work, and Ctrl-C leaves no
temporary directory behind."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.test_service_e2e import by_ref, call

REPO_ROOT = Path(__file__).resolve().parents[1]


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


def test_make_run_demo_shows_the_findings_and_its_tour_works(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUBADGE_")}
    env |= {"GPUBADGE_PORT": "0", "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    demo = subprocess.Popen(
        [sys.executable, "-m", "fixtures.demo"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in demo.stdout or ()], daemon=True).start()
    printed = ""
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C to stop." not in printed:
            printed += lines.get(timeout=max(0.1, deadline - time.monotonic()))
        found = re.search(r"export GPUBADGE=(\S+) REGISTRY=(\S+)", printed)
        assert found, printed
        service, registry = found.groups()
        expected = {
            "samples/pip-torch:2.3": "cuda-12.1-inferred",  # CUDA found in the layers, none declared
            "samples/cuda-mismatch:11.8": "cuda-newer-inside",  # carries 12.4, declares 11.8
            "samples/bad-require:12.2": "requirement-error",
        }
        for name, badge in expected.items():
            reply = by_ref(service, f"{registry}/{name}", wait=60)
            assert reply.status == 200, (name, reply.text)
            assert badge in reply.body["platforms"][0]["badges"], (name, reply.body["platforms"][0]["badges"])

        shell_env = {**env, "GPUBADGE_DB": str(tmp_path / "cli.db")}
        prefix = f"gpubadge() {{ '{sys.executable}' -m gpubadge.cli \"$@\"; }}; "  # this checkout's CLI
        outputs = []
        for command in tour_commands(printed):
            if command.startswith("export "):
                prefix += command + "; "
                continue
            done = subprocess.run(
                ["bash", "-c", prefix + command], env=shell_env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            outputs.append(done.stdout)
        scan, eligibility, hook = outputs
        assert "pip-torch" in scan and "12.1" in scan
        assert '"eligible_count"' in eligibility and '"image_needs_gpu": true' in eligibility
        assert '"accepted": 1' in hook
        # Agents need a token (none: 401); the one the demo prints registers a server.
        joined = re.search(r"gpubadge agent --service \S+ --token (\S+)", printed)
        assert joined, printed
        server = {"name": "demo-node", "gpus": []}
        assert call("POST", f"{service}/api/servers", server).status == 401
        registered = call("POST", f"{service}/api/servers", server, {"Authorization": f"Bearer {joined[1]}"})
        assert registered.status == 200, registered.text
    finally:
        demo.send_signal(signal.SIGINT)  # Ctrl-C
        returncode = demo.wait(timeout=60)
    assert returncode == 0, printed
    assert list(tmp_path.glob("gpubadge-*")) == [], list(tmp_path.iterdir())
