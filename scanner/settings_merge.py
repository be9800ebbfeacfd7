"""How the config file and the environment combine into one set of settings, and where each came from.

The rule, for every setting:
- A single value: the command line, then the environment, then the file, then the default; the first
  that sets it wins (`Origin.shadows` says when the environment replaced a different file value).
- A list or map is never replaced wholesale; the sources merge:
  - a map (`webhook_secrets`, `agent_tokens`) merges by key;
  - a list of entries with a key (`registries`, keyed by `host`) merges by that key, field by field:
    what one source sets and the other does not is kept, so the environment adds a host, or a field,
    and the file's credentials, mirrors, `insecure` and push accounts stay;
  - a plain list (`platforms`) is the union of both, in order.
- Where a merge would have to guess (one key, or one field of one host, given two different values;
  `all` platforms beside named ones) it raises `SettingsConflict`, naming the setting, the key or
  host and field, and both sources, never a value: values may be secrets.

Pure: the caller validates each source on its own and says how to name it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, SecretStr

Source = Literal["default", "file", "environment", "merged", "command line"]
REDACTED = "[redacted]"
# `scheme://user:password@` anywhere in a text, and a bare `user:password@host` value (a mirror
# given as `user:password@mirror:5000`): the password becomes REDACTED, the user name stays.
_URL_USERINFO = re.compile(r"(?P<lead>[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*):(?P<password>[^/@\s]*)@")
_BARE_USERINFO = re.compile(
    r"^(?P<lead>[^/@\s:]+):(?P<password>[^/@\s]*)@(?=(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]+)?(?:/|$))"
)


@dataclass(frozen=True)
class Keyed:
    """A list of models merged entry by entry on the value of the field `key`."""

    key: str


MergeKind = Literal["value", "map", "set"] | Keyed


class SettingsConflict(ValueError):
    """Two sources (or one source twice) give one entry different values: refuse to guess."""


@dataclass(frozen=True)
class Origin:
    """Where one setting's value came from; for a list or map, where each entry came from too."""

    source: Source
    entries: Mapping[str, Source] = field(default_factory=dict)
    shadows: bool = False  # the environment replaced a different value from the file


@dataclass(frozen=True)
class Layer:
    """One source's validated values, only those it set, and how to name it in an error."""

    source: Literal["file", "environment"]
    values: Mapping[str, Any]
    describe: Callable[[str], str]  # setting name -> "the file /etc/gpubadge.toml", …


def merge_layers(
    kinds: Mapping[str, MergeKind], file: Layer, env: Layer
) -> tuple[dict[str, Any], dict[str, Origin]]:
    """The file's and the environment's values combined by the rule above, and each one's origin."""
    values: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    for name in [*file.values, *(n for n in env.values if n not in file.values)]:
        kind = kinds.get(name, "value")
        present = [layer for layer in (file, env) if name in layer.values]
        if kind == "value":
            last = present[-1]
            values[name] = last.values[name]
            shadows = len(present) == 2 and file.values[name] != env.values[name]
            origins[name] = Origin(last.source, shadows=shadows)
            continue
        merged: Any
        entries: dict[str, Source]
        if kind == "map":
            merged, entries = _merge_map(name, present)
        elif kind == "set":
            merged, entries = _merge_set(name, present)
        else:
            merged, entries = _merge_keyed(name, kind.key, present)
        values[name] = merged
        sources = {layer.source for layer in present}
        origins[name] = Origin("merged" if len(sources) == 2 else present[0].source, entries)
    return values, origins


def _conflict(name: str, what: str, first: Layer, second: Layer) -> SettingsConflict:
    where = (
        f"twice in {first.describe(name)}"
        if first is second
        else f"in {first.describe(name)} and in {second.describe(name)}"
    )
    return SettingsConflict(
        f"{name}: {what} is given different values {where}; set it in one place (values not shown)"
    )


