"""What gpubadge knows about a GPU image, as an NFD image-compatibility spec. Pure.

`compatibility_spec(report)` returns None for an image (or platform image) that needs no NVIDIA
GPU, else two kinds of compatibility sets:

1. `tag: nvidia-gpu`, what `nfd compat validate-node` can check today: an NVIDIA GPU (a
   `pci.device` with vendor `10de` and class `0300` VGA or `0302` 3D controller, the two classes
   NVIDIA's GPUs report) and the `nvidia` kernel module loaded (`kernel.loadedmodule`).
   `nvidia_uvm` is not required: nvidia-container-cli loads it when a container starts.
2. `tag: nvidia-gfd`, what only GPU Feature Discovery's labels carry (NFD's `local` source,
   feature `local.label`, which validate-node does not read, so its description says it cannot
   evaluate the set yet):
   - every NVIDIA_REQUIRE_* (and a legacy image's `cuda>=X.Y`) as NVIDIA's runtime reads it,
     `cuda` factors on `nvidia.com/cuda.runtime-version.full` (the CUDA level of the driver)
     and `driver` factors on `nvidia.com/cuda.driver-version.full`, compared with
     `type: version` (`=` is `GeLe [v, v]`); space-separated alternatives become `matchAny`;
   - CUDA inferred from the layers (torch, NVIDIA wheels, ...) as NVIDIA's driver floor for it
     (`placement.cuda_needs.driver_floor`), on `nvidia.com/cuda.driver-version.full`.

The artifact never claims more than it checks. An alternative is expressed only when every one
of its factors is: `brand` (NFD has no brand feature), `arch` (GFD splits compute capability
into major and minor labels), `!=`, and values that are not versions NFD can compare are not,
nor is anything after a malformed factor (the runtime may stop with an error there). So a node
that passes a set passes what the set says; what is left out is named in the set's
description, so a node that fails may still run the image through an alternative not
expressed. Fatbin architectures are named there too. A multi-platform index whose platforms
differ gets one `nvidia-gfd` set per distinct requirement, each naming its platforms.

The same report always gives the same bytes (`artifact_yaml`), so a re-scan with the same
verdict finds the artifact it already attached.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from placement import cuda_needs, gpu_code
from placement.cuda_needs import compute_capability_ranges, driver_floor
from placement.exports.core import parse_version
from placement.exports.kubernetes import CC_LABELS
from placement.nfd.schema import (
    VERSION,
    Compatibility,
    FeatureMatcherTerm,
    GroupRule,
    MatchAnyElem,
    MatchExpression,
    Spec,
)
from placement.nfd.write import dump_spec
from placement.nvidia_require import ImageRequirements
from scanner.facts.require_grammar import AllOf, Condition, latent_error
from scanner.models import ImageReport, PlatformReport

GPU_TAG = "nvidia-gpu"
GFD_TAG = "nvidia-gfd"
LABEL_FEATURE = "local.label"
CUDA_LABEL = "nvidia.com/cuda.runtime-version.full"
DRIVER_LABEL = "nvidia.com/cuda.driver-version.full"
NVIDIA_PCI_VENDOR = "10de"
GPU_PCI_CLASSES = ("0300", "0302")  # display controller: VGA-compatible, 3D controller
_VERSION_OPS = {">=": "Ge", ">": "Gt", "<=": "Le", "<": "Lt"}
_NFD_VERSION = re.compile(r"^[0-9]+(\.[0-9]+){0,2}$")
_EXAMPLES = 2  # alternatives named per reason in a description


@dataclass(frozen=True)
class _Checks:
    """One platform's GFD rules, what they check and what they leave out (in words)."""

    rules: tuple[GroupRule, ...] = ()
    checked: tuple[str, ...] = ()
    alternatives: tuple[str, ...] = ()  # OR-alternatives left out: a failing node may still run it
    unchecked: tuple[str, ...] = ()  # requirements not checked at all: a passing node must still meet them
    notes: tuple[str, ...] = ()  # facts about the requirements (disabled, refused everywhere)


