"""POST /k8s/admit: real AdmissionReview v1 requests against a running `gpubadge serve`.

Pods are built as dicts with the Kubernetes core/v1 field names and validated with
kubernetes-validate (strict) before they are sent; AdmissionReview itself is not in its
schemas, so the review wrapper follows admission.k8s.io/v1's AdmissionReview type by hand.
Images are pushed with skopeo and scanned through the API first, so every decision comes
from stored reports. Mutations are applied with jsonpatch and the result validated again.
"""

from __future__ import annotations

import base64
import copy
import json
import ssl
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from fixtures import catalog
from fixtures.oci import ImageSpec
from fixtures.registry import LocalRegistry, free_port
from fixtures.service import RunningService, run_service_process
from fixtures.tls import self_signed_certificate
from placement.admission import Pod, review_pod
from placement.exports import export_constraints
from placement.image_facts import ImageFacts
from placement.request import DeployRequest
from scanner.models import GpuFacts, ImageReport, InferredCuda, PlatformReport
from tests.conftest import Pusher
from tests.test_service_e2e import call, metric_values, wait_job

TOKEN = "admission-api-token-2b9a"
K8S_VERSION = "1.33.0"
DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "admission-webhooks.yaml"


def validated(resource: dict[str, Any]) -> dict[str, Any]:
    kubernetes_validate.validate(resource, K8S_VERSION, strict=True)
    return resource


def pod(
    *containers: dict[str, Any],
    init: list[dict[str, Any]] | None = None,
    node_selector: dict[str, str] | None = None,
    terms: list[list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = init
    if node_selector:
        spec["nodeSelector"] = node_selector
    if terms is not None:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": term} for term in terms]
                }
            }
        }
    return validated(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"}, "spec": spec}
    )


def container(name: str, image: str, gpus: int | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "image": image}
    if gpus is not None:
        entry["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return entry


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"key": key, "operator": operator}
    if values:
        entry["values"] = list(values)
    return entry


