"""Reports by digest and the image listing: written once, run on both engines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from scanner.facts.badges import libc_label
from scanner.models import STORED, ImageReport, PlatformReport
from store.dialect import Db, reads, writes
from store.models import ImageRow
from store.queries.jobs import JobEnd, finish_job
from store.queries.tags import LayerSeen, TagSeen, announce_reference, record_tags, resolve_tag, save_layers

# Exact totals up to this many matching images; beyond, the planner's estimate where the engine
# has one (see `_count`).
EXACT_COUNT_LIMIT = 10_000

_SAVE_REPORT = (
    "INSERT INTO reports (digest, registry, repository, reference, media_type, gpu_required,"
    " cuda_versions, libc_flavours, platforms, distro, scanned_at, report)"
    " VALUES (:digest, :registry, :repository, :reference, :media_type, :gpu_required,"
    " :cuda_versions, :libc_flavours, :platforms, :distro, :scanned_at, :report)"
    " ON CONFLICT (digest) DO UPDATE SET registry = excluded.registry,"
    " repository = excluded.repository, reference = excluded.reference,"
    " media_type = excluded.media_type, gpu_required = excluded.gpu_required,"
    " cuda_versions = excluded.cuda_versions, libc_flavours = excluded.libc_flavours,"
    " platforms = excluded.platforms, distro = excluded.distro, scanned_at = excluded.scanned_at,"
    " report = excluded.report"
)
_SAVE_PLATFORM = (
    "INSERT INTO platform_reports (digest, report) VALUES (:digest, :report)"
    " ON CONFLICT (digest) DO UPDATE SET report = excluded.report"
)
# An index lists a platform manifest (`index_of` reads these); a manifest's digest names its content,
# so a pair once written stays true.
_LINK_CHILD = "INSERT INTO index_children (child, parent) VALUES (:child, :parent) ON CONFLICT (child, parent) DO NOTHING"


def report_row(db: Db, report: ImageReport, document: str) -> dict[str, Any]:
    """The `reports` row of a successful report, with its JSON `document` serialised once."""
    if report.error is not None or report.digest is None:
        raise ValueError("only successful reports are stored")
    platforms = report.platforms
    dialect = db.dialect
    return {
        "digest": report.digest,
        "registry": report.registry or "",
        "repository": report.repository or "",
        "reference": report.reference,
        "media_type": report.media_type,
        "gpu_required": any(p.gpu.required for p in platforms),
        "cuda_versions": dialect.array(cuda_column(report)),
        "libc_flavours": dialect.array(sorted({libc_label(p.libc) for p in platforms})),
        "platforms": dialect.array([p.platform for p in platforms]),
        "distro": next((p.libc.distro for p in platforms if p.libc.distro), None),
        "scanned_at": dialect.stamp_param(report.scanned_at),
        "report": document,
    }


CARRIED = "carried:"  # a `cuda_versions` entry for CUDA the layers carry, beside the declared versions


def cuda_column(report: ImageReport) -> list[str]:
    """The `cuda_versions` column: each CUDA a platform declares, then `carried:<version>` for each
    one its layers carry, so the listing's CUDA filter matches both from the column (its GIN index
    on PostgreSQL), not from the report's JSON."""
    declared = {p.gpu.cuda_version for p in report.platforms if p.gpu.cuda_version}
    carried = {p.gpu.inferred.cuda for p in report.platforms if p.gpu.inferred and p.gpu.inferred.cuda}
    return sorted(declared) + [CARRIED + version for version in sorted(carried)]


def report_document(report: ImageReport, platforms: Sequence[str]) -> str:
    """The report's JSON around its platforms' JSON, each serialised once: the platforms' text is
    both the `platform_reports` rows and a slice of the report's."""
    head = report.model_dump_json(exclude={"platforms"})
    return f'{head[:-1]},"platforms":[{",".join(platforms)}]}}'


