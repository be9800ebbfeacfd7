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
(`torch.ops.load_library`, `ctypes.CDLL`, `cdll.LoadLibrary`; a method defined with one of those
names, as torch.package's `def import_module(self, ...)`, is not a call). For a call, the text of its scope
up to the call stands for what is loaded: the enclosing function, or else the outermost block
around it (its last `MAX_BLOCK_TEXT` bytes), or else its own line. An extension is named there by
its module name as a word in its own top-level package's code (any code, for a file outside a
package), or, in its own package's code, by a quoted glob pattern that matches
its file name as `glob` would: torchao 0.18 globs `"_C*.so"` in a `try:` and loads each match in
a `try:` of its own, inside a loop, so `_C_cutlass_90a.abi3.so` (Hopper only) and
`_C_mxfp8...so` (Blackwell) are both optional.

A module-level import only runs when its own module does. The imports are also a graph: each
module's unguarded module-level imports (and its parent packages, which Python imports first) are
what importing it runs. A module runs at import when nothing in the layer imports it (a package's
top, a script, what the image's own code or its user imports) and its package does not import its
modules by a name made at run time (vLLM 0.5.5's model registry imports
`f"vllm.model_executor.models.{module_name}"` for the model it serves: its model modules run on
demand, and so does the FlashAttention their SigLIP module imports), when its
own package quotes its dotted name (vLLM 0.8.5 resolves `"vllm.platforms.cuda.CudaPlatform"` by name
when it first asks for its platform, though a function also imports that module), or when a module
that runs imports it at module level. vLLM 0.6.1 imports `vllm_flash_attn` at the top of its
FlashAttention backend, a module its attention selector imports inside a function, on GPUs of
compute capability 8.0 and up; so vllm-flash-attn's extension (sm_80 and sm_90 only) is optional,
and vLLM runs on a T4 with XFormers, as its selector picks. A name a module gives its own package or
itself (`from . import _C`) does not count as importing it: that package runs first anyway.

`LoadSites.state(extension)` answers for one extension module file: `required` when a module that
runs at import loads it at module level (or, for a library loaded by path or a file outside a
package, when any module-level site does), `optional` when only guarded or lazy sites, or modules
that run on demand, do; None when none was found. A layer whose sources were not all read (a bound)
answers by the sites alone: any module-level site needs the extension.

`LoadSites.torch_builders()` names the top-level packages that build a CUDA extension with torch's
`cpp_extension` when they are imported: a build call that runs with its module
(`scanner.layers.python_builds`), in a module that importing the package's top runs (a stricter walk
than the one above: a module nothing imports builds nothing, since a wrong build would refuse the
image everywhere).

