"""NFD's `varsTemplate`: Go's text/template over a rule's matched elements, as `key=value` lines. Pure.

NFD (`pkg/apis/nfd/template/template.go`) parses the template with `missingkey=error`, runs it
over the matched features (`{domain: {feature: [element, ...]}}`, each element a map such as
`{Name, Value}` or an instance's attributes), and reads every non-empty line of the output as
`key=value` (`ExpandMap`). This module evaluates text/template's language: text, `{{ pipeline }}`
where a pipeline is one operand (`.`, `.a.b`, `$`, `$x.a`, a string, number or boolean), variable
declarations (`$x := ...`, `$x = ...`), `if`/`with`/`range` (with `else`, `else if`, `else with`,
`range $i, $e := ...`), comments and `{{-`/`-}}` trimming. It evaluates no function: NFD offers
Go's builtins and sprig's, and a template that calls one is a TemplateError saying so.

Bounded: the template is at most NFD's own 64 KiB, nested at most MAX_NESTING blocks, and the
templates of one evaluation take at most `TemplateBudget.steps` steps (`nfd_max_evaluations`)
and each writes at most `max_bytes` bytes (`nfd_max_template_bytes`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_TEMPLATE_SIZE = 64 * 1024  # NFD's MaxTemplateSize
MAX_NESTING = 100
DEFAULT_STEPS = 500_000  # template steps one evaluation of a document may take (all its rules)


class TemplateError(ValueError):
    """The template cannot be parsed or run, or it needs what gpubadge does not evaluate."""


@dataclass
class TemplateBudget:
    """What the templates of one evaluation may still spend."""

    max_bytes: int
    steps: int = DEFAULT_STEPS

    def __post_init__(self) -> None:
        self.limit = self.steps


# --- parsing ------------------------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(
    r"""\s*(?:(?P<string>"(?:[^"\\]|\\.)*"|`[^`]*`)|(?P<number>[+-]?[0-9][0-9a-fA-FxXoObB._]*)"""
    r"""|(?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)|(?P<field>(?:\.[A-Za-z0-9_]+)+|\.)"""
    r"""|(?P<assign>:=|=)|(?P<comma>,)|(?P<word>[A-Za-z_][A-Za-z0-9_]*)|(?P<other>\S))"""
)


@dataclass
class _Node:
    kind: str  # text, print, assign, if, with, range
    text: str = ""
    operand: Any = None
    names: list[str] = field(default_factory=list)
    body: list[_Node] = field(default_factory=list)
    otherwise: list[_Node] = field(default_factory=list)


