"""Servers and deployments: written once, run on both engines.

Servers and deployments are stored as JSON documents: their shape belongs to placement/, which
the store must not import. Only the reservation is relational, because its primary key is what
makes double-booking a GPU impossible; reserving (`create_deployment`) differs per engine and
stays in each backend. So is a GPU's owner (`gpu_owners`, keyed by GPU UUID): the server that
first reported the GPU keeps it, whether it is live or not, until an operator releases it
(`release_gpu`, `forget_server`) or the fleet-wide agent token reports it on another server
(`reassign`); each registration checks and writes its claims in the transaction that stores it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from store.dialect import Db, reads, writes
from store.events import FLEET_CHANNEL
from store.models import DeploymentRecord, GpuClaims, ServerRecord


@writes
def upsert_server(
    db: Db,
    name: str,
    inventory_json: str,
    gpu_uuids: Sequence[str] = (),
    *,
    reassign: bool = False,
    most_servers: int | None = None,
    uncounted: Sequence[str] = (),
    origin: str = "",
) -> GpuClaims:
    """Register a server, or store its new inventory; either way it was heard from now.

    Its GPUs (`gpu_uuids`) become its own unless another server owns one: then nothing is written
    and `refused` names the owners, unless `reassign` (the fleet-wide agent token) takes them over.
    With `most_servers`, a server not registered yet is refused (`full`) once that many servers
    other than `uncounted` (those with a per-agent token of their own) are registered. `origin`
    names the writing process in the notice, so its own registration, echoed back, is known."""
    if most_servers is not None:
        known = db.one("SELECT 1 FROM servers WHERE name = :name", {"name": name})
        if known is None:  # a count of the table less the few named: no scan comparing every name
            row = db.one(
                "SELECT (SELECT count(*) FROM servers) - (SELECT count(*) FROM servers WHERE "
                + db.dialect.in_list("name", "uncounted")
                + ")",
                {"uncounted": db.dialect.array(uncounted)},
            )
            if row is not None and int(row[0]) >= most_servers:
                return GpuClaims(full=True)
    claims = _claim_gpus(db, name, gpu_uuids, reassign=reassign)
    if not claims.written:
        return claims
    db.execute(
        "INSERT INTO servers (name, inventory, registered_at) VALUES (:name, :inventory, :now)"
        " ON CONFLICT (name) DO UPDATE SET inventory = excluded.inventory",
        {"name": name, "inventory": inventory_json},
    )
    _stamp_now(db, name)
    db.notify(FLEET_CHANNEL, f"inventory {origin}".rstrip())
    return claims


def _claim_gpus(db: Db, name: str, gpu_uuids: Sequence[str], *, reassign: bool) -> GpuClaims:
    """Make `gpu_uuids` the server `name`'s: refused (nothing written) where another server owns one,
    unless `reassign`. One claim at a time across replicas (an advisory lock on PostgreSQL; SQLite's
    one writer)."""
    if not gpu_uuids:
        return GpuClaims()
    db.dialect.lock(db, "gpu-owners")
    rows = db.all(
        "SELECT gpu_uuid, server FROM gpu_owners WHERE " + db.dialect.in_list("gpu_uuid", "uuids"),
        {"uuids": db.dialect.array(gpu_uuids)},
    )
    owners = {row[0]: row[1] for row in rows}
    others = {gpu_uuid: owner for gpu_uuid, owner in owners.items() if owner != name}
    if others and not reassign:
        return GpuClaims(refused=others)
    db.many(
        "INSERT INTO gpu_owners (gpu_uuid, server, claimed_at) VALUES (:uuid, :server, :now)"
        " ON CONFLICT (gpu_uuid) DO UPDATE SET server = excluded.server, claimed_at = excluded.claimed_at",
        [
            {"uuid": gpu_uuid, "server": name}
            for gpu_uuid in dict.fromkeys(gpu_uuids)
            if owners.get(gpu_uuid) != name
        ],
    )
    return GpuClaims(reassigned=others)


@writes
def claim_gpus(db: Db, name: str, gpu_uuids: Sequence[str]) -> GpuClaims:
    """The GPUs of a stored server heard from again: its own, unless another server owns one
    (then `refused` names the owners and nothing is written)."""
    return _claim_gpus(db, name, gpu_uuids, reassign=False)


@writes
def replace_gpus(
    db: Db, name: str, inventory_json: str, gpu_uuids: Sequence[str], *, reassign: bool = False
) -> GpuClaims | None:
    """A registered server reports other GPUs: its new inventory, and the GPUs claimed as
    `upsert_server` claims them. None when the server is not registered."""
    if db.one("SELECT 1 FROM servers WHERE name = :name", {"name": name}) is None:
        return None
    claims = _claim_gpus(db, name, gpu_uuids, reassign=reassign)
    if claims.written:
        db.execute(
            "UPDATE servers SET inventory = :inventory WHERE name = :name",
            {"name": name, "inventory": inventory_json},
        )
        _stamp_now(db, name)
        db.notify(FLEET_CHANNEL, "inventory")
    return claims


@reads
def gpu_owners(db: Db, gpu_uuids: Sequence[str]) -> dict[str, str]:
    """GPU UUID -> the server that owns it, for those of `gpu_uuids` that have an owner."""
    rows = db.all(
        "SELECT gpu_uuid, server FROM gpu_owners WHERE " + db.dialect.in_list("gpu_uuid", "uuids"),
        {"uuids": db.dialect.array(gpu_uuids)},
    )
    return {row[0]: row[1] for row in rows}


@writes
def release_gpu(db: Db, gpu_uuid: str) -> str | None:
    """An operator frees a GPU's claim: the next server to report it owns it. The server that owned
    it, or None when it had no owner."""
    row = db.one("SELECT server FROM gpu_owners WHERE gpu_uuid = :uuid", {"uuid": gpu_uuid})
    if row is None:
        return None
    db.execute("DELETE FROM gpu_owners WHERE gpu_uuid = :uuid", {"uuid": gpu_uuid})
    db.notify(FLEET_CHANNEL, "inventory")
    return str(row[0])


@writes
def forget_server(db: Db, name: str) -> list[str]:
    """An operator removes a registered server: its inventory, its heartbeat and its GPUs' claims
    (returned, released). Its deployments and their reservations stay until they are stopped."""
    released = [
        str(row[0])
        for row in db.all(
            "SELECT gpu_uuid FROM gpu_owners WHERE server = :name ORDER BY gpu_uuid", {"name": name}
        )
    ]
    db.execute("DELETE FROM gpu_owners WHERE server = :name", {"name": name})
    db.execute("DELETE FROM server_heartbeats WHERE name = :name", {"name": name})
    db.execute("DELETE FROM servers WHERE name = :name", {"name": name})
    db.notify(FLEET_CHANNEL, "inventory")
    return released


@reads
def server_count(db: Db) -> int:
    """Registered servers (agents'; the inventory file's are not stored)."""
    row = db.one("SELECT count(*) FROM servers")
    return int(row[0]) if row else 0


def _stamp_now(db: Db, name: str) -> None:
    """The server's last heartbeat is now. Heartbeats live in `server_heartbeats`, a narrow table of
    their own: a stamp rewrites a name and a time, never the server's inventory."""
    db.execute(
        "INSERT INTO server_heartbeats (name, last_heartbeat) VALUES (:name, :now)"
        " ON CONFLICT (name) DO UPDATE SET last_heartbeat = excluded.last_heartbeat",
        {"name": name},
    )