@writes
def save_reports(db: Db, reports: Sequence[ImageReport]) -> None:
    """Store successful reports under their manifest digests, and each platform under its own, in
    one transaction: each statement prepared once for the batch, each report serialised once (a
    platform's JSON is the slice of its image's). An index's platform manifests are linked to it
    (`index_children`, which `index_of` reads)."""
    covered = _covered_children(db, reports)
    rows: list[dict[str, Any]] = []
    platform_rows: list[dict[str, str]] = []
    children: list[str] = []
    links: list[dict[str, str]] = []
    for report in reports:
        documents = [platform.model_dump_json() for platform in report.platforms]
        if report.digest not in covered:
            rows.append(report_row(db, report, report_document(report, documents)))
        for platform, document in zip(report.platforms, documents, strict=True):
            platform_rows.append({"digest": platform.digest, "report": document})
            if platform.digest != report.digest:
                children.append(platform.digest)
                links.append({"child": platform.digest, "parent": report.digest or ""})
    db.many(_SAVE_REPORT, rows)
    db.many(_SAVE_PLATFORM, platform_rows)
    db.many(_LINK_CHILD, links)
    if children:
        # Platform manifests scanned on their own before their index arrived are not images of
        # their own: the index report covers them.
        db.execute(
            f"DELETE FROM reports WHERE {db.dialect.in_list('digest', 'children')}"
            " AND NOT EXISTS (SELECT 1 FROM tags WHERE tags.digest = reports.digest)",
            {"children": db.dialect.array(children)},
        )
    for report in reports:  # long polls on each reference wake, on any replica
        announce_reference(db, report.reference)


def _covered_children(db: Db, reports: Sequence[ImageReport]) -> frozenset[str]:
    """The single-platform reports among `reports` that an index report already covers: their
    digest is stored as a platform but not as an image (only an index's save leaves it so), and no
    tag names it. Such a manifest (a multi-arch child whose own digest-only job finished after its
    index's) is not an image of its own, whatever the timing: its index's save deletes it when
    that save comes second, and this keeps it out when it comes second itself. Both saves take the
    platform digests' locks first (PostgreSQL's advisory locks; SQLite's one writer serialises
    them anyway), so one of the two orders always holds, even across replicas."""
    db.dialect.lock_all(db, sorted({f"platform {p.digest}" for report in reports for p in report.platforms}))
    lone = [
        report.digest
        for report in reports
        if report.digest is not None and [p.digest for p in report.platforms] == [report.digest]
    ]
    if not lone:
        return frozenset()
    rows = db.all(
        f"SELECT p.digest FROM platform_reports p WHERE {db.dialect.in_list('p.digest', 'lone')}"
        " AND NOT EXISTS (SELECT 1 FROM reports r WHERE r.digest = p.digest)"
        " AND NOT EXISTS (SELECT 1 FROM tags t WHERE t.digest = p.digest)",
        {"lone": db.dialect.array(lone)},
    )
    return frozenset(row[0] for row in rows)


@writes
def save_report(db: Db, report: ImageReport) -> None:
    """One report (see `save_reports`)."""
    save_reports(db, [report])


ScanWrite = TagSeen | ImageReport | LayerSeen | JobEnd


@writes
def save_scan_results(db: Db, writes: Sequence[ScanWrite]) -> frozenset[str]:
    """A group commit of what concurrent scans write: layers' cache entries, tags seen, in order,
    then every report in one batch (`save_reports`), then the jobs that ended (`finish_job`). One
    transaction for all of them; the ids of the ended jobs whose worker still held the lease."""
    save_layers(db, [write for write in writes if isinstance(write, LayerSeen)])
    record_tags(db, [write for write in writes if isinstance(write, TagSeen)])
    reports = [write for write in writes if isinstance(write, ImageReport)]
    if reports:
        save_reports(db, reports)
    ends = [write for write in writes if isinstance(write, JobEnd)]
    return frozenset(
        end.job_id for end in ends if finish_job(db, end.job_id, digest=end.digest, owner=end.owner)
    )


