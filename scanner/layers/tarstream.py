"""Stream a layer blob: decompress incrementally and parse tar entries without holding the layer.

Two parts:

- `TarParser`, a pure push parser. Feed it decompressed bytes in any slicing; it returns
  `(TarEntry, head)` pairs. For each entry it asks `want(entry) -> int` how many leading
  content bytes the consumer needs (0 for none), buffers only that head, and skips the
  rest by counting. It understands ustar, PAX extended headers (`path`, `linkpath`,
  `size`) and GNU long names/links (`L`/`K`); it verifies every header checksum.
  Memory is bounded by one header, one PAX/GNU record (<= `max_tar_header_bytes`) and the requested head.

- `iter_layer`, the async driver. It pulls compressed chunks from an async iterator,
  picks gzip, zstd or plain tar by magic bytes (falling back to the media type, since
  registries mislabel layers; `scanner.layers.decompress`), decompresses in bounded slices into the parser, and
  yields entries. It stops pulling as soon as the tar's end marker is seen or the
  consumer stops iterating (use `contextlib.aclosing`). Corrupt input (bad gzip/zstd, a bad
  tar checksum, a truncated archive) raises `CorruptLayer`.

- `LayerFeeder`, the synchronous core of `iter_layer`: push compressed chunks, entries go
  to a callback, and a `stop()` predicate is asked after every decompressed slice. An
  analysis process runs it on chunks shipped from the scanning process.

Bounds (`scanner.layers.limits.AnalysisLimits`), checked after every decompressed slice of
every read, whoever consumes it: a layer inflating more than `max_inflation_ratio` times its
compressed bytes (past `inflation_ratio_floor`), or past `max_layer_bytes`; a path or link
target longer than `max_path_bytes`, more than `max_layer_entries` entries, or an extended
header larger than `max_tar_header_bytes`; and, with a `ScanBudget`, an image past
`max_image_bytes` or its deadline. Each raises `LimitExceeded` naming its setting.
"""

from __future__ import annotations

import posixpath
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from scanner.layers.decompress import Compression, Decoder, decoder_for, detect_compression
from scanner.layers.errors import CorruptLayer
from scanner.layers.limits import AnalysisLimits, LimitExceeded, ScanBudget

BLOCK = 512

EntryKind = Literal["file", "dir", "symlink", "hardlink", "other"]


_REGULAR_TYPES = frozenset(b"07\0")
# Types whose size field carries no data (tarfile and Go's archive/tar agree): links, dirs, devices, fifos.
_NO_DATA_TYPES: dict[int, EntryKind] = {
    ord("1"): "hardlink",
    ord("2"): "symlink",
    ord("5"): "dir",
    ord("3"): "other",
    ord("4"): "other",
    ord("6"): "other",
}


class _Stopped(Exception):
    """The consumer asked to stop mid-chunk; unwinds out of the decompressor."""


@dataclass(frozen=True, slots=True)
class TarEntry:
    """One archive member. `path` is absolute and normalised (`/usr/bin/sh`).

    `linkname` is the raw target for symlinks and the normalised absolute path for
    hardlinks (tar hardlink targets name another member of the same archive).
    """

    path: str
    kind: EntryKind
    size: int
    mode: int
    linkname: str = ""


WantHead = Callable[[TarEntry], int]


class ContentSink(Protocol):
    """Takes one member's content as it streams past, without the parser buffering it.

    `feed` returns False when it wants no more (the rest is skipped by counting); `close` is
    called once, with `complete` True when every byte of the member was fed.
    """

    def feed(self, data: memoryview) -> bool: ...

    def close(self, complete: bool) -> None: ...


StreamContent = Callable[[TarEntry], "ContentSink | None"]


def normalise_path(name: str) -> str:
    """Archive member name -> `/abs/path` without `.`/`..`/trailing slashes; `/` for the root."""
    return posixpath.normpath("/" + name.lstrip("/")) if name.strip("/.") else "/"


def _number(field: bytes, what: str) -> int:
    """Octal (NUL/space padded) or GNU base-256 numeric field."""
    if field and field[0] & 0x80:
        if field[0] != 0x80:
            raise CorruptLayer(f"tar header has a negative {what}")
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise CorruptLayer(f"tar header has an invalid {what} field {text[:16]!r}") from None


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "replace")


def _verify_checksum(block: bytes) -> None:
    stored = _number(block[148:156], "checksum")
    unsigned = sum(block[:148]) + 8 * 0x20 + sum(block[156:])
    if stored == unsigned:
        return
    signed = sum((b - 256 if b > 127 else b) for b in block[:148] + b" " * 8 + block[156:])
    if stored != signed:
        raise CorruptLayer("tar header checksum mismatch (not a tar archive, or corrupt)")


