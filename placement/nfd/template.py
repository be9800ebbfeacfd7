"""NFD's `varsTemplate`: Go's text/template over a rule's matched elements, as `key=value` lines. Pure.

NFD (`pkg/apis/nfd/template/template.go`) parses the template with `missingkey=error` and sprig's
functions, runs it over the matched features (`{domain: {feature: [element, ...]}}`, each element a
map such as `{Name, Value}` or an instance's attributes), and reads every non-empty line of the
output as `key=value` (`ExpandMap`). This module evaluates text/template's language as Go does:
text; actions whose pipelines chain commands with `|`; a command is a function call (Go's built-ins
and the sprig functions of `placement.nfd.template_functions`, the piped value its last argument)
or one operand: `.`, `.a.b`, `$`, `$x.a`, a parenthesised pipeline and the fields after it
(`(index . "a").b`), a string, raw string, character, number, boolean or `nil`; variable
declarations and assignments (`$x := ...`, `$x = ...`); `if`/`with`/`range` with `else`,
`else if`, `else with`, `range $i, $e := ...`, `break` and `continue`; comments and `{{-`/`-}}`
trimming. `and` and `or` evaluate their operands lazily. `define`, `template` and `block` (other
templates) are refused: NFD's templates are single documents.

Bounded: the template is at most NFD's own 64 KiB, nested at most MAX_NESTING blocks (and
parentheses), and the templates of one evaluation take at most `TemplateBudget.steps` steps
(`nfd_max_evaluations`: each node run, range iteration and function call is one) and each writes,
and each function builds, at most `max_bytes` bytes (`nfd_max_template_bytes`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from placement.nfd.template_functions import (
    Missing,
    TemplateError,
    call,
    go_text,
    go_type,
    known,
    truth,
)

MAX_TEMPLATE_SIZE = 64 * 1024  # NFD's MaxTemplateSize
MAX_NESTING = 100
DEFAULT_STEPS = 500_000  # template steps one evaluation of a document may take (all its rules)

__all__ = ["DEFAULT_STEPS", "MAX_TEMPLATE_SIZE", "TemplateBudget", "TemplateError", "expand_map", "parse"]


@dataclass
class TemplateBudget:
    """What the templates of one evaluation may still spend."""

    max_bytes: int
    steps: int = DEFAULT_STEPS

    def __post_init__(self) -> None:
        self.limit = self.steps


# --- parsing ------------------------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-[ \t\r\n])?(.*?)([ \t\r\n]-)?\}\}", re.S)
_TOKEN = re.compile(
    r"""(?P<space>\s+)|(?P<string>"(?:[^"\\\n]|\\.)*")|(?P<raw>`[^`]*`)|(?P<char>'(?:[^'\\\n]|\\.)+')"""
    r"""|(?P<number>[+-]?(?:0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+"""
    r"""|(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][+-]?[0-9]+)?))"""
    r"""|(?P<var>\$[A-Za-z0-9_]*)|(?P<field>\.[A-Za-z_][A-Za-z0-9_]*)|(?P<dot>\.)"""
    r"""|(?P<declare>:=)|(?P<assign>=)|(?P<comma>,)|(?P<pipe>\|)|(?P<open>\()|(?P<close>\))"""
    r"""|(?P<word>[A-Za-z_][A-Za-z0-9_]*)|(?P<other>.)""",
    re.S,
)


@dataclass
class _Token:
    kind: str
    text: str
    spaced: bool  # whitespace before it (a field right after `)` or a variable chains onto it)


# An operand: ("literal", value) | ("field", [names]) on dot | ("var", "$x", [names])
# | ("func", name) | ("pipe", Pipeline, [names]) | ("nil",)
Operand = tuple[Any, ...]


@dataclass
class Pipeline:
    """`$x := a | b c`: commands (each a list of operands), the variables declared or assigned."""

    commands: list[list[Operand]]
    names: list[str] = field(default_factory=list)
    declare: bool = True


@dataclass
class _Node:
    kind: str  # text, action, if, with, range, break, continue
    text: str = ""
    pipeline: Pipeline | None = None
    body: list[_Node] = field(default_factory=list)
    otherwise: list[_Node] = field(default_factory=list)
    chained: bool = False  # an `else if` / `else with`, closed by its parent's `end`


