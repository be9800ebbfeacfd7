"""Write every stored report into a portable SQLite file with sqlite-utils, for SQL and Datasette.

The gpubadge store stays the only database gpubadge runs on; this writes a separate file that
people copy, query and open in Datasette. It is synchronous (the CLI calls it directly, the
service in a thread) and keeps these promises:

- **Bounded memory.** Reports come from the store `batch_size` at a time (`report_page`, keyset
  pages in digest order) and each page is written in one transaction before the next is read.
- **Incremental.** Written again to the same file, each exported digest's rows are deleted
  and written anew in the same transaction: changed reports are replaced, new ones added, none
  duplicated. `since` exports only reports scanned after it; a full export (no `since`) also
  removes the images the store no longer holds. Layers no image links any more are dropped at
  the end; the fleet (`servers`) is small and rewritten whole.
- **Never half-written.** The export goes to a temporary file beside `out` (a copy of `out`
  when it exists) and is renamed over it only when complete and synced, so a killed or failed
  export leaves the previous file as it was. A file that is not a gpubadge export, or is
  read-only, is refused before anything is written; a full disk is an `ExportError` that says so.
- **Only where asked.** Every temporary file is created exclusively under an unpredictable name
  (`mkstemp`: `O_CREAT | O_EXCL`, so a link planted in the directory is never followed). The
  metadata file beside `out` is replaced only when gpubadge wrote it (it carries the
  `gpubadge_export` mark, or is an earlier gpubadge sidecar); any other file or link there is
  refused with an `ExportError` before anything is written.
- **Explorable.** Primary keys, foreign keys, indexes on what people filter by, full-text search
  on `images` (reference, repository), and a Datasette metadata file beside the database
  (`<name>.metadata.json`: titles, every column described, facets, two canned queries).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil
import sqlite3
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlite_utils

from store import queries
from store.backend import QueryRunner
from store.export.rows import (
    COLUMNS,
    FOREIGN_KEYS,
    FORMAT,
    FORMAT_VERSION,
    FULL_TEXT,
    INDEXES,
    METADATA_MARK,
    METADATA_TITLE,
    PRIMARY_KEYS,
    UNIQUE_INDEXES,
    Row,
    datasette_metadata,
    image_rows,
    server_rows,
)

META_TABLE = "gpubadge_export"
METADATA_MAX_BYTES = 1024 * 1024  # far above what `datasette_metadata` writes (about 12 KB)
DEFAULT_BATCH = 500


class ExportError(Exception):
    """The export could not be written; the message says why in words, and `out` is unchanged."""


@dataclass(frozen=True)
class ExportSummary:
    """What one export wrote (`images`, `platforms`, `layer_links`) and what the file now holds."""

    path: Path
    metadata: Path
    images: int
    platforms: int
    layer_links: int
    gpus: int
    removed: int
    total_images: int
    total_platforms: int
    total_layers: int
    seconds: float

    def describe(self) -> str:
        return (
            f"wrote {self.images:,} images ({self.platforms:,} platforms, {self.layer_links:,} layer links)"
            f" and {self.gpus:,} server GPU rows to {self.path} in {self.seconds:.1f} s"
            + (f", removed {self.removed:,} images no longer stored" if self.removed else "")
            + "; it holds"
            f" {self.total_images:,} images, {self.total_platforms:,} platforms, {self.total_layers:,}"
            f" layers.\nDatasette metadata: {self.metadata}"
        )


def metadata_path(out: Path) -> Path:
    """`gpubadge.db` -> `gpubadge.metadata.json`, beside it."""
    return out.with_name(f"{out.stem}.metadata.json")


def export_sqlite(
    backend: QueryRunner,
    out: Path | str,
    *,
    since: datetime | None = None,
    batch_size: int = DEFAULT_BATCH,
    progress: Callable[[int], None] | None = None,
    source: str = "",
    inventory: Sequence[str] = (),
) -> ExportSummary:
    """Export the store's reports (those scanned after `since`, if given) and its fleet into `out`.

    The fleet is the service's: the servers of its inventory file (`inventory`, each a `Server`
    document as JSON, with no registration or heartbeat), and over them, by name, the servers
    agents registered in the store.

    `progress(n)` is called after each written batch with the number of images written so far.
    Raises `ExportError` (with `out` untouched) for a bad `out`, a full disk or an unwritable
    directory; `StoreUnavailable` when the store cannot be read.
    """
    out = Path(out)
    started = time.perf_counter()
    existing = _check_target(out)
    _check_metadata_target(metadata_path(out))
    try:
        handle, temporary_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as exc:
        raise ExportError(f"cannot write beside {out}: {_why(exc)}") from exc
    os.close(handle)
    temporary = Path(temporary_name)
    try:
        if existing:
            shutil.copyfile(out, temporary)
        os.chmod(temporary, stat.S_IMODE(out.stat().st_mode) if existing else 0o644)
        # A full export into an existing file also drops the images the store no longer holds.
        sweep = existing and since is None
        written = _write(
            backend,
            temporary,
            since=since,
            sweep=sweep,
            batch_size=batch_size,
            progress=progress,
            source=source,
            inventory=inventory,
        )
        metadata = metadata_path(out)
        _write_metadata(metadata, out)  # first: a disk that fills now fails before `out` is replaced
        _sync(temporary)
        os.replace(temporary, out)
        _sync_directory(out.parent)
    except sqlite3.Error as exc:
        raise ExportError(f"cannot write {out}: {_why(exc)}") from exc
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {_why(exc)}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
    return ExportSummary(path=out, metadata=metadata, seconds=time.perf_counter() - started, **written)


def _check_target(out: Path) -> bool:
    """Whether `out` exists (and may be exported into again); ExportError when it must not be touched."""
    if not out.parent.is_dir():
        raise ExportError(f"cannot write {out}: the directory {out.parent} does not exist")
    try:
        status = out.stat()
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(status.st_mode):
        raise ExportError(f"{out} is not a regular file")
    if not status.st_mode & 0o222:
        # Checked by mode, not by access(): root could write it, and the rename would replace it.
        raise ExportError(f"{out} is read-only (mode {stat.S_IMODE(status.st_mode):o}); not replacing it")
    try:
        with contextlib.closing(sqlite3.connect(f"{out.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            found = dict(conn.execute(f"SELECT key, value FROM {META_TABLE}").fetchall())
    except sqlite3.Error:
        found = {}
    if found.get("format") != FORMAT:
        raise ExportError(
            f"{out} exists and is not a gpubadge export; not overwriting it (choose another file, or remove it)"
        )
    if found.get("format_version") != str(FORMAT_VERSION):
        raise ExportError(
            f"{out} is a gpubadge export of format {found.get('format_version')}, this gpubadge writes"
            f" format {FORMAT_VERSION}; remove it to export afresh"
        )
    return True


def _write(
    backend: QueryRunner,
    path: Path,
    *,
    since: datetime | None,
    sweep: bool,
    batch_size: int,
    progress: Callable[[int], None] | None,
    source: str,
    inventory: Sequence[str],
) -> dict[str, int]:
    counts = {"images": 0, "platforms": 0, "layer_links": 0, "gpus": 0, "removed": 0}
    db = sqlite_utils.Database(path)
    try:
        # The file is private until the rename, so no rollback journal on disk and no fsync per
        # batch: a crash leaves only the temporary file, which is never renamed into place.
        db.execute("PRAGMA journal_mode=MEMORY")
        db.execute("PRAGMA synchronous=OFF")
        _create_schema(db)
        ids = itertools.count(int(db.execute("SELECT coalesce(max(id), 0) + 1 FROM platforms").fetchone()[0]))
        if sweep:  # the digests this export wrote, on disk (SQLite's temp store), not in memory
            db.execute("CREATE TEMP TABLE exported (digest TEXT PRIMARY KEY)")
        after = ""
        while True:
            page = backend.run(queries.report_page, after=after, since=since, limit=batch_size)
            if not page:
                break
            batch: dict[str, list[Row]] = {name: [] for name in COLUMNS if name != "servers"}
            for report in page:
                for table, rows in image_rows(report, ids).items():
                    batch[table].extend(rows)
            with db.conn:
                _replace_images(db, batch)
                if sweep:
                    db.conn.executemany(
                        "INSERT OR IGNORE INTO temp.exported VALUES (?)",
                        [(row["digest"],) for row in batch["images"]],
                    )
            counts["images"] += len(batch["images"])
            counts["platforms"] += len(batch["platforms"])
            counts["layer_links"] += len(batch["platform_layers"])
            after = page[-1].digest or after
            if progress is not None:
                progress(counts["images"])
            if len(page) < batch_size:
                break
        fleet: dict[str, list[Row]] = {}
        for document in inventory:
            rows = server_rows(document, None, None)
            fleet[str(rows[0]["server"])] = rows
        for record in backend.run(queries.servers):  # an agent's report wins over the file's
            rows = server_rows(*record)
            fleet[str(rows[0]["server"])] = rows
        servers = [row for rows in fleet.values() for row in rows]
        counts["gpus"] = sum(1 for row in servers if row.get("gpu_uuid"))
        with db.conn:
            if sweep:
                counts["removed"] = _remove_unexported(db)
            db.table("servers").delete_where()
            db.table("servers").insert_all(servers, batch_size=500)
            db.execute(
                "DELETE FROM layers WHERE NOT EXISTS"
                " (SELECT 1 FROM platform_layers WHERE layer_digest = layers.digest)"
            )
            db.table(META_TABLE).insert_all(
                [
                    {"key": "format", "value": FORMAT},
                    {"key": "format_version", "value": str(FORMAT_VERSION)},
                    {"key": "exported_at", "value": datetime.now(UTC).isoformat(timespec="seconds")},
                    {"key": "source", "value": source},
                    {"key": "since", "value": since.isoformat() if since else ""},
                ],
                pk="key",
                replace=True,
            )
        totals = {
            f"total_{name}": int(db.execute(f"SELECT count(*) FROM {name}").fetchone()[0])
            for name in ("images", "platforms", "layers")
        }
        db.execute("PRAGMA journal_mode=DELETE")  # a plain file for whoever opens it next
    finally:
        db.close()
    return {**counts, **totals}


def _create_schema(db: sqlite_utils.Database) -> None:
    for name, columns in COLUMNS.items():
        db.table(name).create(
            {column: kind for column, (kind, _) in columns.items()},
            pk=PRIMARY_KEYS[name],
            foreign_keys=FOREIGN_KEYS.get(name, []),
            if_not_exists=True,
        )
        for index in INDEXES.get(name, []):
            db.table(name).create_index(index, if_not_exists=True)
        for index in UNIQUE_INDEXES.get(name, []):
            db.table(name).create_index(index, unique=True, if_not_exists=True)
    for name, fts_columns in FULL_TEXT.items():
        if db.table(name).detect_fts() is None:
            # triggers keep the index true through the per-digest replace of later exports
            db.table(name).enable_fts(fts_columns, create_triggers=True, tokenize="unicode61")
    db.table(META_TABLE).create({"key": str, "value": str}, pk="key", if_not_exists=True)


def _replace_images(db: sqlite_utils.Database, batch: dict[str, list[Row]]) -> None:
    """Delete every row of the batch's digests, then write them anew (one transaction, the caller's).

    Lists travel as one JSON parameter (`json_each`), so no batch size meets SQLite's limit on
    bound variables. A layer already in the file is kept: its digest names its content.
    """
    digests = json.dumps([row["digest"] for row in batch["images"]])
    of_batch = "digest IN (SELECT value FROM json_each(?))"
    db.table("platform_layers").delete_where(
        f"platform_id IN (SELECT id FROM platforms WHERE {of_batch})", [digests]
    )
    for table in ("env", "platforms", "images"):
        db.table(table).delete_where(of_batch, [digests])
    db.table("images").insert_all(batch["images"], batch_size=200)
    db.table("platforms").insert_all(batch["platforms"], batch_size=200)
    db.table("env").insert_all(batch["env"], batch_size=500)
    layers = {row["digest"]: row for row in batch["layers"]}
    known = db.execute(f"SELECT digest FROM layers WHERE {of_batch}", [json.dumps(list(layers))]).fetchall()
    for (digest,) in known:
        del layers[digest]
    db.table("layers").insert_all(layers.values(), batch_size=500)
    db.table("platform_layers").insert_all(batch["platform_layers"], batch_size=500)


def _remove_unexported(db: sqlite_utils.Database) -> int:
    """Delete the images (and their rows) that this full export did not write: gone from the store."""
    stale = "digest NOT IN (SELECT digest FROM temp.exported)"
    db.table("platform_layers").delete_where(f"platform_id IN (SELECT id FROM platforms WHERE {stale})")
    removed = int(db.execute(f"SELECT count(*) FROM images WHERE {stale}").fetchone()[0])
    for table in ("env", "platforms", "images"):
        db.table(table).delete_where(stale)
    return removed


def _check_metadata_target(path: Path) -> None:
    """ExportError unless `path` is absent or a metadata file gpubadge wrote (so it may be replaced)."""
    try:
        status = path.lstat()
    except FileNotFoundError:
        return
    refusal = (
        f"{path} exists and was not written by gpubadge; not replacing it "
        "(remove it, or export to another file)"
    )
    if not stat.S_ISREG(status.st_mode):
        raise ExportError(f"{path} is not a regular file (a link or a directory); not replacing it")
    if status.st_size > METADATA_MAX_BYTES:
        raise ExportError(refusal)
    try:
        with path.open("rb") as handle:
            document = json.loads(handle.read(METADATA_MAX_BYTES + 1))
    except (OSError, ValueError):
        raise ExportError(refusal) from None
    if not isinstance(document, dict):
        raise ExportError(refusal)
    mark = document.get(METADATA_MARK)
    ours = isinstance(mark, dict) and mark.get("format") == FORMAT
    earlier = METADATA_MARK not in document and document.get("title") == METADATA_TITLE
    if not (ours or earlier):
        raise ExportError(refusal)


def _write_metadata(path: Path, database: Path) -> None:
    """The Datasette metadata file, written to a temporary file created exclusively, synced and renamed."""
    document = (json.dumps(datasette_metadata(database.stem), indent=2) + "\n").encode()
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    temporary = Path(name)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(document)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def _sync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sync_directory(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system syncs a directory
        _sync(path)


def _why(exc: BaseException) -> str:
    """A full disk or a read-only file system in plain words; otherwise the error's own."""
    text = str(exc)
    if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "disk is full" in text:
        return "no space left on the disk (nothing was replaced)"
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{exc.strerror} (nothing was replaced)"
    return text


def read_meta(path: Path) -> dict[str, Any]:
    """The export's own key/value record (format, exported_at, source, since)."""
    with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
        return dict(conn.execute(f"SELECT key, value FROM {META_TABLE}").fetchall())
