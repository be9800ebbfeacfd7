"""NFD's rule semantics (placement.nfd.match) against NFD's documented examples and real-shaped nodes.

The examples are NFD's own (docs/usage/customization-guide.md, docs/usage/image-compatibility.md);
the expected outcomes follow what that documentation and NFD's evaluator say. The nodes are
NodeFeature objects shaped like nfd-worker's (with GPU Feature Discovery's labels in
`local.label`): a GPU node, a CPU node, and a GPU node whose driver is too old.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures import catalog
from placement.exports.nfd import compatibility_spec
from placement.inventory import parse_inventory
from placement.nfd.features import FeaturesError, from_server, parse_node_features
from placement.nfd.match import MatchError, evaluate_expression, evaluate_rule, evaluate_spec, parse_version
from placement.nfd.schema import GroupRule, MatchExpression, load_spec
from scanner.facts.gpu import gpu_facts
from scanner.models import ImageReport, PlatformReport

Expr = MatchExpression


def node(
    *, gpu: bool, driver: str | None = None, cuda: str | None = None, modules: tuple[str, ...] = ()
) -> str:
    """A NodeFeature object as nfd-worker publishes it (YAML)."""
    devices: list[dict[str, Any]] = [
        {"attributes": {"class": "0600", "vendor": "8086", "device": "1237"}},  # host bridge
        {"attributes": {"class": "0200", "vendor": "15b3", "device": "101b"}},  # ConnectX NIC
    ]
    if gpu:
        devices.append({"attributes": {"class": "0302", "vendor": "10de", "device": "2330"}})  # H100 SXM
    labels = {"feature.node.kubernetes.io/kernel-version.full": "5.15.0-91-generic"}
    if driver:
        labels["nvidia.com/cuda.driver-version.full"] = driver
        labels["nvidia.com/cuda.driver-version.major"] = driver.split(".")[0]
    if cuda:
        labels["nvidia.com/cuda.runtime-version.full"] = cuda
    document = {
        "apiVersion": "nfd.k8s-sigs.io/v1alpha1",
        "kind": "NodeFeature",
        "metadata": {"name": "worker-abc12", "labels": {"nfd.node.kubernetes.io/node-name": "worker-1"}},
        "spec": {
            "features": {
                "flags": {
                    "kernel.loadedmodule": {"elements": {m: {} for m in ("ip_tables", "overlay", *modules)}},
                    "cpu.cpuid": {"elements": {"AVX": {}, "AVX2": {}, "AVX512F": {}, "SSE4": {}}},
                },
                "attributes": {
                    "cpu.model": {"elements": {"vendor_id": "Intel", "family": "6", "id": "143"}},
                    "kernel.version": {
                        "elements": {"full": "5.15.0-91-generic", "major": "5", "minor": "15"}
                    },
                    "local.label": {"elements": labels},
                },
                "instances": {"pci.device": {"elements": devices}},
            },
            "labels": {},
        },
    }
    return yaml.safe_dump(document)


GPU_NODE = node(
    gpu=True, driver="550.107.02", cuda="12.4", modules=("nvidia", "nvidia_uvm", "nvidia_modeset")
)
CPU_NODE = node(gpu=False)
OLD_DRIVER_NODE = node(gpu=True, driver="470.82.01", cuda="11.4", modules=("nvidia",))


def cuda_image_spec(require: str) -> Any:
    env = catalog.cuda_ubuntu(require=require).env
    gpu = gpu_facts({"config": {"Env": [f"{k}={v}" for k, v in env.items()]}})
    report = ImageReport(
        reference="r/cuda:12",
        digest="sha256:" + "a" * 64,
        platforms=[PlatformReport(platform="linux/amd64", digest="sha256:" + "a" * 64, gpu=gpu)],
    )
    spec = compatibility_spec(report)
    assert spec is not None
    return spec


# --------------------------------------------------------------- gpubadge's artifact on three nodes


def test_gpu_node_meets_both_sets() -> None:
    spec = cuda_image_spec("cuda>=12.2 brand=tesla,driver>=470,driver<471")
    result = evaluate_spec(spec, parse_node_features(GPU_NODE).features, "worker-1")
    assert result.compatible, [s.reasons() for s in result.sets]
    assert [s.tag for s in result.sets] == ["nvidia-gpu", "nvidia-gfd"]


def test_cpu_node_fails_and_says_why() -> None:
    spec = cuda_image_spec("cuda>=12.2")
    parsed = parse_node_features(CPU_NODE)
    assert parsed.name == "worker-1"
    result = evaluate_spec(spec, parsed.features, parsed.name)
    assert result.verdict == "no-match"
    gpu_set, gfd_set = result.sets
    assert gpu_set.reasons() == [
        "rule nvidia-gpu: pci.device: none of 2 elements has vendor In 10de; pci.device: none of 2 elements has class In 0300, 0302",
        "rule nvidia-driver: kernel.loadedmodule: nvidia is absent; needs Exists",
    ]
    assert gfd_set.reasons() == [
        "rule NVIDIA_REQUIRE_CUDA: local.label: nvidia.com/cuda.runtime-version.full is absent; needs Ge 12.2 (version)"
    ]


def test_gpu_node_with_a_too_old_driver_fails_the_gfd_set_only() -> None:
    spec = cuda_image_spec("cuda>=12.2 brand=tesla,driver>=470,driver<471")
    result = evaluate_spec(spec, parse_node_features(OLD_DRIVER_NODE).features)
    gpu_set, gfd_set = result.sets
    assert gpu_set.verdict == "match"
    assert gfd_set.verdict == "no-match"
    assert gfd_set.reasons() == [
        "rule NVIDIA_REQUIRE_CUDA: local.label: nvidia.com/cuda.runtime-version.full is '11.4'; needs Ge 12.2 (version)"
    ]
    # `--tags nvidia-gpu` evaluates only what validate-node can check today.
    assert evaluate_spec(spec, parse_node_features(OLD_DRIVER_NODE).features, tags=["nvidia-gpu"]).compatible


def test_like_validate_node_without_the_local_source() -> None:
    """validate-node runs no `local` source: the GFD set fails there with 'feature not available'."""
    features = parse_node_features(GPU_NODE).features
    without_local = features.model_copy(
        update={"attributes": {k: v for k, v in features.attributes.items() if k != "local.label"}}
    )
    result = evaluate_spec(cuda_image_spec("cuda>=12.2"), without_local)
    assert [s.verdict for s in result.sets] == ["match", "no-match"]
    assert result.sets[1].reasons() == [
        "rule NVIDIA_REQUIRE_CUDA: local.label: feature not available on this node"
    ]


def test_inventory_servers_are_evaluated_from_derived_features() -> None:
    inventory = parse_inventory(Path("fixtures/fleet.yaml").read_text())
    by_name = {server.name: server for server in inventory.servers}
    spec = cuda_image_spec("cuda>=12.2")
    h100 = from_server(by_name["h100-a"])
    assert evaluate_spec(spec, h100.features, h100.name).compatible
    cpu = next(server for server in inventory.servers if not server.gpus)
    verdict = evaluate_spec(spec, from_server(cpu).features, cpu.name)
    assert verdict.sets[0].verdict == "no-match"
    assert "kernel.loadedmodule: nvidia is absent" in " ".join(verdict.sets[0].reasons())


# --------------------------------------------------------------- NFD's documented examples


DOC_MATCH_ANY = GroupRule.model_validate(
    yaml.safe_load("""