@dataclass
class _Unexpressed:
    """Alternatives of one variable left out, grouped by why."""

    by_reason: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, text: str) -> None:
        self.by_reason.setdefault(reason, []).append(text)

    def lines(self, variable: str) -> list[str]:
        lines = []
        for reason, texts in self.by_reason.items():
            shown = ", ".join(texts[:_EXAMPLES]) + (", ..." if len(texts) > _EXAMPLES else "")
            noun = "the alternative" if len(texts) == 1 else f"{len(texts)} alternatives such as"
            lines.append(f"{variable}: {noun} {shown} ({reason})")
        return lines


def _nfd_version(value: str) -> str | None:
    """The requirement value as a version NFD compares the same way, or None."""
    if _NFD_VERSION.match(value):
        return value
    parsed = parse_version(value)  # the runtime's reading: trailing zeros ignored
    if parsed is None or len(parsed) > 3:
        return None
    return ".".join(str(part) for part in parsed) or "0"


def _expression(condition: Condition) -> tuple[str, MatchExpression] | str:
    """(label, expression) for one factor, or why it cannot be one."""
    if condition.key == "brand":
        return "NFD has no GPU brand feature"
    if condition.key == "arch":
        return "GFD publishes the compute capability as separate major and minor labels"
    if condition.op == "!=":
        return "NFD's version comparisons have no 'not equal'"
    version = _nfd_version(condition.value)
    if version is None:
        return f"{condition.value} is not a version NFD can compare"
    label = CUDA_LABEL if condition.key == "cuda" else DRIVER_LABEL
    if condition.op == "=":
        return label, MatchExpression(op="GeLe", value=[version, version], type="version")
    return label, MatchExpression(op=_VERSION_OPS[condition.op], value=[version], type="version")  # type: ignore[arg-type]


def _terms(expressions: Sequence[tuple[str, MatchExpression]]) -> list[FeatureMatcherTerm]:
    """Expressions on `local.label`, one term per label use (a label compared twice needs two terms)."""
    terms: list[dict[str, MatchExpression]] = []
    for label, expression in expressions:
        target = next((t for t in terms if label not in t), None)
        if target is None:
            target = {}
            terms.append(target)
        target[label] = expression
    return [FeatureMatcherTerm(feature=LABEL_FEATURE, match_expressions=t) for t in terms]


def _describe(expressions: Sequence[tuple[str, MatchExpression]]) -> str:
    return " and ".join(f"{label} {e.text()}" for label, e in expressions)


def _requirement_rule(
    variable: str, alternatives: Sequence[AllOf]
) -> tuple[GroupRule | None, list[str], list[str]]:
    """One NVIDIA_REQUIRE_* as a rule (sufficient for the runtime), with what it checks and leaves out."""
    expressed: list[tuple[AllOf, list[tuple[str, MatchExpression]]]] = []
    left_out = _Unexpressed()
    malformed = False
    for alternative in alternatives:
        if malformed:
            left_out.add(
                "after a malformed factor, where the runtime may stop with an error", alternative.text
            )
            continue
        problems = [c for c in alternative.conditions if c.error is not None or latent_error(c) is not None]
        if problems:
            malformed = True
            left_out.add("malformed: the runtime stops with an error when it reaches it", alternative.text)
            continue
        translated = [_expression(condition) for condition in alternative.conditions]
        reasons = [t for t in translated if isinstance(t, str)]
        if reasons:
            left_out.add(reasons[0], alternative.text)
            continue
        expressed.append((alternative, [t for t in translated if not isinstance(t, str)]))
    unchecked = left_out.lines(variable)
    if not expressed:
        return None, [], unchecked
    checked = [f"{variable} {alt.text} as {_describe(exprs)}" for alt, exprs in expressed]
    if len(expressed) == 1:
        rule = GroupRule(name=variable, match_features=_terms(expressed[0][1]))
    else:
        rule = GroupRule(
            name=variable, match_any=[MatchAnyElem(match_features=_terms(e)) for _, e in expressed]
        )
    return rule, checked, unchecked


