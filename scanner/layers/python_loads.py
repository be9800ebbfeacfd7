"""Where a package's Python code loads its compiled extensions, and whether it can run without them.
Pure, bounded.

A package that ships GPU code in an extension module can need it (vLLM imports
`vllm._C_stable_libtorch` at the top of `vllm/platforms/cuda.py`: no kernels, no vLLM) or only gain
features from it (vLLM imports `_qutlass_C` under `contextlib.suppress(ImportError)`, torchao loads
its `_C` library in a `try:` and runs on without it). What the image carries tells the two apart:
the statements that load an extension, and what encloses them. For each load site the scan records
how it runs:

* `module`: at module level, outside any `try:` or `with ...suppress(...)`: the package's import
  fails without the extension, so the package needs it;
* `guarded`: inside a `try:` body or a `with ...suppress(...)` block: the package was written to
  run without it (a `try:` is taken to catch the failure, as the real ones do);
* `lazy`: inside a function: loaded on demand, when a feature that uses it is called.

A load site is an `import`/`from ... import` statement (relative imports resolved against the
file's package), `importlib.import_module("...")`, or a call that loads a library by path
(`torch.ops.load_library`, `ctypes.CDLL`, `cdll.LoadLibrary`). For a call, the text of its scope
up to the call stands for what is loaded: the enclosing function, or else the outermost block
around it (its last `MAX_BLOCK_TEXT` bytes), or else its own line. An extension is named there by
its module name as a word, or, in its own package's code, by a quoted glob pattern that matches
its file name as `glob` would: torchao 0.18 globs `"_C*.so"` in a `try:` and loads each match in
a `try:` of its own, inside a loop, so `_C_cutlass_90a.abi3.so` (Hopper only) and
`_C_mxfp8...so` (Blackwell) are both optional.

`LoadSites.state(extension)` answers for one extension module file: `required` when any
module-level site loads it, `optional` when only guarded or lazy sites do, None when none was
found. The scan reads lines, it does not parse Python: one regular expression finds the
statements, another the block headers (`try`, `def`, `with`, `if`, ...), and a stack of the open
headers by indentation says what encloses each statement (a header-like line inside a
triple-quoted string can mislead it; real packages' sources were read right, `tests/test_gpu_packages.py`).
Work is bounded: each file is read up to `MAX_SOURCE_BYTES`, and a layer's block headers and load
sites are counted against `MAX_BLOCK_HEADERS` and `MAX_SITES_PER_LAYER`; past either bound the
layer's remaining sources are not read, and `truncated` says so.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from dataclasses import dataclass, field
from typing import Literal

from scanner.models import ImportState

Guard = Literal["module", "guarded", "lazy"]
MAX_SOURCE_BYTES = 512 * 1024  # vLLM's largest module is 120 KiB
MAX_BLOCK_HEADERS = 2_000_000  # block headers read per layer (vLLM's sources hold 144,000)
MAX_SITES_PER_LAYER = 200_000
MAX_BLOCK_TEXT = 2048  # text of a load-by-path call's scope kept, up to the call
PYTHON_TREES = re.compile(r"/(?:site|dist)-packages/|^/(?:app|opt|srv|workspace|home|root|usr/src)/")
_EXTENSION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\.(?:cpython-[^/]*|abi3|pypy[^/]*))?\.so$")
_STATEMENT = re.compile(
    rb"\n([ \t]*)(?:from[ \t]+([.\w]+)[ \t]+import[ \t]+\(?([^#\n]*)|import[ \t]+([^#\n]*))"
)
_LOAD_CALLS = (b"import_module(", b"load_library(", b"CDLL(", b"LoadLibrary(")
_GLOB = re.compile(r"""['"]([\w.*?-]*[*?][\w.*?-]*)['"]""")  # a quoted file-name pattern
_HEADER = re.compile(rb"\n([ \t]*)(try|def|async|with|class|if|elif|else|for|while|except|finally)\b")


def extension_name(path: str) -> str | None:
    """The module name of a compiled extension (`_vllm_fa3_C` for `_vllm_fa3_C.abi3.so`), or None."""
    match = _EXTENSION.match(posixpath.basename(path))
    return match.group(1) if match else None


def dotted_module(path: str) -> str | None:
    """`vllm.vllm_flash_attn._vllm_fa3_C` for `.../site-packages/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so`,
    `pkg.mod` for `.../pkg/mod.py`: the import path of a file under a Python tree, or None."""
    match = re.search(r"/(?:site|dist)-packages/(.+)$", path)
    if match is None:
        return None
    parts = match.group(1).split("/")
    stem = extension_name(parts[-1]) if parts[-1].endswith(".so") else parts[-1].removesuffix(".py")
    if not stem or parts[-1] == stem:
        return None
    names = [*parts[:-1], stem]
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names) if all(n.isidentifier() for n in names) else None


@dataclass(slots=True)
class _Site:
    target: str  # a dotted module name, or the text of a block that loads a library by path
    guard: Guard
    by_path: bool
    top: str = ""  # the top-level package of the file the site is in


