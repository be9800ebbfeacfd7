"""Tag history, deleted manifests and the per-layer evidence cache: written once, run on both engines."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from store.dialect import Db, reads, writes
from store.events import REFERENCE_CHANNEL
from store.models import TagEvent

TagKey = tuple[str, str, str]  # (registry, repository, tag)


@dataclass(frozen=True)
class TagSeen:
    """A tag seen pointing at a digest (see `record_tags`)."""

    registry: str
    repository: str
    tag: str
    digest: str


@writes
def record_tag(db: Db, registry: str, repository: str, tag: str, digest: str) -> None:
    """Remember that `tag` points at `digest` now; a change starts a new history row."""
    record_tags(db, [TagSeen(registry, repository, tag, digest)])


@writes
def record_tags(db: Db, seen: Sequence[TagSeen]) -> None:
    """`record_tag` for each of `seen`, in order, with one statement per kind for them all: the
    newest row of a tag that still points at the same digest gets a new `last_seen`; a tag that
    moved (or is new, or was deleted) gets a new history row; the digests are no longer gone.
    Each tag that moved is announced (`announce_reference`), as a stored report is: its long polls
    wake, and every process that serves them forgets what the tag stood for."""
    if not seen:
        return
    keys = sorted({(one.registry, one.repository, one.tag) for one in seen})
    # Serialise writers of one tag (two replicas seeing the same push); SQLite's one writer
    # already is. In one order, so that two batches never wait on each other in a cycle.
    for registry, repository, tag in keys:
        db.dialect.lock(db, f"tag {registry} {repository} {tag}")
    newest = _newest_rows(db, keys)
    pointing: dict[TagKey, str | None] = {}  # what each tag points at as the batch goes on
    touched: set[int] = set()
    inserted: list[dict[str, str]] = []
    for one in seen:
        key = (one.registry, one.repository, one.tag)
        if key not in pointing:
            row = newest.get(key)
            pointing[key] = row[1] if row and row[2] is None else None
            if pointing[key] == one.digest and row:
                touched.add(row[0])
        if pointing[key] != one.digest:
            inserted.append(
                {"registry": one.registry, "repository": one.repository, "tag": one.tag, "digest": one.digest}
            )
            pointing[key] = one.digest
    db.many("UPDATE tags SET last_seen = :now WHERE id = :id", [{"id": row_id} for row_id in sorted(touched)])
    db.many(
        "INSERT INTO tags (registry, repository, tag, digest, first_seen, last_seen)"
        " VALUES (:registry, :repository, :tag, :digest, :now, :now)",
        inserted,
    )
    for moved in inserted:
        announce_reference(db, f"{moved['registry']}/{moved['repository']}:{moved['tag']}")
    db.many(
        "DELETE FROM gone_digests WHERE registry = :registry AND repository = :repository AND digest = :digest",
        [
            {"registry": registry, "repository": repository, "digest": digest}
            for registry, repository, digest in sorted({(o.registry, o.repository, o.digest) for o in seen})
        ],
    )


def _newest_rows(db: Db, keys: Iterable[TagKey]) -> dict[TagKey, tuple[int, str, object]]:
    """The newest history row (id, digest, gone_at) of each key that has one: one statement per
    repository, whatever the number of tags."""
    tags_by_repository: dict[tuple[str, str], set[str]] = {}
    for registry, repository, tag in keys:
        tags_by_repository.setdefault((registry, repository), set()).add(tag)
    newest: dict[TagKey, tuple[int, str, object]] = {}
    for (registry, repository), tags in tags_by_repository.items():
        rows = db.all(
            "SELECT tag, id, digest, gone_at FROM tags WHERE registry = :registry"
            f" AND repository = :repository AND {db.dialect.in_list('tag', 'tags')}",
            {"registry": registry, "repository": repository, "tags": db.dialect.array(sorted(tags))},
        )
        for tag, row_id, digest, gone_at in rows:
            key = (registry, repository, tag)
            if key not in newest or row_id > newest[key][0]:
                newest[key] = (row_id, digest, gone_at)
    return newest


@reads
def resolve_tag(db: Db, registry: str, repository: str, tag: str) -> str | None:
    """The digest a tag pointed at when last seen, or None if unknown or deleted."""
    row = db.one(
        "SELECT digest, gone_at FROM tags WHERE registry = :registry AND repository = :repository"
        " AND tag = :tag ORDER BY id DESC LIMIT 1",
        {"registry": registry, "repository": repository, "tag": tag},
    )
    return row[0] if row and row[1] is None else None


@reads
def resolve_tags(db: Db, keys: Iterable[TagKey]) -> dict[TagKey, str | None]:
    """`resolve_tag` for many (registry, repository, tag) keys: one statement per repository,
    whatever the number of tags, so a command scanning hundreds of tags reads them in one hop.
    Every key asked for is in the answer (None: unknown or deleted)."""
    wanted = list(keys)
    newest = _newest_rows(db, wanted)
    return {
        key: row[1] if (row := newest.get(key)) is not None and row[2] is None else None for key in wanted
    }


@reads
def tag_history(db: Db, registry: str, repository: str, *, limit: int | None = None) -> list[TagEvent]:
    """The repository's tag events, newest first; with `limit`, the newest `limit` only, read along
    `tags_history` (migration 0016) and no further. Newest first is `ORDER BY -id`, the order of that
    index alone, so no planner takes the primary key backwards through other repositories' events."""
    clause = "" if limit is None else " LIMIT :limit"
    rows = db.all(
        f"SELECT tag, digest, first_seen, last_seen, gone_at FROM {db.dialect.read_through('tags', 'tags_history')}"
        f" WHERE registry = :registry AND repository = :repository ORDER BY -id{clause}",
        {"registry": registry, "repository": repository, "limit": limit},
    )
    stamp = db.dialect.stamp
    return [TagEvent(row[0], row[1], stamp(row[2]) or "", stamp(row[3]) or "", stamp(row[4])) for row in rows]