def _platform_checks(platform: PlatformReport) -> _Checks:
    requirements = ImageRequirements.from_gpu_facts(platform.gpu)
    rules: list[GroupRule] = []
    checked: list[str] = []
    alternatives: list[str] = []
    unchecked: list[str] = []
    notes: list[str] = []
    if requirements.disabled:
        notes.append("NVIDIA_DISABLE_REQUIRE is set, so the runtime checks no NVIDIA_REQUIRE_*")
    elif requirements.error is not None:
        notes.append(f"NVIDIA's runtime refuses this image on every host: {requirements.error}")
    for variable, expression in requirements.expressions:
        if expression.always_true:
            continue
        rule, done, left = _requirement_rule(variable, expression.alternatives)
        if rule is not None:
            rules.append(rule)
            alternatives.extend(left)
        else:
            unchecked.extend(left)
        checked.extend(done)
    inferred = platform.gpu.inferred
    if inferred is not None and inferred.cuda:
        floor = driver_floor(inferred.cuda)
        if floor is None:
            unchecked.append(f"CUDA {inferred.cuda} carried in its layers: no known driver floor")
        else:
            version = _nfd_version(floor[0])
            if version is None:
                unchecked.append(f"CUDA {inferred.cuda} found in its layers: {floor[1]}")
            else:
                at_least = MatchExpression(op="Ge", value=[version], type="version")
                rules.append(
                    GroupRule(name="inferred-cuda", match_features=_terms([(DRIVER_LABEL, at_least)]))
                )
                checked.append(
                    f"CUDA {inferred.cuda} found in its layers: {floor[1]}, as {DRIVER_LABEL} {at_least.text()}"
                )
    code_rule = _gpu_code_rule(platform)
    if code_rule is not None:
        rule, text = code_rule
        rules.append(rule)
        checked.append(text)
    return _Checks(tuple(rules), tuple(checked), tuple(alternatives), tuple(unchecked), tuple(notes))


CC_MAJOR_LABEL, CC_MINOR_LABEL = CC_LABELS  # GFD's compute-capability labels


def _gpu_code_rule(platform: PlatformReport) -> tuple[GroupRule, str] | None:
    """Where the image's GPU code runs (`placement.cuda_needs.compute_capability_ranges`, judged by
    `placement.gpu_code`) as GFD's compute-capability labels, one alternative per range, each with the
    driver PTX JIT needs there; None when there is no GPU code to judge."""
    gpu = platform.gpu
    if gpu.archs is None or not gpu.archs.files:
        return None
    ranges = compute_capability_ranges(gpu)
    if ranges is None:
        return None
    alternatives: list[list[tuple[str, MatchExpression]]] = []
    described: list[str] = []
    for low, high, ptx_floor in ranges:
        driver: list[tuple[str, MatchExpression]] = []
        floor_text = ""
        version = _nfd_version(ptx_floor) if ptx_floor else None
        if version is not None:
            driver = [(DRIVER_LABEL, MatchExpression(op="Ge", value=[version], type="version"))]
            floor_text = f" with driver >= {ptx_floor} (PTX JIT)"
        major = (CC_MAJOR_LABEL, MatchExpression(op="In", value=[str(low[0])]))
        if high is None:
            alternatives.append(
                [major, (CC_MINOR_LABEL, MatchExpression(op="Ge", value=[str(low[1])])), *driver]
            )
            alternatives.append([(CC_MAJOR_LABEL, MatchExpression(op="Gt", value=[str(low[0])])), *driver])
            described.append(f"{low[0]}.{low[1]} and newer{floor_text}")
        else:
            minor = (  # NFD refuses a GeLe whose bounds are equal
                MatchExpression(op="In", value=[str(low[1])])
                if low[1] == high[1]
                else MatchExpression(op="GeLe", value=[str(low[1]), str(high[1])])
            )
            alternatives.append([major, (CC_MINOR_LABEL, minor), *driver])
            span = f"{low[0]}.{low[1]}" if low == high else f"{low[0]}.{low[1]}-{high[0]}.{high[1]}"
            described.append(f"{span}{floor_text}")
    if not alternatives:
        alternatives = [[(CC_MAJOR_LABEL, MatchExpression(op="In", value=["none"]))]]
        described = ["no known compute capability"]
    summary = cuda_needs.summary(gpu) or gpu_code.summary(gpu.archs)
    text = (
        f"its GPU code ({summary}) as {CC_MAJOR_LABEL} / {CC_MINOR_LABEL}: compute capability "
        + ", ".join(described)
    )
    if len(alternatives) == 1:
        return GroupRule(name="gpu-code", match_features=_terms(alternatives[0])), text
    return (
        GroupRule(name="gpu-code", match_any=[MatchAnyElem(match_features=_terms(a)) for a in alternatives]),
        text,
    )


def _sentence(items: Sequence[str]) -> str:
    return "; ".join(items) + "."