@writes
def heartbeat(db: Db, name: str, inventory_json: str | None = None) -> bool:
    """Refresh a server's heartbeat (and inventory); False when the server is unknown."""
    if inventory_json is not None:
        db.execute(
            "UPDATE servers SET inventory = :inventory WHERE name = :name",
            {"name": name, "inventory": inventory_json},
        )
    cursor = db.execute(  # every registered server has its row here (upsert_server)
        "UPDATE server_heartbeats SET last_heartbeat = :now WHERE name = :name", {"name": name}
    )
    return cursor.rowcount > 0


@writes
def stamp_heartbeats(db: Db, stamps: Mapping[str, float], origin: str = "") -> None:
    """Record many servers' last heartbeats at once (server name -> seconds since the epoch; the
    service batches them; no inventory is written). A stamp never moves a heartbeat back. Other
    replicas are told (NOTIFY "stamps <origin>", `origin` naming the writer) and read them; each
    row keeps the name of the process whose stamp it holds, so a reader can skip its own."""
    if stamps:  # one statement for the batch: per-row parameter sets held the GIL 3-4x longer
        pairs, params = db.dialect.stamp_pairs(stamps)
        db.execute(
            f"UPDATE server_heartbeats SET last_heartbeat = v.seen, stamped_by = :origin FROM {pairs} AS v"
            " WHERE server_heartbeats.name = v.name AND server_heartbeats.last_heartbeat < v.seen",
            {**params, "origin": origin},
        )
    db.notify(FLEET_CHANNEL, f"stamps {origin}")