@reads
def report(db: Db, digest: str) -> ImageReport | None:
    row = db.one("SELECT report FROM reports WHERE digest = :digest", {"digest": digest})
    return ImageReport.model_validate_json(row[0], context=STORED) if row else None


@reads
def report_page(db: Db, *, after: str, since: datetime | None, limit: int) -> list[ImageReport]:
    """Up to `limit` stored reports with a digest above `after`, in digest order; with `since`,
    only those scanned after it. What an export of the whole store pages through
    (`store.export`): keyset pages are a range scan of the primary key whatever the store's
    size, and reports saved meanwhile never shift a page (an offset would skip or repeat them)."""
    where, params = "digest > :after", {"after": after, "limit": limit}
    if since is not None:
        where += " AND scanned_at > :since"
        params["since"] = db.dialect.stamp_param(since)
    rows = db.all(f"SELECT report FROM reports WHERE {where} ORDER BY digest LIMIT :limit", params)
    return [ImageReport.model_validate_json(row[0], context=STORED) for row in rows]


@reads
def has_report(db: Db, digest: str) -> bool:
    """Whether `digest` was scanned, as an image or as one platform of an index."""
    row = db.one(
        "SELECT EXISTS (SELECT 1 FROM reports WHERE digest = :d)"
        " OR EXISTS (SELECT 1 FROM platform_reports WHERE digest = :d)",
        {"d": digest},
    )
    return bool(row and row[0])


@reads
def platform_report(db: Db, digest: str) -> PlatformReport | None:
    row = db.one("SELECT report FROM platform_reports WHERE digest = :digest", {"digest": digest})
    return PlatformReport.model_validate_json(row[0], context=STORED) if row else None


# A digest's report as an image and as one platform of an index (JSON texts), in one statement.
_BOTH_REPORTS = "SELECT (SELECT report FROM reports WHERE digest = :d), (SELECT report FROM platform_reports WHERE digest = :d)"


@reads
def stored(db: Db, digest: str) -> tuple[ImageReport | None, PlatformReport | None]:
    """The digest's report as an image and as one platform of an index, in one statement."""
    row = db.one(_BOTH_REPORTS, {"d": digest})
    image, platform = row if row else (None, None)
    return (
        ImageReport.model_validate_json(image, context=STORED) if image else None,
        PlatformReport.model_validate_json(platform, context=STORED) if platform else None,
    )


@reads
def reference_report(
    db: Db, registry: str, repository: str, tag: str, digest: str | None
) -> tuple[str | None, ImageReport | None, PlatformReport | None]:
    """What a reference stands for, in one read: its digest (`digest` itself, else what `tag` last
    pointed at, `resolve_tag`) and that digest's stored report, as an image or else as one
    platform of an index. (None, None, None) when the tag is unknown or deleted. One store hop
    for the lookup every placement request starts with."""
    digest = digest or resolve_tag(db, registry, repository, tag)
    if digest is None:
        return None, None, None
    row = db.one(_BOTH_REPORTS, {"d": digest})
    image, platform = row if row else (None, None)
    if image:  # the platform's JSON is parsed only when there is no image report
        return digest, ImageReport.model_validate_json(image, context=STORED), None
    return digest, None, PlatformReport.model_validate_json(platform, context=STORED) if platform else None


@reads
def stored_many(
    db: Db, digests: Sequence[str]
) -> dict[str, tuple[ImageReport | None, PlatformReport | None]]:
    """`stored` for many digests in one statement: every digest asked for is in the answer."""
    found: dict[str, tuple[ImageReport | None, PlatformReport | None]] = dict.fromkeys(digests, (None, None))
    wanted = db.dialect.in_list("digest", "digests")
    rows = db.all(
        f"SELECT digest, report, 1 FROM reports WHERE {wanted}"
        f" UNION ALL SELECT digest, report, 0 FROM platform_reports WHERE {wanted}",
        {"digests": db.dialect.array(sorted(set(digests)))},
    )
    for digest, document, as_image in rows:
        image, platform = found[digest]
        if as_image:
            image = ImageReport.model_validate_json(document, context=STORED)
        else:
            platform = PlatformReport.model_validate_json(document, context=STORED)
        found[digest] = (image, platform)
    return found