def _gfd_description(checks: _Checks, platforms: Sequence[str] | None) -> str:
    parts = []
    if platforms:
        parts.append(f"For {', '.join(platforms)}.")
    parts.append(
        "Needs GPU Feature Discovery's labels (NFD's local source, feature local.label). "
        "nfd compat validate-node does not read the local source, so it cannot evaluate this set yet: "
        "its rules fail on every node there."
    )
    parts.append("Checks: " + _sentence(checks.checked))
    if checks.alternatives:
        parts.append(
            "Alternatives not expressed, so a node that fails this set may still run the image through them: "
            + _sentence(checks.alternatives)
        )
    if checks.unchecked:
        parts.append(
            "Not checked, so a node that passes this set must still meet: " + _sentence(checks.unchecked)
        )
    if checks.notes:
        parts.append(_sentence(checks.notes))
    return " ".join(parts)


def _gpu_set(
    gpu_platforms: Sequence[PlatformReport], all_platforms: int, notes: Sequence[str]
) -> Compatibility:
    signals = sorted({signal for p in gpu_platforms for signal in p.gpu.signals})
    inferred = sorted({p.gpu.inferred.cuda for p in gpu_platforms if p.gpu.inferred and p.gpu.inferred.cuda})
    why = f"its config sets {', '.join(signals)}" if signals else "its config asks for one"
    if inferred:
        why += f"; CUDA {', '.join(inferred)} found in its layers"
    parts = [
        f"An NVIDIA GPU (PCI vendor {NVIDIA_PCI_VENDOR}, class {GPU_PCI_CLASSES[0]} VGA or {GPU_PCI_CLASSES[1]} "
        "3D controller) and the nvidia kernel module loaded: what nfd compat validate-node checks today.",
        f"gpubadge found that the image needs an NVIDIA GPU: {why}.",
    ]
    if all_platforms > 1:
        parts.append(f"Platforms that need one: {', '.join(p.platform for p in gpu_platforms)}.")
    if notes:
        parts.append("No rule checks the image's own requirements: " + _sentence(notes))
    rules = [
        GroupRule(
            name="nvidia-gpu",
            match_features=[
                FeatureMatcherTerm(
                    feature="pci.device",
                    match_expressions={
                        "vendor": MatchExpression(op="In", value=[NVIDIA_PCI_VENDOR]),
                        "class": MatchExpression(op="In", value=list(GPU_PCI_CLASSES)),
                    },
                )
            ],
        ),
        GroupRule(
            name="nvidia-driver",
            match_features=[
                FeatureMatcherTerm(
                    feature="kernel.loadedmodule", match_expressions={"nvidia": MatchExpression(op="Exists")}
                )
            ],
        ),
    ]
    return Compatibility(rules=rules, tag=GPU_TAG, description=" ".join(parts))


def compatibility_spec(report: ImageReport) -> Spec | None:
    """The image-compatibility spec for what `report` describes (an index, or one platform image)."""
    gpu_platforms = [p for p in report.platforms if p.gpu.required]
    if report.error is not None or report.pending or not gpu_platforms:
        return None
    groups: dict[str, tuple[_Checks, list[str]]] = {}
    for platform in gpu_platforms:
        checks = _platform_checks(platform)
        key = repr(([r.model_dump_json() for r in checks.rules], checks))
        groups.setdefault(key, (checks, []))[1].append(platform.platform)
    gfd_sets = []
    orphan_notes: list[str] = []
    for checks, platforms in groups.values():
        named = platforms if len(groups) > 1 else None
        if checks.rules:
            gfd_sets.append(
                Compatibility(
                    rules=list(checks.rules), tag=GFD_TAG, description=_gfd_description(checks, named)
                )
            )
        else:
            prefix = f"for {', '.join(platforms)}: " if named else ""
            orphan_notes.extend(prefix + note for note in (*checks.unchecked, *checks.notes))
    gpu_set = _gpu_set(gpu_platforms, len(report.platforms), orphan_notes)
    return Spec(version=VERSION, compatibilities=[gpu_set, *gfd_sets])


def artifact_yaml(report: ImageReport) -> bytes | None:
    """The artifact's layer: `compatibility_spec` as YAML, checked against NFD's schema; None for no GPU."""
    spec = compatibility_spec(report)
    return None if spec is None else dump_spec(spec)
