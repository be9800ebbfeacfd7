"""NVIDIA_REQUIRE_* text -> an immutable expression tree, with libnvidia-container's grammar.

The grammar is the one `nvidia-container-cli --require` implements (libnvidia-container
`src/cli/dsl.c`), because that is what decides whether a container starts:

    requirement := term { " " term }        space = OR (split on single spaces, empty parts skipped)
    term        := factor { "," factor }    comma = AND (binds tighter; empty parts skipped)
    factor      := KEY OP VALUE             KEY: cuda | driver | arch | brand, any case
                                            OP: the whole run of "<>=!" chars, one of = != < <= > >=
                                            VALUE: non-empty; digits and dots for cuda/driver/arch

An empty requirement (or only spaces/commas) is always satisfied; a lone `!` operator means `!=`
(both quirks of dsl.c, kept because the runtime has them). Unknown keys are errors,
as in the C implementation (the Go CSV-mode code would skip them, but it is not the path
Docker/containerd use).

NVIDIA's C code reports a malformed factor only when evaluation reaches it (it short-circuits).
`parse_requirement` is strict and raises on any malformed factor; `parse_requirement_lenient`
keeps malformed factors in the tree as values so an evaluator can reproduce the runtime exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

RequirementKey = Literal["cuda", "driver", "arch", "brand"]
Operator = Literal["=", "!=", "<", "<=", ">", ">="]

KEYS: tuple[RequirementKey, ...] = ("cuda", "driver", "arch", "brand")
OPERATORS: tuple[Operator, ...] = ("=", "!=", "<", "<=", ">", ">=")
VERSION_KEYS: frozenset[str] = frozenset({"cuda", "driver", "arch"})
_OPERATOR_CHARS = "<>=!"
_VERSION_TEXT = re.compile(r"^[0-9.]*$")
_OPERATOR_RUN = re.compile(r"[<>=!]+")
_DIGITS = re.compile(r"[0-9]+")
EXPR_MAX = 128  # dsl.c formats a failed factor into a 128-byte buffer; longer is "invalid expression"
_UINTMAX = 2**64 - 1  # strtoumax saturates here, which dsl.c treats as an error
# strcasecmp folds ASCII only; str.lower() would also fold other letters and change lengths.
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")

# Words the UI uses for the operators, so a condition reads as a sentence.
_OPERATOR_WORDS: dict[str, str] = {
    "=": "is",
    "!=": "is not",
    "<": "below",
    "<=": "at most",
    ">": "above",
    ">=": "at least",
}


class RequirementSyntaxError(ValueError):
    """A requirement term that NVIDIA's runtime would reject as `invalid expression`."""

    def __init__(self, message: str, term: str = "") -> None:
        super().__init__(message)
        self.term = term


@dataclass(frozen=True, slots=True)
class Condition:
    """One `KEY OP VALUE` factor. `error` is set when the factor is malformed (lenient parse only)."""

    key: str
    op: str
    value: str
    text: str
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.error is None

    def __str__(self) -> str:
        if self.error is not None:
            return self.text
        return f"{self.key}{self.op}{self.value}"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"key": self.key, "op": self.op, "value": self.value, "text": self.text}
        if self.error is not None:
            data["error"] = self.error
        return data


@dataclass(frozen=True, slots=True)
class AllOf:
    """An AND-term: every condition must hold (a comma-separated group)."""

    conditions: tuple[Condition, ...]

    def __str__(self) -> str:
        return " AND ".join(str(c) for c in self.conditions)

    @property
    def text(self) -> str:
        """The term as NVIDIA writes it (comma-separated), e.g. for 'unsatisfied condition:' messages."""
        return ",".join(c.text for c in self.conditions)

    def to_dict(self) -> dict[str, Any]:
        return {"all_of": [c.to_dict() for c in self.conditions]}


@dataclass(frozen=True, slots=True)
class Expression:
    """An OR of AND-terms, in source order. No alternatives means "always satisfied"."""

    alternatives: tuple[AllOf, ...]
    text: str = ""
    errors: tuple[str, ...] = field(default=())

    @property
    def always_true(self) -> bool:
        return not self.alternatives

    @property
    def valid(self) -> bool:
        return not self.errors

    @property
    def conditions(self) -> tuple[Condition, ...]:
        return tuple(c for term in self.alternatives for c in term.conditions)

    def __str__(self) -> str:
        if not self.alternatives:
            return "(no condition)"
        if len(self.alternatives) == 1:
            return str(self.alternatives[0])
        parts = []
        for term in self.alternatives:
            rendered = str(term)
            parts.append(f"({rendered})" if len(term.conditions) > 1 else rendered)
        return " OR ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"text": self.text, "any_of": [t.to_dict() for t in self.alternatives]}
        if self.errors:
            data["errors"] = list(self.errors)
        return data


