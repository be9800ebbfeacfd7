"""NOTIFY and LISTEN for the processes that share one SQLite file on one host.

PostgreSQL tells every replica of a commit (`NOTIFY`); a SQLite file tells nobody. So that
`gpubadge serve --workers 0` and `gpubadge worker` processes sharing a SQLite file wake each
other as replicas on PostgreSQL do (a worker when a webhook queues a job, a long-poll when a
worker stores the badge), each listening process binds a UNIX datagram socket in a directory
beside the file, `<file>-notify/`, and a commit sends its notices, once it is durable, to every
socket there, its own included (as PostgreSQL's listeners hear their own NOTIFY).

- A notice is one datagram, `<channel>\\n<payload>`, the payload cut at `PAYLOAD_MAX` bytes as
  PostgreSQL cuts its own. Sending never blocks: a listener whose queue is full misses that
  notice, and waiters re-check on their own (`store.events.SAFETY_RECHECK`), so a slow reader
  delays an answer by seconds at worst and never stalls a commit.
- A listener that is gone (its process died without cleaning up) is found at the next send
  (the socket refuses) and its entry removed.
- A socket path is limited to 107 bytes. When the directory's path is longer, the socket is
  bound in a short private directory under the system's temporary directory, and the entry
  beside the SQLite file is a symbolic link to it.
- The directory is made with mode 0700: only the file's owner may send to its listeners.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

Notice = tuple[str, str]  # (channel, payload), as PostgreSQL's
PAYLOAD_MAX = 7900  # what PostgreSQL's 8000-byte NOTIFY limit leaves, as store.postgres cuts it
DATAGRAM_MAX = 8192
SUN_PATH_MAX = 107  # sockaddr_un's sun_path, less its terminating NUL


def notify_directory(database: Path) -> Path:
    """Where the listeners of the SQLite file `database` bind their sockets."""
    return database.with_name(database.name + "-notify")


class LocalNotifier:
    """The listeners of one SQLite file: send notices to all of them, or become one."""

    def __init__(self, database: Path) -> None:
        self.directory = notify_directory(database)
        self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sender.setblocking(False)
        self._lock = threading.Lock()  # one sender socket, many store threads

    def send(self, notices: Sequence[Notice]) -> None:
        """Hand `notices` to every listener now; never blocks, never raises."""
        if not notices:
            return
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return  # no directory: nobody listens
        datagrams = [f"{channel}\n{payload}".encode()[: PAYLOAD_MAX + 64] for channel, payload in notices]
        for entry in entries:
            target = entry.path
            if entry.is_symlink():
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    continue
            for datagram in datagrams:
                try:
                    with self._lock:
                        self._sender.sendto(datagram, target)
                except BlockingIOError:
                    break  # its queue is full: it re-checks on its own
                except (ConnectionRefusedError, FileNotFoundError):
                    _remove_stale(entry.path, target)
                    break
                except OSError as exc:
                    log.debug("notice to %s not sent: %s", entry.path, exc)
                    break

    def listen(self, callback: Callable[[Notice], None]) -> Callable[[], None]:
        """Call `callback((channel, payload))` from a background thread for every notice sent to this
        file's listeners; returns a function that stops listening and removes the socket."""
        self.directory.mkdir(mode=0o700, exist_ok=True)
        name = f"{os.getpid()}.{secrets.token_hex(4)}"
        entry = self.directory / name
        private: Path | None = None
        if len(os.fsencode(entry)) <= SUN_PATH_MAX:
            address = str(entry)
        else:
            private = Path(tempfile.mkdtemp(prefix="gpubadge-notify-"))
            address = str(private / "s")
        receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            receiver.bind(address)
            if private is not None:
                entry.symlink_to(address)
        except OSError:
            receiver.close()
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)
            raise
        stopped = threading.Event()

        def receive() -> None:
            while not stopped.is_set():
                try:
                    datagram = receiver.recv(DATAGRAM_MAX)
                except OSError:
                    return  # closed by stop()
                if not datagram:
                    continue
                channel, _, payload = datagram.decode(errors="replace").partition("\n")
                try:
                    callback((channel, payload))
                except Exception:
                    log.exception("listener callback failed on %s", channel)

        thread = threading.Thread(target=receive, name="sqlite-listen", daemon=True)
        thread.start()

        def stop() -> None:
            if stopped.is_set():
                return
            stopped.set()
            # the wake-up goes to the bound path, so before the path is unlinked
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:
                waker.sendto(b"", address)  # wakes the thread's recv; it sees `stopped` and ends
            with contextlib.suppress(OSError):
                os.unlink(entry)
            thread.join(timeout=5)
            receiver.close()
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(address)

        return stop

    def close(self) -> None:
        self._sender.close()


def _remove_stale(entry: str, target: str) -> None:
    """A listener that no longer answers: its process is gone. Remove its entry (and its socket,
    with the private directory it was bound in, if any)."""
    for path in {entry, target}:
        with contextlib.suppress(OSError):
            os.unlink(path)
    parent = Path(target).parent
    if target != entry and parent.name.startswith("gpubadge-notify-"):
        with contextlib.suppress(OSError):
            parent.rmdir()
    log.debug("removed the socket of a listener that is gone: %s", entry)
