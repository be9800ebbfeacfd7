"""How processes and threads share one SQLite file: the writer lock's fast lane for webhook intake,
and why a file cannot be opened, in words SQLite does not give. Used by `store.sqlite`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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


def unwritable_hint(path: Path) -> str:
    """Why a SQLite file cannot be opened when it, or its directory, is not this process's to write:
    SQLite says only "unable to open database file". Names the path, the user and the remedy (in a
    container: a volume the user can write, such as a root-owned bind mount is not); "" otherwise."""
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
        f" can write (docker run -v gpubadge:{path.parent}, or chown {uid} the host directory), or set"
        " GPUBADGE_DATABASE_URL to use PostgreSQL instead"
    )