def review_of(obj: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    """An admission.k8s.io/v1 AdmissionReview as the API server sends it for a Pod."""
    pods = {"group": "", "version": "v1", "resource": "pods"}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": obj.get("kind", "Pod")},
            "resource": pods,
            "requestKind": {"group": "", "version": "v1", "kind": obj.get("kind", "Pod")},
            "requestResource": pods,
            "name": obj["metadata"]["name"],
            "namespace": "ml",
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:ml:deployer", "groups": ["system:authenticated"]},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def admit(
    service: RunningService,
    obj: dict[str, Any],
    query: str = "",
    dry_run: bool = False,
    token: str | None = None,
) -> dict[str, Any]:
    sent = review_of(obj)
    sent["request"]["dryRun"] = dry_run
    headers = {"Authorization": f"Bearer {token}"} if token else None
    reply = call("POST", f"{service.url}/k8s/admit{query}", sent, headers)
    assert reply.status == 200, reply.text
    assert (reply.body["apiVersion"], reply.body["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    response: dict[str, Any] = reply.body["response"]
    assert response["uid"] == sent["request"]["uid"]
    return response


@pytest.fixture(scope="module")
def service(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    env = {"GPUBADGE_REGISTRIES": registry.host, "GPUBADGE_API_TOKEN": TOKEN, "GPUBADGE_ADMISSION": "deny"}
    with run_service_process(tmp_path_factory.mktemp("admission") / "a.db", env=env) as running:
        yield running


@pytest.fixture(scope="module")
def images(service: RunningService, registry: LocalRegistry, push: Pusher) -> dict[str, str]:
    """name -> image reference, pushed with skopeo and scanned through the API."""
    specs: dict[str, tuple[str, ImageSpec | list[ImageSpec]]] = {
        "cuda": ("adm/cuda:12", catalog.cuda_ubuntu(require="cuda>=12.2")),
        "multi": ("adm/multi:1", catalog.multi_arch()),
        "plain": ("adm/plain:1", catalog.plain_glibc()),
    }
    refs = {}
    for name, (path, spec) in specs.items():
        push(spec, path)
        ref = f"{registry.host}/{path}"
        reply = call("POST", f"{service.url}/api/scans", {"ref": ref}, {"Authorization": f"Bearer {TOKEN}"})
        assert wait_job(service.url, str(reply.body["id"]))["state"] == "done"
        refs[name] = ref
    return refs


def test_gpu_image_without_a_gpu_request_is_denied_naming_image_and_evidence(
    service: RunningService, images: dict[str, str]
) -> None:
    response = admit(service, pod(container("train", images["cuda"])))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert response["status"]["code"] == 403
    assert images["cuda"] in message and "'train'" in message
    assert "NVIDIA_REQUIRE_CUDA" in message and "nvidia.com/gpu" in message


def test_gpu_image_with_a_gpu_is_allowed_quietly(service: RunningService, images: dict[str, str]) -> None:
    response = admit(
        service, pod(container("train", images["cuda"], gpus=1), container("side", images["plain"]))
    )
    assert response["allowed"] is True
    assert "warnings" not in response and "patch" not in response


def test_a_long_last_applied_annotation_is_read(service: RunningService, images: dict[str, str]) -> None:
    obj = pod(container("train", images["cuda"]))
    obj["metadata"]["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": "x" * 200_000}
    response = admit(service, obj)
    assert response["allowed"] is False and "nvidia.com/gpu" in response["status"]["message"]


def test_init_containers_are_checked_too(service: RunningService, images: dict[str, str]) -> None:
    obj = pod(container("main", images["plain"]), init=[container("warmup", images["multi"])])
    response = admit(service, obj)
    assert response["allowed"] is False
    assert "init container 'warmup'" in response["status"]["message"]


def test_unknown_images_are_allowed_with_a_warning_and_scanned_for_next_time(
    service: RunningService, registry: LocalRegistry, push: Pusher
) -> None:
    push(catalog.alpine_gpu(), "adm/later:1")
    image = f"{registry.host}/adm/later:1"
    assert admit(service, pod(container("x", image)), dry_run=True, token=TOKEN)["allowed"] is True
    # Issue 30 (5): without the API token, a review is answered from stored reports and queues nothing.
    anonymous = admit(service, pod(container("x", image)))
    assert anonymous["allowed"] is True
    assert any("queued no scan" in warning for warning in anonymous["warnings"]), anonymous
    assert not [
        j
        for j in call("GET", f"{service.url}/api/scans?limit=200").body["jobs"]
        if "adm/later" in j["reference"]
    ]
    response = admit(service, pod(container("x", image)), token=TOKEN)
    assert response["allowed"] is True
    [warning] = response["warnings"]
    assert "adm/later:1" in warning and "not scanned" in warning
    # The answer did not wait, but a scan was queued: once it is done, the next pod is checked.
    assert call("GET", f"{service.url}/api/images/by-ref?ref={image}&wait=20").status == 200
    again = admit(service, pod(container("x", image)))
    assert again["allowed"] is False and "NVIDIA_GPU" in again["status"]["message"]
    outside = admit(service, pod(container("x", "registry.invalid/never/pushed:1")), token=TOKEN)
    assert outside["allowed"] is True and "not scanned" in outside["warnings"][0]
    jobs = call("GET", f"{service.url}/api/scans?limit=200").body["jobs"]
    assert [job["source"] for job in jobs if "adm/later" in job["reference"]] == ["admission"]
    assert not [job for job in jobs if "registry.invalid" in job["reference"]]  # off the allowlist
    # Queued in order: had the dry run (sent first) queued a scan, it would be listed by now.
    assert not [job for job in jobs if "adm/dry" in job["reference"]]


@pytest.mark.parametrize(
    ("selector", "terms", "clause"),
    [
        (None, [[expr("nvidia.com/cuda.runtime-version.major", "In", "11")]], "node affinity term 1"),
        (None, [[expr("nvidia.com/cuda.runtime-version.major", "Lt", "12")]], "runtime-version.major Lt [12]"),
        (
            None,
            [[expr("nvidia.com/cuda.runtime-version.major", "In", "12"), expr("nvidia.com/cuda.runtime-version.minor", "Lt", "2")]],
            "runtime-version.minor Lt [2]",
        ),
        ({"nvidia.com/cuda.runtime-version.full": "11.8"}, None, "nodeSelector nvidia.com/cuda.runtime-version.full=11.8"),
        (
            None,
            [[expr("nvidia.com/cuda.runtime-version.major", "In", "10")], [expr("nvidia.com/cuda.runtime-version.major", "In", "11")]],
            "node affinity term 2",
        ),
    ],
)  # fmt: skip
def test_affinity_that_reaches_only_failing_nodes_is_denied_with_requirement_and_clause(
    service: RunningService,
    images: dict[str, str],
    selector: dict[str, str] | None,
    terms: list[list[dict[str, Any]]] | None,
    clause: str,
) -> None:
    response = admit(
        service, pod(container("train", images["cuda"], gpus=1), node_selector=selector, terms=terms)
    )
    assert response["allowed"] is False, response
    message = response["status"]["message"]
    assert "cuda>=12.2" in message and clause in message
    assert "no node the pod may be scheduled on can run it" in message


@pytest.mark.parametrize(
    "terms",
    [
        [[expr("nvidia.com/cuda.runtime-version.major", "Gt", "11")]],
        [[expr("nvidia.com/cuda.runtime-version.major", "In", "11")], [expr("nvidia.com/cuda.runtime-version.major", "In", "12")]],
        [[expr("nvidia.com/cuda.runtime-version.major", "In", "12"), expr("nvidia.com/cuda.runtime-version.minor", "Gt", "1")]],
        [[expr("nvidia.com/gpu.product", "In", "NVIDIA-H100-80GB-HBM3")]],
        [[expr("nvidia.com/cuda.runtime-version.major", "DoesNotExist")]],
    ],
)  # fmt: skip
def test_affinity_that_may_reach_a_passing_node_is_allowed(
    service: RunningService, images: dict[str, str], terms: list[list[dict[str, Any]]]
) -> None:
    response = admit(service, pod(container("train", images["cuda"], gpus=1), terms=terms))
    assert response["allowed"] is True, response


def test_node_architecture_the_image_lacks_is_denied(service: RunningService, images: dict[str, str]) -> None:
    response = admit(
        service,
        pod(container("train", images["cuda"], gpus=1), node_selector={"kubernetes.io/arch": "arm64"}),
    )
    assert response["allowed"] is False
    assert "kubernetes.io/arch arm64, the image has amd64" in response["status"]["message"]
    multi = admit(
        service,
        pod(container("train", images["multi"], gpus=1), node_selector={"kubernetes.io/arch": "arm64"}),
    )
    assert multi["allowed"] is True


def test_mutation_adds_gpu_limit_and_affinity_and_the_result_is_valid_and_admitted(
    service: RunningService, images: dict[str, str]
) -> None:
    original = pod(container("train", images["cuda"]), container("side", images["plain"]))
    response = admit(service, original, "?mutate=true")
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    operations = json.loads(base64.b64decode(response["patch"]))
    patched = validated(jsonpatch.apply_patch(copy.deepcopy(original), operations))
    train, side = patched["spec"]["containers"]
    assert train["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert "resources" not in side
    affinity = patched["spec"]["affinity"]
    report = call("GET", f"{service.url}/api/images/by-ref?ref={images['cuda']}").body
    exported = export_constraints(
        ImageFacts.from_report(ImageReport.model_validate(report)), DeployRequest(), [], "kubernetes"
    )
    assert (
        affinity == exported["affinity"]
    )  # placement's kubernetes export, as is (no fleet: no GPU products)
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # Independently: the terms reach CUDA 12.2+ and 13+ nodes on amd64, and not CUDA 12.1.
    assert any(
        expr("nvidia.com/cuda.runtime-version.minor", "Gt", "1") in t["matchExpressions"] for t in terms
    )
    assert all(expr("kubernetes.io/arch", "In", "amd64") in t["matchExpressions"] for t in terms)
    assert admit(service, patched)["allowed"] is True  # the validating webhook agrees with the mutation
    assert admit(service, original, "/mutate")["patch"] == response["patch"]  # the path form, for configs


def test_mutation_leaves_pods_that_say_more_alone(service: RunningService, images: dict[str, str]) -> None:
    obj = pod(
        container("train", images["cuda"], gpus=2),
        terms=[[expr("nvidia.com/cuda.runtime-version.major", "Gt", "12")]],
    )
    response = admit(service, obj, "?mutate=true")
    assert response["allowed"] is True and "patch" not in response
    existing_limits = pod({"name": "t", "image": images["cuda"], "resources": {"limits": {"memory": "1Gi"}}})
    operations = json.loads(base64.b64decode(admit(service, existing_limits, "?mutate=true")["patch"]))
    patched = validated(jsonpatch.apply_patch(copy.deepcopy(existing_limits), operations))
    assert patched["spec"]["containers"][0]["resources"]["limits"] == {"memory": "1Gi", "nvidia.com/gpu": "1"}


def test_metrics_count_decisions(service: RunningService, images: dict[str, str]) -> None:
    admit(service, pod(container("train", images["cuda"])))
    admit(service, pod(container("train", images["cuda"])), "?mutate=true")
    counted = metric_values(call("GET", f"{service.url}/metrics").text, "gpubadge_admission_reviews_total")
    # prometheus_client writes a sample's labels in name order
    assert counted['{decision="denied",webhook="validate"}'] >= 1
    assert counted['{decision="patched",webhook="mutate"}'] >= 1


def test_non_pods_and_deletes_are_allowed_and_bad_reviews_refused(service: RunningService) -> None:
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}}
    sent = review_of(deployment)
    sent["request"]["kind"] = {"group": "apps", "version": "v1", "kind": "Deployment"}
    reply = call("POST", f"{service.url}/k8s/admit", sent)
    assert reply.status == 200 and reply.body["response"]["allowed"] is True
    nested = (
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":'
        + b"[" * 200
        + b"]" * 200
        + b"}"
    )
    for body in (
        b"{",
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"},
        {"kind": "x"},
        nested,
    ):
        bad = call("POST", f"{service.url}/k8s/admit", body)
        assert bad.status == 400 and "error" in bad.body, bad.text


def test_warn_mode_turns_the_gpu_denial_into_a_warning() -> None:
    facts = GpuFacts(required=True, signals=["NVIDIA_GPU"])
    report = ImageReport(
        reference="r/x:1", digest="sha256:" + "a" * 64, platforms=[PlatformReport(platform="linux/amd64", digest="sha256:" + "a" * 64, gpu=facts)]
    )  # fmt: skip
    obj = Pod.model_validate(pod(container("c", "r/x:1")))
    assert not review_pod(obj, {"r/x:1": report}, mode="deny").allowed
    warned = review_pod(obj, {"r/x:1": report}, mode="warn")
    assert warned.allowed and "needs an NVIDIA GPU (NVIDIA_GPU)" in warned.warnings[0]


def test_a_declared_image_carrying_a_newer_cuda_is_flagged_with_its_driver_floor() -> None:
    setter = "/usr/lib/python3/dist-packages/torch/version.py: torch 2.9.1+cu130, cuda = '13.0'"
    facts = GpuFacts(
        required=True,
        signals=["CUDA_VERSION"],
        cuda_version="12.8",
        inferred=InferredCuda(cuda="13.0", set_by=setter),
    )
    digest = "sha256:" + "c" * 64
    report = ImageReport(reference="r/cu130:1", digest=digest, platforms=[PlatformReport(platform="linux/amd64", digest=digest, gpu=facts)])  # fmt: skip
    review = review_pod(Pod.model_validate(pod(container("c", "r/cu130:1", gpus=1))), {"r/cu130:1": report})
    assert review.allowed
    assert any(
        f"declares CUDA 12.8, but carries the newer CUDA 13.0 ({setter}): needs driver >= 580" in w
        for w in review.warnings
    ), review.warnings


def test_deploy_manifests_are_valid_webhook_configurations() -> None:
    documents = [doc for doc in yaml.safe_load_all(DEPLOY.read_text()) if doc]
    kinds = {doc["kind"]: doc for doc in documents}
    assert set(kinds) == {"Service", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"}
    for document in documents:
        validated(document)
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        [hook] = kinds[kind]["webhooks"]
        assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "NoneOnDryRun"
        assert hook["timeoutSeconds"] <= 5
    assert (
        kinds["MutatingWebhookConfiguration"]["webhooks"][0]["clientConfig"]["service"]["path"]
        == "/k8s/admit/mutate"
    )


def test_https_listener_for_the_api_server(
    registry: LocalRegistry, tmp_path: Path, images: dict[str, str]
) -> None:
    """The API server calls webhooks over TLS only: the admission endpoint on its own HTTPS port."""
    cert, key = self_signed_certificate(tmp_path)
    tls_port = free_port()
    env = {
        "GPUBADGE_REGISTRIES": registry.host,
        "GPUBADGE_ADMISSION_TLS_PORT": str(tls_port),
        "GPUBADGE_ADMISSION_TLS_CERT": str(cert),
        "GPUBADGE_ADMISSION_TLS_KEY": str(key),
    }
    with run_service_process(tmp_path / "tls.db", env=env):
        context = ssl.create_default_context(cafile=str(cert))
        body = json.dumps(review_of(pod(container("x", images["plain"])))).encode()
        request = urllib.request.Request(
            f"https://127.0.0.1:{tls_port}/k8s/admit", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, context=context, timeout=20) as reply:
            answer = json.loads(reply.read())
        assert answer["response"]["allowed"] is True
        # Only the admission endpoint is served there.
        probe = urllib.request.Request(f"https://127.0.0.1:{tls_port}/api/images")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(probe, context=context, timeout=20)
        assert refused.value.code == 404


def test_mutation_turns_brand_clauses_into_the_fleets_products() -> None:
    """With the fleet's GPUs known, NVIDIA's brand escape terms become nvidia.com/gpu.product lists."""
    from fixtures.catalog import cuda_images
    from placement.exports.core import KnownGpu
    from scanner.facts.gpu import gpu_facts

    require = cuda_images()[1]["NVIDIA_REQUIRE_CUDA"]
    facts = gpu_facts({"config": {"Env": [f"NVIDIA_REQUIRE_CUDA={require}", "CUDA_VERSION=12.2.2"]}})
    digest = "sha256:" + "b" * 64
    report = ImageReport(reference="r/cuda:12", digest=digest, platforms=[PlatformReport(platform="linux/amd64", digest=digest, gpu=facts)])  # fmt: skip
    obj = pod(container("c", "r/cuda:12"))
    fleet = [KnownGpu("Tesla T4", "Tesla", 15360, "7.5")]
    review = review_pod(Pod.model_validate(obj), {"r/cuda:12": report}, mutate=True, fleet=fleet)
    patched = validated(jsonpatch.apply_patch(copy.deepcopy(obj), review.patch))
    terms = patched["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    products = [e for t in terms for e in t["matchExpressions"] if e["key"] == "nvidia.com/gpu.product"]
    assert products and all("Tesla-T4" in e["values"] for e in products)
    assert len(terms) > 2  # the CUDA terms, plus the driver-branch escapes for the fleet's Tesla