@dataclass
class LoadSites:
    """One layer's load sites (`add_source` per Python file), then `state(extension path)`."""

    sites: list[_Site] = field(default_factory=list)
    headers_read: int = 0
    truncated: bool = False

    def add_source(self, path: str, text: bytes) -> None:
        """Record the load sites of one Python file (its first `MAX_SOURCE_BYTES`)."""
        if self.truncated:
            return
        text = b"\n" + text[:MAX_SOURCE_BYTES]  # every line, the first too, follows a newline
        module = dotted_module(path) or ""
        package = module if path.endswith("/__init__.py") else module.rpartition(".")[0]
        found: list[tuple[int, int, list[str] | None]] = []  # (offset, indent, targets; None: by path)
        for match in _STATEMENT.finditer(text):
            found.append((match.start(), len(match.group(1)), _targets(match, package)))
        for call in _LOAD_CALLS:
            at = text.find(call)
            while at >= 0:
                line = text.rfind(b"\n", 0, at)
                content = text[line + 1 : at].lstrip(b" \t")
                if not content.startswith(b"#"):
                    found.append((line, at - line - 1 - len(content), None))
                at = text.find(call, at + 1)
        if not found:
            return
        if len(self.sites) + len(found) > MAX_SITES_PER_LAYER:
            self.truncated = True
            return
        found.sort(key=lambda site: site[0])
        headers = _HEADER.finditer(text) if any(indent for _, indent, _ in found) else iter(())
        header = next(headers, None)
        stack: list[tuple[int, Guard, int, bool]] = []  # open blocks: (indent, guard inside, offset, a def)
        for at, indent, targets in found:
            while header is not None and header.start() < at:
                depth, word = len(header.group(1)), header.group(2)
                while stack and stack[-1][0] >= depth:
                    stack.pop()
                outer: Guard = stack[-1][1] if stack else "module"
                inner = outer
                function = word == b"def" or (word == b"async" and text.startswith(b"def", header.end() + 1))
                if function:
                    inner = "lazy"
                elif outer == "module" and (
                    word == b"try"
                    or (
                        word == b"with" and b"suppress" in text[header.end() : text.find(b"\n", header.end())]
                    )
                ):
                    inner = "guarded"
                stack.append((depth, inner, header.start(), function))
                self.headers_read += 1
                header = next(headers, None)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            guard: Guard = stack[-1][1] if stack else "module"
            if targets is None:  # a library loaded by path: the names in its scope stand for it
                block_start = _scope_start(stack, at)
                end = text.find(b"\n", at + 1)
                block = text[block_start : end if end >= 0 else len(text)][-MAX_BLOCK_TEXT:]
                self.sites.append(
                    _Site(block.decode("utf-8", "replace"), guard, True, module.partition(".")[0])
                )
            else:
                self.sites.extend(_Site(target, guard, False) for target in targets)
        if self.headers_read > MAX_BLOCK_HEADERS:
            self.truncated = True

    def state(self, extension_path: str) -> ImportState | None:
        """`required`, `optional` or None for the extension module at `extension_path` (see the module
        docstring)."""
        name = extension_name(extension_path)
        if name is None:
            return None
        dotted = dotted_module(extension_path)
        basename = posixpath.basename(extension_path)
        top = dotted.partition(".")[0] if dotted else None
        token = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])")
        found: ImportState | None = None
        for site in self.sites:
            if site.by_path:
                hit = token.search(site.target) is not None or (
                    site.top == top  # a glob names files of its own package
                    and any(fnmatch.fnmatchcase(basename, pattern) for pattern in _GLOB.findall(site.target))
                )
            else:
                hit = site.target == dotted if dotted else site.target.rpartition(".")[2] == name
            if not hit:
                continue
            if site.guard == "module":
                return "required"
            found = "optional"
        return found


def _scope_start(stack: list[tuple[int, Guard, int, bool]], at: int) -> int:
    """Where a load-by-path call's scope starts: its innermost enclosing function, else the outermost
    block around it, else its own line (`at`)."""
    for _, _, offset, function in reversed(stack):
        if function:
            return offset
    return stack[0][2] if stack else at


def _targets(match: re.Match[bytes], package: str) -> list[str]:
    """The dotted modules one import statement loads."""
    source, names, plain = match.group(2), match.group(3), match.group(4)
    if plain is not None:
        return [part.split()[0] for part in plain.decode("utf-8", "replace").split(",") if part.split()]
    base = _resolve(source.decode("utf-8", "replace"), package)
    found = [base]
    for part in names.decode("utf-8", "replace").replace(")", "").split(","):
        words = part.split()
        if words and words[0].isidentifier():
            found.append(f"{base}.{words[0]}" if base else words[0])
    return found


def _resolve(name: str, package: str) -> str:
    """A relative module name (`.`, `..ops`) resolved against the importing file's package."""
    if not name.startswith("."):
        return name
    level = len(name) - len(name.lstrip("."))
    parts = package.split(".") if package else []
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    rest = name[level:]
    return ".".join([*base, rest] if rest else base)
