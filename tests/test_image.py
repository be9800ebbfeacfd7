"""The container image, built air-gapped by `make image-airgapped` and run in every role.

A private dockerd (overlay2 where the kernel allows it, else vfs; no bridge, so every container
uses the host's network on loopback) builds the image from a debootstrapped base with
`docker build --network none`, then runs it as users would: read-only root, tmpfs /tmp, uid 999,
against the real test registry and the real test PostgreSQL. Health is Docker's own verdict from
the image's HEALTHCHECK (a short --health-interval here). The image itself is pushed by
`docker push` and scanned by gpubadge: the one image in the tests that a real builder made.

Skips only where Docker or debootstrap cannot run; under GPUBADGE_REQUIRE_DOCKER=1 it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.busybox import busybox_image, busybox_unavailable_reason, gpu_busybox_image
from fixtures.dockerd import LocalDockerd, dockerd_unavailable_reason, run_dockerd
from fixtures.notifications import distribution_push
from fixtures.registry import LocalRegistry, free_port
from store.migrations import latest_version
from tests.conftest import REQUIRE_DOCKER_ENV, Pusher, docker_required
from tests.test_referrers_service import wait_metric
from tests.test_service_e2e import by_ref, call, wait_job

pytestmark = pytest.mark.docker
REPO_ROOT = Path(__file__).resolve().parents[1]
IMAGE = "gpubadge:airgapped-test"
API_TOKEN = "image-api-token"
AGENT_TOKEN = "image-agent-token"
WEBHOOK_SECRET = "image-webhook-secret"
ADDED_LAYERS_GOAL = 80_000_000  # bytes gpubadge adds above its base (docker's MB)


def _unavailable_reason() -> str | None:
    reason = dockerd_unavailable_reason() or busybox_unavailable_reason()
    if reason is None and not shutil.which("debootstrap"):
        reason = "debootstrap is not installed (Debian package debootstrap; make deps-system)"
    if reason is None and not (shutil.which("make") and shutil.which("docker")):
        reason = "make or the docker command is not installed"
    return reason


@dataclass
class Docker:
    """The docker CLI against one private daemon."""

    daemon: LocalDockerd

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["docker", *args],
            env={**os.environ, "DOCKER_HOST": self.daemon.host},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return done

    def inspect(self, name: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = json.loads(self.run("inspect", name).stdout)
        return found[0]

    def wait_healthy(self, name: str, timeout: float = 90) -> None:
        """Until Docker itself marks the container healthy (its HEALTHCHECK), bounded; fails at once
        if it turns unhealthy or exits."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.inspect(name)["State"]
            health = state.get("Health", {}).get("Status")
            if health == "healthy":
                return
            if health == "unhealthy" or not state["Running"] or time.monotonic() > deadline:
                logs = self.run("logs", name, check=False)
                probes = state.get("Health", {}).get("Log", [])[-3:]
                raise AssertionError(
                    f"{name}: {health}, running={state['Running']}; probes {probes}\n{logs.stderr[-3000:]}"
                )
            time.sleep(0.2)


