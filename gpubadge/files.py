"""The files commands read (inventories, NFD specs and node features), with errors a user can act on.

Each loader raises `FileProblem` (a ValueError) whose message names the file, the line and the path
in it where the document has them, and what was expected: `inventory fleet.yaml: line 12,
servers[0].gpus[1].memory_mib: expected an integer, got 'lots'`. Never pydantic's dump.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from scanner.problems import document_error, problems

if TYPE_CHECKING:
    from placement.inventory import Inventory


class FileProblem(ValueError):
    """A file that could not be read or is not what it should be; the message says where and why."""


def read_text(path: Path, kind: str, most: int | None = None) -> str:
    """The file's text; FileProblem naming it (`inventory x.yaml: no such file`) when it cannot be read.

    With `most`, at most that many bytes are read: a bigger file is refused naming the bound, without
    being read whole (a node-features or spec file is untrusted input).
    """
    try:
        if most is None:
            return path.read_text()
        with path.open("rb") as file:
            data = file.read(most + 1)
        if len(data) > most:
            raise FileProblem(f"{kind} {path}: larger than {most:,} bytes, the most that is read")
        return data.decode()
    except FileNotFoundError:
        raise FileProblem(f"{kind} {path}: no such file") from None
    except IsADirectoryError:
        raise FileProblem(f"{kind} {path}: a directory, not a file") from None
    except UnicodeDecodeError as exc:
        raise FileProblem(f"{kind} {path}: not text (byte {exc.start} is not UTF-8)") from None
    except OSError as exc:
        raise FileProblem(f"{kind} {path}: cannot read it: {exc.strerror or exc}") from None


def load_inventory(path: Path) -> Inventory:
    """An inventory file (`{servers: [...]}` or a bare list, YAML or JSON), validated."""
    from placement.inventory import Inventory, parse_json_or_yaml

    text = read_text(path, "inventory")
    try:
        data = parse_json_or_yaml(text)
    except ValueError as exc:
        cause = exc.__context__ if exc.__context__ is not None else exc
        raise FileProblem(f"inventory {path}: not YAML or JSON: {document_error(cause)}") from None
    if isinstance(data, list):
        data = {"servers": data}
    if data is not None and not isinstance(data, dict):
        raise FileProblem(
            f"inventory {path}: expected a mapping with a servers list, got {type(data).__name__}"
        )
    try:
        return Inventory.model_validate(data or {})
    except ValidationError as exc:
        raise FileProblem(describe(f"inventory {path}", exc, text)) from None


def describe(source: str, exc: ValidationError, text: str | None = None) -> str:
    """`source: line N, path: expected …`, one problem per line after the first."""
    found = problems(exc, text)
    if len(found) == 1:
        return f"{source}: {found[0]}"
    return f"{source}: {len(found)} problems:\n" + "\n".join(f"  {line}" for line in found)
