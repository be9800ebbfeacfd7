"""The body of a placement request (eligibility, constraints, deployments): `{"image", ...request}`
split into checked parts, the answer's paging options, and `decide` + `answer` as one pure call."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from placement.answer import ANSWER_FIELDS, AnswerBody, AnswerOptions, answer, decode_cursor
from placement.decide import decide, kept_decision
from placement.image_facts import ImageFacts
from placement.index import FleetIndex
from placement.request import DeployRequest
from scanner.models import ImageReport
from web.api_models import RunSpec
from web.errors import first_error, json_http_error, read_json
from web.state import services_of

RUN_FIELDS = ("command", "env")


async def request_body(
    request: web.Request, *, run_fields: bool = False, other_fields: Sequence[str] = ()
) -> tuple[str, DeployRequest, RunSpec, dict[str, Any]]:
    """Split `{"image", ...request}` (plus `command`/`env` for deployments) into checked parts.

    `other_fields` (e.g. `limit`, `format`) are taken out of the body unchecked, for the caller.
    """
    data: Any = await read_json(request, services_of(request).settings.json_limits())
    if not isinstance(data, dict) or not isinstance(data.get("image"), str):
        raise json_http_error(web.HTTPBadRequest, 'expected {"image": REF, ...request}')
    image = data.pop("image")
    run_data = {key: data.pop(key) for key in RUN_FIELDS if run_fields and key in data}
    others = {key: data.pop(key) for key in other_fields if key in data}
    try:
        deploy = DeployRequest.parse_any(data)
        if deploy.gpu_code_rule is None:  # the service's rule, where the request names none
            deploy = deploy.model_copy(update={"gpu_code_rule": services_of(request).settings.gpu_code_rule})
        return image, deploy, RunSpec.model_validate(run_data), others
    except (ValidationError, ValueError) as exc:
        detail = first_error(exc) if isinstance(exc, ValidationError) else str(exc)
        raise json_http_error(web.HTTPBadRequest, f"invalid request: {detail}") from None


def answer_options(request: web.Request, fields: dict[str, Any]) -> AnswerOptions:
    """`limit`, `cursor`, `explain` from the body, else the query string; 400 when out of bounds."""
    data: dict[str, Any] = {key: request.query[key] for key in ANSWER_FIELDS if key in request.query}
    data.update(fields)
    try:
        options = AnswerOptions.model_validate(data)
        if options.cursor is not None:
            decode_cursor(options.cursor)
    except ValidationError as exc:
        raise json_http_error(web.HTTPBadRequest, f"invalid request: {first_error(exc)}") from None
    except ValueError as exc:
        raise json_http_error(web.HTTPBadRequest, f"invalid request: cursor: {exc}") from None
    most = services_of(request).settings.eligibility_max_limit
    if options.limit > most:
        raise json_http_error(web.HTTPBadRequest, f"invalid request: limit: at most {most}")
    return options


# A summary page of at most this many servers, from a decision the index keeps, is answered on the
# loop: a fraction of a millisecond at 10,000 servers (bench/placement_bench.py, "function only").
SMALL_PAGE = 100


async def eligibility_answer(
    report: ImageReport, deploy: DeployRequest, index: FleetIndex, options: AnswerOptions
) -> AnswerBody:
    """decide + answer, pure and CPU-only. A question the index has answered on its current view
    (a scheduler asking again) is answered here on the loop when the page is small (`SMALL_PAGE`,
    `explain: summary`): paging through a kept decision costs less than the hop to a thread,
    whose wake-ups wait for a core and the interpreter lock under load. Anything else (a new
    question: O(shapes); `explain: all`: O(servers)) runs in a worker thread. The index's
    `view()` must be built before (on the loop), so the thread only reads it."""
    facts = ImageFacts.from_report(report)
    if options.explain == "summary" and options.limit <= SMALL_PAGE:
        kept = kept_decision(facts, deploy, index)
        if kept is not None:
            return answer(kept, options)
    return await asyncio.to_thread(_decide_and_answer, facts, deploy, index, options)


def _decide_and_answer(
    facts: ImageFacts, deploy: DeployRequest, index: FleetIndex, options: AnswerOptions
) -> AnswerBody:
    return answer(decide(facts, deploy, index), options)