@reads
def tags_for_digest(db: Db, digest: str) -> list[tuple[str, str, str]]:
    """(registry, repository, tag) triples currently pointing at `digest`."""
    rows = db.all(
        "SELECT t.registry, t.repository, t.tag FROM tags t WHERE t.digest = :digest AND t.gone_at IS NULL"
        " AND t.id = (SELECT max(id) FROM tags t2 WHERE t2.registry = t.registry"
        " AND t2.repository = t.repository AND t2.tag = t.tag) ORDER BY t.tag",
        {"digest": digest},
    )
    return [(row[0], row[1], row[2]) for row in rows]


@writes
def mark_gone(db: Db, registry: str, repository: str, *, tag: str | None, digest: str | None) -> None:
    """A registry deleted a tag or a manifest: keep the history, flag it gone, and announce it
    as a settle of the reference (every process forgets what it stood for)."""
    key = {"registry": registry, "repository": repository, "tag": tag, "digest": digest}
    if tag:
        announce_reference(db, f"{registry}/{repository}:{tag}")
        db.execute(
            "UPDATE tags SET gone_at = :now WHERE id = (SELECT max(id) FROM tags WHERE registry = :registry"
            " AND repository = :repository AND tag = :tag) AND gone_at IS NULL",
            key,
        )
    if digest:
        announce_reference(db, f"{registry}/{repository}@{digest}")
        # by the digest's own few rows (SQLite, with no statistics, would walk the repository's events)
        db.execute(
            f"UPDATE {db.dialect.read_through('tags', 'tags_digest')} SET gone_at = :now"
            " WHERE registry = :registry AND repository = :repository AND digest = :digest AND gone_at IS NULL",
            key,
        )
        db.execute(
            "INSERT INTO gone_digests (registry, repository, digest, gone_at)"
            " VALUES (:registry, :repository, :digest, :now)"
            " ON CONFLICT (registry, repository, digest) DO UPDATE SET gone_at = excluded.gone_at",
            key,
        )


def announce_reference(db: Db, reference: str) -> None:
    """What `reference` stands for changed (a report stored, a tag moved or deleted): a notice on
    `REFERENCE_CHANNEL`, sent after the commit, which each listening process takes as a settle of
    no job (`store.events.REPORTED_JOB`). Its long polls wake, and every process that serves them
    forgets what it looked up (`store.report_lookups`); processes that only scan do not hear it."""
    db.notify(REFERENCE_CHANNEL, reference)


@reads
def is_gone(db: Db, registry: str, repository: str, digest: str) -> bool:
    row = db.one(
        "SELECT 1 FROM gone_digests WHERE registry = :registry AND repository = :repository AND digest = :digest",
        {"registry": registry, "repository": repository, "digest": digest},
    )
    return row is not None


@reads
def layer_evidence(db: Db, digest: str) -> str | None:
    """The cached libc evidence JSON for a layer digest."""
    row = db.one("SELECT evidence FROM layers WHERE digest = :digest", {"digest": digest})
    return row[0] if row else None


@reads
def layer_evidences(db: Db, digests: Sequence[str]) -> dict[str, str]:
    """The cached evidence JSON of those of `digests` the cache holds, by digest, in one statement."""
    if not digests:
        return {}
    rows = db.all(
        f"SELECT digest, evidence FROM layers WHERE {db.dialect.in_list('digest', 'digests')}",
        {"digests": db.dialect.array(sorted(set(digests)))},
    )
    return {row[0]: row[1] for row in rows}


@dataclass(frozen=True)
class LayerSeen:
    """A layer's cache entry (the evidence its walk found), written with a batch (`save_layers`)."""

    digest: str
    evidence_json: str


_SAVE_LAYER = (
    "INSERT INTO layers (digest, evidence, stored_at) VALUES (:digest, :evidence, :now)"
    " ON CONFLICT (digest) DO UPDATE SET evidence = excluded.evidence, stored_at = excluded.stored_at"
)


@writes
def save_layer_evidence(db: Db, digest: str, evidence_json: str) -> None:
    save_layers(db, [LayerSeen(digest, evidence_json)])


def save_layers(db: Db, layers: Sequence[LayerSeen]) -> None:
    """Layers' cache entries, one statement for the batch (the last entry of a digest wins)."""
    db.many(_SAVE_LAYER, [{"digest": layer.digest, "evidence": layer.evidence_json} for layer in layers])
