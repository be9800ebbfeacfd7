"""deploy/kubernetes/: valid against the Kubernetes OpenAPI schemas (offline, strict), and wired right.

Schema validity alone would pass a manifest that inlines a token or whose Service
selects no pod, so the wiring the README promises is asserted too: secrets only
through secretKeyRef, readiness on /healthz, the roles' arguments accepted by our
own command-line parsers, the agent only on GPU nodes.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agent.main import parse_args as parse_agent_args
from gpubadge.healthcheck import probe_for
from gpubadge.worker import worker_parser
from web.commands import db_parser, serve_parser
from web.settings import ServiceSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = REPO_ROOT / "deploy" / "kubernetes"
# Oldest still-supported minor and the newest the validator knows: the manifests must hold for both.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
SECRET_LIKE = re.compile(r"TOKEN|SECRET|PASSWORD|DATABASE_URL|CREDENTIAL", re.IGNORECASE)


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# The opt-in admission add-on (needs cert-manager; tests/test_admission.py validates its webhooks):
# not part of the base that kustomization.yaml applies.
ADD_ON = ("admission-",)


def _resources() -> list[tuple[str, dict[str, Any]]]:
    """Every resource of the base (and of the Secret example), with its file name."""
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml" or path.name.startswith(ADD_ON):
            continue
        found.extend((path.name, doc) for doc in _documents(path))
    return found


def _by_kind(kind: str, name: str) -> dict[str, Any]:
    matches = [doc for _, doc in _resources() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    pod = workload["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("filename", "resource"), _resources(), ids=lambda value: str(value)[:40])
def test_every_resource_validates_strictly_offline(
    version: str, filename: str, resource: dict[str, Any]
) -> None:
    # strict: an unknown or misspelt field (say `readinessprobe`) fails instead of being ignored
    kubernetes_validate.validate(resource, version, strict=True)


def test_kustomization_applies_every_manifest_but_the_secret_example() -> None:
    kustomization = _documents(MANIFESTS / "kustomization.yaml")[0]
    on_disk = {path.name for path in MANIFESTS.glob("*.yaml") if not path.name.startswith(ADD_ON)}
    on_disk -= {"kustomization.yaml", "secrets.example.yaml"}
    assert set(kustomization["resources"]) == on_disk
    assert "secrets.example.yaml" not in kustomization["resources"]


def test_secrets_are_referenced_never_inlined() -> None:
    secret_keys = {
        (doc["metadata"]["name"], key)
        for _, doc in _resources()
        if doc["kind"] == "Secret"
        for key in doc.get("stringData", {})
    }
    references = 0
    for _, doc in _resources():
        if doc["kind"] == "ConfigMap":
            assert not [key for key in doc["data"] if SECRET_LIKE.search(key)], "a secret in a ConfigMap"
        if doc["kind"] not in ("Deployment", "DaemonSet", "Job"):
            continue
        for container in _containers(doc):
            for env in container.get("env", []):
                if not SECRET_LIKE.search(env["name"]):
                    continue
                assert "value" not in env, f"{doc['metadata']['name']}: {env['name']} is inlined"
                ref = env["valueFrom"]["secretKeyRef"]
                assert (ref["name"], ref["key"]) in secret_keys, f"{ref} is not a documented Secret key"
                references += 1
            assert not [arg for arg in container.get("args", []) if arg.startswith("--token")]
    assert references >= 6  # database URL twice, webhook/api/agent tokens, the agent's token


def test_api_is_replicated_ready_on_healthz_and_behind_the_service() -> None:
    api = _by_kind("Deployment", "gpubadge-api")
    assert api["spec"]["replicas"] >= 2
    (container,) = api["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    serve_args = serve_parser().parse_args(container["args"][1:])
    assert container["args"][0] == "serve" and serve_args.workers == 0
    service = _by_kind("Service", "gpubadge")
    pod_labels = api["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port_names = {port["name"] for port in container["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= port_names
    # the pod's ports are the ones its settings listen on: the API's, and the intake port registries send to
    settings = _by_kind("ConfigMap", "gpubadge-settings")["data"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["http"] == int(settings["GPUBADGE_PORT"])
    assert ports["intake"] == int(settings["GPUBADGE_INTAKE_PORT"])
    (upgrade,) = api["spec"]["template"]["spec"]["initContainers"]
    assert upgrade["args"][0] == "db"
    db_parser().parse_args(upgrade["args"][1:])


def test_workers_and_agent_run_their_roles() -> None:
    workers = _by_kind("Deployment", "gpubadge-workers")
    (container,) = workers["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "worker"
    worker_args = worker_parser().parse_args(container["args"][1:])
    assert worker_args.concurrency >= 1
    probe_port = container["livenessProbe"]["httpGet"]["port"]
    (metrics_port,) = [port for port in container["ports"] if port["name"] == probe_port]
    assert metrics_port["containerPort"] == worker_args.metrics_port  # the probe reaches the worker
    agent = _by_kind("DaemonSet", "gpubadge-agent")
    pod = agent["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (agent_container,) = pod["containers"]
    assert agent_container["args"][0] == "agent"
    parse_agent_args(agent_container["args"][1:])
    for workload in (workers, agent, _by_kind("Deployment", "gpubadge-api")):
        for each in _containers(workload):
            assert each["image"] == "gpubadge"  # one image, every role (kustomize pins the tag)
            assert each["securityContext"]["allowPrivilegeEscalation"] is False


def _merge_by_name(base: list[dict[str, Any]], patch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Strategic merge for lists keyed by `name` (containers, volumes, ports, env, mounts)."""
    merged = {item["name"]: dict(item) for item in base}
    for item in patch:
        merged[item["name"]] = _merge(merged.get(item["name"], {}), item)
    return list(merged.values())