@reads
def stored_digests(db: Db, limit: int) -> tuple[frozenset[str], frozenset[str]] | None:
    """Every digest stored as an image and every digest stored as a platform, when the store
    holds at most `limit` of each; None when it holds more (then ask `stored_many`). Each is a
    scan of its table's primary key, read no further than `limit` rows: the caller bounds the
    cost by what a lookup per digest would cost instead."""
    sets: list[frozenset[str]] = []
    for table in ("reports", "platform_reports"):
        rows = db.all(f"SELECT digest FROM {table} LIMIT :n", {"n": limit + 1})
        if len(rows) > limit:
            return None
        sets.append(frozenset(row[0] for row in rows))
    return sets[0], sets[1]


SEARCH_MAX_CHARS = 200  # the longest search text (`list_images(query=…)`): every report is matched against it


@reads
def list_images(
    db: Db,
    *,
    gpu: bool | None = None,
    libc: str | None = None,
    cuda: str | None = None,
    registry: str | None = None,
    query: str | None = None,
    limit: int = 50,
    offset: int = 0,
    inferred: bool | None = None,
) -> tuple[list[ImageRow], int]:
    """Filtered, newest-first listing plus the total count for pagination.

    `gpu`: the image declares an NVIDIA GPU (or not); `inferred`: CUDA was found in its layers (or
    not): together they are placement.image_needs' vocabulary (required / optional / none). `cuda`
    matches the CUDA an image declares or carries; `query` searches every name it was seen under."""
    dialect = db.dialect
    where: list[str] = []
    params: dict[str, Any] = {}
    if inferred is not None:  # CUDA found in the layers (deep scan) of any platform
        where.append(
            ("" if inferred else "NOT ") + dialect.json_any("r.report", "platforms", ["gpu", "inferred"])
        )
    if gpu is not None:
        where.append("r.gpu_required = :gpu")
        params["gpu"] = gpu
    if libc:
        where.append(dialect.array_has("r.libc_flavours", "libc"))
        params["libc"] = libc
    if cuda:  # the CUDA it declares or carries (`cuda_column`): the newer of the two sets its driver floor
        params |= {"cuda": cuda, "carried_cuda": CARRIED + cuda}
        if "." in cuda:
            declared, carried = (
                dialect.array_has("r.cuda_versions", "cuda"),
                dialect.array_has("r.cuda_versions", "carried_cuda"),
            )
            where.append(f"({declared} OR {carried})")
        else:  # a major matches its minors
            params |= {"cuda_major": f"{cuda}.%", "carried_major": f"{CARRIED}{cuda}.%"}
            where.append(
                dialect.array_any(
                    "r.cuda_versions",
                    "v = :cuda OR v LIKE :cuda_major OR v = :carried_cuda OR v LIKE :carried_major",
                )
            )
    if registry:
        where.append("r.registry = :registry")
        params["registry"] = registry
    if query:  # its own name, digest and distro, or any other name a tag gives it
        columns = ["r.repository", "r.reference", "r.digest", "coalesce(r.distro, '')"]
        named = dialect.search(["t.registry", "t.repository", "t.tag"], "q")
        tagged = f"SELECT t.digest FROM tags t WHERE t.gone_at IS NULL AND {named}"
        where.append(f"({dialect.search(columns, 'q')} OR {dialect.in_rows('r.digest', tagged)})")
        escaped = query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        params["q"] = f"%{escaped}%"
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    total = _count(db, clause, params, at_least=offset + limit)
    # The page is cut first, and only its rows look up their tags: an engine may compute the select
    # list for the rows OFFSET skips too, so a deep page would pay for every skipped row.
    # A row's own tags are found by its digest: SQLite, with no statistics, would rather walk every tag
    # event of its repository (the two columns it also names), 50,000 for each row of a CI repository.
    other = "t.registry || '/' || t.repository || ':' || t.tag"
    rows = db.all(
        "SELECT r.digest, r.registry, r.repository, r.reference, r.gpu_required, r.cuda_versions,"
        " r.libc_flavours, r.platforms, r.distro, r.scanned_at,"
        f" (SELECT {dialect.agg('t.tag')} FROM {dialect.read_through('tags t', 'tags_digest')} WHERE t.digest = r.digest"
        "   AND t.gone_at IS NULL AND t.registry = r.registry AND t.repository = r.repository"
        "   AND t.id = (SELECT max(id) FROM tags t2 WHERE t2.registry = t.registry"
        "   AND t2.repository = t.repository AND t2.tag = t.tag)),"
        f" {dialect.json_strings('r.report', 'platforms', 'badges')},"
        f" (SELECT {dialect.agg(other)} FROM tags t WHERE t.digest = r.digest AND t.gone_at IS NULL"
        "   AND NOT (t.registry = r.registry AND t.repository = r.repository)"
        "   AND t.id = (SELECT max(id) FROM tags t2 WHERE t2.registry = t.registry"
        "   AND t2.repository = t.repository AND t2.tag = t.tag))"
        f" FROM (SELECT * FROM reports r {clause} ORDER BY r.scanned_at DESC, r.digest"
        " LIMIT :limit OFFSET :offset) AS r ORDER BY r.scanned_at DESC, r.digest",
        {**params, "limit": limit, "offset": offset},
    )
    images = [
        ImageRow(
            digest=row[0],
            registry=row[1],
            repository=row[2],
            reference=row[3],
            gpu_required=bool(row[4]),
            cuda_versions=[v for v in dialect.array_value(row[5]) if not v.startswith(CARRIED)],
            carried_cuda=[
                v.removeprefix(CARRIED) for v in dialect.array_value(row[5]) if v.startswith(CARRIED)
            ],
            libc_flavours=dialect.array_value(row[6]),
            platforms=dialect.array_value(row[7]),
            distro=row[8],
            scanned_at=dialect.stamp(row[9]) or "",
            tags=sorted(dialect.array_value(row[10])),
            platform_badges=sorted(dialect.array_value(row[11])),
            other_names=sorted(set(dialect.array_value(row[12]))),
        )
        for row in rows
    ]
    return images, total


