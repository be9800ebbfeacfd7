"""What upper layers hide from lower ones: the one index every layer consumer asks. Pure.

OCI overlay rules, as `mutate.extract` in go-containerregistry applies them when it squashes
an image, but as an index instead of a squashed tar, because consumers see layers one at a
time, top layer first, and must ask "is this lower entry still visible?" as entries arrive:

- a whiteout `dir/.wh.name` deletes `dir/name` and everything under it in lower layers;
- an opaque marker `dir/.wh..wh..opq` hides everything under `dir` in lower layers (not `dir`);
- a non-directory entry at a path hides everything a lower layer has *under* that path (a file
  replacing a directory); the entry at the same path is simply the upper one, which the
  consumer keeps (its own "first seen wins" map).

Layers are numbered top-down from 0; each hide remembers the topmost layer that did it, and
`hidden_above(path, index)` says whether a layer above `index` hides `path`. A lookup costs
O(len(path)): ancestors are sliced out only at lengths some hide has, so a path with thousands
of components costs one scan for slashes, not one slice per level. `forget` undoes one layer's
hides (the libc analysis rolls back a cached layer it could not use).
"""

from __future__ import annotations

from collections.abc import Iterable

_NOWHERE = 1 << 62  # "hidden by no layer"
OPAQUE_MARKER = ".wh..wh..opq"
WHITEOUT_PREFIX = ".wh."


def whiteout_target(directory: str, name: str) -> tuple[str, str] | None:
    """("opaque", dir) or ("deleted", path) for a whiteout entry's name, None for a normal entry."""
    if not name.startswith(WHITEOUT_PREFIX):
        return None
    if name == OPAQUE_MARKER:
        return "opaque", directory
    hidden = name[len(WHITEOUT_PREFIX) :]
    return "deleted", f"{directory}/{hidden}" if directory != "/" else f"/{hidden}"


def _slash_positions(path: str) -> Iterable[int]:
    """Indexes of the `/` separators after the root one: the lengths of the path's ancestors."""
    position = path.find("/", 1)
    while position != -1:
        yield position
        position = path.find("/", position + 1)


class WhiteoutIndex:
    """Deleted paths and covered directories, each with the topmost layer that hid it."""

    def __init__(self) -> None:
        self.deleted: dict[str, int] = {}  # the path and everything under it
        self.covered: dict[str, int] = {}  # everything under the path (opaque dirs, non-directories)
        self._lengths: set[int] = set()  # lengths of the keys above (a superset after `forget`)

    def delete(self, index: int, path: str) -> bool:
        """Record a whiteout of `path` by layer `index`; True when the index changed."""
        return self._hide(self.deleted, index, path)

    def cover(self, index: int, path: str) -> bool:
        """Record that layer `index` hides everything under `path`; True when the index changed."""
        return self._hide(self.covered, index, path)

    def _hide(self, table: dict[str, int], index: int, path: str) -> bool:
        if path in table:
            return False  # layers arrive top-down: the first hide is the topmost
        table[path] = index
        self._lengths.add(len(path))
        return True

    def forget(self, index: int, paths: Iterable[str]) -> None:
        """Undo what layer `index` hid at `paths` (only the keys it owns)."""
        for path in paths:
            for table in (self.deleted, self.covered):
                if table.get(path) == index:
                    del table[path]

    def is_deleted(self, path: str) -> bool:
        """A whiteout of this very path (by any layer seen so far)."""
        return path in self.deleted

    def hides_below(self, path: str) -> bool:
        """Some layer hides what lower layers have under `path` (deleted, opaque or replaced)."""
        return path in self.deleted or path in self.covered

    def hidden_above(self, path: str, index: int) -> bool:
        """True when a layer above layer `index` deleted `path` or hides it under an ancestor."""
        if self.deleted.get(path, _NOWHERE) < index:
            return True
        lengths = self._lengths
        if not lengths:
            return False
        if 1 in lengths and min(self.deleted.get("/", _NOWHERE), self.covered.get("/", _NOWHERE)) < index:
            return True
        if len(lengths) < 32:  # the usual case: few distinct hide lengths, test each directly
            candidates: Iterable[int] = (n for n in lengths if 1 < n < len(path) and path[n] == "/")
        else:
            candidates = (n for n in _slash_positions(path) if n in lengths)
        for position in candidates:
            ancestor = path[:position]
            if min(self.deleted.get(ancestor, _NOWHERE), self.covered.get(ancestor, _NOWHERE)) < index:
                return True
        return False