The scan reads lines, it does not parse Python: one regular expression finds the statements,
another the block headers (`try`, `def`, `with`, `if`, ...), and a stack of the open headers by
indentation says what encloses each statement (a header-like line inside a triple-quoted string can
mislead it; real packages' sources were read right, `tests/test_gpu_packages.py`). Work is bounded:
each file is read up to `MAX_SOURCE_BYTES`, a dotted name up to `MAX_MODULE_NAME` (a longer one is
not read), and a layer's block headers, load sites, load-by-path calls, globs and the distinct names
kept (the graph's included) are counted against `MAX_BLOCK_HEADERS`, `MAX_SITES_PER_LAYER`,
`MAX_PATH_LOADS_PER_LAYER`, `MAX_GLOBS_PER_LAYER` and `MAX_LOAD_NAMES`; past any bound the layer's
remaining sources are not read, and `truncated_by` names the bound. Sites are indexed as they are
read and what runs at import is one walk of the graph per layer, so the state of each extension is a
few lookups, whatever the number of sites and extensions.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from array import array
from dataclasses import dataclass, field
from typing import Literal

from scanner.layers.python_builds import MAX_CLAUSE_SCAN_BYTES, build_calls, goes_on
from scanner.models import ImportState

Guard = Literal["module", "guarded", "lazy"]
MAX_SOURCE_BYTES = 512 * 1024  # vLLM's largest module is 120 KiB
# One layer may hold a whole environment. The sources of 24 GPU packages (torch, transformers, vLLM,
# FlashInfer, TensorFlow, ...; 17,838 files, bench/RESULTS.md) hold 312,000 block headers, 338,000
# load sites (each imported name counts) and 85,000 distinct names, read in 2.6 s of CPU (1.6 us a site).
MAX_BLOCK_HEADERS = 8_000_000  # block headers read per layer
MAX_SITES_PER_LAYER = 4_000_000  # load sites read per layer
MAX_LOAD_NAMES = 500_000  # distinct names the sites' index keeps per layer (its memory)
MAX_PATH_LOADS_PER_LAYER = 4096  # load-by-path calls per layer (FlashInfer 0.7.4 has 327, vLLM 87)
MAX_GLOBS_PER_LAYER = 256  # distinct quoted globs in their scopes (vLLM has 4, torchao 1)
MAX_BLOCK_TEXT = 2048  # text of a load-by-path call's scope kept, up to the call
# A longer name is not read: every import of it would copy it (20,000 names imported from one module
# named by 20,000 characters: 400 MB and up to 1.3 s for one line). The longest of 29,252 real sources read
# here is 121 (FlashInfer's), and a file name is at most 255 bytes.
MAX_MODULE_NAME = 512
PYTHON_TREES = re.compile(r"/(?:site|dist)-packages/|^/(?:app|opt|srv|workspace|home|root|usr/src)/")
_EXTENSION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\.(?:cpython-[^/]*|abi3|pypy[^/]*))?\.so$")
_STATEMENT = re.compile(
    rb"\n([ \t]*)(?:from[ \t]+([.\w]+)[ \t]+import[ \t]+\(?([^#\n]*)|import[ \t]+([^#\n]*))"
)
_LOAD_CALLS = (b"import_module(", b"load_library(", b"CDLL(", b"LoadLibrary(")
# `def import_module(self, name):` (torch.package's PackageImporter): a definition, not a call
_DEFINITION = re.compile(rb"(?:async[ \t]+)?def[ \t]+\w*")
_QUOTED_NAME = re.compile(r"""['"]([\w.*?-]{1,200})['"]""")  # a quoted file name or pattern: linear
_QUALIFIED = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")  # a dotted name, quoted
_CONCATENATED = re.compile(rb"[ \t]*\+")  # `"pkg.plugins." + name`: the rest of the name is made
# `import_module(f".{name}", __name__)`, `import_module("." + name, "pkg.plugins")`: the package's name
# the second argument, `__name__` or `__package__` the file's own package (another expression: not read)
_RELATIVE_MADE = re.compile(
    rb"""import_module\([ \t]*(?:f['"]\.\{[^'"\n]{0,200}['"]|(['"])\.\1[ \t]*\+[ \t]*[\w.]{1,200})"""
    rb"""[ \t]*,[ \t]*(?:package[ \t]*=[ \t]*)?(__name__|__package__|(['"])([\w.]{1,512})\3)[ \t]*[,)]"""
)
_WORD = re.compile(r"[A-Za-z0-9_]+")  # a name in a scope's text: an extension's name matches a whole one
# Packages whose importers are listed (`LoadSites.importers_of`): Triton, FlashInfer and tvm-ffi compile
# kernels for the GPU at hand, and placement names who is left without them
# (`placement.triton_compiler`, `placement.flashinfer_compiler`, `placement.tvm_ffi_compiler`).
WATCHED_IMPORTS = frozenset({"triton", "flashinfer", "tvm_ffi.cpp"})  # tvm-ffi's JIT, not its calls
_HEADER = re.compile(rb"\n([ \t]*)(try|def|async|with|class|if|elif|else|for|while|except|finally)\b")
# A site that is a call of torch's extension builder (`scanner.layers.python_builds`), among import sites
_BUILD: list[str] = []
MAX_BUILD_IMPORTS = 64  # the modules a building file imports, kept as the built extension it may try first


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


@dataclass
class LoadSites:
    """One layer's load sites (`add_source` per Python file), then `state(extension path)`.

    Sites are indexed as they are read, each key noting whether some site of it is at module level:
    the dotted modules imported (and their last names), the words in each load-by-path call's scope,
    and the quoted globs there per top-level package. `state` is then a few lookups and at most
    `MAX_GLOBS_PER_LAYER` glob matches, however many sites and extensions the layer holds.
    """

    headers_read: int = 0
    sites_read: int = 0
    path_loads: int = 0
    globs_read: int = 0
    names_kept: int = 0
    truncated_by: str | None = None  # the bound past which the layer's remaining sources were not read
    _modules: dict[str, bool] = field(default_factory=dict, repr=False)  # dotted target -> at module level
    _names: dict[str, bool] = field(default_factory=dict, repr=False)  # a target's last name -> same
    # a word in a by-path call's scope, per top-level package of the call -> at module level
    _words: dict[str, dict[str, bool]] = field(default_factory=dict, repr=False)
    _globs: dict[str, dict[str, bool]] = field(default_factory=dict, repr=False)  # top -> glob -> same
    # the import graph: dotted names as numbers, what each module read imports at module level
    # (unguarded), the modules read, and the names imported from outside their own package line
    _nodes: dict[str, int] = field(default_factory=dict, repr=False)
    _edges: dict[int, array[int]] = field(default_factory=dict, repr=False)
    _read: set[int] = field(default_factory=set, repr=False)
    _named: set[int] = field(default_factory=set, repr=False)
    _named_down_to: dict[int, int] = field(default_factory=dict, repr=False)  # `_name`'s progress per name
    _by_name: set[int] = field(default_factory=set, repr=False)  # named in a string of their own package
    # packages whose modules the layer imports by a name made at run time (their modules run on demand)
    _on_demand: set[int] = field(default_factory=set, repr=False)
    _parent: dict[int, int] = field(default_factory=dict, repr=False)  # a module read -> its package
    _runs: set[int] | None = field(default=None, repr=False)  # what runs at import (`_at_import`)
    _any_words: dict[str, bool] | None = field(
        default=None, repr=False
    )  # every package's words (`_all_words`)
    _importers: dict[str, set[str]] = field(default_factory=dict, repr=False)  # watched -> importing tops
    # a module whose build call runs with it -> (its dotted name, the modules its file imports)
    _builders: dict[int, tuple[str, list[str]]] = field(default_factory=dict, repr=False)
    clause_bytes: int = 0  # bytes read looking for the clauses of `try:`s around build calls

    @property
    def truncated(self) -> bool:
        return self.truncated_by is not None

    def add_source(self, path: str, text: bytes) -> None:
        """Record the load sites of one Python file (its first `MAX_SOURCE_BYTES`)."""
        if self.truncated:
            return
        text = b"\n" + text[:MAX_SOURCE_BYTES]  # every line, the first too, follows a newline
        module = dotted_module(path) or ""
        package = module if path.endswith("/__init__.py") else module.rpartition(".")[0]
        self._runs = self._any_words = None
        found: list[tuple[int, int, list[str] | None]] = []  # (offset, indent, targets; None: by path)
        for match in _STATEMENT.finditer(text):
            found.append((match.start(), len(match.group(1)), _targets(match, package)))
        named, made = _qualified_names(text, module.partition(".")[0])
        if b"import_module(" in text:
            for relative in _RELATIVE_MADE.finditer(text):
                made.append(relative.group(4).decode() if relative.group(4) else package)
        for call in _LOAD_CALLS:
            at = text.find(call)
            while at >= 0:
                line = text.rfind(b"\n", 0, at)
                content = text[line + 1 : at].lstrip(b" \t")
                if not content.startswith(b"#") and not _DEFINITION.fullmatch(content):
                    found.append((line, at - line - 1 - len(content), None))
                at = text.find(call, at + 1)
        imports: list[str] = []  # what the file imports, where it imports torch's builder
        if module and any("cpp_extension" in name for _, _, targets in found if targets for name in targets):
            imports = sorted({name for _, _, targets in found if targets for name in targets})
            found += [(at, indent, _BUILD) for at, indent in build_calls(text, set(imports))]
        by_path = sum(1 for site in found if site[2] is None)
        sites = (
            sum(1 if targets is None else len(targets) for _, _, targets in found) + len(named) + len(made)
        )
        if self.sites_read + sites > MAX_SITES_PER_LAYER:
            self.truncated_by = "MAX_SITES_PER_LAYER"
            return
        if self.path_loads + by_path > MAX_PATH_LOADS_PER_LAYER:
            self.truncated_by = "MAX_PATH_LOADS_PER_LAYER"
            return
        self.sites_read += sites
        self.path_loads += by_path
        source = self._node(module or path)  # a file outside a package is never imported by name
        self._read.add(source)
        outgoing = self._edges.setdefault(source, array("i"))
        parts = module.split(".")
        for depth in range(1, len(parts)):  # importing a module imports its parent packages first
            outgoing.append(self._node(".".join(parts[:depth])))
        if len(parts) > 1:
            self._parent[source] = outgoing[-1]
        for name in named:  # "vllm.platforms.cuda.CudaPlatform": the module, or the module of an attribute
            self._by_name.add(self._node(name))
            self._by_name.add(self._node(name.rpartition(".")[0]))
        for name in made:  # f"vllm.model_executor.models.{name}": that package's modules load on demand
            if name:
                self._on_demand.add(self._node(name))
        if not found:
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
                    word == b"try" or (word == b"with" and _suppresses(text, header.end()))
                ):
                    inner = "guarded"
                stack.append((depth, inner, header.start(), function))
                self.headers_read += 1
                header = next(headers, None)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            at_module = not stack or stack[-1][1] == "module"
            if targets is _BUILD:
                if self._build_runs(text, stack, at):
                    self._builders[source] = (module, imports[:MAX_BUILD_IMPORTS])
            elif targets is None:  # a library loaded by path: the names in its scope stand for it
                end = text.find(b"\n", at + 1)
                end = end if end >= 0 else len(text)
                scope = text[max(_scope_start(stack, at), end - MAX_BLOCK_TEXT) : end]
                self._add_scope(scope.decode("utf-8", "replace"), module.partition(".")[0], at_module)
            else:
                for target in targets:
                    for watched in WATCHED_IMPORTS:
                        if module and (target == watched or target.startswith(watched + ".")):
                            self._importers.setdefault(watched, set()).add(module.partition(".")[0])
                    self._note(self._modules, target, at_module)
                    self._note(self._names, target.rpartition(".")[2], at_module)
                    self._name(target, module)
                    if at_module:
                        outgoing.append(self._node(target))
        if self.headers_read > MAX_BLOCK_HEADERS:
            self.truncated_by = "MAX_BLOCK_HEADERS"
        elif self.names_kept > MAX_LOAD_NAMES:
            self.truncated_by = "MAX_LOAD_NAMES"

    def _build_runs(self, text: bytes, stack: list[tuple[int, Guard, int, bool]], at: int) -> bool:
        """Whether the build call on the line after offset `at`, inside the blocks `stack`, runs when its
        module does (`scanner.layers.python_builds`)."""
        for depth, _, offset, function in stack:
            head = offset + 1 + depth
            if function or (text.startswith(b"with", head) and _suppresses(text, head)):
                return False
            if text.startswith(b"try", head):
                caught, read = goes_on(text, depth, at, MAX_CLAUSE_SCAN_BYTES - self.clause_bytes)
                self.clause_bytes += read
                if caught is None:
                    self.truncated_by = "MAX_CLAUSE_SCAN_BYTES"
                if caught is not False:
                    return False
        return True

    def _add_scope(self, scope: str, top: str, at_module: bool) -> None:
        words = self._words.setdefault(top, {})
        for word in _WORD.findall(scope):
            self._note(words, word, at_module)
        globs = self._globs.setdefault(top, {})
        for pattern in _QUOTED_NAME.findall(scope):
            if "*" not in pattern and "?" not in pattern:
                continue
            if pattern not in globs:
                if self.globs_read >= MAX_GLOBS_PER_LAYER:
                    self.truncated_by = "MAX_GLOBS_PER_LAYER"
                    return
                self.globs_read += 1
            self._note(globs, pattern, at_module)

    def _node(self, name: str) -> int:
        """The number of a dotted name (or a file's path) in the import graph."""
        node = self._nodes.get(name)
        if node is None:
            node = self._nodes[name] = len(self._nodes)
            self.names_kept += 1
        return node

    def _name(self, target: str, importer: str) -> None:
        """`importer` imports `target`: it and its parent packages are imported by name, up to the
        first that is `importer` itself or one of its own packages (those run before it anyway).

        Each name remembers the length of its shortest prefix named so far, so a site costs one step
        plus the prefixes it names first, however deep the name and however many sites repeat it."""
        node = self._node(target)
        shortest = self._named_down_to.get(node, len(target) + 1)
        if shortest == 0:
            return
        name = target if shortest > len(target) else target[:shortest].rpartition(".")[0]
        while name:
            if name == importer or importer.startswith(name + "."):
                break
            self._named.add(self._node(name))
            shortest = len(name)
            name = name.rpartition(".")[0]
        else:
            shortest = 0
        self._named_down_to[node] = shortest

    def _at_import(self) -> set[int]:
        """The modules (and the names they import) that run when the layer's packages are imported:
        everything reached over unguarded module-level imports from the modules nothing imports, but
        those of a package whose modules are imported by a name made at run time."""
        if self._runs is None:
            on_demand, parent = self._on_demand, self._parent
            runs = {
                node
                for node in self._read
                if node in self._by_name
                or (node not in self._named and parent.get(node, -1) not in on_demand)
            }
            self._runs = self._reach(runs)
        return self._runs

    def _reach(self, roots: set[int]) -> set[int]:
        """`roots` and everything they reach over unguarded module-level imports."""
        reached = set(roots)
        waiting = list(reached)
        while waiting:
            for target in self._edges.get(waiting.pop(), ()):
                if target not in reached:
                    reached.add(target)
                    waiting.append(target)
        return reached

    def _all_words(self) -> dict[str, bool]:
        """Every package's by-path words in one index, merged once per layer read (files outside a
        package are named by any call)."""
        if self._any_words is None:
            merged: dict[str, bool] = {}
            for words in self._words.values():
                for word, at_module in words.items():
                    merged[word] = merged.get(word, False) or at_module
            self._any_words = merged
        return self._any_words

    def _note(self, index: dict[str, bool], key: str, at_module: bool) -> None:
        """Key `key` in `index`, noting whether a site of it is at module level."""
        known = index.get(key)
        if known is None:
            self.names_kept += 1
        index[key] = bool(known) or at_module

    def _from_tops(self) -> set[int]:
        """What importing the layer's top-level packages (and modules) runs: everything reached over
        unguarded module-level imports from them."""
        return self._reach({node for node in self._read if node not in self._parent})

    def torch_builders(self) -> dict[str, list[str]]:
        """The top-level packages that build a CUDA extension with torch's `cpp_extension` when they are
        imported -> the modules the building files import (the built extension, where the image carries
        it, spares the build). A build counts where its call runs with its module
        (`scanner.layers.python_builds`) and importing its top-level package runs that module; a module
        nothing imports (a test, a benchmark) builds nothing. Empty where the layer's sources were not all
        read: nothing is claimed."""
        if self.truncated or not self._builders:
            return {}
        reached = self._from_tops()
        found: dict[str, set[str]] = {}
        for node, (module, imports) in self._builders.items():
            if node in reached:
                found.setdefault(module.partition(".")[0], set()).update(imports)
        return {top: sorted(imports) for top, imports in sorted(found.items())}

    def importers_of(self, package: str) -> list[str]:
        """The top-level packages (`package` is one of `WATCHED_IMPORTS`; its own top-level package is
        left out) whose sources import it or a module below it anywhere, guarded or not, sorted."""
        return sorted(self._importers.get(package, set()) - {package.partition(".")[0]})

    def state(self, extension_path: str) -> ImportState | None:
        """`required`, `optional` or None for the extension module at `extension_path` (see the module
        docstring)."""
        name = extension_name(extension_path)
        if name is None:
            return None
        dotted = dotted_module(extension_path)
        if dotted is None:
            hits = [self._names.get(name)]
        else:
            hits = [self._modules.get(dotted)]
            if hits[0] and not self.truncated:  # a module-level site: does its module run at import?
                hits[0] = self._nodes[dotted] in self._at_import()
        # a call names its own package's extensions (torch's `os.path.join` names no `join.abi3.so` of cuDF's);
        # a file outside any package, any call's words
        words = self._words.get(dotted.partition(".")[0], {}) if dotted else self._all_words()
        hits.append(words.get(name))
        if dotted:  # a glob names files of its own package
            basename = posixpath.basename(extension_path)
            globs = self._globs.get(dotted.partition(".")[0], {})
            hits += [module for pattern, module in globs.items() if fnmatch.fnmatchcase(basename, pattern)]
        if any(hits):
            return "required"
        return "optional" if any(hit is not None for hit in hits) else None


