"""How processes and threads share one SQLite file: the writer lock's fast lane for webhook intake,
how a new file and its directory are made (the service user's alone), and why a file cannot be
opened, in words SQLite does not give; one immediate transaction on a writer connection. Used by
`store.sqlite` and `store.intake_journal`.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def immediate_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """`BEGIN IMMEDIATE` on `conn` (the write lock taken at once), COMMIT when the block ends and
    ROLLBACK when it raises. The caller holds the process's writer lock."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


class WriterLock:
    """The in-process writer lock, with a fast lane: webhook intake commits go before queued scan writes.

    A registry waits for each webhook answer before it sends the next, so an intake commit that
    queued behind a burst of report writes (and their fsyncs, with synchronous=FULL) would hold
    back every push behind it. Urgent waiters are served first; the others keep FIFO-ish order.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._held = False
        self._urgent_waiting = 0

    def acquire(self, *, urgent: bool) -> None:
        """Take the lock: at once when it is free (and, for a scan write, no intake commit waits)."""
        with self._condition:
            if not self._held and (urgent or not self._urgent_waiting):
                self._held = True
                return
            if urgent:
                self._urgent_waiting += 1
                try:
                    self._condition.wait_for(lambda: not self._held)
                finally:
                    self._urgent_waiting -= 1
            else:
                self._condition.wait_for(lambda: not self._held and not self._urgent_waiting)
            self._held = True

    def release(self) -> None:
        with self._condition:
            self._held = False
            self._condition.notify_all()

    @contextmanager
    def hold(self, *, urgent: bool) -> Iterator[None]:
        self.acquire(urgent=urgent)
        try:
            yield
        finally:
            self.release()


def create_private_file(path: Path) -> None:
    """Make the database file, and the directories it lacks, as the service user's alone.

    The store holds deployments' environment values, so a file gpubadge makes is mode 0600 (SQLite
    gives its WAL and shared-memory files the same mode) and a directory it makes is mode 0700; it
    is made exclusively (`O_EXCL | O_NOFOLLOW`), so a link planted under that name is never
    followed to make a file elsewhere. A file or directory that exists is the operator's, used as
    named (a database moved behind a link stays usable), except a link that leads nowhere:
    SQLite would create its target, so it is refused.
    """
    if path.parent != path and not path.parent.exists():
        _make_directories(path.parent)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        if path.is_symlink() and not path.exists():
            raise FileExistsError(
                f"{path} is a symbolic link to {os.readlink(path)}, which does not exist: SQLite would create"
                " the file it names; remove the link or make its target"
            ) from None
        return
    os.close(descriptor)


def _make_directories(directory: Path) -> None:
    """`mkdir -p` with mode 0700 for each directory made (Path.mkdir gives made parents the umask's)."""
    if directory.parent != directory and not directory.parent.exists():
        _make_directories(directory.parent)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        if not directory.is_dir():
            raise


POSTGRES_INSTEAD = "set GPUBADGE_DATABASE_URL to use PostgreSQL instead"


def unwritable_hint(path: Path, otherwise: str = POSTGRES_INSTEAD) -> str:
    """Why a SQLite file cannot be opened when it, or its directory, is not this process's to write:
    SQLite says only "unable to open database file". Names the path, the user and the remedy (in a
    container: a volume the user can write, such as a root-owned bind mount is not; or `otherwise`);
    "" otherwise."""
    uid, gid = os.getuid(), os.getgid()
    if path.exists():
        if os.access(path, os.R_OK | os.W_OK):
            return ""
        blocked = path
    else:
        directory = path.parent
        while not directory.exists() and directory != directory.parent:
            directory = directory.parent
        if os.access(directory, os.W_OK | os.X_OK):
            return ""
        blocked = directory
    return (
        f"; {blocked} is not writable by uid {uid} (gid {gid}): mount a volume at {path.parent} that uid {uid}"
        f" can write (docker run -v gpubadge:{path.parent}, or chown {uid} the host directory), or {otherwise}"
    )