def _tokens(source: str) -> list[_Token]:
    found: list[_Token] = []
    spaced = True
    for match in _TOKEN.finditer(source):
        kind = match.lastgroup or "other"
        if kind == "space":
            spaced = True
            continue
        if kind == "other":
            raise TemplateError(f"unexpected {match.group()!r} in command")
        found.append(_Token(kind, match.group(), spaced))
        spaced = False
    return found


def _unquote(token: _Token) -> Any:
    if token.kind == "raw":
        return token.text[1:-1]
    if token.kind == "char":
        text = _unquote(_Token("string", '"' + token.text[1:-1].replace('"', '\\"') + '"', True))
        if len(text) != 1:
            raise TemplateError(f"malformed character constant: {token.text}")
        return ord(text)
    try:
        return str(json.loads(re.sub(r"\\x([0-9a-fA-F]{2})", r"\\u00\1", token.text)))
    except ValueError:
        raise TemplateError(f"bad string {token.text}") from None


def _number(text: str) -> int | float:
    clean = text.replace("_", "")
    try:
        return int(clean, 0)
    except ValueError:
        try:
            return float(clean)
        except ValueError:
            raise TemplateError(f"bad number syntax: {text!r}") from None


class _Parser:
    """One action's tokens, read as Go's parser reads a pipeline."""

    def __init__(self, tokens: list[_Token], action: str) -> None:
        self.tokens, self.position, self.action, self.depth = tokens, 0, action, 0

    def peek(self) -> _Token | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> _Token:
        token = self.peek()
        if token is None:
            raise TemplateError(f"unexpected end of {{{{{self.action.strip()}}}}}")
        self.position += 1
        return token

    def pipeline(self, *, context: str, declarations: int = 1) -> Pipeline:
        names: list[str] = []
        declare = True
        start = self.position
        while (token := self.peek()) is not None and token.kind == "var":
            names.append(token.text)
            self.position += 1
            following = self.peek()
            if following is not None and following.kind == "comma" and len(names) < declarations:
                self.position += 1
                continue
            break
        following = self.peek()
        if names and following is not None and following.kind in ("declare", "assign"):
            declare = following.kind == "declare"
            self.position += 1
        else:
            names, self.position = [], start
        commands = [self.command()]
        while (token := self.peek()) is not None and token.kind == "pipe":
            self.position += 1
            commands.append(self.command())
        if not commands[0]:
            raise TemplateError(f"missing value for {context}")
        for later in commands[1:]:
            if later and later[0][0] != "func":
                raise TemplateError(f"non executable command in pipeline stage {commands.index(later) + 1}")
        return Pipeline(commands, names, declare)

    def command(self) -> list[Operand]:
        operands: list[Operand] = []
        while (token := self.peek()) is not None and token.kind not in ("pipe", "close"):
            if operands and not token.spaced and token.kind != "field":
                raise TemplateError(f"missing space? {{{{{self.action.strip()}}}}}")
            operands.append(self.operand())
        return operands

    def operand(self) -> Operand:
        token = self.take()
        kind = token.kind
        if kind in ("string", "raw", "char"):
            term: Operand = ("literal", _unquote(token))
        elif kind == "number":
            term = ("literal", _number(token.text))
        elif kind == "dot":
            term = ("field", [])
        elif kind == "field":
            names = [token.text[1:]]
            names += self.chain()
            return ("field", names)
        elif kind == "var":
            return ("var", token.text, self.chain())
        elif kind == "open":
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise TemplateError(f"parentheses nested deeper than {MAX_NESTING}")
            inner = self.pipeline(context="parenthesized pipeline")
            if inner.names:
                raise TemplateError("cannot declare a variable inside parentheses")
            closing = self.take()
            if closing.kind != "close":
                raise TemplateError(f"unclosed left paren in {{{{{self.action.strip()}}}}}")
            self.depth -= 1
            return ("pipe", inner, self.chain())
        elif kind == "word":
            if token.text in ("true", "false"):
                term = ("literal", token.text == "true")
            elif token.text == "nil":
                term = ("nil",)
            elif known(token.text):
                term = ("func", token.text)
            else:
                raise TemplateError(f'function "{token.text}" not defined')
        else:
            raise TemplateError(f"unexpected {token.text!r} in operand")
        if (following := self.peek()) is not None and following.kind == "field" and not following.spaced:
            raise TemplateError(f"unexpected . after term {token.text!r}")
        return term

    def chain(self) -> list[str]:
        names: list[str] = []
        while (token := self.peek()) is not None and token.kind == "field" and not token.spaced:
            names.append(token.text[1:])
            self.position += 1
        return names

    def end(self) -> None:
        token = self.peek()
        if token is not None:
            raise TemplateError(f"unexpected {token.text!r} in {{{{{self.action.strip()}}}}}")


