"""View models of the fleet pages: server rows and GPU groups (`/servers`), the eligibility form
and its result (`/eligibility`); pure functions, no I/O.

The eligibility form is a GET form, so it works without JavaScript and a result can be
bookmarked or shared as a link.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from aiohttp import web
from pydantic import ValidationError

from placement.answer import SCORE_MEANING, AnswerBody
from placement.image_needs import GpuUse, image_needs
from placement.inventory import Gpu, Server
from placement.mig import sort_key
from placement.request import DeployRequest
from scanner.models import ImageReport
from scanner.problems import expected
from web.views.templating import human_bytes, image_url, time_ago


@dataclass(frozen=True)
class GpuGroupView:
    """Identical GPUs of one server, shown as one line (`8 × NVIDIA H100 80GB HBM3`)."""

    count: int
    model: str
    memory: str
    compute_capability: str
    mig: bool


@dataclass(frozen=True)
class GpuInUseView:
    """A GPU, or a MIG device (`label` `GPU 0 · 1g.10gb`), reserved or busy."""

    index: int
    uuid: str
    label: str = ""


@dataclass(frozen=True)
class MigProfileUseView:
    """The MIG devices of one profile on one GPU: how many, how many in use."""

    profile: str
    count: int
    in_use: int
    memory: str


@dataclass(frozen=True)
class MigGpuView:
    """A GPU in MIG mode and its slices (`GPU 0 · 7 × 1g.10gb, 3 in use`)."""

    index: int
    model: str
    profiles: list[MigProfileUseView]
    devices: int
    in_use: int


@dataclass(frozen=True)
class ServerRowView:
    name: str
    arch: str
    cpus: int
    memory: str
    driver: str
    cuda: str
    gpu_groups: list[GpuGroupView]
    gpu_count: int
    in_use: list[GpuInUseView]
    source: str
    heartbeat: str
    heartbeat_at: str | None
    labels: list[tuple[str, str]]
    mig_gpus: list[MigGpuView] = field(default_factory=list)
    whole_in_use: int = 0  # GPUs out of MIG mode reserved or busy

    @property
    def mig_in_use(self) -> int:
        return sum(gpu.in_use for gpu in self.mig_gpus)

    @property
    def mig_devices(self) -> int:
        return sum(gpu.devices for gpu in self.mig_gpus)

    @property
    def whole_gpus(self) -> int:
        """GPUs that can be handed out whole (not in MIG mode)."""
        return self.gpu_count - len(self.mig_gpus)


def gpu_groups(gpus: Sequence[Gpu]) -> list[GpuGroupView]:
    """Group GPUs by model, memory, compute capability and MIG mode, in index order of first appearance."""
    counts: dict[tuple[str, int, str, bool], int] = {}
    for gpu in sorted(gpus, key=lambda g: g.index):
        key = (gpu.name, gpu.memory_mib, gpu.compute_capability, gpu.mig)
        counts[key] = counts.get(key, 0) + 1
    return [
        GpuGroupView(
            count=count,
            model=name,
            memory=human_bytes(memory_mib * 1024 * 1024) if memory_mib else "unknown",
            compute_capability=capability or "unknown",
            mig=mig,
        )
        for (name, memory_mib, capability, mig), count in counts.items()
    ]


def mig_gpu_views(gpus: Sequence[Gpu], busy: set[str]) -> list[MigGpuView]:
    """Each GPU in MIG mode with its MIG devices by profile (smallest first) and how many are in use."""
    views = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        if not gpu.mig:
            continue
        parent_busy = gpu.uuid in busy
        counts: dict[str, list[int]] = {}  # profile -> [count, in use, memory MiB]
        for device in gpu.mig_devices:
            entry = counts.setdefault(device.profile, [0, 0, device.memory_mib])
            entry[0] += 1
            entry[1] += parent_busy or device.uuid in busy
        profiles = [
            MigProfileUseView(
                profile=profile,
                count=count,
                in_use=used,
                memory=human_bytes(memory_mib * 1024 * 1024) if memory_mib else "unknown",
            )
            for profile, (count, used, memory_mib) in sorted(
                counts.items(), key=lambda item: sort_key(item[0])
            )
        ]
        views.append(
            MigGpuView(
                index=gpu.index,
                model=gpu.name,
                profiles=profiles,
                devices=len(gpu.mig_devices),
                in_use=sum(view.in_use for view in profiles),
            )
        )
    return views


def server_row_view(server: Server, now: datetime | None = None) -> ServerRowView:
    busy = set(server.gpus_in_use)
    in_use = []
    whole_in_use = 0
    for gpu in sorted(server.gpus, key=lambda g: g.index):
        if gpu.uuid in busy:
            in_use.append(GpuInUseView(gpu.index, gpu.uuid, f"GPU {gpu.index}"))
            whole_in_use += not gpu.mig
            continue
        for device in sorted(gpu.mig_devices, key=lambda d: d.index):
            if device.uuid in busy:
                in_use.append(GpuInUseView(gpu.index, device.uuid, f"GPU {gpu.index} · {device.profile}"))
    # A server from the inventory file sends no heartbeat: it is listed, and judged, for as long as
    # the file lists it.
    heartbeat = (
        "none: from the inventory file" if server.source == "file" else time_ago(server.last_heartbeat, now)
    )
    return ServerRowView(
        name=server.name,
        arch=server.arch,
        cpus=server.cpus,
        memory=human_bytes(server.memory) if server.memory else "unknown",
        driver=server.driver_version or "—",
        cuda=server.cuda_driver_version or "—",
        gpu_groups=gpu_groups(server.gpus),
        gpu_count=len(server.gpus),
        in_use=in_use,
        source=server.source,
        heartbeat=heartbeat,
        heartbeat_at=server.last_heartbeat.isoformat() if server.last_heartbeat else None,
        labels=sorted(server.labels.items()),
        mig_gpus=mig_gpu_views(server.gpus, busy),
        whole_in_use=whole_in_use,
    )


def server_rows(servers: Sequence[Server], now: datetime | None = None) -> list[ServerRowView]:
    return [server_row_view(server, now) for server in sorted(servers, key=lambda s: s.name)]


# Form field -> (DeployRequest field, label the page shows); the label names the field in errors.
FORM_FIELDS: tuple[tuple[str, str], ...] = (
    ("gpus", "GPU count"),
    ("mig_devices", "MIG devices"),
    ("mig_profiles", "MIG profiles"),
    ("gpu_models", "GPU models"),
    ("min_gpu_memory", "Min GPU memory"),
    ("min_compute_capability", "Min compute capability"),
    ("min_driver", "Min driver"),
    ("cpus", "CPUs"),
    ("memory", "Memory"),
)


FIELD_LABELS = dict(FORM_FIELDS)


class FormError(ValueError):
    """Input the user can fix; the message is shown on the page as it is."""


@dataclass(frozen=True)
class EligibilityForm:
    """The explorer's query string, kept as typed so the form shows it back unchanged."""

    image: str = ""
    values: Mapping[str, str] = field(default_factory=dict)
    answer: Mapping[str, str] = field(default_factory=dict)  # limit, cursor, explain: the page's shape

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> EligibilityForm:
        return cls(
            image=query.get("image", "").strip(),
            values={name: query.get(name, "").strip() for name, _ in FORM_FIELDS},
            answer={name: query[name] for name in ("limit", "cursor", "explain", "rank") if query.get(name)},
        )

    def link(self, **changes: str | None) -> str:
        """This form's URL with some answer fields changed (None drops one)."""
        fields = {"image": self.image, **{k: v for k, v in self.values.items() if v}, **self.answer}
        for name, value in changes.items():
            if value is None:
                fields.pop(name, None)
            else:
                fields[name] = value
        return "/eligibility?" + urlencode(fields)

    @property
    def first_rank(self) -> int:
        """The rank of the page's first server (carried in the link: a cursor has no position)."""
        text = self.answer.get("rank", "1")
        return int(text) if text.isdigit() and 0 < len(text) < 10 else 1

    def value(self, name: str) -> str:
        return self.values.get(name, "")

    @property
    def submitted(self) -> bool:
        return bool(self.image) or any(self.values.values())

    def request_fields(self) -> dict[str, Any]:
        """The non-empty fields as DeployRequest takes them (GPU models split on commas)."""
        fields: dict[str, Any] = {}
        for name, _ in FORM_FIELDS:
            text = self.value(name)
            if not text:
                continue
            if name in ("gpu_models", "mig_profiles"):
                fields[name] = [item.strip() for item in text.split(",") if item.strip()]
            else:
                fields[name] = text
        return fields

    def deploy_request(self) -> DeployRequest:
        """Parse the form into a DeployRequest; a FormError names the field in the page's words."""
        try:
            return DeployRequest.parse_any(self.request_fields())
        except ValidationError as exc:
            raise FormError(validation_message(exc)) from None
        except ValueError as exc:
            raise FormError(str(exc)) from None