def _merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(patch, list) and all("name" in item for item in base + patch):
        return _merge_by_name(base, patch)
    return patch


def test_the_admission_add_on_patch_fits_the_api_deployment() -> None:
    """The add-on's patch targets this Deployment and its `api` container: merged, it still validates."""
    (patch,) = _documents(MANIFESTS / "admission-api-patch.yaml")
    api = _by_kind("Deployment", "gpubadge-api")
    assert (patch["kind"], patch["metadata"]["name"]) == ("Deployment", api["metadata"]["name"])
    patched = {container["name"] for container in patch["spec"]["template"]["spec"]["containers"]}
    assert patched <= {container["name"] for container in api["spec"]["template"]["spec"]["containers"]}
    merged = _merge(api, patch)
    (container,) = merged["spec"]["template"]["spec"]["containers"]
    assert {"http", "https-admission"} <= {port["name"] for port in container["ports"]}
    assert "GPUBADGE_DATABASE_URL" in {env["name"] for env in container["env"]}  # nothing of ours lost
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(merged, version, strict=True)


WORKLOADS = [
    ("Deployment", "gpubadge-api"),
    ("Deployment", "gpubadge-workers"),
    ("DaemonSet", "gpubadge-agent"),
    ("Job", "gpubadge-rescan-outdated"),
]