def _pipeline_of(tokens: list[_Token], action: str, context: str, declarations: int = 1) -> Pipeline:
    parser = _Parser(tokens, action)
    pipeline = parser.pipeline(context=context, declarations=declarations)
    parser.end()
    return pipeline


def _open_block(
    kind: str,
    tokens: list[_Token],
    action: str,
    current: list[_Node],
    stack: list[tuple[_Node, list[_Node]]],
    *,
    chained: bool = False,
) -> list[_Node]:
    """Append an if/with/range block to `current`, push it on `stack` (at most MAX_NESTING deep)
    and return its body, the list the actions that follow fill."""
    pipeline = _pipeline_of(tokens, action, kind, declarations=2 if kind == "range" else 1)
    node = _Node(kind, pipeline=pipeline, chained=chained)
    current.append(node)
    stack.append((node, current))
    if len(stack) > MAX_NESTING:
        raise TemplateError(f"blocks nested deeper than {MAX_NESTING}")
    return node.body


def parse(source: str) -> list[_Node]:
    """The template's tree; TemplateError where Go's parser refuses it."""
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
        head = tokens[0].text if tokens[0].kind == "word" else ""
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
                chained = tokens[1].text
                if chained not in ("if", "with") or (node.kind == "range" and chained == "with"):
                    raise TemplateError(f"unexpected {chained!r} after else")
                current = _open_block(chained, tokens[2:], content, current, stack, chained=True)
        elif head == "end":
            if len(tokens) > 1:
                raise TemplateError("unexpected operand after end")
            if not stack:
                raise TemplateError("unexpected {{end}}")
            while True:
                node, parent = stack.pop()
                current = parent
                if not node.chained:
                    break
        elif head in ("break", "continue"):
            if not any(node.kind == "range" for node, _ in stack):
                raise TemplateError(f"{{{{{head}}}}} outside {{{{range}}}}")
            current.append(_Node(head))
        elif head in ("define", "template", "block"):
            raise TemplateError(f"{{{{{head}}}}}: NFD's templates are single documents; gpubadge refuses it")
        else:
            current.append(_Node("action", pipeline=_pipeline_of(tokens, content, "command")))
    if stack:
        raise TemplateError(f"unexpected EOF: {{{{{stack[-1][0].kind}}}}} has no {{{{end}}}}")
    return root