def validation_message(exc: ValidationError) -> str:
    """`GPU count: expected an integer, got 'two'` for the first wrong field: the form's label and
    plain words (scanner.problems), never pydantic's."""
    error = exc.errors(include_url=False)[0]
    location = [str(part) for part in error.get("loc", ())]
    label = FIELD_LABELS.get(location[0], location[0]) if location else ""
    message = expected(error)
    return f"{label}: {message}" if label else message


def http_error_body(exc: web.HTTPException) -> dict[str, object]:
    """The JSON object of an API error (`{"error": ..., "scan": ...}`), or {} where it has none."""
    text = exc.text or ""
    try:
        body = json.loads(text.removeprefix(f"{exc.status}: "))
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def http_error_message(exc: web.HTTPException) -> str:
    """The `error` text of an API error (JSON body), else its reason phrase."""
    message = http_error_body(exc).get("error")
    if isinstance(message, str):
        return message
    return exc.reason


def page_status(exc: web.HTTPException) -> int:
    """Bad input is 400; a reference we cannot scan (allowlist, scan failure) is 422."""
    if exc.status == 400:
        return 400
    if exc.status in (403, 404, 422):
        return 422
    return exc.status


@dataclass(frozen=True)
class AssignedGpuView:
    uuid: str
    description: str


