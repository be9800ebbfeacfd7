"""Placement against an independent reading of NVIDIA's grammar, over generated cases.

The reference evaluator below is written in this file from the grammar as
/work/shared/reference/nvidia_semantics.md §1.3-1.6 states it (libnvidia-container's
`dsl_evaluate`: space = OR, comma = AND, left to right with short-circuit, a malformed factor is
an error only when evaluation reaches it), independently of placement/nvidia_require.py. A seeded
generator builds requirement strings from valid and malformed factors (NVIDIA's real
NVIDIA_REQUIRE_CUDA strings among them, with malformed factors spliced in) and hosts, and every
case compares placement's decision with the reference's: per GPU, per image (several variables),
and through `decide()` over a fleet of those hosts.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from placement.decide import decide
from placement.image_facts import ImageFacts
from placement.inventory import Server
from placement.nvidia_require import DeviceFacts, ImageRequirements, evaluate, evaluate_text
from placement.request import DeployRequest
from scanner.facts.require_grammar import parse_requirement_lenient
from scanner.models import GpuFacts, ImageReport, PlatformReport

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
REAL = sorted(
    {
        i["NVIDIA_REQUIRE_CUDA"]
        for i in json.loads((FIXTURES / "cuda_require_strings.json").read_text())["images"]
    }
)

Result = Literal["satisfied", "unsatisfied", "error"]

# --- the reference evaluator (from the grammar, not from placement) ----------------------------

# dsl.c's operator table, in its order; the run of operator characters selects the first entry
# that the run is a prefix of (strncmp over the run's length), so a lone "!" selects "!=".
OPERATOR_TABLE = ("=", "!=", "<", "<=", ">", ">=")
OPERATOR_CHARS = set("<>=!")
FORMAT_LIMIT = 128  # a false factor formatted "%s %s %s" must fit in 128 bytes (with its NUL)
SATURATED = 2**64 - 1  # strtoumax's overflow value, which dsl.c treats as an error


@dataclass(frozen=True)
class Host:
    cuda: str | None
    driver: str | None
    arch: str | None
    brand: str | None
    visible: bool = True


def ref_version(host: str, op: str, wanted: str) -> bool | None:
    """§1.4: numeric parts compared pairwise; the longer side's leftover counts if it is not all zeros."""
    if set(host) - set("0123456789.") or set(wanted) - set("0123456789."):
        return None
    left, right = re.findall(r"\d+", host), re.findall(r"\d+", wanted)
    if host and wanted and (host.startswith(".") or wanted.startswith(".")):
        return None  # the first part has no digits
    for a_text, b_text in zip(left, right, strict=False):
        a, b = int(a_text), int(b_text)
        if a >= SATURATED or b >= SATURATED:
            return None
        if a != b:
            return {"=": False, "!=": True, "<": a < b, "<=": a < b, ">": a > b, ">=": a > b}[op]
    host_more = any(int(part) for part in left[len(right) :])
    wanted_more = any(int(part) for part in right[len(left) :])
    if op == "!=":
        return host_more or wanted_more
    if op in ("=", "<=", ">=") and not host_more and not wanted_more:
        return True
    if op == "=":
        return False
    if op in ("<", "<="):
        return not host_more and wanted_more
    return host_more and not wanted_more


def ref_factor(factor: str, host: Host) -> bool | None:
    """One KEY OP VALUE factor: True, False, or None for "invalid expression"."""
    start = next((i for i, ch in enumerate(factor) if ch in OPERATOR_CHARS), None)
    if not start:  # no operator, or nothing before it
        return None
    end = start
    while end < len(factor) and factor[end] in OPERATOR_CHARS:
        end += 1
    run, key, value = factor[start:end], factor[:start], factor[end:]
    op = next((entry for entry in OPERATOR_TABLE if entry.startswith(run)), None)
    if op is None or not value:
        return None
    name = key.lower() if key.isascii() else key
    if name not in ("cuda", "driver", "arch", "brand"):
        return None
    known = {"cuda": host.cuda, "driver": host.driver}
    known["arch"] = host.arch if host.visible else None
    known["brand"] = host.brand if host.visible else None
    have = known[name]
    if have is None:
        return True  # the rule returns before it looks at the operator or the value
    if name == "brand":
        result: bool | None = {"=": have.lower() == value.lower(), "!=": have.lower() != value.lower()}.get(
            op
        )
    else:
        result = ref_version(have, op, value)
    if result is False and len(f"{key} {op} {value}") >= FORMAT_LIMIT:
        return None
    return result