def _parse_pax(data: bytes) -> dict[str, str]:
    """PAX records `LEN KEY=VALUE\\n` -> dict."""
    records: dict[str, str] = {}
    position = 0
    while position < len(data):
        if data[position] == 0:  # some writers pad with NULs
            break
        space = data.find(b" ", position)
        if space < 0:
            raise CorruptLayer("malformed PAX extended header")
        try:
            length = int(data[position:space])
        except ValueError:
            raise CorruptLayer("malformed PAX extended header length") from None
        record = data[space + 1 : position + length]
        if length <= 0 or position + length > len(data) or not record.endswith(b"\n"):
            raise CorruptLayer("malformed PAX extended header record")
        key, equals, value = record[:-1].partition(b"=")
        if not equals:
            raise CorruptLayer("malformed PAX extended header record (no '=')")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        position += length
    return records


class TarParser:
    """Pure push parser for tar streams. See the module docstring."""

    def __init__(
        self, want: WantHead, limits: AnalysisLimits | None = None, stream: StreamContent | None = None
    ) -> None:
        self._want = want
        self._stream = stream
        self._sink: ContentSink | None = None
        self._stream_left = 0
        self._stream_padding = 0
        self._limits = limits or AnalysisLimits()
        self._buffer = bytearray()
        self._need = BLOCK
        self._state: Literal["header", "extended", "head", "skip", "stream", "done"] = "header"
        self._skip = 0
        self._zero_blocks = 0
        self._pending: dict[str, str] = {}  # path/linkpath/size from PAX or GNU records
        self._extended_type = 0
        self._extended_size = 0
        self._entry: TarEntry | None = None
        self._rest_after_head = 0
        self.entries_seen = 0

    @property
    def done(self) -> bool:
        """True once the end-of-archive marker was read; further input is ignored."""
        return self._state == "done"

    def feed(self, data: bytes | memoryview) -> list[tuple[TarEntry, bytes]]:
        out: list[tuple[TarEntry, bytes]] = []
        view = memoryview(data)
        position, end = 0, len(view)
        while position < end and self._state != "done":
            if self._state == "skip":
                step = min(self._skip, end - position)
                self._skip -= step
                position += step
                if self._skip == 0:
                    self._state = "header"
                    self._need = BLOCK
                continue
            if self._state == "stream":
                step = min(self._stream_left, end - position)
                position += step
                self._stream_left -= step
                self._feed_sink(view[position - step : position])
                continue
            take = min(self._need - len(self._buffer), end - position)
            self._buffer += view[position : position + take]
            position += take
            if len(self._buffer) < self._need:
                break
            chunk = bytes(self._buffer)
            self._buffer.clear()
            if self._state == "header":
                self._on_header(chunk, out)
            elif self._state == "extended":
                self._on_extended(chunk)
            else:
                self._on_head(chunk, out)
        return out

    def close(self) -> None:
        """Call at end of input: raises CorruptLayer if the archive stopped mid-way."""
        if self._state == "done":
            return
        at_boundary = self._state == "header" and not self._buffer and not self._pending
        if at_boundary and self._zero_blocks:
            return  # one end block instead of two: harmless
        if at_boundary and self.entries_seen == 0:
            raise CorruptLayer("layer holds no tar data")
        # Strict on purpose: a layer cut at an entry boundary could hide the loader we look for.
        raise CorruptLayer("tar archive is truncated (no end-of-archive marker)")

    # -- states

    def _skip_then_header(self, count: int) -> None:
        if count:
            self._state, self._skip = "skip", count
        else:
            self._state, self._need = "header", BLOCK

    def _on_header(self, block: bytes, out: list[tuple[TarEntry, bytes]]) -> None:
        if block.count(0) == BLOCK:
            self._zero_blocks += 1
            if self._zero_blocks >= 2:
                self._state = "done"
            return
        if self._zero_blocks:
            raise CorruptLayer("tar data after an end-of-archive block")
        _verify_checksum(block)
        typeflag = block[156]
        size = _number(block[124:136], "size")
        padded = -(-size // BLOCK) * BLOCK
        if typeflag in (ord("x"), ord("g"), ord("L"), ord("K")):
            if size > self._limits.max_tar_header_bytes:
                raise LimitExceeded(
                    f"a tar extended header holds {size:,} bytes",
                    self._limits.max_tar_header_bytes,
                    "max_tar_header_bytes",
                )
            self._extended_type = typeflag
            self._extended_size = size
            if padded == 0:
                self._on_extended(b"")
            else:
                self._state, self._need = "extended", padded
            return

        name = _text(block[0:100])
        if block[257:263] == b"ustar\x00":
            prefix = _text(block[345:500])
            if prefix:
                name = f"{prefix}/{name}"
        linkname = _text(block[157:257])
        pending, self._pending = self._pending, {}
        name = pending.get("path", name)
        linkname = pending.get("linkpath", linkname)
        if "size" in pending:
            try:
                size = int(pending["size"])
            except ValueError:
                raise CorruptLayer("PAX size is not a number") from None
            padded = -(-size // BLOCK) * BLOCK

        kind: EntryKind
        has_data = True
        if typeflag in _REGULAR_TYPES:
            kind = "file"
        elif typeflag in _NO_DATA_TYPES:
            kind = _NO_DATA_TYPES[typeflag]
            has_data = False
        else:
            kind = "other"
        longest = max(len(name), len(linkname))
        if longest > self._limits.max_path_bytes:
            raise LimitExceeded(
                f"a layer entry has a path or link target of {longest:,} bytes",
                self._limits.max_path_bytes,
                "max_path_bytes",
            )
        if self.entries_seen >= self._limits.max_layer_entries:
            raise LimitExceeded(
                f"a layer has more than {self._limits.max_layer_entries:,} entries",
                self._limits.max_layer_entries,
                "max_layer_entries",
            )
        if kind == "hardlink":
            linkname = normalise_path(linkname)
        entry = TarEntry(
            path=normalise_path(name),
            kind=kind,
            size=size if has_data else 0,
            mode=_number(block[100:108], "mode") & 0o7777,
            linkname=linkname,
        )
        self.entries_seen += 1
        data_blocks = padded if has_data else 0
        head_size = min(max(self._want(entry), 0), entry.size) if kind == "file" else 0
        if self._stream is not None and kind == "file" and entry.size:
            self._sink = self._stream(entry)
        if head_size:
            self._entry = entry
            self._rest_after_head = data_blocks - head_size
            self._state, self._need = "head", head_size
            return
        out.append((entry, b""))
        if self._sink is not None:
            self._start_stream(entry.size, data_blocks)
        else:
            self._skip_then_header(data_blocks)

    def _start_stream(self, left: int, data_blocks: int) -> None:
        """Feed the next `left` content bytes to the sink, then skip the padding."""
        self._stream_left = left
        self._stream_padding = data_blocks - left  # after the content, skipped at the end
        if left:
            self._state = "stream"
        else:
            self._end_stream(complete=True)

    def _feed_sink(self, data: memoryview) -> None:
        assert self._sink is not None
        if not self._sink.feed(data):
            self._skip_left_of_stream(complete=self._stream_left == 0)
        elif self._stream_left == 0:
            self._end_stream(complete=True)

    def _skip_left_of_stream(self, complete: bool) -> None:
        left, self._stream_left = self._stream_left, 0
        self._end_stream(complete, extra=left)

    def _end_stream(self, complete: bool, extra: int = 0) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.close(complete)
        self._skip_then_header(self._stream_padding + extra)

    def _on_extended(self, data: bytes) -> None:
        body = data[: self._extended_size]
        if self._extended_type == ord("x"):
            records = _parse_pax(body)
            for key in ("path", "linkpath", "size"):
                if records.get(key):
                    self._pending[key] = records[key]
        elif self._extended_type == ord("L"):
            self._pending["path"] = _text(body)
        elif self._extended_type == ord("K"):
            self._pending["linkpath"] = _text(body)
        # 'g' (global PAX): path/linkpath make no sense globally; nothing we use.
        self._state, self._need = "header", BLOCK

    def _on_head(self, head: bytes, out: list[tuple[TarEntry, bytes]]) -> None:
        assert self._entry is not None
        entry = self._entry
        out.append((entry, head))
        self._entry = None
        sink = self._sink
        if sink is None:
            self._skip_then_header(self._rest_after_head)
            return
        rest = entry.size - len(head)
        if not sink.feed(memoryview(head)):
            self._sink = None
            sink.close(rest == 0)
            self._skip_then_header(self._rest_after_head)
            return
        self._start_stream(rest, self._rest_after_head)


@dataclass
class StreamStats:
    """Counters the driver updates as it goes, for reports and tests."""

    compressed_bytes: int = 0
    decompressed_bytes: int = 0
    entries: int = 0
    compression: Compression | None = None
    reached_end: bool = False


class LayerFeeder:
    """Push compressed layer bytes in; entries come out through `on_entry`. See the module docstring.

    `feed` returns False once no more input is wanted: the archive ended, or `stop()` said
    so (asked after every decompressed slice, so a consumer can give up inside one huge
    member or one highly compressed chunk). Call `close` at the end of input.
    """

    def __init__(
        self,
        media_type: str,
        *,
        want: WantHead,
        on_entry: Callable[[TarEntry, bytes], None],
        stats: StreamStats | None = None,
        stop: Callable[[], bool] | None = None,
        limits: AnalysisLimits | None = None,
        budget: ScanBudget | None = None,
        stream: StreamContent | None = None,
    ) -> None:
        self.stats = stats if stats is not None else StreamStats()
        self._media_type = media_type
        self._limits = limits or (budget.limits if budget else AnalysisLimits())
        self._on_entry = on_entry
        self._stop = stop
        self._budget = budget
        self._parser = TarParser(want, self._limits, stream)
        self._decoder: Decoder | None = None
        self._sniff = b""
        self._finished = False

    def _sink(self, data: bytes) -> None:
        if self._parser.done:
            return
        stats = self.stats
        stats.decompressed_bytes += len(data)
        limits = self._limits
        if stats.decompressed_bytes > limits.inflation_ratio_floor and (
            stats.decompressed_bytes > limits.max_inflation_ratio * max(stats.compressed_bytes, 1)
        ):
            raise LimitExceeded(
                f"a layer inflates more than {limits.max_inflation_ratio}x ({stats.decompressed_bytes:,}"
                f" bytes from {stats.compressed_bytes:,}): a decompression bomb",
                limits.max_inflation_ratio,
                "max_inflation_ratio",
            )
        if stats.decompressed_bytes > limits.max_layer_bytes:
            raise LimitExceeded(
                f"a layer decompresses to more than {limits.max_layer_bytes:,} bytes",
                limits.max_layer_bytes,
                "max_layer_bytes",
            )
        if self._budget is not None:
            self._budget.spend_bytes(len(data))
            self._budget.check_time()
        for entry, head in self._parser.feed(data):
            self.stats.entries += 1
            self._on_entry(entry, head)
        if self._parser.done or (self._stop is not None and self._stop()):
            raise _Stopped

    def feed(self, chunk: bytes) -> bool:
        """Take the next compressed chunk; False when no more input is wanted."""
        if self._finished:
            return False
        if not chunk:
            return True
        self.stats.compressed_bytes += len(chunk)
        if self._decoder is None:
            self._sniff += chunk
            if len(self._sniff) < 262:
                return True
            self.stats.compression = detect_compression(self._sniff, self._media_type)
            self._decoder, chunk, self._sniff = decoder_for(self.stats.compression), self._sniff, b""
        try:
            self._decoder.feed(chunk, self._sink)
        except _Stopped:
            self._finished = True
            self.stats.reached_end = self._parser.done
            return False
        return True

    def close(self) -> None:
        """End of input: raises CorruptLayer when the archive stopped mid-way."""
        if self._finished:
            return
        if self._decoder is None:
            if not self._sniff:
                raise CorruptLayer("layer is empty: no data")
            self.stats.compression = detect_compression(self._sniff, self._media_type)
            self._decoder = decoder_for(self.stats.compression)
            try:
                self._decoder.feed(self._sniff, self._sink)
            except _Stopped:
                self._finished = True
                self.stats.reached_end = self._parser.done
                return
        self._finished = True
        self._parser.close()
        self.stats.reached_end = True


async def iter_layer(
    chunks: AsyncIterator[bytes],
    media_type: str,
    *,
    want: WantHead,
    stats: StreamStats | None = None,
    stop: Callable[[], bool] | None = None,
    limits: AnalysisLimits | None = None,
) -> AsyncGenerator[tuple[TarEntry, bytes], None]:
    """Yield `(entry, head)` for each member of a layer blob; see the module docstring.

    `stop()` is asked after every chunk, so a consumer can give up even in the middle of
    one huge member. `stats.reached_end` is True only when the whole archive was parsed.
    """
    ready: list[tuple[TarEntry, bytes]] = []
    feeder = LayerFeeder(
        media_type,
        want=want,
        on_entry=lambda entry, head: ready.append((entry, head)),
        stats=stats,
        limits=limits,
    )
    async for chunk in chunks:
        wanted = feeder.feed(chunk)
        for item in ready:
            yield item
        ready.clear()
        if not wanted or (stop is not None and stop()):
            return
    feeder.close()
    for item in ready:
        yield item