def _tokens(source: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    position = 0
    while position < len(source):
        match = _TOKEN.match(source, position)
        if match is None or match.end() == position:
            if source[position:].strip() == "":
                break
            raise TemplateError(f"unexpected {source[position : position + 20]!r}")
        kind = match.lastgroup or "other"
        found.append((kind, match.group(kind)))
        position = match.end()
    return found


def _operand(tokens: list[tuple[str, str]], action: str) -> Any:
    if len(tokens) != 1:
        words = [value for kind, value in tokens if kind == "word"] or [v for k, v in tokens if k == "other"]
        if words:
            raise TemplateError(
                f"{{{{{action.strip()}}}}} calls {words[0]!r}; gpubadge evaluates no template function "
                "(NFD offers Go's and sprig's)"
            )
        raise TemplateError(f"{{{{{action.strip()}}}}}: a pipeline of one operand is all gpubadge evaluates")
    kind, value = tokens[0]
    if kind == "field":
        return ("field", [] if value == "." else value[1:].split("."))
    if kind == "var":
        name, _, rest = value.partition(".")
        return ("var", name, rest.split(".") if rest else [])
    if kind == "string":
        return ("literal", _unquote(value))
    if kind == "number":
        try:
            return ("literal", int(value.replace("_", ""), 0))
        except ValueError:
            try:
                return ("literal", float(value))
            except ValueError:
                raise TemplateError(f"bad number {value!r}") from None
    if kind == "word" and value in ("true", "false"):
        return ("literal", value == "true")
    if kind == "word" and value == "nil":
        raise TemplateError("nil is not a command")
    raise TemplateError(
        f"{{{{{action.strip()}}}}} calls {value!r}; gpubadge evaluates no template function (NFD offers Go's and sprig's)"
    )


def _unquote(text: str) -> str:
    if text.startswith("`"):
        return text[1:-1]
    import json

    try:
        return str(json.loads(text))
    except ValueError:
        raise TemplateError(f"bad string {text}") from None


def _declaration(tokens: list[tuple[str, str]]) -> tuple[list[str], list[tuple[str, str]], str | None]:
    """`$a, $b := rest` -> (["$a", "$b"], rest, ":="); no declaration -> ([], tokens, None)."""
    names: list[str] = []
    index = 0
    while index < len(tokens) and tokens[index][0] == "var" and "." not in tokens[index][1]:
        names.append(tokens[index][1])
        index += 1
        if index < len(tokens) and tokens[index][0] == "comma":
            index += 1
            continue
        break
    if names and index < len(tokens) and tokens[index][0] == "assign":
        return names, tokens[index + 1 :], tokens[index][1]
    return [], tokens, None


def _open_block(
    kind: str,
    tokens: list[tuple[str, str]],
    action: str,
    current: list[_Node],
    stack: list[tuple[_Node, list[_Node]]],
    *,
    text: str = "",
) -> list[_Node]:
    """Append an if/with/range block to `current`, push it on `stack` (at most MAX_NESTING deep)
    and return its body, the list the actions that follow fill."""
    names, rest, _ = _declaration(tokens)
    node = _Node(kind, operand=_operand(rest, action), names=names, text=text)
    current.append(node)
    stack.append((node, current))
    if len(stack) > MAX_NESTING:
        raise TemplateError(f"blocks nested deeper than {MAX_NESTING}")
    return node.body


def parse(source: str) -> list[_Node]:
    """The template's tree; TemplateError where Go's parser (or gpubadge's subset) refuses it."""
    if len(source) > MAX_TEMPLATE_SIZE:
        raise TemplateError(
            f"template exceeds maximum allowed size: {len(source)} bytes > {MAX_TEMPLATE_SIZE} limit"
        )
    pieces: list[tuple[str, str]] = []
    position = 0
    for match in _ACTION.finditer(source):
        text = source[position : match.start()]
        if match.group(1):
            text = text.rstrip(" \t\r\n")
        pieces.append(("text", text))
        pieces.append(("action", match.group(2)))
        position = match.end()
        if match.group(3):
            following = source[position:]
            position += len(following) - len(following.lstrip(" \t\r\n"))
    tail = source[position:]
    if "{{" in tail:
        raise TemplateError("unclosed action")
    pieces.append(("text", tail))
    root: list[_Node] = []
    stack: list[tuple[_Node, list[_Node]]] = []  # open blocks and the list now being filled
    current = root
    for kind, content in pieces:
        if kind == "text":
            if content:
                current.append(_Node("text", text=content))
            continue
        stripped = content.strip()
        if stripped.startswith("/*"):
            if not stripped.endswith("*/"):
                raise TemplateError("unclosed comment")
            continue
        tokens = _tokens(content)
        if not tokens:
            raise TemplateError("missing value for command")
        head = tokens[0][1] if tokens[0][0] == "word" else ""
        if head in ("if", "with", "range"):
            current = _open_block(head, tokens[1:], content, current, stack)
        elif head == "else":
            if not stack:
                raise TemplateError("unexpected {{else}}")
            node, _ = stack[-1]
            if current is node.otherwise:
                raise TemplateError("expected end; found {{else}}")
            current = node.otherwise
            # else if / else with: a block nested in the else branch, closed by the same end
            if len(tokens) > 1:
                chained = tokens[1][1]
                if chained not in ("if", "with"):
                    raise TemplateError(f"unexpected {chained!r} after else")
                current = _open_block(chained, tokens[2:], content, current, stack, text="chained")
        elif head == "end":
            if not stack:
                raise TemplateError("unexpected {{end}}")
            while True:
                node, parent = stack.pop()
                current = parent
                if node.text != "chained":
                    break
        elif head in ("define", "template", "block", "break", "continue"):
            raise TemplateError(f"{{{{{head}}}}} is not evaluated by gpubadge")
        else:
            names, rest, assign = _declaration(tokens)
            if assign is not None:
                current.append(_Node("assign", operand=_operand(rest, content), names=names, text=assign))
            else:
                current.append(_Node("print", operand=_operand(tokens, content)))
    if stack:
        raise TemplateError(f"unexpected EOF: {{{{{stack[-1][0].kind}}}}} has no {{{{end}}}}")
    return root


# --- running -------------------------------------------------------------------------------------


def _truth(value: Any) -> bool:
    return bool(value) if value is not None else False


def _go_text(value: Any) -> str:
    """fmt.Print of a value: strings as they are, maps as `map[k:v]` (sorted keys), lists as `[a b]`."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "<no value>"
    if isinstance(value, Mapping):
        return "map[" + " ".join(f"{k}:{_go_text(value[k])}" for k in sorted(value)) + "]"
    if isinstance(value, list):
        return "[" + " ".join(_go_text(item) for item in value) + "]"
    return str(value)


class _Run:
    def __init__(self, data: Any, budget: TemplateBudget) -> None:
        self.out: list[str] = []
        self.size = 0
        self.budget = budget
        self.scopes: list[dict[str, Any]] = [{"$": data}]

    def step(self) -> None:
        self.budget.steps -= 1
        if self.budget.steps < 0:
            raise TemplateError(
                f"the templates of this document take more than {self.budget.limit:,} steps (the setting "
                "nfd_max_evaluations)"
            )

    def write(self, text: str) -> None:
        self.size += len(text.encode())
        if self.size > self.budget.max_bytes:
            raise TemplateError(
                f"expands past {self.budget.max_bytes:,} bytes (the setting nfd_max_template_bytes)"
            )
        self.out.append(text)

    def lookup(self, name: str) -> Any:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise TemplateError(f'undefined variable "{name}"')

    def assign(self, name: str, value: Any, declare: bool) -> None:
        if declare:
            self.scopes[-1][name] = value
            return
        for scope in reversed(self.scopes):
            if name in scope:
                scope[name] = value
                return
        raise TemplateError(f'undefined variable "{name}"')

    def value(self, operand: Any, dot: Any) -> Any:
        kind = operand[0]
        if kind == "literal":
            return operand[1]
        base, path = (dot, operand[1]) if kind == "field" else (self.lookup(operand[1]), operand[2])
        for name in path:
            if isinstance(base, Mapping):
                if name not in base:
                    raise TemplateError(f'map has no entry for key "{name}"')
                base = base[name]
            else:
                raise TemplateError(f"can't evaluate field {name} in type {_go_type(base)}")
        return base

    def run(self, nodes: list[_Node], dot: Any) -> None:
        for node in nodes:
            self.step()
            if node.kind == "text":
                self.write(node.text)
            elif node.kind == "print":
                self.write(_go_text(self.value(node.operand, dot)))
            elif node.kind == "assign":
                self.assign(node.names[0], self.value(node.operand, dot), node.text == ":=")
            elif node.kind in ("if", "with"):
                value = self.value(node.operand, dot)
                self.scopes.append({})
                if node.names:
                    self.assign(node.names[0], value, True)
                if _truth(value):
                    self.run(node.body, value if node.kind == "with" else dot)
                else:
                    self.run(node.otherwise, dot)
                self.scopes.pop()
            elif node.kind == "range":
                self._range(node, dot)

    def _range(self, node: _Node, dot: Any) -> None:
        value = self.value(node.operand, dot)
        if isinstance(value, Mapping):
            items: list[tuple[Any, Any]] = [(key, value[key]) for key in sorted(value)]
        elif isinstance(value, list):
            items = list(enumerate(value))
        elif value is None:
            items = []
        else:
            raise TemplateError(f"range can't iterate over {_go_text(value)}")
        if not items:
            self.run(node.otherwise, dot)
            return
        for key, item in items:
            self.step()
            self.scopes.append({})
            if len(node.names) == 1:
                self.assign(node.names[0], item, True)
            elif len(node.names) == 2:
                self.assign(node.names[0], key, True)
                self.assign(node.names[1], item, True)
            self.run(node.body, item)
            self.scopes.pop()


def _go_type(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "[]interface {}"
    return "interface {}" if value is None else type(value).__name__


def execute(source: str, data: Any, budget: TemplateBudget) -> str:
    """The template's output over `data`; TemplateError on any problem or past the budget."""
    run = _Run(data, budget)
    run.run(parse(source), data)
    return "".join(run.out)


def expand_map(source: str, data: Any, budget: TemplateBudget) -> dict[str, str]:
    """NFD's ExpandMap: each non-empty output line, trimmed, is `key=value`; {} for no template."""
    if source == "":
        return {}
    out: dict[str, str] = {}
    for line in execute(source, data, budget).split("\n"):
        trimmed = line.strip()
        if trimmed:
            key, equals, value = trimmed.partition("=")
            if not equals:
                raise TemplateError(
                    f"missing value in expanded template line {trimmed!r}, (format must be '<key>=<value>')"
                )
            out[key] = value
    return out