def ref_evaluate(text: str, host: Host) -> Result:
    """§1.3: OR-terms left to right; the first false factor ends a term, the first true term wins."""
    result = True
    for term in text.split(" "):
        if not term:
            continue
        finished = True  # the term ran out of factors (all true, or only empty parts)
        for factor in term.split(","):
            if not factor:
                continue
            outcome = ref_factor(factor, host)
            if outcome is None:
                return "error"
            result = outcome
            if not outcome:
                finished = False
                break
        if finished:
            break
    return "satisfied" if result else "unsatisfied"


# --- generated cases ---------------------------------------------------------------------------

VERSIONS = {
    "cuda": ["11.8", "12", "12.0", "12.2", "12.2.0", "12.2.1", "12.4", "12.10", "012.2", "13.0", "12..2"],
    "driver": ["470", "470.57.02", "470.57.2", "525.60.13", "535", "536", "535.104.05", "550.54.15", "999"],
    "arch": ["7.0", "7.5", "8", "8.0", "8.6", "9.0", "10.0", "12.0"],
}
BRAND_VALUES = ["tesla", "nvidia", "geforce", "unknown", "NVIDIA", "QuadroRTX", "titan", "grid"]
MALFORMED = [
    "gpu=h100",
    "foo",
    "=12.2",
    "cuda",
    "cuda==12.2",
    "cuda=>12.2",
    "cuda>=",
    "cuda>=v12.2",
    "cuda>=12.2-rc1",
    "brand>=tesla",
    "brand<nvidia",
    "driver<.5",
    "arch>=99999999999999999999999",
    "cuda>=12.2.99999999999999999999999",
    "driver>=" + "0" * 130 + "999",
    "driver<" + "0" * 130 + "1",
    "CUDA<>12",
    "memory>=40",
]
HOSTS_CUDA = ["11.4", "12.0", "12.2", "12.4", "12.8", "13.0", None]
HOSTS_DRIVER = ["470.57.02", "525.60.13", "535.104.05", "550.54.15", "570.124.06", None]
HOSTS_ARCH = ["7.0", "7.5", "8.0", "8.9", "9.0", "12.0", None]
HOSTS_BRAND = ["Tesla", "Nvidia", "GeForce", "Unknown", "QuadroRTX", "TITAN", None]