def _merge_map(name: str, layers: list[Layer]) -> tuple[dict[str, Any], dict[str, Source]]:
    merged: dict[str, Any] = {}
    owner: dict[str, Layer] = {}
    for layer in layers:
        for key, value in layer.values[name].items():
            if key in merged and merged[key] != value:
                raise _conflict(name, f"key {key!r}", owner[key], layer)
            merged[key] = value
            owner.setdefault(key, layer)
    return merged, _entry_sources(merged, layers, lambda layer: set(layer.values[name]))


def _merge_set(name: str, layers: list[Layer]) -> tuple[list[Any], dict[str, Source]]:
    merged: list[Any] = []
    for layer in layers:
        merged += [item for item in layer.values[name] if item not in merged]
    everything = [
        layer for layer in layers if any(str(i).strip().lower() == "all" for i in layer.values[name])
    ]
    if everything and len(merged) > 1 and len(layers) == 2:
        other = layers[1] if everything[0] is layers[0] else layers[0]
        raise _conflict(name, "`all` beside named entries", everything[0], other)
    return merged, _entry_sources(
        {str(item): item for item in merged}, layers, lambda layer: {str(i) for i in layer.values[name]}
    )


def _merge_keyed(name: str, key: str, layers: list[Layer]) -> tuple[list[BaseModel], dict[str, Source]]:
    fields: dict[str, dict[str, Any]] = {}  # key value -> the fields some source set
    owner: dict[tuple[str, str], Layer] = {}  # (key value, field) -> the source that set it first
    kind: dict[str, type[BaseModel]] = {}
    for layer in layers:
        for entry in layer.values[name]:
            ident = str(getattr(entry, key))
            kind.setdefault(ident, type(entry))
            known = fields.setdefault(ident, {})
            for field_name in sorted(entry.model_fields_set):
                value = getattr(entry, field_name)
                if field_name in known and known[field_name] != value:
                    raise _conflict(
                        name, f"{key} {ident}: field {field_name}", owner[(ident, field_name)], layer
                    )
                known[field_name] = value
                owner.setdefault((ident, field_name), layer)
    merged = [kind[ident](**set_fields) for ident, set_fields in fields.items()]
    return merged, _entry_sources(
        fields, layers, lambda layer: {str(getattr(e, key)) for e in layer.values[name]}
    )


def _entry_sources(
    entries: Mapping[str, Any], layers: list[Layer], keys_of: Callable[[Layer], set[str]]
) -> dict[str, Source]:
    """Each entry's source: the one layer that names it, or `merged` when both do."""
    named = [(layer.source, keys_of(layer)) for layer in layers]
    sources: dict[str, Source] = {}
    for key in entries:
        holders = {source for source, keys in named if key in keys}
        sources[key] = "merged" if len(holders) > 1 else next(iter(holders))
    return sources


def shown(value: Any) -> Any:
    """A value as `gpubadge config` prints it: JSON-ready, every secret `[redacted]` (unset stays null)."""
    if isinstance(value, SecretStr):
        return REDACTED
    if isinstance(value, BaseModel):
        return {name: shown(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, Mapping):
        return {str(key): shown(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [shown(item) for item in value]
    if isinstance(value, str):
        return redact_userinfo(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)  # paths and other scalars


def redact_userinfo(text: str) -> str:
    """`text` with the password of every `scheme://user:password@` URL in it, and of a whole value
    `user:password@host[:port][/path]` (a mirror written without a scheme), replaced by REDACTED.

    References such as `repo:tag@sha256:...` inside a longer text are left alone: only a URL with a
    scheme, or a value that is nothing but `user:password@host`, is taken to carry user info."""
    if "@" not in text:
        return text
    text = _URL_USERINFO.sub(lambda m: f"{m['lead']}:{REDACTED}@", text)
    if " " not in text and "://" not in text:
        text = _BARE_USERINFO.sub(lambda m: f"{m['lead']}:{REDACTED}@", text)
    return text