def describe_condition(condition: Condition) -> str:
    """A condition in words, e.g. `driver CUDA at least 12.2`."""
    subject = {"cuda": "driver CUDA", "driver": "driver", "arch": "compute capability", "brand": "brand"}
    name = subject.get(condition.key, condition.key)
    return f"{name} {_OPERATOR_WORDS.get(condition.op, condition.op)} {condition.value}"


def _parse_factor(text: str) -> Condition:
    """Parse one factor, never raising: problems land in `Condition.error`."""
    start = next((i for i, ch in enumerate(text) if ch in _OPERATOR_CHARS), -1)
    if start < 0:
        return Condition("", "", "", text, f"invalid requirement term {text!r}: no operator")
    if start == 0:
        return Condition("", "", "", text, f"invalid requirement term {text!r}: no key before the operator")
    run = _OPERATOR_RUN.match(text, start)
    assert run is not None
    raw_key, op, value = text[:start], run.group(0), text[run.end() :]
    key = raw_key.translate(_ASCII_LOWER)
    if op == "!":
        # dsl.c matches the operator with strncmp over the run's length, so a lone "!" is "!=".
        op = "!="
    if key not in KEYS:
        return Condition(
            raw_key,
            op,
            value,
            text,
            f"invalid requirement term {text!r}: unknown key {raw_key!r} "
            "(expected cuda, driver, arch or brand)",
        )
    if op not in OPERATORS:
        return Condition(
            key,
            op,
            value,
            text,
            f"invalid requirement term {text!r}: invalid operator {op!r} (expected = != < <= > >=)",
        )
    if not value:
        return Condition(key, op, value, text, f"invalid requirement term {text!r}: empty value")
    if key in VERSION_KEYS and not _VERSION_TEXT.match(value):
        return Condition(
            key,
            op,
            value,
            text,
            f"invalid requirement term {text!r}: {key} version {value!r} may contain only digits and dots",
        )
    if key == "brand" and op not in ("=", "!="):
        return Condition(
            key, op, value, text, f"invalid requirement term {text!r}: brand supports only = and !="
        )
    return Condition(key, op, value, text)


def formatted_length(condition: Condition) -> int:
    """Length of dsl.c's `"%s %s %s"` rendering of the factor (raw key, operator, value)."""
    raw_op_length = len(condition.text) - len(condition.key) - len(condition.value)
    return len(condition.text) + 2 + (len(condition.op) - raw_op_length)


UINT_DIGITS = len(str(_UINTMAX))  # a run of more significant digits is past any uint64


def digits_value(digits: str) -> int | None:
    """A run of ASCII digits as a number, or None past `UINT_DIGITS` significant digits: beyond any
    uint64 (strtoumax saturates), and never handed to int(), which refuses 4,300 digits."""
    significant = digits.lstrip("0")
    if len(significant) > UINT_DIGITS:
        return None
    return int(significant or "0")


def _too_large(digits: str) -> bool:
    """A run of digits strtoumax saturates on."""
    value = digits_value(digits)
    return value is None or value >= _UINTMAX


def latent_error(condition: Condition) -> str | None:
    """Why a well-formed factor is still an error for nvidia-container-cli (when compared), if it is."""
    if condition.error is not None or condition.key == "brand":
        return None
    if condition.value.startswith("."):
        return f"invalid requirement term {condition.text!r}: a version cannot start with '.'"
    if any(_too_large(part) for part in _DIGITS.findall(condition.value)):
        return f"invalid requirement term {condition.text!r}: a number too large for nvidia-container-cli"
    if formatted_length(condition) >= EXPR_MAX:
        return (
            f"invalid requirement term {condition.text!r}: longer than nvidia-container-cli reports "
            "(an error wherever it is false)"
        )
    return None


def parse_requirement_lenient(text: str) -> Expression:
    """Parse without raising; malformed factors stay in the tree and are listed in `errors`.

    Use this to reproduce the runtime exactly: it only reports a malformed factor when
    evaluation reaches it.
    """
    alternatives: list[AllOf] = []
    errors: list[str] = []
    for or_part in text.split(" "):
        if not or_part:
            continue
        conditions: list[Condition] = []
        for and_part in or_part.split(","):
            if not and_part:
                continue
            condition = _parse_factor(and_part)
            if condition.error is not None:
                errors.append(condition.error)
            conditions.append(condition)
        if not conditions:
            # A term made only of commas ends dsl.c's loop with the result so far: satisfied when it
            # comes first, unsatisfied after failed terms. Dropping it and every later term is the
            # same thing (later terms are never looked at, so their errors never surface either).
            break
        alternatives.append(AllOf(tuple(conditions)))
    return Expression(tuple(alternatives), text, tuple(errors))


def parse_requirement(text: str) -> Expression:
    """Parse an NVIDIA_REQUIRE_* value; raises RequirementSyntaxError naming the first bad term."""
    expression = parse_requirement_lenient(text)
    for condition in expression.conditions:
        if condition.error is not None:
            raise RequirementSyntaxError(condition.error, condition.text)
    return expression