name: nics
matchAny:
  - matchFeatures:
      - feature: kernel.loadedmodule
        matchExpressions:
          kmod-1: {op: Exists}
      - feature: pci.device
        matchExpressions:
          vendor: {op: In, value: ["0eee"]}
          class: {op: In, value: ["0200"]}
  - matchFeatures:
      - feature: kernel.loadedmodule
        matchExpressions:
          kmod-2: {op: Exists}
      - feature: pci.device
        matchExpressions:
          vendor: {op: In, value: ["0fff"]}
          class: {op: In, value: ["0200"]}
""")
)


def features(modules: list[str], devices: list[dict[str, str]], **attributes: dict[str, str]) -> Any:
    return parse_node_features(
        yaml.safe_dump(
            {
                "flags": {
                    "kernel.loadedmodule": {"elements": {m: {} for m in modules}},
                    "cpu.cpuid": {"elements": {"AVX2": {}, "SSE4": {}}},
                },
                "attributes": {name.replace("_", "."): {"elements": v} for name, v in attributes.items()},
                "instances": {"pci.device": {"elements": [{"attributes": d} for d in devices]}},
            }
        )
    ).features


@pytest.mark.parametrize(
    ("modules", "devices", "matched"),
    [
        (["kmod-1"], [{"vendor": "0eee", "class": "0200"}], True),
        (["kmod-2"], [{"vendor": "0fff", "class": "0200"}], True),
        (["kmod-1"], [{"vendor": "0fff", "class": "0200"}], False),  # each alternative needs its own pair
        (
            ["kmod-1", "kmod-2"],
            [{"vendor": "0eee", "class": "0300"}, {"vendor": "0fff", "class": "0200"}],
            True,
        ),
        (
            ["kmod-1"],
            [{"vendor": "0eee", "class": "0300"}, {"vendor": "1234", "class": "0200"}],
            False,
        ),  # not one device
    ],
)
def test_documented_match_any(modules: list[str], devices: list[dict[str, str]], matched: bool) -> None:
    assert evaluate_rule(DOC_MATCH_ANY, features(modules, devices)).matched is matched


def test_documented_image_compatibility_example() -> None:
    from tests.test_nfd_schema import DOCUMENTED_EXAMPLE

    spec, _ = load_spec(DOCUMENTED_EXAMPLE)
    good = features(["vfio-pci"], [{"vendor": "0fff", "class": "0200"}], cpu_model={"vendor_id": "AMD"})
    assert evaluate_spec(spec, good).compatible
    bad = features(["vfio-pci"], [{"vendor": "0fff", "class": "0200"}], cpu_model={"vendor_id": "ARM"})
    [result] = evaluate_spec(spec, bad).sets
    assert result.reasons() == ["rule kernel and cpu: cpu.model: vendor_id is 'ARM'; needs In Intel, AMD"]


def test_match_name_with_a_regular_expression() -> None:
    rule = GroupRule.model_validate(
        {
            "name": "avx",
            "matchFeatures": [{"feature": "cpu.cpuid", "matchName": {"op": "InRegexp", "value": ["^AVX"]}}],
        }
    )
    assert evaluate_rule(rule, features([], [])).matched  # AVX2 is there
    sse_only = GroupRule.model_validate(
        {
            "name": "x",
            "matchFeatures": [
                {"feature": "cpu.cpuid", "matchName": {"op": "InRegexp", "value": ["^AVX512"]}}
            ],
        }
    )
    result = evaluate_rule(sse_only, features([], []))
    assert not result.matched and result.reasons() == ["cpu.cpuid: no element name matches InRegexp ^AVX512"]


# --------------------------------------------------------------- one expression, operator by operator


@pytest.mark.parametrize(
    ("expression", "valid", "value", "expected"),
    [
        (Expr(op="In", value=["a", "b"]), True, "b", True),
        (Expr(op="In", value=["a"]), False, None, False),
        (Expr(op="NotIn", value=["a"]), True, "b", True),
        (Expr(op="NotIn", value=["a"]), False, None, False),  # a missing element is not "not in"
        (Expr(op="InRegexp", value=["^5\\.1[0-9]"]), True, "5.15.0", True),
        (Expr(op="Exists"), True, None, True),
        (Expr(op="DoesNotExist"), True, None, False),
        (Expr(op="DoesNotExist"), False, None, True),
        (Expr(op="Gt", value=["4"]), True, "5", True),
        (Expr(op="Lt", value=["4"]), True, "4", False),
        (Expr(op="GtLt", value=["1", "5"]), True, "5", False),
        (Expr(op="GeLe", value=["1", "5"]), True, "5", True),
        (Expr(op="IsTrue"), True, "true", True),
        (Expr(op="IsFalse"), True, "true", False),
        (Expr(op=""), False, None, True),
        (Expr(op="Ge", value=["525.60.13"], type="version"), True, "550.107.02", True),
        (Expr(op="Ge", value=["525.60.13"], type="version"), True, "525.60.13", True),
        (Expr(op="Ge", value=["535.54.03"], type="version"), True, "535.54", False),
        (Expr(op="Lt", value=["560"], type="version"), True, "570.26", False),
        (Expr(op="Ge", value=["12.2"], type="version"), True, "12.10", True),  # numbers, not text
        (
            Expr(op="Ge", value=["5.15"], type="version"),
            True,
            "5.15.0-91-generic",
            True,
        ),  # pre-release ignored
        (Expr(op="GeLe", value=["12.2", "12.2"], type="version"), True, "12.2.0", True),
        (Expr(op="Gt", value=["2.0"], type="version"), True, "2.0", False),
    ],
)
def test_operators(expression: MatchExpression, valid: bool, value: str | None, expected: bool) -> None:
    assert evaluate_expression(expression, valid, value) is expected


@pytest.mark.parametrize(
    ("expression", "value", "problem"),
    [
        (Expr(op="Gt", value=["4"]), "five", "not a number"),
        (Expr(op="Gt", value=["4", "5"]), "5", "exactly one element"),
        (Expr(op="GtLt", value=["5", "1"]), "3", "must be less than"),
        (Expr(op="In"), "x", "must be non-empty"),
        (Expr(op="Exists", value=["x"]), "x", "must be empty"),
        (Expr(op="Ge", value=["12.2"], type="version"), "12.2.0.1", "not a version"),
        (Expr(op="Ge", value=["1"], type="semver"), "1", "'type' field"),
        (Expr(op="InRegexp", value=["(?=lookahead)"]), "x", "invalid regular expression"),  # RE2, as Go
    ],
)
def test_what_nfd_reports_as_an_error(expression: MatchExpression, value: str, problem: str) -> None:
    with pytest.raises(MatchError, match=problem):
        evaluate_expression(expression, True, value)


def test_an_error_makes_the_rule_an_error_not_a_crash() -> None:
    rule = GroupRule.model_validate(
        {
            "name": "n",
            "matchFeatures": [
                {"feature": "pci.device", "matchExpressions": {"class": {"op": "Gt", "value": ["0300"]}}}
            ],
        }
    )
    result = evaluate_rule(rule, features([], [{"class": "0c03", "vendor": "8086"}]))
    assert result.verdict == "error" and "not a number '0c03'" in (result.error or "")


def test_hostile_regular_expression_runs_in_linear_time() -> None:
    import time

    started = time.monotonic()
    assert not evaluate_expression(Expr(op="InRegexp", value=["^(a+)+$"]), True, "a" * 100_000 + "b")
    assert time.monotonic() - started < 1.0


def test_versions_read_as_nfd_reads_them() -> None:
    assert parse_version("550.107.02") == (550, 107, 2)
    assert parse_version("v1.2") == (1, 2, 0)
    for bad in ("1.2.3.4", "", "1..2", "x1", "1.2-01"):
        with pytest.raises(MatchError):
            parse_version(bad)


def test_flags_and_attributes_are_one_union_and_does_not_exist_needs_both_absent() -> None:
    from placement.nfd.features import AttributeFeatureSet, Features, FlagFeatureSet

    both = Features(
        flags={"x.y": FlagFeatureSet(elements={"a": {}})},
        attributes={"x.y": AttributeFeatureSet(elements={"b": "1"})},
    )
    rule = GroupRule.model_validate(
        {
            "name": "u",
            "matchFeatures": [
                {
                    "feature": "X.Y",
                    "matchExpressions": {"a": {"op": "Exists"}, "b": {"op": "In", "value": ["1"]}},
                }
            ],
        }
    )
    assert evaluate_rule(rule, both).matched  # feature names are case-insensitive, as in NFD
    absent = GroupRule.model_validate(
        {
            "name": "d",
            "matchFeatures": [{"feature": "x.y", "matchExpressions": {"b": {"op": "DoesNotExist"}}}],
        }
    )
    assert not evaluate_rule(absent, both).matched
    flagged = GroupRule.model_validate(
        {
            "name": "f",
            "matchFeatures": [{"feature": "x.y", "matchExpressions": {"a": {"op": "DoesNotExist"}}}],
        }
    )
    assert not evaluate_rule(flagged, both).matched  # a flag counts, though the attributes lack it
    nowhere = GroupRule.model_validate(
        {
            "name": "n",
            "matchFeatures": [{"feature": "x.y", "matchExpressions": {"c": {"op": "DoesNotExist"}}}],
        }
    )
    assert evaluate_rule(nowhere, both).matched


def test_node_feature_documents() -> None:
    listed = parse_node_features(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "List",
                "items": [yaml.safe_load(GPU_NODE), yaml.safe_load(CPU_NODE)],
            }
        )
    )
    assert listed.name == "worker-1" and "pci.device" in listed.features.instances
    for bad in ("[1, 2]", "kind: Pod\nspec: {}\n", "{not json nor yaml"):
        with pytest.raises(FeaturesError):
            parse_node_features(bad)