def _qualified_names(text: bytes, top: str) -> tuple[list[str], list[str]]:
    """The dotted names of the file's own top-level package quoted in its text, and the packages whose
    modules it names by a name made at run time.

    A whole name (`"vllm.platforms.cuda.CudaPlatform"`, which `resolve_obj_by_qualname` imports) is a
    module that may be imported by name, at any time, so it counts as run at import. A quoted package
    followed by a placeholder or a `+` (`f"vllm.model_executor.models.{module_name}"`, `"pkg.plugins." +
    name`, `"pkg.plugins.%s"`) makes a module's name when it is needed: vLLM 0.5.5's model registry
    imports the module of the model it serves, so the modules of that package run on demand. Each
    hit is read once."""
    named: list[str] = []
    made: list[str] = []
    if not top:
        return named, made
    for quote in (b'"', b"'"):
        needle = quote + top.encode() + b"."
        at = text.find(needle)
        while at >= 0:
            match = _QUALIFIED.match(text, at + 1)
            end = match.end() if match is not None else at
            if match is not None and end - match.start() <= MAX_MODULE_NAME:
                after = text[end : end + 2]
                if after[:1] == quote:
                    named.append(match.group().decode())
                elif after in (b".{", b".%") or (
                    after == b"." + quote and _CONCATENATED.match(text, end + 2)
                ):
                    made.append(match.group().decode())
            at = text.find(needle, at + 1)
    return named, made


def _suppresses(text: bytes, at: int) -> bool:
    """Whether the `with` header whose line goes on from `at` enters a `suppress(...)`."""
    return b"suppress" in text[at : text.find(b"\n", at)]


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
        found = [part.split()[0] for part in plain.decode("utf-8", "replace").split(",") if part.split()]
        return [name for name in found if len(name) <= MAX_MODULE_NAME]
    if len(source) > MAX_MODULE_NAME:
        return []
    base = _resolve(source.decode("utf-8", "replace"), package)
    if len(base) > MAX_MODULE_NAME:  # a relative import resolved against a deep package
        return []
    found = [base]
    for part in names.decode("utf-8", "replace").replace(")", "").split(","):
        words = part.split()
        if words and len(words[0]) <= MAX_MODULE_NAME and words[0].isidentifier():
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
