"""Where a Python file builds a CUDA extension with torch's `cpp_extension` when its module runs. Pure, bounded.

ExLlamaV2 and ExLlamaV3 as PyPI serves them (py3-none-any wheels: CUDA sources, no built extension)
build their extension when they are imported: `exllamav2/ext.py` calls torch's
`cpp_extension.load(...)` at module level unless `import exllamav2_ext` (the extension built, from
their GitHub release wheels) succeeds first, and the package's top imports that module (through
`exllamav2/model.py`). Torch's `load` then compiles the sources with ninja, `nvcc` and a C++
compiler, for the GPU at hand (`placement.torch_extension_compiler` judges whether the image can).

A build call is `load(` or `load_inline(` where the file imports that name from
`torch.utils.cpp_extension`, or either called through `cpp_extension.` (`cpp_extension.load(`,
`torch.utils.cpp_extension.load(`); a definition (`def load(`) or a comment is none. The call runs
when its module does unless a function encloses it, or a `with ...suppress(...)`, or a `try:` that
catches the failure and goes on: one of its `except` clauses raises nothing in its first
`MAX_HANDLER_TEXT` bytes (exllamav2's `try:` has only `finally:`; exllamav3's `except IndexError:`
raises again, so neither goes on without the extension). A condition (`if build_jit:`) is taken to
hold: the built extension the file imports first is what spares the build (`LoadSites.torch_builders`).

The scan reads lines, as `scanner.layers.python_loads` does: a `try:`'s clauses are the lines at its
own indentation after its body. Work is bounded: `MAX_BUILD_CALLS_PER_FILE` calls are read in a file,
and the bytes read looking for clauses count against a layer's `MAX_CLAUSE_SCAN_BYTES`.
"""

from __future__ import annotations

import functools
import re

MAX_BUILD_CALLS_PER_FILE = 64  # exllamav2 and exllamav3 make one each
MAX_HANDLER_TEXT = 4096  # a clause's text read for a `raise`; past it, the clause is taken to go on
MAX_CLAUSE_SCAN_BYTES = 64 * 1024 * 1024  # per layer: bytes read looking for `try:` clauses
BUILDERS = ("torch.utils.cpp_extension.load", "torch.utils.cpp_extension.load_inline")

# `load(`, `load_inline(`, also across a backslash's line break (exllamav2 writes `load \` then `(`)
_BUILD_CALL = re.compile(
    rb"(?<![\w.])((?:torch\.utils\.)?cpp_extension\.)?(load|load_inline)(?:[ \t]|\\\r?\n)*\("
)
_DEFINITION = re.compile(rb"(?:async[ \t]+)?def[ \t]+")
_CLAUSE = re.compile(rb"(except|else|finally)\b")
_RAISE = re.compile(rb"\braise\b")


def build_calls(text: bytes, imported: set[str]) -> list[tuple[int, int]]:
    """The calls of torch's builder in `text` (a file's source after a newline), as (the offset of the
    newline before the call's line, the line's indentation); `imported`: the dotted names the file's
    import statements bind (`torch.utils.cpp_extension.load` for `from torch.utils.cpp_extension import load`)."""
    bare = {name.rpartition(".")[2].encode() for name in BUILDERS if name in imported}
    calls: list[tuple[int, int]] = []
    # Each line is looked at once, and a newline is looked for only since the last call: a line of
    # many calls (in a comment, past the bound's count) costs its length, not its length per call.
    line, searched, indent, comment = -1, 0, 0, False
    for match in _BUILD_CALL.finditer(text):
        if match.group(1) is None and match.group(2) not in bare:
            continue
        newline = text.rfind(b"\n", searched, match.start())
        first_on_line = newline >= 0 or searched == 0
        searched = match.start() + 1  # a call may span a backslash's line break
        if first_on_line:
            line = newline
            before = text[line + 1 : match.start()]
            content = before.lstrip(b" \t")
            indent, comment = len(before) - len(content), content.startswith(b"#")
            if _DEFINITION.fullmatch(content):
                continue  # only a line's first call can follow `def`
        if comment:
            continue
        calls.append((line, indent))
        if len(calls) >= MAX_BUILD_CALLS_PER_FILE:
            break
    return calls


@functools.lru_cache(maxsize=64)
def _outer_line(width: int) -> re.Pattern[bytes]:
    """A line indented `width` or less that holds code (neither blank nor a comment)."""
    return re.compile(rb"\n([ \t]{0,%d})(?=[^ \t\r\n#])" % width)


def goes_on(text: bytes, width: int, after: int, budget: int) -> tuple[bool | None, int]:
    """Whether the `try:` indented `width` whose body holds the line after offset `after` catches a
    failure there and goes on (module docstring), and the bytes read to say so; None where `budget`
    bytes were read first."""
    outer = _outer_line(width)
    start = position = after + 1
    while True:
        end = min(len(text), start + budget)
        line = outer.search(text, position, end)
        if line is None:
            return (None, budget) if end < len(text) else (False, end - start)
        clause = _CLAUSE.match(text, line.end())
        if len(line.group(1)) != width or clause is None:
            return False, line.end() - start  # the `try:` statement ended
        if clause.group(1) == b"except":
            following = outer.search(text, line.end(), min(end, line.end() + MAX_HANDLER_TEXT))
            body = text[line.end() : following.start() if following else line.end() + MAX_HANDLER_TEXT]
            if not _RAISE.search(body):
                return True, line.end() - start + len(body)
        position = line.end()
