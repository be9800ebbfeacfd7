"""The eligibility answer: one shape for the API, the UI and `gpubadge eligible`.

A Decision over 10,000 servers is turned into a page of the best eligible servers (with a cursor
for the next page) and a summary of the others by reason, so the answer's size and cost do not
grow with the fleet. `explain="all"` adds every server with every reason, for people who want
the full list and accept its size.

The cursor is opaque to clients: the (rank key, server name) of the last server listed, so the
next page starts after it even when the fleet changed in between (no server is listed twice;
a server that moved up past the cursor is not listed again).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

from placement.decision import Cursor, Decision, EligibleServer, IneligibleServer, ReasonSummary
from placement.image_needs import GpuUse

DEFAULT_LIMIT = 50
MAX_CURSOR_CHARS = 512
EXAMPLES = 3
ANSWER_FIELDS = ("limit", "cursor", "explain")


class AnswerOptions(BaseModel):
    """How much of a decision to return: `limit` eligible servers after `cursor`; `explain`."""

    model_config = ConfigDict(extra="forbid")

    limit: int = Field(default=DEFAULT_LIMIT, ge=1, description="eligible servers per page")
    cursor: str | None = Field(
        default=None, max_length=MAX_CURSOR_CHARS, description="`next_cursor` of the previous page"
    )
    explain: Literal["summary", "all"] = Field(
        default="summary",
        description="`all` also lists every server: `eligible` unpaged and `ineligible` with every reason",
    )


SCORE_MEANING = (
    "how well the server fits, 1 = exactly: 1 / (1 + preference rank + spare GPUs), where the rank"
    " is the position of its GPU model in an ordered `gpu_models` list (0 otherwise) and spare GPUs"
    " are the free GPUs a deployment would leave unused there; higher is a tighter fit"
)


class ReasonCount(BaseModel):
    reason: str
    count: int = Field(
        description="ineligible servers whose decisive (first) reason this is: each server is counted"
        " once, so the counts add up to `ineligible_count` (explain=all lists every reason)"
    )
    examples: list[str] = Field(description=f"up to {EXAMPLES} of them, by name")


class EligibleEntry(BaseModel):
    server: str
    gpus: list[str] = Field(description="GPU UUIDs a deployment would reserve, in order")
    score: float = Field(description=SCORE_MEANING)
    platform: str = Field(description="the image platform that would run")
    why: list[str] = Field(
        default_factory=list,
        description="why it passes: the platform, what was asked of its GPUs, the alternative of the"
        " image's NVIDIA_REQUIRE_* that holds there (brand exceptions named), the carried CUDA's driver"
        " and the GPU code that covers its compute capability",
    )


class IneligibleEntry(BaseModel):
    server: str
    reasons: list[str] = Field(description="every reason, the decisive one first")


class EligibilityAnswer(BaseModel):
    """`POST /api/eligibility`'s answer (and `gpubadge eligible --json`'s)."""

    eligible: list[EligibleEntry] = Field(description="best fit first; one page unless explain=all")
    eligible_count: int = Field(description="all eligible servers, on every page")
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last")
    image_gpu: GpuUse = Field(
        default="none",
        description="does the image need a GPU, in the one vocabulary of the images list, the image page,"
        " the API and `gpubadge scan`: required (it declares an NVIDIA GPU), optional (it declares none"
        " but carries CUDA: it runs on a CPU too, and on a GPU only with a driver for that CUDA) or"
        " none (CPU only; with gpus asked for, a hint says they would sit idle)",
    )
    image_needs_gpu: bool = Field(
        default=False, description="image_gpu is required: it declares an NVIDIA GPU and runs on none else"
    )
    ineligible_count: int
    ineligible_by_reason: list[ReasonCount] = Field(description="most common reason first")
    ineligible: list[IneligibleEntry] | None = Field(
        default=None, description="every ineligible server with every reason (explain=all only)"
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="malformed NVIDIA_REQUIRE_* clauses: hosts whose evaluation reaches one refuse the image",
    )
    hints: list[str] = Field(
        default_factory=list,
        description="e.g. CUDA found in the layers of an image placed without gpus: ask for gpus to use it",
    )
    pending: list[str] = Field(
        default_factory=list,
        description="facts not judged yet because the image's layers are still being read, and what they"
        " could change; empty when the answer is final",
    )


class AnswerBody(TypedDict, total=False):
    eligible: list[EligibleServer]
    eligible_count: int
    next_cursor: str | None
    image_gpu: GpuUse
    image_needs_gpu: bool
    ineligible_count: int
    ineligible_by_reason: list[ReasonSummary]
    ineligible: list[IneligibleServer]
    warnings: list[str]
    hints: list[str]
    pending: list[str]


def encode_cursor(cursor: Cursor) -> str:
    key, name = cursor
    raw = json.dumps([list(key), name], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(text: str) -> Cursor:
    """Raises ValueError for anything `encode_cursor` did not make."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        data = json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise ValueError("invalid cursor") from None
    ok = (
        isinstance(data, list)
        and len(data) == 2
        and isinstance(data[1], str)
        and isinstance(data[0], list)
        and len(data[0]) == 5
        and all(isinstance(part, int | float) and not isinstance(part, bool) for part in data[0])
    )
    if not ok:
        raise ValueError("invalid cursor")
    rank, spare, mib, cpus, memory = data[0]
    return (int(rank), int(spare), int(mib), float(cpus), int(memory)), data[1]


def answer(decision: Decision, options: AnswerOptions) -> AnswerBody:
    """The answer for `options`: O(shapes + limit), or O(servers) with explain=all."""
    body: AnswerBody
    if options.explain == "all":
        listed, after = decision.eligible, None
    else:
        listed, after = decision.page(
            options.limit, decode_cursor(options.cursor) if options.cursor else None
        )
    body = {
        "eligible": listed,
        "eligible_count": decision.eligible_count,
        "next_cursor": encode_cursor(after) if after is not None else None,
        "image_gpu": decision.image_gpu,
        "image_needs_gpu": decision.image_needs_gpu,
        "ineligible_count": decision.ineligible_count,
        "ineligible_by_reason": decision.ineligible_summary(EXAMPLES),
        "warnings": list(decision.warnings),
        "hints": list(decision.hints),
        "pending": list(decision.pending),
    }
    if options.explain == "all":
        body["ineligible"] = decision.ineligible
    return body