def _count(db: Db, clause: str, params: dict[str, Any], at_least: int) -> int:
    """The exact number of matches up to EXACT_COUNT_LIMIT; beyond it, the planner's estimate.

    An exact count(*) reads every matching row, so its cost grows with the table (about 100 ms
    at 1M reports on PostgreSQL) while a page costs the same at any size. Past the limit nobody
    pages by the last digit: the estimate (never below the limit, or below what this page
    proves) keeps the listing's latency flat. An engine without an estimate counts exactly.
    """
    cap = max(EXACT_COUNT_LIMIT, at_least + 1)
    # the cap is a parameter: statement texts (and their cached translations) never vary with input
    row = db.one(
        f"SELECT count(*) FROM (SELECT 1 FROM reports r {clause} LIMIT :cap) AS m", {**params, "cap": cap}
    )
    exact = int(row[0]) if row else 0
    if exact < cap:
        return exact
    estimate = db.dialect.estimate(db, f"SELECT 1 FROM reports r {clause}", params)
    if estimate is None:
        full = db.one(f"SELECT count(*) FROM reports r {clause}", params)
        return int(full[0]) if full else exact
    return max(estimate, cap)


@dataclass(frozen=True)
class IndexOf:
    """The index a platform manifest was scanned as part of (a multi-arch image's child)."""

    digest: str
    reference: str
    platform: str
    scanned_at: str