@dataclass(frozen=True)
class EligibleView:
    rank: int
    server: str
    platform: str
    score: str
    gpus: list[AssignedGpuView]
    why: list[str] = field(default_factory=list)  # why it passes (placement's words)


@dataclass(frozen=True)
class RejectedView:
    server: str
    reasons: list[str]


@dataclass(frozen=True)
class ReasonView:
    reason: str
    count: int
    examples: list[str]


@dataclass(frozen=True)
class ResultView:
    reference: str
    digest: str | None
    image_url: str
    gpu: GpuUse  # placement.image_needs' answer: required, optional or none
    headline: str  # the image page's answer, in the same words
    eligible: list[EligibleView]
    eligible_count: int
    ineligible_count: int
    by_reason: list[ReasonView]
    rejected: list[RejectedView] | None  # every server, with explain=all only
    warnings: list[str]
    hints: list[str]
    next_url: str | None
    all_url: str | None
    score_meaning: str = SCORE_MEANING


def result_view(
    report: ImageReport, body: AnswerBody, servers: Sequence[Server], form: EligibilityForm
) -> ResultView:
    """The page for one answer (/api/eligibility's shape): a page of servers, the rest by reason."""
    described: dict[str, str] = {}
    for server in servers:
        for gpu in server.gpus:
            described[gpu.uuid] = f"GPU {gpu.index} · {gpu.name}"
            for device in gpu.mig_devices:
                described[device.uuid] = f"GPU {gpu.index} · MIG {device.profile} · {gpu.name}"

    def assigned(uuid: str) -> AssignedGpuView:
        return AssignedGpuView(uuid=uuid, description=described.get(uuid, ""))

    first = form.first_rank if form.answer.get("cursor") else 1
    listed = body.get("eligible", [])
    next_cursor = body.get("next_cursor")
    rejected = body.get("ineligible")
    return ResultView(
        reference=report.reference,
        digest=report.digest,
        image_url=image_url(report.reference),
        gpu=body.get("image_gpu", "none"),
        headline=image_needs(report).headline,
        eligible=[
            EligibleView(
                rank=rank,
                server=entry["server"],
                platform=entry["platform"],
                score=f"{entry['score']:.3g}",
                gpus=[assigned(uuid) for uuid in entry["gpus"]],
                why=list(entry.get("why", [])),
            )
            for rank, entry in enumerate(listed, start=first)
        ],
        eligible_count=body.get("eligible_count", 0),
        ineligible_count=body.get("ineligible_count", 0),
        by_reason=[
            ReasonView(item["reason"], item["count"], list(item["examples"]))
            for item in body.get("ineligible_by_reason", [])
        ],
        rejected=None
        if rejected is None
        else [RejectedView(entry["server"], list(entry["reasons"])) for entry in rejected],
        warnings=list(body.get("warnings", [])),
        hints=list(body.get("hints", [])),
        next_url=form.link(cursor=next_cursor, rank=str(first + len(listed)), explain=None)
        if next_cursor
        else None,
        all_url=None if rejected is not None else form.link(explain="all", cursor=None, rank=None),
    )
