"""Evaluate NVIDIA_REQUIRE_* expressions against one GPU, the way nvidia-container-cli does.

The rules follow libnvidia-container (`src/cli/dsl.c` and the rule functions in
`src/cli/configure.c`), because that is the code that refuses to start a container:

* terms are tried left to right; the first fully-true OR-term wins, the first false factor
  ends its AND-term, and a malformed factor is an error only when evaluation reaches it;
* `cuda`, `driver` and `arch` compare numerically component by component; when one side runs
  out, trailing zeros and dots are ignored (`12.2 == 12.2.0`, `470.57.02 == 470.57.2`,
  `470.57.02 > 470`);
* an unknown host value (no driver CUDA version, no visible device for `arch`/`brand`) makes
  the factor true without looking at it;
* `brand` compares case-insensitively and allows only `=` and `!=`.

Besides NVIDIA's own message, a verdict lists the failed clauses in plain words for people.
Image-level rules (which variables count, NVIDIA_DISABLE_REQUIRE, legacy CUDA_VERSION) live in
`ImageRequirements`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from scanner.facts.require_grammar import (
    EXPR_MAX,
    KEYS,
    OPERATORS,
    AllOf,
    Condition,
    Expression,
    digits_value,
    formatted_length,
    latent_error,
    parse_requirement_lenient,
)
from scanner.models import GpuFacts

Outcome = Literal["satisfied", "unsatisfied", "error"]

MAX_REQUIREMENTS = 32  # nvidia-container-cli keeps `char *reqs[32]`; a 33rd is "too many requirements"
_UINTMAX = 2**64 - 1
_VERSION_TEXT = re.compile(r"^[0-9.]*$")
_DIGITS = re.compile(r"[0-9]+")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_CUDA_HINT = ", please update your driver to a newer version, or use an earlier cuda container"
_NEGATION = {">=": "<", ">": "<=", "<=": ">", "<": ">=", "=": "!=", "!=": "="}
_SUBJECT = {"cuda": "driver CUDA", "driver": "driver", "arch": "compute capability", "brand": "brand"}


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """What the runtime knows when it checks one GPU. None means NVML gave nothing (rule is true)."""

    cuda: str | None = None
    driver: str | None = None
    arch: str | None = None
    brand: str | None = None
    device_visible: bool = True


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one or more requirements on one GPU.

    `message` is what nvidia-container-cli would print; `failed` explains it in plain words.
    """

    outcome: Outcome
    message: str = ""
    failed: tuple[str, ...] = ()
    requirement: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "satisfied"


SATISFIED = Verdict("satisfied")


def _lower(text: str) -> str:
    return text.translate(_ASCII_LOWER)


@lru_cache(maxsize=65536)
def compare_version(host: str, op: str, wanted: str) -> bool | None:
    """dsl_compare_version: True/False, or None when either side is not a version (an error)."""
    if not _VERSION_TEXT.match(host) or not _VERSION_TEXT.match(wanted):
        return None
    i, j = 0, 0
    while i < len(host) and j < len(wanted):
        m1 = _DIGITS.match(host, i)
        m2 = _DIGITS.match(wanted, j)
        if m1 is None or m2 is None:
            return None  # strtoumax found no digits (e.g. a leading '.')
        n1, n2 = digits_value(m1.group()), digits_value(m2.group())
        if n1 is None or n2 is None or n1 >= _UINTMAX or n2 >= _UINTMAX:
            return None  # strtoumax saturates to UINTMAX_MAX, which dsl.c treats as an error
        if n1 != n2:
            if op == "=":
                return False
            if op == "!=":
                return True
            return n1 < n2 if op in ("<", "<=") else n1 > n2
        i, j = m1.end(), m2.end()
        while i < len(host) and host[i] == ".":
            i += 1
        while j < len(wanted) and wanted[j] == ".":
            j += 1
    while i < len(host) and host[i] in ".0":
        i += 1
    while j < len(wanted) and wanted[j] in ".0":
        j += 1
    host_left, wanted_left = i < len(host), j < len(wanted)
    if op == "!=":
        return host_left or wanted_left
    if op in ("=", "<=", ">=") and not host_left and not wanted_left:
        return True
    if op == "=":
        return False
    if op in ("<", "<="):
        return not host_left and wanted_left
    return host_left and not wanted_left


def _host_value(key: str, facts: DeviceFacts) -> str | None:
    if key == "cuda":
        return facts.cuda
    if key == "driver":
        return facts.driver
    if not facts.device_visible:
        return None
    return facts.arch if key == "arch" else facts.brand


