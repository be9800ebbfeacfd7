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
  (the socket refuses) and its socket removed.
- A listener that hears only the queue's channels (`store.events.JOB_CHANNELS`: a process that
  only runs scan workers) says so in its socket's name (`JOBS_ONLY_SUFFIX`); it is sent nothing
  else, so a report stored wakes only the processes that serve long polls.

The directory is the service user's alone, and nothing in it is trusted before it is checked
(the file may sit in a directory other users can write to, where they could plant a directory
of that name, or links in it):

- It is created with mode 0700. One that exists is used only when it is a real directory (not
  a link) owned by the user this process runs as; group and other permissions on it are taken
  away. Anything else is refused (`UnsafeDirectory`, an `OSError`: the store then goes without
  other processes' events and says why) and left as it is.
- It is opened once per use (`O_NOFOLLOW | O_DIRECTORY`) and every socket is bound, sent to and
  removed through that descriptor (`/proc/self/fd/N/<name>`, `unlinkat`), so a path swapped
  after the check is never followed, and a socket path is never longer than 107 bytes
  whatever the directory's path.
- Only entries that are sockets owned by this user are sent to; links, files, directories and
  other users' sockets are skipped and never removed. A stale socket is removed by name in the
  checked directory: no link is ever followed to find what to unlink.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import socket
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from store.events import JOB_CHANNELS

log = logging.getLogger(__name__)

Notice = tuple[str, str]  # (channel, payload), as PostgreSQL's
PAYLOAD_MAX = 7900  # what PostgreSQL's 8000-byte NOTIFY limit leaves, as store.postgres cuts it
DATAGRAM_MAX = 8192
READ_BATCH = 256  # datagrams read per turn of the loop at most: a flood cannot hold the loop
SUN_PATH_MAX = 107  # sockaddr_un's sun_path, less its terminating NUL
JOBS_ONLY_SUFFIX = ".jobs"  # a socket so named hears only JOB_CHANNELS
_PROC_FD = Path("/proc/self/fd")


class UnsafeDirectory(PermissionError):
    """The notify directory is not this user's own private directory; the message says why."""


def notify_directory(database: Path) -> Path:
    """Where the listeners of the SQLite file `database` bind their sockets."""
    return database.with_name(database.name + "-notify")


def open_private_directory(directory: Path, *, create: bool) -> int:
    """A descriptor of `directory`, checked to be a real directory owned by this process's user with
    no group or other permissions (taken away if it had them). With `create`, made (mode 0700) when
    it does not exist. Raises `UnsafeDirectory` for anything else, FileNotFoundError when absent."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
    try:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW met a link, or a file is there
            kind = "a symbolic link" if os.path.islink(directory) else "not a directory"
            raise UnsafeDirectory(_refusal(directory, f"it is {kind}")) from None
        raise
    try:
        found = os.fstat(descriptor)
        user = os.geteuid()
        if found.st_uid != user:
            raise UnsafeDirectory(
                _refusal(directory, f"it is owned by uid {found.st_uid}, not by this process's uid {user}")
            )
        if stat.S_IMODE(found.st_mode) & 0o077:
            os.fchmod(descriptor, 0o700)  # ours: others lose access before anything in it is used
            log.info("%s: group and other permissions removed (mode 0700)", directory)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _refusal(directory: Path, why: str) -> str:
    return (
        f"{directory} is not used for notices: {why}; remove it, or keep the database in a directory"
        " only the service's user can write to"
    )


def _address(descriptor: int, directory: Path, name: str) -> str:
    """A socket address for `name` in the checked directory open as `descriptor`: through the
    descriptor (no path is looked up again, and it is short whatever the directory's path)."""
    if _PROC_FD.is_dir():
        return f"{_PROC_FD}/{descriptor}/{name}"
    address = str(directory / name)  # no /proc: the path itself, where it fits
    if len(os.fsencode(address)) > SUN_PATH_MAX:
        raise OSError(f"{address}: longer than a socket path may be ({SUN_PATH_MAX} bytes) and no /proc")
    return address


def _own_sockets(descriptor: int) -> Iterator[str]:
    """Names of the entries of the open directory that are sockets owned by this process's user;
    nothing else (links included) is ever looked at twice."""
    user = os.geteuid()
    with os.scandir(descriptor) as entries:
        for entry in entries:
            try:
                found = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISSOCK(found.st_mode) and found.st_uid == user:
                yield entry.name
            else:
                log.debug("not a listener of ours, skipped: %s", entry.name)


class LocalNotifier:
    """The listeners of one SQLite file: send notices to all of them, or become one (`bind`)."""

    def __init__(self, database: Path) -> None:
        self.directory = notify_directory(database)
        self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sender.setblocking(False)
        self._lock = threading.Lock()  # one sender socket, many store threads
        self._refused = False  # an unsafe directory is logged once per process

    def send(self, notices: Sequence[Notice]) -> None:
        """Hand `notices` to every listener now; never blocks, never raises."""
        if not notices:
            return
        try:
            descriptor = open_private_directory(self.directory, create=False)
        except UnsafeDirectory as exc:
            if not self._refused:
                self._refused = True
                log.warning("%s", exc)
            return
        except OSError:
            return  # no directory: nobody listens
        try:
            datagrams = [
                (channel in JOB_CHANNELS, f"{channel}\n{payload}".encode()[: PAYLOAD_MAX + 64])
                for channel, payload in notices
            ]
            for name in list(_own_sockets(descriptor)):
                wanted = [
                    datagram for queue, datagram in datagrams if queue or not name.endswith(JOBS_ONLY_SUFFIX)
                ]
                if not wanted:
                    continue
                try:
                    address = _address(descriptor, self.directory, name)
                except OSError:
                    continue
                for datagram in wanted:
                    try:
                        with self._lock:
                            self._sender.sendto(datagram, address)
                    except BlockingIOError:
                        break  # its queue is full: it re-checks on its own
                    except (ConnectionRefusedError, FileNotFoundError):
                        # nobody bound to it any more: its process is gone. Removed by name in the
                        # checked directory (a socket, so no link is followed).
                        with contextlib.suppress(OSError):
                            os.unlink(name, dir_fd=descriptor)
                        log.debug("removed the socket of a listener that is gone: %s", name)
                        break
                    except OSError as exc:
                        log.debug("notice to %s not sent: %s", name, exc)
                        break
        finally:
            os.close(descriptor)

    def bind(self, *, jobs_only: bool = False) -> BoundListener:
        """A socket of this file's listeners, bound in the checked directory, for an event loop to read
        (`BoundListener.attach`), or any reader of its `receiver`. `jobs_only`: it is sent only the
        notices on `JOB_CHANNELS`.

        Raises `UnsafeDirectory` (an OSError) when the directory is not this user's own."""
        descriptor = open_private_directory(self.directory, create=True)
        name = f"{os.getpid()}.{secrets.token_hex(4)}{JOBS_ONLY_SUFFIX if jobs_only else ''}"
        receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            address = _address(descriptor, self.directory, name)
            receiver.bind(address)
        except BaseException:
            receiver.close()
            os.close(descriptor)
            raise
        return BoundListener(receiver, descriptor, name, address)

    def close(self) -> None:
        self._sender.close()


def _deliver(callback: Callable[[Notice], None], datagram: bytes) -> None:
    """Hand one datagram's notice to `callback`; an empty one (a stopping listener's own wake-up) is
    none, and the callback's failure is logged, never raised into the reader."""
    if not datagram:
        return
    channel, _, payload = datagram.decode(errors="replace").partition("\n")
    try:
        callback((channel, payload))
    except Exception:
        log.exception("listener callback failed on %s", channel)


class BoundListener:
    """One listener's socket in the notify directory (`LocalNotifier.bind`).

    `attach` reads it on an asyncio loop: the loop wakes when a notice arrives and takes every
    datagram queued by then in one turn, with no thread between the socket and the loop (a thread
    would add a wake-up and a hand-over per notice; a scan commits several). `detach` on the loop,
    then `close` (in any thread) removes the socket.
    """

    def __init__(self, receiver: socket.socket, descriptor: int, name: str, address: str) -> None:
        self.receiver = receiver
        self.address = address
        self._descriptor = descriptor
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unbound = False
        self._closed = False

    def attach(self, loop: asyncio.AbstractEventLoop, callback: Callable[[Notice], None]) -> None:
        """On `loop`: call `callback((channel, payload))` there for every notice, in the order sent."""
        self.receiver.setblocking(False)
        receiver = self.receiver

        def readable() -> None:
            for _ in range(READ_BATCH):
                try:
                    datagram = receiver.recv(DATAGRAM_MAX)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:  # not readable any more: stop, rather than spin on it
                    log.warning(
                        "the notice socket failed (%s); other processes' commits are seen by re-checks", exc
                    )
                    self.detach()
                    return
                _deliver(callback, datagram)

        loop.add_reader(receiver.fileno(), readable)
        self._loop = loop

    def detach(self) -> None:
        """On the loop it was attached to: stop reading (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.receiver.fileno())

    def unbind(self) -> None:
        """Remove the socket's name from the directory: senders skip it from now on."""
        if self._unbound:
            return
        self._unbound = True
        with contextlib.suppress(OSError):
            os.unlink(self._name, dir_fd=self._descriptor)

    def close(self) -> None:
        """Remove the socket and close it (after `detach`, when attached); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.unbind()
        self.receiver.close()
        os.close(self._descriptor)
