"""What gpubadge makes on disk is its user's alone, and what it finds there is checked before it is
trusted (issue 43, point 3).

The SQLite file may sit in a directory other local users can write to; one of them can plant the
`<db>-notify/` directory that processes sharing the file use for their notices (store.sqlite_notify),
with links in it to files of the service's user. A planted directory is refused, links are never
followed, and nothing is unlinked through one. The tests plant as another user (uid 65534, by
chown: the suite runs as root, as the service's tests do) against real stores and, last, a real
`gpubadge serve --workers 0` answering `POST /api/scans`.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from pathlib import Path

import pytest

from fixtures.service import run_service_process
from store import AsyncStore, SqliteStore
from store.sqlite_notify import notify_directory
from tests.test_service_e2e import call

OTHER_USER = 65534  # nobody


@pytest.fixture(autouse=True)
def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("planting another user's files needs root (the suite runs as root)")


def _victims(tmp_path: Path) -> list[Path]:
    """Files of the service's user that a planted link names."""
    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    secret = private / "id_ed25519"
    secret.write_text("private key\n")
    secret.chmod(0o600)
    return [secret]


def _plant(directory: Path, targets: list[Path], owner: int = OTHER_USER, mode: int = 0o777) -> list[str]:
    """A notify directory as another user leaves it: a link per target named as a listener's socket
    would be, a plain file, and a socket of that user's that nobody listens on."""
    directory.mkdir()
    names = []
    for number, target in enumerate(targets):
        name = f"{1000 + number}.deadbeef"
        (directory / name).symlink_to(target)
        names.append(name)
    (directory / "readme").write_text("planted\n")
    held = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:  # through the descriptor, as the service binds: a deep temp path would pass AF_UNIX's 108 bytes
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as theirs:
            theirs.bind(f"/proc/self/fd/{held}/4242.0badf00d")
    finally:
        os.close(held)
    for name in [*names, "readme", "4242.0badf00d"]:
        os.lchown(directory / name, owner, owner)
    os.chown(directory, owner, owner)
    directory.chmod(mode)
    return sorted([*names, "readme", "4242.0badf00d"])


async def test_another_users_notify_directory_is_refused_and_nothing_it_links_to_is_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    db = shared / "gpubadge.db"
    victims = _victims(tmp_path)
    planted = _plant(notify_directory(db), [*victims, db])
    backend = SqliteStore(db, shared_events=True)
    store = AsyncStore(backend)
    try:
        with caplog.at_level(logging.WARNING):
            await store.start_events()
        assert not store.events.cross_process  # re-checks instead of the planted directory
        assert f"owned by uid {OTHER_USER}" in caplog.text
        for number in range(3):  # commits: each would send its notices to every entry
            backend.enqueue([(f"reg.example/app:{number}", "reg.example")])
    finally:
        await store.close()
    assert all(victim.read_text() == "private key\n" for victim in victims)
    assert db.exists() and db.stat().st_size > 0
    assert sorted(os.listdir(notify_directory(db))) == planted  # left as it was found
    assert os.lstat(notify_directory(db)).st_uid == OTHER_USER


def test_a_link_in_place_of_the_directory_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "gpubadge.db"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    notify_directory(db).symlink_to(elsewhere)
    store = SqliteStore(db, shared_events=True)
    try:
        with pytest.raises(PermissionError, match="symbolic link"):
            store.bind_listener()
        store.enqueue([("reg.example/app:1", "reg.example")])
    finally:
        store.close()
    assert os.listdir(elsewhere) == []  # no socket bound through the link


def test_links_files_and_other_users_sockets_in_its_own_directory_are_skipped_never_unlinked(
    tmp_path: Path,
) -> None:
    db = tmp_path / "gpubadge.db"
    victims = _victims(tmp_path)
    planted = _plant(notify_directory(db), [*victims, db], owner=os.geteuid(), mode=0o777)
    for name in planted:  # their entries, in a directory of the service's user left open to all
        os.lchown(notify_directory(db) / name, OTHER_USER, OTHER_USER)
    store = SqliteStore(db, shared_events=True)
    listener = store.bind_listener()
    try:
        assert stat.S_IMODE(os.stat(notify_directory(db)).st_mode) == 0o700  # closed to others first
        for number in range(3):
            store.enqueue([(f"reg.example/app:{number}", "reg.example")])
    finally:
        listener.close()
        store.close()
    assert all(victim.read_text() == "private key\n" for victim in victims)
    assert db.exists() and db.stat().st_size > 0
    assert sorted(os.listdir(notify_directory(db))) == planted


def test_a_new_database_and_its_directories_are_the_service_users_alone(tmp_path: Path) -> None:
    db = tmp_path / "data" / "gpubadge" / "gpubadge.db"
    SqliteStore(db).close()
    assert stat.S_IMODE(db.stat().st_mode) == 0o600  # deployments' env values live in it
    for directory in (db.parent, db.parent.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for companion in (db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        if companion.exists():
            assert stat.S_IMODE(companion.stat().st_mode) & 0o077 == 0
    # one that exists is the operator's: used as it is
    existing = tmp_path / "existing.db"
    existing.touch(mode=0o640)
    SqliteStore(existing).close()
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640


def test_a_dangling_link_in_place_of_the_database_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "home" / ".profile"
    victim.parent.mkdir()
    db = tmp_path / "gpubadge.db"
    db.symlink_to(victim)
    with pytest.raises(Exception, match="does not exist"):
        SqliteStore(db)
    assert not victim.exists()  # SQLite made no file through the link


def test_serve_on_a_shared_sqlite_file_deletes_nothing_through_a_planted_directory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp: anyone may create entries
    db = shared / "gpubadge.db"
    victims = _victims(tmp_path)
    _plant(notify_directory(db), [*victims, db])
    with run_service_process(db, env={"GPUBADGE_WORKERS": "0"}) as service:
        for number in range(3):
            reply = call("POST", f"{service.url}/api/scans", {"ref": f"127.0.0.1:9/app:{number}"})
            assert reply.status == 202, reply.text
        assert call("GET", f"{service.url}/healthz").status == 200
        log = service.log()
    assert all(victim.read_text() == "private key\n" for victim in victims)
    assert db.exists()
    assert f"owned by uid {OTHER_USER}" in log and "re-checks" in log