def evaluate_condition(condition: Condition, facts: DeviceFacts) -> bool | None:
    """One factor, as the C rule functions do it: True, False, or None for "invalid expression"."""
    if condition.key not in KEYS or condition.op not in OPERATORS or not condition.value:
        return None
    host = _host_value(condition.key, facts)
    if host is None:
        return True  # NVML gave nothing or no device is visible: the rule does not look further
    if condition.key == "brand":
        if condition.op == "=":
            return _lower(host) == _lower(condition.value)
        if condition.op == "!=":
            return _lower(host) != _lower(condition.value)
        return None
    return compare_version(host, condition.op, condition.value)


def _error_detail(condition: Condition, facts: DeviceFacts) -> str:
    if condition.error is not None:
        return condition.error
    host = _host_value(condition.key, facts) or ""
    return f"invalid requirement term {condition.text!r}: cannot compare {condition.key} {host!r}"


def evaluate(expression: Expression, facts: DeviceFacts, *, explain: bool = True) -> Verdict:
    """Evaluate one requirement on one GPU with nvidia-container-cli's exact rules (`explain=False`:
    an unsatisfied verdict without the plain-words lines, for callers that only ask whether)."""
    text = expression.text
    if not expression.alternatives:
        return Verdict("satisfied", requirement=text)
    result = True
    for term in expression.alternatives:
        result = True
        for condition in term.conditions:
            outcome = evaluate_condition(condition, facts)
            if outcome is False and formatted_length(condition) >= EXPR_MAX:
                detail = f"requirement term {condition.text!r} is too long for nvidia-container-cli"
                return Verdict("error", "invalid expression", (detail,), text)
            if outcome is None:
                return Verdict("error", "invalid expression", (_error_detail(condition, facts),), text)
            if not outcome:
                result = False
                break
        if result:
            return Verdict("satisfied", requirement=text)
    first = text.split(" ", 1)[0]
    message = f"unsatisfied condition: {first}"
    if first.startswith("cuda>="):
        message += _CUDA_HINT
    return Verdict("unsatisfied", message, explain_failures(expression, facts) if explain else (), text)


def evaluate_text(text: str, facts: DeviceFacts) -> Verdict:
    """Parse leniently and evaluate: malformed factors are errors only when reached, as in the runtime."""
    return evaluate(parse_requirement_lenient(text), facts)


# --- plain words -------------------------------------------------------------------------------


def _branch_of(term: AllOf) -> tuple[int, Condition, Condition] | None:
    """`driver>=N,driver<N+1` in a term is NVIDIA's idiom for "driver branch N"."""
    lower = upper = None
    for condition in term.conditions:
        if (
            condition.key == "driver"
            and condition.value.isdigit()
            and digits_value(condition.value) is not None
        ):
            if condition.op == ">=":
                lower = condition
            elif condition.op == "<":
                upper = condition
    if lower and upper and int(upper.value) == int(lower.value) + 1:
        return int(lower.value), lower, upper
    return None


def _phrase(condition: Condition, facts: DeviceFacts) -> str:
    host = _host_value(condition.key, facts)
    subject = _SUBJECT.get(condition.key, condition.key)
    if condition.key == "brand":
        return f"brand {host} is {'not ' if condition.op == '=' else ''}{condition.value}"
    return f"{subject} {host} {_NEGATION.get(condition.op, 'fails')} {condition.key}{condition.op}{condition.value}"


def explain_failures(expression: Expression, facts: DeviceFacts) -> tuple[str, ...]:
    """Why every OR-term failed, merged so 30 near-identical escape terms read as three lines."""
    order: list[tuple[str, str]] = []
    brands_missed: dict[str, list[str]] = {}
    branches_missed: dict[str, list[str]] = {}
    phrases: set[str] = set()
    brand_hit = branch_hit = False  # the GPU's brand / driver branch appears in some escape term

    def note(kind: str, key: str) -> None:
        if (kind, key) not in order:
            order.append((kind, key))

    for term in expression.alternatives:
        branch = _branch_of(term)
        branch_conditions = (branch[1], branch[2]) if branch else ()
        if branch and all(evaluate_condition(c, facts) for c in branch_conditions):
            branch_hit = True
        elif branch:
            host = facts.driver or "unknown"
            values = branches_missed.setdefault(host, [])
            if str(branch[0]) not in values:
                values.append(str(branch[0]))
            note("branch", host)
        term_failed = False  # a malformed factor after a false one is never read by the runtime
        for condition in term.conditions:
            outcome = evaluate_condition(condition, facts)
            if outcome is None and term_failed:
                continue
            term_failed = term_failed or outcome is False
            if condition in branch_conditions:
                continue
            if outcome:
                brand_hit = brand_hit or (condition.key == "brand" and condition.op == "=")
                continue
            if outcome is None:
                phrase = _error_detail(condition, facts)
            elif condition.key == "brand" and condition.op == "=":
                host = _host_value("brand", facts) or "unknown"
                values = brands_missed.setdefault(host, [])
                if _lower(condition.value) not in values:
                    values.append(_lower(condition.value))
                note("brand", host)
                continue
            else:
                phrase = _phrase(condition, facts)
            if phrase not in phrases:
                phrases.add(phrase)
                note("phrase", phrase)

    # Name the missing half only: "branch 535 is listed, but not for GeForce" reads as the brand.
    if brand_hit and not branch_hit:
        order = [item for item in order if item[0] != "brand"]
    elif branch_hit and not brand_hit:
        order = [item for item in order if item[0] != "branch"]
    lines: list[str] = []
    for kind, key in order:
        if kind == "phrase":
            lines.append(key)
        elif kind == "branch":
            lines.append(f"driver {key} is not in branch {', '.join(branches_missed[key])}")
        else:
            wanted = brands_missed[key]
            listed = wanted[0] if len(wanted) == 1 else "one of " + ", ".join(wanted)
            lines.append(f"brand {key} is not {listed}")
    return tuple(lines)