@reads
def index_of(db: Db, registry: str, repository: str, digest: str) -> IndexOf | None:
    """The newest stored index report that lists `digest` as one of its platforms, its own
    repository's first (then one that names it through another repository); None when no stored
    image lists it. Read through the child's links (`index_children`): its cost is the indexes that
    list it, whatever the repository's or the store's size."""
    row = db.one(
        "SELECT r.digest, r.reference, r.scanned_at, r.report FROM index_children c"
        " JOIN reports r ON r.digest = c.parent"
        " WHERE c.child = :digest AND r.digest <> :digest"
        " ORDER BY CASE WHEN r.registry = :registry AND r.repository = :repository THEN 0 ELSE 1 END,"
        " r.scanned_at DESC LIMIT 1",
        {"registry": registry, "repository": repository, "digest": digest},
    )
    if row is None:
        return None
    report = ImageReport.model_validate_json(row[3], context=STORED)
    platform = next((p.platform for p in report.platforms if p.digest == digest), "")
    return IndexOf(row[0], row[1], platform, db.dialect.stamp(row[2]) or "")


@dataclass(frozen=True)
class ScanVerdict:
    """What a finished scan found, for the scans page: an image's (or one platform's) GPU answer and
    badges; for a platform manifest of an index, that index."""

    digest: str
    gpu_required: bool
    badges: list[str]  # every platform's badges, once each
    index: IndexOf | None = None


@reads
def scan_verdicts(db: Db, names: Mapping[str, tuple[str, str]]) -> dict[str, ScanVerdict]:
    """The verdicts of digests (`names`: digest -> its job's registry and repository), as images,
    else as one platform of an index (with that index, `index_of`). Two statements, then one per
    platform manifest (a page of jobs holds few)."""
    if not names:
        return {}
    dialect = db.dialect
    rows = db.all(
        f"SELECT r.digest, r.gpu_required, {dialect.json_strings('r.report', 'platforms', 'badges')}"
        f" FROM reports r WHERE {dialect.in_list('r.digest', 'digests')}",
        {"digests": dialect.array(list(names))},
    )
    found = {row[0]: ScanVerdict(row[0], bool(row[1]), sorted(dialect.array_value(row[2]))) for row in rows}
    rest = [digest for digest in names if digest not in found]
    if rest:
        for digest, document in db.all(
            f"SELECT p.digest, p.report FROM platform_reports p WHERE {dialect.in_list('p.digest', 'rest')}",
            {"rest": dialect.array(rest)},
        ):
            platform = PlatformReport.model_validate_json(document, context=STORED)
            registry, repository = names[digest]
            index = index_of(db, registry, repository, digest)
            found[digest] = ScanVerdict(digest, platform.gpu.required, list(platform.badges), index)
    return found


@reads
def registries(db: Db) -> list[str]:
    """Distinct registries by skipping through the (registry, repository) index: one probe per
    registry, not a pass over every report."""
    rows = db.all(
        "WITH RECURSIVE found(registry) AS ("
        " SELECT * FROM (SELECT registry FROM reports ORDER BY registry LIMIT 1) AS lowest"
        " UNION ALL"
        " SELECT (SELECT r.registry FROM reports r WHERE r.registry > found.registry"
        "   ORDER BY r.registry LIMIT 1) FROM found WHERE found.registry IS NOT NULL)"
        " SELECT registry FROM found WHERE registry IS NOT NULL"
    )
    return [row[0] for row in rows]


__all__ = [
    "EXACT_COUNT_LIMIT",
    "IndexOf",
    "ScanVerdict",
    "TagSeen",
    "has_report",
    "index_of",
    "list_images",
    "platform_report",
    "registries",
    "report",
    "report_row",
    "save_report",
    "save_reports",
    "save_scan_results",
    "scan_verdicts",
    "stored",
    "stored_many",
]