@reads
def heartbeats(db: Db, since: datetime | None = None, skip: str = "") -> list[tuple[str, float]]:
    """(name, last heartbeat in seconds since the epoch, to the millisecond) of every server heard
    from at or after `since` (every server: None), leaving out the rows whose stamp the process
    `skip` wrote (its own: it knows them). An API replica reads thousands of these a second: the
    engine converts them, so neither the store's thread nor the event loop parses a date."""
    select = f"SELECT name, {db.dialect.epoch('last_heartbeat')} FROM server_heartbeats"
    where: list[str] = []
    params: dict[str, Any] = {}
    if since is not None:
        where.append("last_heartbeat >= :since")
        params["since"] = db.dialect.stamp_param(since)
    if skip:
        where.append("stamped_by <> :skip")
        params["skip"] = skip
    rows = db.all(select + (" WHERE " + " AND ".join(where) if where else ""), params)
    return [(row[0], float(row[1])) for row in rows]


@reads
def server_records(db: Db, names: Sequence[str]) -> list[ServerRecord]:
    """The stored inventories of `names` (those registered), as `servers` gives them."""
    rows = db.all(
        "SELECT s.inventory, s.registered_at, h.last_heartbeat FROM servers s"
        " JOIN server_heartbeats h ON h.name = s.name WHERE " + db.dialect.in_list("s.name", "names"),
        {"names": db.dialect.array(names)},
    )
    stamp = db.dialect.stamp
    return [ServerRecord(row[0], stamp(row[1]) or "", stamp(row[2]) or "") for row in rows]


@reads
def servers(db: Db) -> list[ServerRecord]:
    """(inventory JSON, registered_at, last_heartbeat) for every registered server."""
    rows = db.all(
        "SELECT s.inventory, s.registered_at, h.last_heartbeat FROM servers s"
        " JOIN server_heartbeats h ON h.name = s.name ORDER BY s.name"
    )
    stamp = db.dialect.stamp
    return [ServerRecord(row[0], stamp(row[1]) or "", stamp(row[2]) or "") for row in rows]


@reads
def server_inventory(db: Db, name: str) -> str | None:
    row = db.one("SELECT inventory FROM servers WHERE name = :name", {"name": name})
    return row[0] if row else None


@reads
def reserved_gpus(db: Db) -> dict[str, str]:
    """GPU UUID -> deployment id, for every GPU currently reserved."""
    return {row[0]: row[1] for row in db.all("SELECT gpu_uuid, deployment_id FROM reservations")}


@reads
def deployment(db: Db, deployment_id: str) -> DeploymentRecord | None:
    """(record JSON, state, desired)."""
    row = db.one("SELECT record, state, desired FROM deployments WHERE id = :id", {"id": deployment_id})
    return DeploymentRecord(*row) if row else None


@reads
def deployments(db: Db, *, server: str | None = None, limit: int = 100) -> list[DeploymentRecord]:
    clause = "WHERE server = :server" if server else ""
    rows = db.all(
        f"SELECT record, state, desired FROM deployments {clause} ORDER BY created_at DESC LIMIT :limit",
        {"server": server, "limit": limit},
    )
    return [DeploymentRecord(*row) for row in rows]