def _holds(condition: Condition, facts: DeviceFacts) -> str:
    """A condition that holds on this GPU, in words: `driver CUDA 12.4 >= 12.2`, `brand Tesla`."""
    host = _host_value(condition.key, facts)
    subject = _SUBJECT.get(condition.key, condition.key)
    if host is None:
        return f"{subject} not known (the runtime does not check {condition.text})"
    if condition.key == "brand":
        return f"brand {host}" if condition.op == "=" else f"brand {host}, not {condition.value}"
    return f"{subject} {host} {condition.op} {condition.value}"


def explain_pass(expression: Expression, facts: DeviceFacts) -> str | None:
    """The alternative (OR-term) that lets this GPU pass, in words, as the runtime finds it (the
    first fully-true term); a brand exception says so. None when no term holds."""
    if not expression.alternatives:
        return "no condition"
    for term in expression.alternatives:
        if all(evaluate_condition(c, facts) is True for c in term.conditions):
            branch = _branch_of(term)
            parts = [
                _holds(c, facts) for c in term.conditions if not branch or c not in (branch[1], branch[2])
            ]
            if branch:
                parts.append(f"driver {facts.driver} in branch {branch[0]}")
            brand = any(c.key == "brand" and c.op == "=" for c in term.conditions)
            return ("brand exception: " if brand else "") + ", ".join(parts)
    return None


# --- image-level rules -------------------------------------------------------------------------

_TRUE_WORDS = frozenset({"1", "t", "T", "TRUE", "true", "True"})  # Go's strconv.ParseBool
_LEGACY_CUDA = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?$")


def legacy_cuda_requirement(cuda_version: str) -> str:
    """`CUDA_VERSION` of a legacy image -> `cuda>=MAJOR.MINOR` (toolkit's parseMajorMinorVersion).

    Raises ValueError for values the toolkit rejects (more than three parts, signs, empty parts,
    parts above uint32).
    """
    match = _LEGACY_CUDA.match(cuda_version)
    if not match or any(
        (value := digits_value(part)) is None or value > 2**32 - 1
        for part in match.groups()
        if part is not None
    ):
        raise ValueError(f"invalid CUDA_VERSION {cuda_version!r}: expected MAJOR[.MINOR[.PATCH]]")
    major, minor = match.group(1), match.group(2) or "0"
    return f"cuda>={int(major)}.{int(minor)}"


