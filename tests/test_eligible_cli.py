"""`gpubadge eligible`: exit 0 when a server fits, 3 when none does, 1 on error; local and via the service."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import yaml

from fixtures import catalog
from fixtures.registry import LocalRegistry, free_port
from fixtures.service import run_service_inprocess
from tests.conftest import Pusher
from tests.test_fleet_api import FLEET
from web.settings import ServiceSettings


async def _eligible(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpubadge.cli",
        "eligible",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_eligible_exit_codes(registry: LocalRegistry, push: Pusher, tmp_path: Path) -> None:
    push(catalog.cuda_ubuntu(), "eligible/cuda:12.2")
    servers = tmp_path / "servers.yaml"
    servers.write_text(yaml.safe_dump(FLEET))
    image = f"{registry.host}/eligible/cuda:12.2"

    code, out, _ = await _eligible(image, "--servers", str(servers), "--gpus", "1")
    assert code == 0 and "eligible    h100-new" in out and "ineligible  t4-old" in out

    code, out, _ = await _eligible(image, "--servers", str(servers), "--gpu-model", "a100", "--json")
    assert code == 3
    decision = json.loads(out)
    assert decision["eligible"] == [] and decision["eligible_count"] == 0
    assert decision["ineligible_count"] == len(FLEET["servers"])
    assert sum(item["count"] for item in decision["ineligible_by_reason"]) >= len(FLEET["servers"])

    code, out, _ = await _eligible(
        image, "--servers", str(servers), "--gpu-model", "a100", "--explain", "all"
    )
    assert code == 3 and all(f"ineligible  {server['name']}: " in out for server in FLEET["servers"])

    code, _, err = await _eligible(f"{registry.host}/eligible/missing:1", "--servers", str(servers))
    assert code == 1 and "missing" in err

    settings = ServiceSettings(db=tmp_path / "svc.db", inventory_file=servers, docker_config=None)
    async with run_service_inprocess(settings, port=free_port()) as service:
        code, out, _ = await _eligible(image, "--service", service.url, "--min-gpu-memory", "40Gi", "--json")
    assert code == 0 and json.loads(out)["eligible"][0]["server"] == "h100-new"


async def _constraints(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpubadge.cli",
        "constraints",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_constraints_cli_locally_and_via_the_service(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    push(catalog.cuda_ubuntu(), "constraints/cuda:12.2")
    servers = tmp_path / "servers.yaml"
    servers.write_text(yaml.safe_dump(FLEET))
    image = f"{registry.host}/constraints/cuda:12.2"

    code, out, err = await _constraints(image, "--servers", str(servers), "--format", "kubernetes")
    assert code == 0, err
    document = yaml.safe_load(out)  # notes are comments; the rest is the Pod spec fragment
    assert document["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert document["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]

    code, out, _ = await _constraints(image, "--servers", str(servers), "--format", "nomad")
    assert code == 0 and 'device "nvidia/gpu"' in out

    code, out, _ = await _constraints(image, "--servers", str(servers), "--format", "dra", "--gpus", "2")
    claim, affinity = list(yaml.safe_load_all(out))
    assert claim["kind"] == "ResourceClaimTemplate" and "nodeAffinity" in affinity["affinity"]

    code, _, err = await _constraints(image, "--servers", str(servers), "--format", "swarm")
    assert code != 0 and "swarm" in err

    settings = ServiceSettings(db=tmp_path / "svc.db", inventory_file=servers, docker_config=None)
    async with run_service_inprocess(settings, port=free_port()) as service:
        code, out, _ = await _constraints(image, "--service", service.url, "--format", "akash", "--json")
    body = json.loads(out)
    assert (
        code == 0
        and body["format"] == "akash"
        and body["sdl"]["profiles"]["compute"]["app"]["resources"]["gpu"]
    )