@pytest.fixture(scope="module")
def docker_cli() -> Iterator[Docker]:
    """A private dockerd for this module: overlay2 when it starts, else vfs (slow, but works anywhere)."""
    reason = _unavailable_reason()
    if reason and docker_required():
        pytest.fail(f"{REQUIRE_DOCKER_ENV} is set (make test installs Docker), but {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        try:
            daemon = stack.enter_context(run_dockerd(storage_driver="overlay2"))
        except (RuntimeError, TimeoutError):
            daemon = stack.enter_context(run_dockerd())
        yield Docker(daemon)


@dataclass
class Built:
    image: str
    base: str
    seconds: float


@pytest.fixture(scope="module")
def built(docker_cli: Docker) -> Built:
    """`make image-airgapped` exactly as documented, against the private daemon (DOCKER_HOST)."""
    started = time.monotonic()
    done = subprocess.run(
        ["make", "--no-print-directory", "image-airgapped", f"IMAGE={IMAGE}", f"PYTHON={sys.executable}"],
        cwd=REPO_ROOT,
        env={**os.environ, "DOCKER_HOST": docker_cli.daemon.host},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, f"make image-airgapped failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    bases = [
        line.split()[0]
        for line in docker_cli.run("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        if line.startswith("gpubadge-base:")
    ]
    assert len(bases) == 1, bases
    print(f"\nmake image-airgapped: {seconds:.1f}s")
    return Built(IMAGE, bases[0], seconds)


@contextlib.contextmanager
def container(docker_cli: Docker, name: str, *args: str) -> Iterator[str]:
    """`docker run -d` on the host network, read-only root and tmpfs /tmp; removed afterwards."""
    docker_cli.run("run", "-d", "--name", name, "--network", "host", "--read-only", "--tmpfs", "/tmp", *args)
    try:
        yield name
    finally:
        docker_cli.run("rm", "-f", "-v", name, check=False)


def run_once(docker_cli: Docker, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return docker_cli.run(
        "run",
        "--rm",
        "--network",
        "host",
        "--read-only",
        "--tmpfs",
        "/tmp",
        *args,
        timeout=timeout,
        check=False,
    )


HEALTH = ("--health-interval", "1s", "--health-start-period", "60s", "--health-retries", "3")


def test_the_image_is_small_non_root_and_holds_one_venv_and_no_build_tools(
    docker_cli: Docker, built: Built
) -> None:
    image, base = docker_cli.inspect(built.image), docker_cli.inspect(built.base)
    added = image["Size"] - base["Size"]
    print(
        f"\nimage {image['Size'] / 1e6:.1f} MB, base {base['Size'] / 1e6:.1f} MB, added {added / 1e6:.1f} MB"
    )
    assert added <= ADDED_LAYERS_GOAL
    # built on the debootstrapped base this daemon imported: no image came from a registry
    assert image["RootFS"]["Layers"][0] == base["RootFS"]["Layers"][0] and len(base["RootFS"]["Layers"]) == 1
    history = json.loads(
        "["
        + ",".join(
            docker_cli.run(
                "history", "--no-trunc", "--human=false", "--format", "{{json .}}", built.image
            ).stdout.split("\n")[:-1]
        )
        + "]"
    )
    sized = [entry for entry in history if int(entry["Size"]) > 0]
    # the base, the user, the venv: no dead COPY of wheels, no layer that a later `rm` hides
    assert len(sized) == 3, [entry["CreatedBy"][:80] for entry in sized]
    config = image["Config"]
    assert config["User"] == "999:999"
    assert config["Entrypoint"] == ["gpubadge"] and config["Cmd"] == ["serve"]
    assert config["Healthcheck"]["Test"] == ["CMD", "gpubadge", "healthcheck"]
    look = run_once(
        docker_cli,
        "--user",
        "0",
        "--entrypoint",
        "/bin/sh",
        built.image,
        "-c",
        "find / -xdev \\( -name '*.whl' -o -path '*/.cache/pip' -o -name 'site-packages' -path '/usr/*' \\) -print;"
        " for tool in pip pip3 gcc cc make ld; do command -v $tool; done;"
        " ls /opt/gpubadge/lib/python3*/site-packages | grep -E '^(pip|setuptools|wheel)$';"
        " /opt/gpubadge/bin/python3 -c 'import gpubadge, web, store, scanner, agent, placement'",
    )
    assert look.returncode == 0 and look.stdout == "", (look.stdout, look.stderr)


def test_serve_read_only_on_a_volume_turns_healthy_answers_and_scans_its_own_image(
    docker_cli: Docker, built: Built, registry: LocalRegistry, push: Pusher
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = [
        *("-e", f"GPUBADGE_PORT={port}"),  # not the image's 8080: the health check must follow it
        *("-e", f"GPUBADGE_INTAKE_PORT={free_port()}"),  # nor its 8081 (the host's network)
        # reports attached as referrers: the push path writes its blob under the tmpfs /tmp
        *("-e", f'GPUBADGE_REGISTRIES=[{{"host": "{registry.host}", "push_anonymous": true}}]'),
        *("-e", "GPUBADGE_ATTACH_REPORTS=true"),
        *("-e", f"GPUBADGE_API_TOKEN={API_TOKEN}"),
        *("-e", f"GPUBADGE_AGENT_TOKEN={AGENT_TOKEN}"),
    ]
    auth = {"Authorization": f"Bearer {API_TOKEN}"}
    volume = f"gbdata{port}"
    try:
        with container(docker_cli, f"serve{port}", *HEALTH, "-v", f"{volume}:/data", *env, built.image):
            docker_cli.wait_healthy(f"serve{port}")
            page = call("GET", f"{url}/")
            assert page.status == 200 and "text/html" in page.headers["Content-Type"]
            assert call("GET", f"{url}/api/openapi.json").status == 200
            assert call("GET", f"{url}/metrics").status == 200

            digest = push(gpu_busybox_image(), "image-test/cuda:12")
            queued = call(
                "POST", f"{url}/api/scans", {"ref": f"{registry.host}/image-test/cuda:12"}, headers=auth
            )
            assert queued.status == 202, queued.text
            assert finished(url, queued.body["id"], 60)["state"] == "done"
            report = by_ref(url, f"{registry.host}/image-test/cuda:12").body
            assert report["digest"] == digest
            (gpu,) = report["platforms"]
            assert gpu["badges"] == ["nvidia-gpu", "cuda-12.2", "no-libc"]
            attached = wait_metric(
                url, "gpubadge_referrer_attach_total", '{result="attached"}', 1, timeout=60
            )
            assert attached >= 1, docker_cli.run("logs", f"serve{port}").stderr[-3000:]

            # gpubadge's own image: pushed by Docker itself, scanned by gpubadge.
            target = f"{registry.host}/gpubadge/gpubadge:airgapped"
            docker_cli.run("tag", built.image, target)
            docker_cli.run("push", target, timeout=300)
            manifest = registry_manifest(registry, "gpubadge/gpubadge", "airgapped")
            queued = call("POST", f"{url}/api/scans", {"ref": target}, headers=auth)
            assert queued.status == 202, queued.text
            assert finished(url, queued.body["id"], 120)["state"] == "done"
            own = by_ref(url, target).body
            (platform,) = own["platforms"]
            image = docker_cli.inspect(built.image)
            assert platform["platform"] == f"{image['Os']}/{image['Architecture']}"
            assert platform["gpu"]["required"] is False and "nvidia-gpu" not in platform["badges"]
            assert platform["libc"]["flavour"] == "glibc" and "glibc" in platform["badges"]
            assert platform["libc"]["distro"].startswith("Debian GNU/Linux")
            real = [(layer["digest"], layer["size"]) for layer in manifest["layers"]]
            assert [(layer["digest"], layer["size"]) for layer in platform["layers"]] == real
            assert len(real) == len(image["RootFS"]["Layers"])
            assert platform["config_digest"] == manifest["config"]["digest"] == image["Id"]

            # The agent, as uid 999, through the engine's socket: its group is all it needs.
            socket_gid = docker_cli.daemon.socket_path.stat().st_gid
            agent_args = [
                *("-v", f"{docker_cli.daemon.socket_path}:/var/run/docker.sock"),
                *("-e", f"GPUBADGE_AGENT_TOKEN={AGENT_TOKEN}"),
                built.image,
                *("agent", "--service", url, "--name", "image-node"),
            ]
            refused = run_once(docker_cli, *agent_args, timeout=60)
            assert refused.returncode == 1
            assert "Permission denied" in refused.stderr and f"--group-add {socket_gid}" in refused.stderr
            with container(docker_cli, f"agent{port}", *HEALTH, "--group-add", str(socket_gid), *agent_args):
                docker_cli.wait_healthy(f"agent{port}")  # nothing to probe: healthy while it runs

                def registered() -> bool:
                    servers = call("GET", f"{url}/api/servers", headers=auth).body
                    return "image-node" in json.dumps(servers)

                wait_for(registered, 60, "the agent's server registered")
    finally:
        docker_cli.run("volume", "rm", "-f", volume, check=False)


def registry_manifest(registry: LocalRegistry, repository: str, tag: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://{registry.host}/v2/{repository}/manifests/{tag}",
        headers={
            "Accept": "application/vnd.docker.distribution.manifest.v2+json,"
            " application/vnd.oci.image.manifest.v1+json"
        },
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        manifest: dict[str, Any] = json.loads(response.read())
    return manifest


def finished(service: str, job_id: str, timeout: float) -> dict[str, Any]:
    """The job once it is done or failed: long-polls (the service answers as it lands), bounded."""
    deadline = time.monotonic() + timeout
    while True:
        job = wait_job(service, job_id, wait=min(10.0, max(0.0, deadline - time.monotonic())))
        if job["state"] in ("done", "failed") or time.monotonic() > deadline:
            return job


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout}s")
        time.sleep(0.2)


def test_an_unwritable_data_directory_names_the_path_the_user_and_the_remedy(
    docker_cli: Docker, built: Built, tmp_path: Path
) -> None:
    root_owned = tmp_path / "data"
    root_owned.mkdir(mode=0o755)
    for mount in (["-v", f"{root_owned}:/data"], []):  # a root-owned bind mount; no volume at all
        done = run_once(docker_cli, *mount, built.image, "serve", timeout=60)
        assert done.returncode == 1, done.stderr
        assert "/data is not writable by uid 999" in done.stderr
        assert "mount a volume at /data" in done.stderr and "GPUBADGE_DATABASE_URL" in done.stderr


def journaled_api_settings() -> tuple[str, str]:
    """The intake journal's file and the directory its volume is mounted on, as the journaled
    overlay's StatefulSet gives them to the API container."""
    manifest = REPO_ROOT / "deploy" / "kubernetes-journaled-intake" / "api-statefulset.yaml"
    (stateful,) = [doc for doc in yaml.safe_load_all(manifest.read_text()) if doc]
    (api,) = [each for each in stateful["spec"]["template"]["spec"]["containers"] if each["name"] == "api"]
    (journal,) = [env["value"] for env in api["env"] if env["name"] == "GPUBADGE_INTAKE_JOURNAL"]
    (mounted,) = [mount["mountPath"] for mount in api["volumeMounts"] if mount["name"] == "intake-journal"]
    return journal, mounted


def test_postgres_roles_db_upgrade_worker_api_scan_config_and_export(
    docker_cli: Docker, built: Built, registry: LocalRegistry, push: Pusher, postgres_url: str
) -> None:
    nothing = run_once(docker_cli, built.image, "db", "upgrade")
    assert nothing.returncode == 2 and "GPUBADGE_DATABASE_URL" in nothing.stderr, nothing.stderr
    database = ["-e", f"GPUBADGE_DATABASE_URL={postgres_url}"]
    upgraded = run_once(docker_cli, *database, built.image, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert f"schema at version {latest_version('postgres')}" in upgraded.stdout

    env = [
        *database,
        *("-e", f"GPUBADGE_REGISTRIES={registry.host}"),
        *("-e", f"GPUBADGE_WEBHOOK_SECRET={WEBHOOK_SECRET}"),
    ]
    api_port, metrics_port, intake_port = free_port(), free_port(), free_port()
    api = f"http://127.0.0.1:{api_port}"
    # A second API replica as deploy/kubernetes-journaled-intake/ runs it: its intake journal on a
    # volume of its own (here a tmpfs owned by the image's user, as the claim's fsGroup makes it).
    journal_env, journal_dir = journaled_api_settings()
    # Without that volume (the read-only root): one line naming the path, the user and the remedies.
    unmounted = run_once(
        docker_cli, *env, "-e", f"GPUBADGE_INTAKE_JOURNAL={journal_env}", built.image, "serve", timeout=60
    )
    assert unmounted.returncode == 1, unmounted.stderr
    (line,) = [line for line in unmounted.stderr.splitlines() if line.startswith("gpubadge serve:")]
    assert f"the intake journal {journal_env} cannot be opened" in line
    assert f"is not writable by uid 999 (gid 999): mount a volume at {journal_dir}" in line
    assert "unset GPUBADGE_INTAKE_JOURNAL" in line and "Traceback" not in unmounted.stderr
    journaled_port, journaled_intake = free_port(), free_port()
    with (
        container(
            docker_cli,
            f"worker{metrics_port}",
            *HEALTH,
            *env,
            built.image,
            "worker",
            "--metrics-port",
            str(metrics_port),
        ),
        container(
            docker_cli,
            f"api{api_port}",
            *HEALTH,
            *env,
            "-e",
            f"GPUBADGE_PORT={api_port}",
            "-e",
            f"GPUBADGE_INTAKE_PORT={intake_port}",
            built.image,
            "serve",
            "--workers",
            "0",
        ),
        container(
            docker_cli,
            f"api{journaled_port}",
            *HEALTH,
            *env,
            *("--tmpfs", f"{journal_dir}:uid=999,gid=999,mode=0750"),
            *("-e", f"GPUBADGE_INTAKE_JOURNAL={journal_env}"),
            *("-e", f"GPUBADGE_PORT={journaled_port}", "-e", f"GPUBADGE_INTAKE_PORT={journaled_intake}"),
            built.image,
            "serve",
            "--workers",
            "0",
        ),
    ):
        docker_cli.wait_healthy(f"worker{metrics_port}")  # probes the metrics port, not 8080
        docker_cli.wait_healthy(f"api{api_port}")
        docker_cli.wait_healthy(f"api{journaled_port}")
        digest = push(busybox_image(), "image-test/busybox:1")
        for replica, port, tag in (
            (api_port, intake_port, "1"),
            (journaled_port, journaled_intake, "journaled"),
        ):
            hook = call(  # to the intake port, as registries are told to send
                "POST",
                f"http://127.0.0.1:{port}/hooks/distribution",
                distribution_push(registry.host, "image-test/busybox", digest, tag),
                headers={
                    "Authorization": f"Bearer {WEBHOOK_SECRET}",
                    "Content-Type": "application/vnd.docker.distribution.events.v1+json",
                },
            )
            assert hook.status == 202, hook.text
            # the APIs run no workers: only the worker container can finish the job (the journaled
            # replica's once its mover has carried it into PostgreSQL, where the other replica reads it too)
            assert finished(f"http://127.0.0.1:{replica}", hook.body["jobs"][0], 60)["state"] == "done"
            assert finished(api, hook.body["jobs"][0], 0)["state"] == "done"
        report = by_ref(api, f"{registry.host}/image-test/busybox:1").body
        assert report["digest"] == digest and report["platforms"][0]["badges"] == ["no-libc"]

    shown = run_once(docker_cli, *env, built.image, "config", "--json")
    assert shown.returncode == 0, shown.stderr
    assert postgres_url not in shown.stdout and WEBHOOK_SECRET not in shown.stdout  # secrets redacted
    settings = {row["variable"]: row for row in json.loads(shown.stdout)["settings"]}
    assert settings["GPUBADGE_DATABASE_URL"]["value"] == "[redacted]"
    assert (settings["GPUBADGE_PORT"]["value"], settings["GPUBADGE_PORT"]["source"]) == (8080, "environment")

    scanned = run_once(
        docker_cli, *env, built.image, "scan", "--json", f"{registry.host}/image-test/busybox:1"
    )
    assert scanned.returncode == 0, scanned.stderr
    assert json.loads(scanned.stdout)["digest"] == digest

    exported = run_once(
        docker_cli,
        *env,
        *("--entrypoint", "/bin/sh", built.image, "-c"),
        'gpubadge export sqlite /tmp/reports.db >&2 && /opt/gpubadge/bin/python3 -c "import sqlite3;'
        " print(sqlite3.connect('/tmp/reports.db').execute('SELECT digest FROM images').fetchall())\"",
    )
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.strip() == str([(digest,)])  # the export role reads PostgreSQL, writes /tmp
