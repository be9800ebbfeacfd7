"""The intake journal's move into `jobs`: written once, run on both engines by `store.intake_mover`.

One call is one pass of the mover, in one write transaction of the store: it reads how far this
journal was moved (`intake_moved`), inserts the journal's rows after that in journal order, and
records the new mark in the same transaction, so a crash anywhere moves each job exactly once. A
row whose reference has an active (queued or running) job inserts nothing; its id becomes an alias
of that job (`job_aliases`), which `queries.jobs.job` reads through, so the id its sender was given
still names the scan that covers it. `queued_beside_journal` is the queue cap's count beside a
journal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from store.dialect import Db, reads, writes
from store.events import JOBS_QUEUED_CHANNEL
from store.intake_journal import JournaledJob

ROUNDS = 5  # a row goes round again only when the active job it met settled before its alias was written
INSERT_ROWS = 1000  # rows per INSERT statement (8 parameters each: under SQLite's 32,766)

_COLUMNS = ("id", "reference", "registry", "dedupe_key", "max_attempts", "not_before", "source", "created_at")
_INSERT = (
    "INSERT INTO jobs (id, reference, registry, dedupe_key, state, attempts, max_attempts, not_before, source,"
    " created_at, updated_at) VALUES {values}"
    " ON CONFLICT (dedupe_key) WHERE state IN ('queued', 'running') DO NOTHING RETURNING id"
)
_ROW = (
    "(:id{n}, :reference{n}, :registry{n}, :dedupe_key{n}, 'queued', 0, :max_attempts{n}, :not_before{n},"
    " :source{n}, :created_at{n}, :created_at{n})"
)
_ALIAS = (
    "INSERT INTO job_aliases (id, job_id) SELECT :id, id FROM jobs"
    " WHERE dedupe_key = :dedupe_key AND state IN ('queued', 'running') ON CONFLICT (id) DO NOTHING"
)
_MARK = (
    "INSERT INTO intake_moved (journal, seq) VALUES (:journal, :through) ON CONFLICT (journal) DO UPDATE"
    " SET seq = CASE WHEN excluded.seq > intake_moved.seq THEN excluded.seq ELSE intake_moved.seq END"
)


def _insert(db: Db, jobs: Sequence[JournaledJob]) -> set[str]:
    """INSERT `jobs` in order, INSERT_ROWS to a statement; the ids inserted (the others met an
    active job of their reference, or an earlier row of this pass)."""
    inserted: set[str] = set()
    for start in range(0, len(jobs), INSERT_ROWS):
        chunk = jobs[start : start + INSERT_ROWS]
        params: dict[str, object] = {}
        for n, job in enumerate(chunk):
            for column in _COLUMNS:
                params[f"{column}{n}"] = getattr(job, column)
        values = ", ".join(_ROW.format(n=n) for n in range(len(chunk)))
        inserted.update(str(row[0]) for row in db.all(_INSERT.format(values=values), params))
    return inserted


@writes
def move_journaled(
    db: Db, journal_id: str, rows_after: Callable[[int], Sequence[JournaledJob]], through: int
) -> int:
    """Move the rows of journal `journal_id` after its recorded mark (`rows_after(mark)`, which
    stops at `through`) into `jobs`, and mark the journal moved through `through`; returns how many
    rows were moved. Movers of one journal take turns (an advisory lock on PostgreSQL; SQLite's
    writer), and each jobs' insert wakes the workers at commit."""
    db.dialect.lock(db, f"intake journal {journal_id}")
    row = db.one("SELECT seq FROM intake_moved WHERE journal = :journal", {"journal": journal_id})
    moved = rows_after(int(row[0]) if row else 0)
    inserted = _insert(db, moved)
    for job in moved:
        if job.id in inserted:
            continue
        for _ in range(ROUNDS):  # its id names the active job it met (rare: a second mention of a reference)
            if db.execute(_ALIAS, {"id": job.id, "dedupe_key": job.dedupe_key}).rowcount or _insert(
                db, [job]
            ):
                break
    db.execute(_MARK, {"journal": journal_id, "through": through})
    if moved:
        db.notify(JOBS_QUEUED_CHANNEL, "")
    return len(moved)


@reads
def queued_beside_journal(db: Db, journal_id: str | None, *, cap: int) -> tuple[int, int]:
    """How far journal `journal_id` was moved (0 for one never moved, or None), and the jobs waiting
    to run (up to `cap`), read in one statement, so in one snapshot: with the journal's rows past that
    mark, every waiting job counted once, even while a move commits (`IntakeMover.waiting`)."""
    row = db.one(
        "SELECT coalesce((SELECT seq FROM intake_moved WHERE journal = :journal), 0),"
        " (SELECT count(*) FROM (SELECT 1 FROM jobs WHERE state = 'queued' LIMIT :cap) AS waiting)",
        {"journal": journal_id, "cap": cap},
    )
    return (int(row[0]), int(row[1])) if row else (0, 0)
