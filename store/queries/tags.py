"""Tag history, deleted manifests and the per-layer evidence cache: written once, run on both engines."""

from __future__ import annotations

from collections.abc import Iterable

from store.dialect import Db, reads, writes
from store.models import TagEvent


@writes
def record_tag(db: Db, registry: str, repository: str, tag: str, digest: str) -> None:
    """Remember that `tag` points at `digest` now; a change starts a new history row."""
    key = {"registry": registry, "repository": repository, "tag": tag, "digest": digest}
    # Serialise writers of one tag (two replicas seeing the same push); SQLite's one writer already is.
    db.dialect.lock(db, f"tag {registry} {repository} {tag}")
    current = db.one(
        "SELECT id, digest, gone_at FROM tags WHERE registry = :registry AND repository = :repository"
        " AND tag = :tag ORDER BY id DESC LIMIT 1",
        key,
    )
    if current and current[1] == digest and current[2] is None:
        db.execute("UPDATE tags SET last_seen = :now WHERE id = :id", {"id": current[0]})
    else:
        db.execute(
            "INSERT INTO tags (registry, repository, tag, digest, first_seen, last_seen)"
            " VALUES (:registry, :repository, :tag, :digest, :now, :now)",
            key,
        )
    db.execute(
        "DELETE FROM gone_digests WHERE registry = :registry AND repository = :repository AND digest = :digest",
        key,
    )


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
def resolve_tags(db: Db, keys: Iterable[tuple[str, str, str]]) -> dict[tuple[str, str, str], str | None]:
    """`resolve_tag` for many (registry, repository, tag) keys: one statement per repository,
    whatever the number of tags, so a command scanning hundreds of tags reads them in one hop.
    Every key asked for is in the answer (None: unknown or deleted)."""
    tags_by_repository: dict[tuple[str, str], set[str]] = {}
    for registry, repository, tag in keys:
        tags_by_repository.setdefault((registry, repository), set()).add(tag)
    found: dict[tuple[str, str, str], str | None] = {}
    for (registry, repository), tags in tags_by_repository.items():
        latest: dict[str, tuple[int, str | None]] = {}
        rows = db.all(
            "SELECT tag, id, digest, gone_at FROM tags WHERE registry = :registry"
            f" AND repository = :repository AND {db.dialect.in_list('tag', 'tags')}",
            {"registry": registry, "repository": repository, "tags": db.dialect.array(sorted(tags))},
        )
        for tag, row_id, digest, gone_at in rows:  # the newest row of each tag is its state now
            if tag not in latest or row_id > latest[tag][0]:
                latest[tag] = (row_id, digest if gone_at is None else None)
        for tag in tags:
            found[(registry, repository, tag)] = latest[tag][1] if tag in latest else None
    return found


@reads
def tag_history(db: Db, registry: str, repository: str) -> list[TagEvent]:
    rows = db.all(
        "SELECT tag, digest, first_seen, last_seen, gone_at FROM tags"
        " WHERE registry = :registry AND repository = :repository ORDER BY id DESC",
        {"registry": registry, "repository": repository},
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
    """A registry deleted a tag or a manifest: keep the history, flag it gone."""
    key = {"registry": registry, "repository": repository, "tag": tag, "digest": digest}
    if tag:
        db.execute(
            "UPDATE tags SET gone_at = :now WHERE id = (SELECT max(id) FROM tags WHERE registry = :registry"
            " AND repository = :repository AND tag = :tag) AND gone_at IS NULL",
            key,
        )
    if digest:
        db.execute(
            "UPDATE tags SET gone_at = :now WHERE registry = :registry AND repository = :repository"
            " AND digest = :digest AND gone_at IS NULL",
            key,
        )
        db.execute(
            "INSERT INTO gone_digests (registry, repository, digest, gone_at)"
            " VALUES (:registry, :repository, :digest, :now)"
            " ON CONFLICT (registry, repository, digest) DO UPDATE SET gone_at = excluded.gone_at",
            key,
        )


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


@writes
def save_layer_evidence(db: Db, digest: str, evidence_json: str) -> None:
    db.execute(
        "INSERT INTO layers (digest, evidence, stored_at) VALUES (:digest, :evidence, :now)"
        " ON CONFLICT (digest) DO UPDATE SET evidence = excluded.evidence, stored_at = excluded.stored_at",
        {"digest": digest, "evidence": evidence_json},
    )
