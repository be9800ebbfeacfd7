"""What one NFD evaluation (one spec on one node) may spend, and the error past it. Pure.

`Budget` counts the expressions evaluated on single elements (`nfd_max_evaluations`), compiles
regular expressions with RE2 under `nfd_regex_max_mem`, charges each pattern once per evaluation
against `nfd_regex_budget`, keeps compiled patterns in one process-wide cache bounded by
`REGEX_CACHE_INSTRUCTIONS`, and hands templates their own `TemplateBudget`. Past any bound it
raises `MatchError` naming the setting; `placement.nfd.match` evaluates under it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import re2

from placement.nfd.schema import DEFAULT_LIMITS, DocumentLimits
from placement.nfd.template import TemplateBudget

REGEX_CACHE_INSTRUCTIONS = 4_000_000  # compiled patterns kept by the process, in RE2 instructions (~64 MiB)
_regex_cache: OrderedDict[tuple[str, int], tuple[Any, int, str]] = OrderedDict()
_regex_cache_size = 0


class MatchError(ValueError):
    """NFD would stop evaluating here with this error (an invalid expression or value)."""


class Budget:
    """What one evaluation (one spec on one node) may still spend compiling regular expressions."""

    def __init__(self, limits: DocumentLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.spent = 0
        self._charged: set[str] = set()
        self._options = re2.Options()
        self._options.log_errors = False
        self._options.max_mem = limits.regex_max_mem
        self.template = TemplateBudget(limits.max_template_bytes, steps=limits.max_evaluations)
        self.evaluations = 0

    def evaluation(self) -> None:
        """Count one expression evaluated on one element; past `max_evaluations`, a MatchError."""
        self.evaluations += 1
        if self.evaluations > self.limits.max_evaluations:
            raise MatchError(
                f"this document needs more than {self.limits.max_evaluations:,} expression evaluations on this "
                "node (the setting nfd_max_evaluations)"
            )

    def regex(self, pattern: str) -> Any:
        """`pattern` compiled (from the process-wide cache when it is there), charged once per evaluation.

        A pattern RE2 (or Go's syntax) refuses is remembered too, so it is compiled once, not once
        per element; it costs what the largest allowed pattern would.
        """
        global _regex_cache_size
        if pattern not in self._charged and self.spent + 1 > self.limits.regex_budget:
            raise MatchError(self._over_budget())
        key = (pattern, self.limits.regex_max_mem)
        cached = _regex_cache.get(key)
        if cached is None:
            cached = self._compile(pattern)
            _regex_cache[key] = cached
            _regex_cache_size += cached[1]
            while _regex_cache_size > REGEX_CACHE_INSTRUCTIONS and len(_regex_cache) > 1:
                _, (_, size, _) = _regex_cache.popitem(last=False)
                _regex_cache_size -= size
        else:
            _regex_cache.move_to_end(key)
        compiled, cost, problem = cached
        self._charge(pattern, cost)
        if compiled is None:
            raise MatchError(f"invalid regular expression {pattern!r}: {problem}")
        return compiled

    def _compile(self, pattern: str) -> tuple[Any, int, str]:
        """(the compiled pattern or None, its cost in RE2 instructions, why it was refused)."""
        problem = _go_syntax_problem(pattern)
        if problem is None:
            try:
                compiled = re2.compile(pattern, options=self._options)
            except re2.error as exc:
                problem = str(exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc)
            else:
                return compiled, max(1, compiled.programsize), ""
        if "pattern too large" in problem:
            problem = (
                f"it needs more than {self.limits.regex_max_mem:,} bytes (the setting nfd_regex_max_mem)"
            )
        return None, max(1, self.limits.regex_max_mem // 24), problem  # ~ the largest program max_mem allows

    def _charge(self, pattern: str, cost: int) -> None:
        if pattern in self._charged:
            return
        self._charged.add(pattern)
        self.spent += cost
        if self.spent > self.limits.regex_budget:
            raise MatchError(self._over_budget())

    def _over_budget(self) -> str:
        return (
            f"the regular expressions of this document need more than {self.limits.regex_budget:,} RE2 "
            "instructions to compile (the setting nfd_regex_budget)"
        )


def _go_syntax_problem(pattern: str) -> str | None:
    """Where Go's regexp/syntax refuses what RE2 accepts: `\\C` (any byte)."""
    index = 0
    while index < len(pattern):
        if pattern[index] == "\\":
            if pattern[index + 1 : index + 2] == "C":
                return "invalid escape sequence: `\\C` (Go's regexp has no \\C)"
            index += 2
            continue
        index += 1
    return None