def requirement_texts(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(variable, value) of every requirement the toolkit passes to `--require`, ordered by name.

    Every NVIDIA_REQUIRE_* counts except NVIDIA_REQUIRE_JETPACK*; a legacy image (CUDA_VERSION
    without NVIDIA_REQUIRE_CUDA) adds `cuda>=MAJOR.MINOR`. NVIDIA_DISABLE_REQUIRE empties the list.
    Raises ValueError for a legacy CUDA_VERSION the toolkit cannot parse.
    """
    if env.get("NVIDIA_DISABLE_REQUIRE") in _TRUE_WORDS:
        return []
    found = [
        (name, value)
        for name, value in sorted(env.items())
        if name.startswith("NVIDIA_REQUIRE_") and not name.startswith("NVIDIA_REQUIRE_JETPACK")
    ]
    legacy = env.get("CUDA_VERSION", "")
    if legacy and not env.get("NVIDIA_REQUIRE_CUDA"):
        found.append(("CUDA_VERSION", legacy_cuda_requirement(legacy)))
    return found


@dataclass(frozen=True, slots=True)
class ImageRequirements:
    """An image's requirements, parsed once per query. `error` makes the image run nowhere.

    A malformed clause is not an `error`: like nvidia-container-cli, `check` fails only when
    evaluation reaches it (`warnings` lists such clauses).
    """

    expressions: tuple[tuple[str, Expression], ...] = ()
    error: str | None = None
    disabled: bool = False

    @classmethod
    def from_texts(cls, texts: Iterable[tuple[str, str]]) -> ImageRequirements:
        """Parse (variable, requirement) pairs; the same texts give the same (immutable) result."""
        return _parsed_requirements(tuple(texts))

    @classmethod
    def from_gpu_facts(cls, facts: GpuFacts) -> ImageRequirements:
        """Build from the scanner's facts: env when it has the variables, else the values list."""
        if facts.disable_require or facts.env.get("NVIDIA_DISABLE_REQUIRE") in _TRUE_WORDS:
            return cls(disabled=True)
        env = dict(facts.env)
        has_require_vars = any(name.startswith("NVIDIA_REQUIRE_") for name in env)
        if not has_require_vars and facts.requirements:
            env.update({f"NVIDIA_REQUIRE_{i:02d}": value for i, value in enumerate(facts.requirements)})
        if facts.cuda_version and "CUDA_VERSION" not in env and not env.get("NVIDIA_REQUIRE_CUDA"):
            env["CUDA_VERSION"] = facts.cuda_version
        try:
            return cls.from_texts(requirement_texts(env))
        except ValueError as exc:
            return cls(error=str(exc))

    @property
    def warnings(self) -> tuple[str, ...]:
        """Every clause that fails when reached, named: the runtime refuses the container there."""
        found = []
        for variable, expression in self.expressions:
            for condition in expression.conditions:
                problem = condition.error or latent_error(condition)
                if problem is not None:
                    found.append(
                        f"{variable}: {problem}; a host whose evaluation reaches it refuses the "
                        "container (invalid expression)"
                    )
        return tuple(found)

    @property
    def has_device_conditions(self) -> bool:
        """True when some factor reads arch or brand, so verdicts differ per GPU."""
        return any(c.key in ("arch", "brand") for _, e in self.expressions for c in e.conditions)

    def satisfied(self, facts: DeviceFacts) -> bool:
        """Whether every requirement holds on this GPU: `check(facts).ok`, without the explanation."""
        if self.error is not None:
            return False
        return all(evaluate(expression, facts, explain=False).ok for _, expression in self.expressions)

    def passes_by(self, facts: DeviceFacts) -> tuple[str, ...]:
        """Why a GPU passes, one line per requirement (`NVIDIA_REQUIRE_CUDA: driver CUDA 12.4 >= 12.2`);
        () where nothing is required. Call it for a GPU that `check` passes."""
        if self.disabled:
            return ("NVIDIA_DISABLE_REQUIRE: the runtime checks no requirement",)
        lines = []
        for variable, expression in self.expressions:
            why = explain_pass(expression, facts)
            if why is not None:
                lines.append(f"{variable}: {why}")
        return tuple(lines)

    def check(self, facts: DeviceFacts) -> Verdict:
        """All requirements must hold (they are ANDed); the first failing one decides the message."""
        if self.error is not None:
            return Verdict("error", "invalid expression", (self.error,))
        for variable, expression in self.expressions:
            verdict = evaluate(expression, facts)
            if not verdict.ok:
                return Verdict(
                    verdict.outcome,
                    verdict.message,
                    tuple(f"{variable}: {line}" for line in verdict.failed),
                    verdict.requirement,
                )
        return SATISFIED


@lru_cache(maxsize=256)
def _parsed_requirements(pairs: tuple[tuple[str, str], ...]) -> ImageRequirements:
    """Parsing is pure and its result frozen, so a query for an image already seen skips it.

    Parsing is lenient: a malformed clause stays in the tree and fails only on hosts where the
    runtime's short-circuit evaluation reaches it (`warnings` names it for people).
    """
    if len(pairs) > MAX_REQUIREMENTS:
        return ImageRequirements(
            error=f"too many requirements: {len(pairs)} (nvidia-container-cli accepts 32)"
        )
    return ImageRequirements(tuple((variable, parse_requirement_lenient(value)) for variable, value in pairs))


def check_devices(requirements: ImageRequirements, devices: Sequence[DeviceFacts]) -> Verdict:
    """Per assigned GPU, as the runtime does; pass one `device_visible=False` fact when no GPU is assigned."""
    for device in devices:
        verdict = requirements.check(device)
        if not verdict.ok:
            return verdict
    return SATISFIED