@writes
def update_deployment(
    db: Db,
    deployment_id: str,
    record_json: str,
    *,
    state: str,
    desired: str | None = None,
    release: bool = False,
) -> None:
    """Store a new state (and record); `release` frees the deployment's GPUs in the same step."""
    params = {"id": deployment_id, "record": record_json, "state": state, "desired": desired}
    db.execute(
        "UPDATE deployments SET record = :record, state = :state, desired = coalesce(:desired, desired),"
        " updated_at = :now WHERE id = :id",
        params,
    )
    if release:
        db.execute("DELETE FROM reservations WHERE deployment_id = :id", params)
    # other replicas: refresh the placement index, wake the agent's long-poll
    db.notify(FLEET_CHANNEL, "reservations")


# The states a deployment ends in (placement.protocol.TERMINAL_STATES, which the store must not import).
_ENDED_STATES = "('exited', 'failed', 'stopped')"
# Both conditions are also partial indexes' (migrations 0020 and 0023), word for word.
_ACTIONABLE = (
    f"((desired = 'run' AND state = 'pending') OR (desired = 'stop' AND state NOT IN {_ENDED_STATES}))"
)
_ENDED = f"state IN {_ENDED_STATES}"


@reads
def actionable_servers(db: Db) -> set[str]:
    """The servers with a deployment their agent must act on (`actionable_deployments`)."""
    return {row[0] for row in db.all(f"SELECT DISTINCT server FROM deployments WHERE {_ACTIONABLE}")}


@reads
def actionable_deployments(db: Db, server: str) -> list[DeploymentRecord]:
    """Deployments the server's agent must act on: new ones to run, live ones to stop."""
    rows = db.all(
        f"SELECT record, state, desired FROM {db.dialect.read_through('deployments', 'deployments_actionable')}"
        f" WHERE server = :server AND {_ACTIONABLE}"
        " ORDER BY created_at",
        {"server": server},
    )
    return [DeploymentRecord(*row) for row in rows]


@reads
def ended_deployments(db: Db, *, cap: int) -> int:
    """Deployments that ended (exited, failed or stopped), counted up to `cap` (a partial index's range)."""
    ended = db.dialect.read_through("deployments", "deployments_ended")
    row = db.one(
        f"SELECT count(*) FROM (SELECT 1 FROM {ended} WHERE {_ENDED} LIMIT :cap) AS counted", {"cap": cap}
    )
    return int(row[0]) if row else 0


@reads
def ended_beyond(db: Db, *, keep: int) -> datetime | None:
    """The last update of the newest ended deployment past the newest `keep` (what a count cap deletes
    through), or None where no more than `keep` ended."""
    ended = db.dialect.read_through("deployments", "deployments_ended")
    row = db.one(
        f"SELECT updated_at FROM {ended} WHERE {_ENDED} ORDER BY updated_at DESC LIMIT 1 OFFSET :keep",
        {"keep": keep},
    )
    stamp = db.dialect.stamp(row[0]) if row else None
    return datetime.fromisoformat(stamp) if stamp else None


DEPLOYMENT_RETENTION_LOCK = "deployment retention"


@writes
def delete_ended(db: Db, *, through: datetime, limit: int) -> int:
    """Delete up to `limit` ended deployments last updated at or before `through`, oldest first, with any
    GPU reservation they still hold (an end frees its GPUs; this frees what a lost update left); how many
    went. Never a deployment that has not ended, even one an agent's late report made live meanwhile. One
    sweeper at a time deletes (an advisory lock on PostgreSQL; SQLite's one writer)."""
    db.dialect.lock(db, DEPLOYMENT_RETENTION_LOCK)
    ended = db.dialect.read_through("deployments", "deployments_ended")
    rows = db.all(
        f"DELETE FROM deployments WHERE id IN (SELECT id FROM {ended} WHERE {_ENDED} AND updated_at <= :through"
        f" ORDER BY updated_at LIMIT :limit) AND {_ENDED} RETURNING id",
        {"through": db.dialect.stamp_param(through), "limit": limit},
    )
    ids = [row[0] for row in rows]
    if ids:
        released = db.execute(
            f"DELETE FROM reservations WHERE {db.dialect.in_list('deployment_id', 'ids')}",
            {"ids": db.dialect.array(ids)},
        )
        if released.rowcount:
            db.notify(FLEET_CHANNEL, "reservations")
    return len(ids)