# --- running -------------------------------------------------------------------------------------


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


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

    @staticmethod
    def fields(base: Any, names: list[str]) -> Any:
        for name in names:
            if isinstance(base, Mapping):
                if name not in base:
                    raise TemplateError(f'map has no entry for key "{name}"')
                base = base[name]
            elif base is None or isinstance(base, Missing):
                raise TemplateError(f"nil pointer evaluating interface {{}}.{name}")
            else:
                raise TemplateError(f"can't evaluate field {name} in type {go_type(base)}")
        return base

    def pipeline(self, pipeline: Pipeline, dot: Any) -> Any:
        value: Any = _UNSET
        for command in pipeline.commands:
            self.step()
            value = self.command(command, dot, value)
        for name in pipeline.names[-1:]:
            self.assign(name, value, pipeline.declare)
        return value

    def command(self, operands: list[Operand], dot: Any, piped: Any) -> Any:
        first = operands[0]
        if first[0] == "func":
            name = first[1]
            if name in ("and", "or"):
                return self._logic(name, operands[1:], dot, piped)
            arguments = [self.operand(o, dot) for o in operands[1:]]
            if piped is not _UNSET:
                arguments.append(piped)
            return call(name, arguments, self.budget.max_bytes)
        if len(operands) > 1 or piped is not _UNSET:
            described = {"field": "field", "var": "variable", "pipe": "parenthesized pipeline"}.get(
                first[0], "non-function"
            )
            raise TemplateError(f"can't give argument to {described} {_spell(first)}")
        return self.operand(first, dot)

    def _logic(self, name: str, operands: list[Operand], dot: Any, piped: Any) -> Any:
        """Go's `and`/`or`: the first operand that decides (falsy for and, truthy for or), else the last."""
        if not operands and piped is _UNSET:
            raise TemplateError(f"wrong number of args for {name}: want at least 1 got 0")
        value: Any = None
        for operand in operands:
            value = self.operand(operand, dot)
            if truth(value) != (name == "and"):
                return value
        if piped is not _UNSET:
            value = piped
        return value

    def operand(self, operand: Operand, dot: Any) -> Any:
        kind = operand[0]
        if kind == "literal":
            return operand[1]
        if kind == "nil":
            raise TemplateError("nil is not a command")
        if kind == "field":
            return self.fields(dot, operand[1])
        if kind == "var":
            return self.fields(self.lookup(operand[1]), operand[2])
        if kind == "pipe":
            return self.fields(self.pipeline(operand[1], dot), operand[2])
        return call(operand[1], [], self.budget.max_bytes)  # a function named alone: called with no argument

    def run(self, nodes: list[_Node], dot: Any) -> None:
        for node in nodes:
            self.step()
            if node.kind == "text":
                self.write(node.text)
            elif node.kind == "action":
                assert node.pipeline is not None
                value = self.pipeline(node.pipeline, dot)
                if not node.pipeline.names:
                    self.write(go_text(value))
            elif node.kind in ("if", "with"):
                assert node.pipeline is not None
                self.scopes.append({})
                try:
                    value = self.pipeline(node.pipeline, dot)
                    if truth(value):
                        self.run(node.body, value if node.kind == "with" else dot)
                    else:
                        self.run(node.otherwise, dot)
                finally:
                    self.scopes.pop()
            elif node.kind == "range":
                self._range(node, dot)
            elif node.kind == "break":
                raise _Break
            elif node.kind == "continue":
                raise _Continue

    def _range(self, node: _Node, dot: Any) -> None:
        assert node.pipeline is not None
        pipeline = Pipeline(node.pipeline.commands)
        value = self.pipeline(pipeline, dot)
        if isinstance(value, Mapping):
            items: list[tuple[Any, Any]] = [(key, value[key]) for key in sorted(value)]
        elif isinstance(value, list):
            items = list(enumerate(value))
        elif isinstance(value, str):
            items = list(enumerate(ord(c) for c in value))
        elif isinstance(value, int) and not isinstance(value, bool):
            items = [(i, i) for i in range(value)]  # Go 1.22: range over an integer
        elif value is None or isinstance(value, Missing):
            items = []
        else:
            raise TemplateError(f"range can't iterate over {go_text(value)}")
        if not items:
            self.run(node.otherwise, dot)
            return
        names = node.pipeline.names
        for key, item in items:
            self.step()
            self.scopes.append({})
            try:
                if len(names) == 1:
                    self.assign(names[0], item, True)
                elif len(names) == 2:
                    self.assign(names[0], key, True)
                    self.assign(names[1], item, True)
                self.run(node.body, item)
            except _Continue:
                pass
            except _Break:
                break
            finally:
                self.scopes.pop()


_UNSET: Any = object()  # no piped value yet


def _spell(operand: Operand) -> str:
    if operand[0] == "field":
        return "." + ".".join(operand[1])
    if operand[0] == "var":
        return ".".join([operand[1], *operand[2]])
    if operand[0] == "literal":
        return go_text(operand[1])
    return str(operand[0])


def execute(source: str, data: Any, budget: TemplateBudget) -> str:
    """The template's output over `data`; TemplateError on any problem or past the budget."""
    run = _Run(data, budget)
    try:
        run.run(parse(source), data)
    except RecursionError:
        raise TemplateError(f"nested deeper than {MAX_NESTING} levels") from None
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