def _dockerfile_user() -> tuple[int, int]:
    """The final stage's USER uid:gid, as the image runs every role (tests/test_image.py runs it)."""
    (user,) = [
        line.split()[1]
        for line in (REPO_ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("USER ")
    ]
    uid, gid = user.split(":")
    return int(uid), int(gid)


@pytest.mark.parametrize(("kind", "name"), WORKLOADS)
def test_every_role_runs_as_the_image_proved_non_root_read_only_with_a_tmpfs_tmp(
    kind: str, name: str
) -> None:
    """The same user, read-only root and in-memory /tmp that tests/test_image.py runs each role with."""
    uid, gid = _dockerfile_user()
    workload = _by_kind(kind, name)
    pod = workload["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    for container in _containers(workload):
        context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        assert (context["runAsUser"], context["runAsGroup"], context["runAsNonRoot"]) == (uid, gid, True)
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"] == {"drop": ["ALL"]}
        (tmp,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/tmp"]
        assert volumes[tmp["name"]]["emptyDir"]["medium"] == "Memory"  # tmpfs, as `--tmpfs /tmp`
        # No /data on PostgreSQL: every role here reads GPUBADGE_DATABASE_URL or has no store.
        assert not [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/data"]


@pytest.mark.parametrize(("kind", "name"), WORKLOADS)
def test_probes_reach_what_the_images_healthcheck_probes(
    kind: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kubernetes ignores the image's HEALTHCHECK: its probes must ask the same port and path that
    `gpubadge healthcheck` resolves from the same settings and flags (none where there is nothing)."""
    for key, value in _by_kind("ConfigMap", "gpubadge-settings")["data"].items():
        monkeypatch.setenv(key, value)
    (container,) = _by_kind(kind, name)["spec"]["template"]["spec"]["containers"]
    probe = probe_for(container["args"])
    probes = [container[key]["httpGet"] for key in ("readinessProbe", "livenessProbe") if key in container]
    if probe.url is None:
        assert not probes, f"{name}: a probe where the role serves nothing ({probe.reason})"
        return
    assert probes
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    for http in probes:
        assert probe.url.endswith(f":{ports[http['port']]}{http['path']}"), (probe.url, http)


def test_the_outdated_reports_job_runs_the_sweep_once_per_apply() -> None:
    """`kubectl apply -k` after an upgrade queues the scans of reports an older analysis wrote: the Job
    runs `gpubadge db rescan-outdated` as our parser reads it, against the database, and deletes
    itself after it ends so that the next apply runs it again."""
    job = _by_kind("Job", "gpubadge-rescan-outdated")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"][:2] == ["db", "rescan-outdated"]
    parsed = db_parser().parse_args(container["args"][1:])
    assert parsed.action == "rescan-outdated" and parsed.limit == 10_000 and parsed.follow
    assert "GPUBADGE_DATABASE_URL" in {env["name"] for env in container["env"]}
    assert container["image"] == "gpubadge" and job["spec"]["ttlSecondsAfterFinished"] > 0


def test_the_agent_uses_the_docker_socket_through_its_group_not_root() -> None:
    agent = _by_kind("DaemonSet", "gpubadge-agent")
    pod = agent["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["supplementalGroups"], "the socket's gid, as docker run --group-add"
    (socket_mount,) = [mount for mount in container["volumeMounts"] if mount["name"] == "docker-socket"]
    environment = {env["name"]: env.get("value") for env in container["env"]}
    assert environment["DOCKER_HOST"] == f"unix://{socket_mount['mountPath']}"
    (volume,) = [volume for volume in pod["volumes"] if volume["name"] == "docker-socket"]
    assert volume["hostPath"]["type"] == "Socket"


JOURNALED = REPO_ROOT / "deploy" / "kubernetes-journaled-intake"


def _journaled_resources() -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/kubernetes-journaled-intake/` applies, composed as kustomize does
    for this overlay: the base's resources less what its patches delete, then its own. (Rendered with
    `kubectl kustomize` (kustomize v5.5) when written; CI has no kustomize, so the composition is ours.)"""
    overlay = _documents(JOURNALED / "kustomization.yaml")[0]
    base_dir, *own = overlay["resources"]
    assert (JOURNALED / base_dir).resolve() == MANIFESTS
    base = _documents(MANIFESTS / "kustomization.yaml")[0]
    deleted = []
    for entry in overlay["patches"]:
        patch = yaml.safe_load(entry["patch"])
        assert patch.pop("$patch") == "delete"
        deleted.append((patch["kind"], patch["metadata"]["name"], patch["metadata"]["namespace"]))
    composed = []
    for filename in base["resources"]:
        for doc in _documents(MANIFESTS / filename):
            key = (doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace", base["namespace"]))
            if key in deleted:
                deleted.remove(key)
                continue
            composed.append(doc)
    assert not deleted, f"a patch deletes what the base does not have: {deleted}"
    assert overlay["images"] == base["images"]  # the StatefulSet runs the base's pinned image
    for filename in own:
        composed.extend(_documents(JOURNALED / filename))
    return composed


def test_the_journaled_intake_overlay_validates_strictly_offline() -> None:
    resources = _journaled_resources()
    kinds = [(doc["kind"], doc["metadata"]["name"]) for doc in resources]
    assert ("Deployment", "gpubadge-api") not in kinds  # replaced, not doubled
    assert ("StatefulSet", "gpubadge-api") in kinds
    assert len(kinds) == len(set(kinds))
    for doc in resources:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_journaled_api_is_the_base_api_with_a_journal_on_a_volume_of_its_own() -> None:
    """The StatefulSet's pod is the base Deployment's plus the journal (its setting, its mount, the
    fsGroup that lets the image's user write it), so the two never drift apart; and `serve` accepts
    that setting beside the database URL the pod reads."""
    (stateful,) = [doc for doc in _journaled_resources() if doc["kind"] == "StatefulSet"]
    deployment = _by_kind("Deployment", "gpubadge-api")
    template = copy.deepcopy(stateful["spec"]["template"])
    pod = template["spec"]
    assert pod["securityContext"].pop("fsGroup") == _dockerfile_user()[1]
    (container,) = [each for each in pod["containers"] if each["name"] == "api"]
    (journal_env,) = [env for env in container["env"] if env["name"] == "GPUBADGE_INTAKE_JOURNAL"]
    container["env"].remove(journal_env)
    (claim,) = stateful["spec"]["volumeClaimTemplates"]
    (mount,) = [mount for mount in container["volumeMounts"] if mount["name"] == claim["metadata"]["name"]]
    container["volumeMounts"].remove(mount)
    assert template == deployment["spec"]["template"]
    assert Path(journal_env["value"]).parent == Path(mount["mountPath"])  # on the claim, not the tmpfs
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]  # a journal per replica
    assert stateful["spec"]["replicas"] == deployment["spec"]["replicas"]
    assert stateful["spec"]["selector"] == deployment["spec"]["selector"]
    (headless,) = [
        doc for doc in _journaled_resources() if doc["metadata"]["name"] == stateful["spec"]["serviceName"]
    ]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= stateful["spec"]["template"]["metadata"]["labels"].items()
    settings = ServiceSettings(
        database_url="postgresql://gpubadge@db.example/gpubadge", intake_journal=journal_env["value"]
    )
    assert settings.intake_journal == Path(journal_env["value"])
