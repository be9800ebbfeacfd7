"""Members of real wheels on PyPI, read with HTTP range requests: only the files a test needs.

A wheel is a zip: its central directory (at the end) lists every member with its offset, sizes and
CRC-32. `member_files(wheel, names)` reads the directory, then each wanted member's local header
and compressed bytes, inflates them, checks the CRC-32 and the size, and caches the file under
`CACHE/members/<wheel>/` (ignored by git, never committed). The wheel itself is pinned by its sha256,
checked against PyPI's own listing of the file (the simple API's JSON, PEP 691) before any byte is
read, so the members are those of the pinned wheel. vLLM's 320 MiB wheel costs its 60 MiB of GPU
libraries this way, cuDNN's 527 MiB wheel its 100 KiB `libcudnn.so.9`. A package PyPI has no wheel
of is read from its source distribution, whole, when it is small (`sdist_files`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import tarfile
import threading
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tests.nvidia_wheels import CACHE, cache_lock

INDEX = os.environ.get("GPUBADGE_PYPI_SIMPLE", "https://pypi.org/simple")
TIMEOUT = 120
_CHUNK = 8 << 20
_LOCK = threading.Lock()


@dataclass(frozen=True)
class RemoteWheel:
    """A wheel on PyPI, pinned: its project, file name and sha256."""

    project: str
    filename: str
    sha256: str

    @property
    def key(self) -> str:
        return self.filename.removesuffix(".whl")


@dataclass(frozen=True)
class _Member:
    name: str
    method: int
    crc: int
    compressed: int
    size: int
    offset: int


def _get(url: str, start: int | None = None, end: int | None = None) -> bytes:
    """The bytes of `url`, or of its range [start, end]."""
    headers = {"Range": f"bytes={start}-{end}"} if start is not None else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT) as answer:
        data: bytes = answer.read()
    if start is not None and end is not None and len(data) != end - start + 1:
        raise RuntimeError(f"{url}: asked for bytes {start}-{end}, got {len(data)}")
    return data


def wheel_url(wheel: RemoteWheel) -> tuple[str, int]:
    """(URL, size) of the pinned file, from PyPI's listing; RuntimeError unless it lists our sha256."""
    request = urllib.request.Request(
        f"{INDEX}/{wheel.project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
        listing = json.load(answer)
    for file in listing.get("files", []):
        if file.get("filename") == wheel.filename:
            if file.get("hashes", {}).get("sha256") != wheel.sha256:
                raise RuntimeError(
                    f"{wheel.filename}: PyPI lists sha256 {file.get('hashes')}, pinned {wheel.sha256}"
                )
            return str(file["url"]), int(file["size"])
    raise RuntimeError(f"{wheel.filename} is not on {INDEX}/{wheel.project}/")


def _directory(url: str, size: int) -> list[_Member]:
    tail = _get(url, max(0, size - 65_557), size - 1)
    end = tail.rfind(b"PK\x05\x06")
    if end < 0:
        raise RuntimeError(f"{url}: no zip end of central directory")
    count, length, offset = struct.unpack_from("<HII", tail, end + 10)
    if offset == 0xFFFFFFFF or count == 0xFFFF:  # zip64
        locator = tail.rfind(b"PK\x06\x07")
        (record,) = struct.unpack_from("<Q", tail, locator + 8)
        length, offset = struct.unpack_from("<QQ", _get(url, record, record + 55), 40)
    table = _get(url, offset, offset + length - 1)
    members: list[_Member] = []
    at = 0
    while table[at : at + 4] == b"PK\x01\x02":
        method, crc, compressed, plain, name_length, extra_length, comment_length = struct.unpack_from(
            "<H4xIIIHHH", table, at + 10
        )
        (local,) = struct.unpack_from("<I", table, at + 42)
        name = table[at + 46 : at + 46 + name_length].decode()
        extra = table[at + 46 + name_length : at + 46 + name_length + extra_length]
        if 0xFFFFFFFF in (compressed, plain, local):
            fields = iter(_zip64(extra))
            plain = next(fields) if plain == 0xFFFFFFFF else plain
            compressed = next(fields) if compressed == 0xFFFFFFFF else compressed
            local = next(fields) if local == 0xFFFFFFFF else local
        members.append(_Member(name, method, crc, compressed, plain, local))
        at += 46 + name_length + extra_length + comment_length
    return members


def _zip64(extra: bytes) -> Iterator[int]:
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            for field in range(at + 4, at + 4 + size, 8):
                yield struct.unpack_from("<Q", extra, field)[0]
            return
        at += 4 + size


_GAP = 4 << 20  # members closer than this share one range request


def _spans(members: list[_Member]) -> list[list[_Member]]:
    """Wanted members grouped into runs read with one request each (vLLM's 3,200 sources: a few)."""
    spans: list[list[_Member]] = []
    end = -1
    for member in sorted(members, key=lambda m: m.offset):
        if spans and member.offset - end <= _GAP:
            spans[-1].append(member)
        else:
            spans.append([member])
        end = max(end, member.offset + 30 + len(member.name.encode()) + 65_535 + member.compressed)
    return spans


def _fetch_span(url: str, span: list[_Member], root: Path) -> None:
    """Read one run of members with one request (into a temporary file), then inflate each."""
    first = span[0].offset
    last = max(m.offset + 30 + len(m.name.encode()) + m.compressed for m in span) + 65_535
    scratch = root / f".span-{first}"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    request = urllib.request.Request(url, headers={"Range": f"bytes={first}-{last}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as answer, scratch.open("wb") as out:
        shutil.copyfileobj(answer, out, _CHUNK)
    try:
        with scratch.open("rb") as data:
            for member in span:
                _extract(data, member.offset - first, member, root / member.name)
    finally:
        scratch.unlink()


def _extract(data: BinaryIO, at: int, member: _Member, target: Path) -> None:
    """Inflate one member whose local header is at offset `at` of `data`; check its CRC-32 and size."""
    data.seek(at)
    header = data.read(30)
    if header[:4] != b"PK\x03\x04":
        raise RuntimeError(f"{member.name}: no local file header where the directory says")
    name_length, extra_length = struct.unpack_from("<HH", header, 26)
    data.seek(at + 30 + name_length + extra_length)
    if member.method not in (0, 8):
        raise RuntimeError(f"{member.name}: zip method {member.method}")
    inflate = zlib.decompressobj(-15) if member.method == 8 else None
    crc, written, left = 0, 0, member.compressed
    partial = target.with_name(target.name + ".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("wb") as out:
        while left:
            raw = data.read(min(left, _CHUNK))
            if not raw:
                break
            left -= len(raw)
            plain = inflate.decompress(raw) if inflate is not None else raw
            crc, written = zlib.crc32(plain, crc), written + len(plain)
            out.write(plain)
        if inflate is not None:
            rest = inflate.flush()
            crc, written = zlib.crc32(rest, crc), written + len(rest)
            out.write(rest)
    if crc != member.crc or written != member.size:
        partial.unlink()
        raise RuntimeError(f"{member.name}: CRC-32 or size differs from the wheel's directory")
    partial.replace(target)


def member_files(wheel: RemoteWheel, wanted: Callable[[str], bool]) -> dict[str, Path]:
    """Every member of `wheel` that `wanted(name)` accepts, as cached files: {name in the wheel: path}."""
    root = CACHE / "members" / wheel.key
    listing = root / ".members.json"
    with _LOCK, cache_lock(f"members-{wheel.key}"):
        if listing.exists():
            names = json.loads(listing.read_text())
            chosen = [n for n in names if wanted(n)]
            if all((root / n).exists() for n in chosen):
                return {n: root / n for n in chosen}
        url, size = wheel_url(wheel)
        members = _directory(url, size)
        needed = [
            m for m in members if wanted(m.name) and not m.name.endswith("/") and not (root / m.name).exists()
        ]
        for span in _spans(needed):
            _fetch_span(url, span, root)
        root.mkdir(parents=True, exist_ok=True)
        listing.write_text(json.dumps([m.name for m in members]))
        return {m.name: root / m.name for m in members if wanted(m.name) and not m.name.endswith("/")}


MAX_SDIST_BYTES = 8 << 20  # a source distribution read whole: small ones only


def sdist_files(sdist: RemoteWheel, wanted: Callable[[str], bool]) -> dict[str, Path]:
    """Every member of the source distribution `sdist` (a `.tar.gz`, read whole and checked against its
    pinned sha256) that `wanted(name)` accepts, its first directory left off ("pkg-1.0/pkg/m.py" is
    "pkg/m.py"), as cached files: {name: path}. For packages PyPI has no wheel of (mamba-ssm)."""
    root = CACHE / "members" / sdist.filename.removesuffix(".tar.gz")
    listing = root / ".members.json"
    with _LOCK, cache_lock(f"members-{sdist.filename}"):
        if not listing.exists():
            url, size = wheel_url(sdist)
            if size > MAX_SDIST_BYTES:
                raise RuntimeError(f"{sdist.filename}: {size} bytes, more than {MAX_SDIST_BYTES}")
            data = _get(url)
            if hashlib.sha256(data).hexdigest() != sdist.sha256:
                raise RuntimeError(f"{sdist.filename}: its bytes do not have the pinned sha256")
            names: list[str] = []
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
                for entry in archive:
                    name = entry.name.partition("/")[2]
                    if not entry.isfile() or not name or ".." in name.split("/"):
                        continue
                    source = archive.extractfile(entry)
                    if source is None:
                        continue
                    target = root / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(source.read())
                    names.append(name)
            root.mkdir(parents=True, exist_ok=True)
            listing.write_text(json.dumps(names))
        return {name: root / name for name in json.loads(listing.read_text()) if wanted(name)}


def clear(wheel: RemoteWheel) -> None:
    """Forget a wheel's cached members (a test of the reader itself)."""
    shutil.rmtree(CACHE / "members" / wheel.key, ignore_errors=True)
