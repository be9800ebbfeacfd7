"""`gpubadge agent`: command line, discovery wiring and a clean SIGTERM shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import docker.errors

from agent.host import build_server, detect_runtime_modes, load_server_file, merge_runtime_modes
from agent.loop import Agent, AgentSettings, Discovery
from agent.nvml import read_nvml
from agent.runner import DockerRunner
from agent.service_client import ServiceClient
from placement.inventory import RuntimeMode, Server

log = logging.getLogger("gpubadge.agent")
TOKEN_ENV = "GPUBADGE_AGENT_TOKEN"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpubadge agent", description="Run deployments for gpubadge on this server."
    )
    service = os.environ.get("GPUBADGE") or None  # the URL the CLI's --service defaults to as well
    parser.add_argument(
        "--service",
        required=service is None,
        default=service,
        help="service base URL, e.g. http://gpubadge:8080 (default: $GPUBADGE)",
    )
    parser.add_argument("--token", default=None, help=f"agent token (default: ${TOKEN_ENV})")
    parser.add_argument("--name", default=None, help="server name (default: the host name)")
    parser.add_argument("--inventory-file", type=Path, default=None, help="one Server (YAML/JSON) to report")
    parser.add_argument("--docker-host", default=None, help="Docker engine URL (default: $DOCKER_HOST)")
    parser.add_argument("--poll-timeout", type=float, default=30.0, help="long-poll wait in seconds")
    parser.add_argument(
        "--heartbeat", type=float, default=None, help="heartbeat seconds (default: service's)"
    )
    parser.add_argument(
        "--gpu-mode",
        choices=["auto", "runtime", "device-requests", "cdi"],
        default="auto",
        help="how GPU containers get the NVIDIA runtime (auto: the nvidia runtime when Docker lists it)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def engine_runtime_modes(runner: DockerRunner) -> list[RuntimeMode] | None:
    """The NVIDIA modes the Docker engine offers, or None (logged) when it cannot be asked."""
    try:
        return detect_runtime_modes(runner.info())
    except (docker.errors.DockerException, OSError) as exc:  # requests' errors are OSErrors
        log.warning("cannot read docker info: %s", exc)
        return None


def make_discovery(name: str, runner: DockerRunner, inventory_file: Path | None) -> Discovery:
    """Build the inventory callable: NVML + host + `docker info`, or the file + `docker info`.

    The file stands in for NVML (GPUs, driver), not for the engine: its runtime modes are added
    to those `docker info` shows.
    """

    def from_file() -> tuple[Server, str | None]:
        assert inventory_file is not None
        server = load_server_file(inventory_file, name)
        if not server.gpus:
            return server, f"{inventory_file} lists no GPUs"
        engine = engine_runtime_modes(runner)
        modes = merge_runtime_modes(engine, server.runtime_modes)
        if engine is not None and (extra := [mode for mode in server.runtime_modes if mode not in engine]):
            log.info("%s declares runtime modes the engine does not show: %s", inventory_file, extra)
        return server.model_copy(update={"runtime_modes": modes}), None

    def from_host() -> tuple[Server, str | None]:
        facts = read_nvml()
        modes = engine_runtime_modes(runner) or []
        return build_server(name, facts, modes), facts.reason

    return from_file if inventory_file is not None else from_host


def server_name(explicit: str | None, inventory_file: Path | None) -> str:
    """--name, else the inventory file's server name, else the host name."""
    if explicit:
        return explicit
    if inventory_file is not None:
        return load_server_file(inventory_file).name
    return socket.gethostname()


async def _main(args: argparse.Namespace, token: str) -> int:
    name = server_name(args.name, args.inventory_file)
    runner = DockerRunner.from_env(name, args.docker_host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    settings = AgentSettings(
        name=name, poll_timeout=args.poll_timeout, heartbeat=args.heartbeat, gpu_mode=args.gpu_mode
    )
    try:
        async with aiohttp.ClientSession() as session:
            agent = Agent(
                settings,
                ServiceClient(args.service, token, session),
                runner,
                make_discovery(name, runner, args.inventory_file),
            )
            await agent.run(stop)
    finally:
        runner.client.close()
    log.info("agent %s stopped", name)
    return 0


def socket_hint(docker_host: str | None) -> str:
    """What the agent needs when the engine's unix socket refuses it, else "".

    The socket is root's and its group's (mode 660); the image runs as uid 999, so the container
    needs the socket's group as a supplementary group, which only the caller can grant."""
    url = docker_host or "unix:///var/run/docker.sock"
    if not url.startswith("unix://"):
        return ""
    path = url.removeprefix("unix://")
    try:
        owner = os.stat(path)
    except OSError:
        return f"; there is no Docker socket at {path}: mount the host's (-v /var/run/docker.sock:{path})"
    if os.access(path, os.R_OK | os.W_OK):
        return ""
    return (
        f"; {path} belongs to uid {owner.st_uid}, gid {owner.st_gid} (mode {owner.st_mode & 0o777:o}) and"
        f" uid {os.getuid()} (groups {', '.join(map(str, os.getgroups())) or 'none'}) may not use it:"
        f" run with its group, `docker run --group-add {owner.st_gid}`"
        f" (Kubernetes: securityContext.supplementalGroups: [{owner.st_gid}])"
    )


def run_agent(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        print(f"gpubadge agent: no token; pass --token or set {TOKEN_ENV}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args, token))
    except docker.errors.DockerException as exc:
        hint = socket_hint(args.docker_host or os.environ.get("DOCKER_HOST"))
        print(f"gpubadge agent: cannot reach the Docker engine: {exc}{hint}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"gpubadge agent: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(run_agent(sys.argv[1:]))