def _factor(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.18:
        return rng.choice(MALFORMED)
    key = rng.choice(["cuda", "driver", "arch", "brand"])
    if key == "brand":
        op = rng.choice(["=", "=", "!=", "!"])
        value = rng.choice(BRAND_VALUES)
    else:
        op = rng.choice([*OPERATOR_TABLE, "!"])
        value = rng.choice(VERSIONS[key])
    spelled = key.upper() if rng.random() < 0.1 else key
    return f"{spelled}{op}{value}"


def _requirement(rng: random.Random) -> str:
    if rng.random() < 0.15:  # a real NVIDIA string with a factor spliced in somewhere
        terms = rng.choice(REAL).split(" ")
        position = rng.randrange(len(terms) + 1)
        if rng.random() < 0.5:
            terms.insert(position, _factor(rng))
        else:
            target = rng.randrange(len(terms))
            terms[target] = f"{terms[target]},{_factor(rng)}"
        return " ".join(terms)
    terms = []
    for _ in range(rng.randint(1, 4)):
        factors = [_factor(rng) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.05:
            factors.insert(rng.randrange(len(factors) + 1), "")  # an empty factor: skipped
        terms.append(",".join(factors))
    if rng.random() < 0.05:
        terms.insert(rng.randrange(len(terms) + 1), ",")  # a comma-only term ends evaluation
    if rng.random() < 0.05:
        terms.insert(rng.randrange(len(terms) + 1), "")  # a double space: an empty term, skipped
    return " ".join(terms)


def _host(rng: random.Random) -> Host:
    return Host(
        rng.choice(HOSTS_CUDA),
        rng.choice(HOSTS_DRIVER),
        rng.choice(HOSTS_ARCH),
        rng.choice(HOSTS_BRAND),
        rng.random() > 0.1,
    )


def _facts(host: Host) -> DeviceFacts:
    return DeviceFacts(host.cuda, host.driver, host.arch, host.brand, host.visible)


REQUIREMENTS = [_requirement(random.Random(seed)) for seed in range(2000)]
HOST_TABLE = [_host(random.Random(10_000 + seed)) for seed in range(24)]


def test_generated_table_covers_every_outcome_and_the_lazy_error_cases() -> None:
    """Guards the generator: the table must contain the cases the comparison is about."""
    outcomes = Counter(ref_evaluate(text, host) for text in REQUIREMENTS for host in HOST_TABLE)
    assert min(outcomes.values()) > 5000, outcomes
    lazy = sum(
        1
        for text in REQUIREMENTS
        if any(
            bad in text.split(" ") or any(bad in t.split(",") for t in text.split(" ")) for bad in MALFORMED
        )
        for host in HOST_TABLE
        if ref_evaluate(text, host) == "satisfied"
    )
    assert lazy > 2000  # malformed factors that the runtime never reaches


def test_placement_decides_like_the_grammar_on_every_generated_case() -> None:
    differences = []
    for text in REQUIREMENTS:
        expression = parse_requirement_lenient(text)  # what evaluate_text does, once per string
        for host in HOST_TABLE:
            expected = ref_evaluate(text, host)
            got = evaluate(expression, _facts(host)).outcome
            if got != expected:
                differences.append((text, host, expected, got))
    assert not differences, f"{len(differences)} of {len(REQUIREMENTS) * len(HOST_TABLE)}: {differences[:5]}"
    # evaluate_text (parse + evaluate) gives the same, on a sample
    for text in REQUIREMENTS[:200]:
        for host in HOST_TABLE[:4]:
            assert evaluate_text(text, _facts(host)).outcome == ref_evaluate(text, host)


def test_image_requirements_and_them_together_like_the_runtime() -> None:
    """Several NVIDIA_REQUIRE_* variables are ANDed; each is evaluated lazily on its own."""
    rng = random.Random(99)
    differences = []
    for _ in range(1500):
        texts = [rng.choice(REQUIREMENTS) for _ in range(rng.randint(1, 3))]
        env = {f"NVIDIA_REQUIRE_X{i}": text for i, text in enumerate(texts)}
        image = ImageRequirements.from_gpu_facts(GpuFacts(required=True, env=env))
        for host in rng.sample(HOST_TABLE, 6):
            results = [ref_evaluate(text, host) for text in texts]
            expected = all(result == "satisfied" for result in results)
            verdict = image.check(_facts(host))
            if verdict.ok != expected or (len(texts) == 1 and verdict.outcome != results[0]):
                differences.append((texts, host, results, verdict.outcome))
        if any(ref_evaluate(text, host) == "error" for text in texts for host in HOST_TABLE):
            assert image.warnings  # a clause that can fail is named
    assert not differences, differences[:5]


# Brands whose libnvidia-container name has not changed since 2019, so every runtime version
# compares the same word (placement also checks the older `Unknown` name for newer brands).
STABLE_BRANDS = ["Tesla", "GeForce", "Quadro", "TITAN", None]


@pytest.mark.parametrize("seed", range(4))
def test_decide_over_a_fleet_of_generated_hosts(seed: int) -> None:
    rng = random.Random(seed)
    hosts = [
        Host(
            rng.choice([c for c in HOSTS_CUDA if c]),
            rng.choice([d for d in HOSTS_DRIVER if d]),
            rng.choice(HOSTS_ARCH),
            rng.choice(STABLE_BRANDS),
        )
        for _ in range(40)
    ]
    fleet = [
        Server.model_validate(
            {
                "name": f"host-{n:02d}",
                "driver_version": host.driver,
                "cuda_driver_version": host.cuda,
                "gpus": [
                    {
                        "index": 0,
                        "uuid": f"GPU-{n}",
                        "name": "GPU",
                        "brand": host.brand or "",
                        "memory_mib": 16384,
                        "compute_capability": host.arch or "",
                    }
                ],
            }
        )
        for n, host in enumerate(hosts)
    ]
    for text in rng.sample(REQUIREMENTS, 60):
        gpu = GpuFacts(required=True, env={"NVIDIA_REQUIRE_CUDA": text})
        report = ImageReport(
            reference="generated",
            platforms=[PlatformReport(platform="linux/amd64", digest="sha256:0", gpu=gpu)],
        )
        decision = decide(ImageFacts.from_report(report), DeployRequest(gpus=1), fleet)
        expected = {
            f"host-{n:02d}" for n, host in enumerate(hosts) if ref_evaluate(text, host) == "satisfied"
        }
        assert {entry["server"] for entry in decision.eligible} == expected, text
