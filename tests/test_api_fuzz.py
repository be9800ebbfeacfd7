"""Fuzz the whole HTTP API from its own OpenAPI document (schemathesis), against a real service.

Every operation in `/api/openapi.json` gets generated requests, valid and invalid, sent over
HTTP to a running `gpubadge serve`. Each response must not be a 5xx, and its status, content
type and body must be ones the document declares. The number of examples per operation is
bounded (FUZZ_EXAMPLES), so the whole run stays well under a minute on two cores.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import Case
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from fixtures.registry import free_port
from fixtures.service import RunningService, run_service_process
from web.app import openapi_document

TOKEN = "fuzz-token-3b9c"  # API, agent and webhook secret at once, so every door can be opened
FUZZ_EXAMPLES = 25
LONG_POLL_CAP = "0.05"  # seconds: generated `wait` values would hold a request up to 60 s

schema = schemathesis.openapi.from_dict(openapi_document())
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    dead_registry = f"127.0.0.1:{free_port()}"  # allowed, but nothing listens: scans fail fast
    env = {
        "GPUBADGE_API_TOKEN": TOKEN,
        "GPUBADGE_AGENT_TOKEN": TOKEN,
        "GPUBADGE_WEBHOOK_SECRET": TOKEN,
        "GPUBADGE_REGISTRIES": dead_registry,
        "GPUBADGE_RETRIES": "1",
        "GPUBADGE_MAX_ATTEMPTS": "1",
    }
    with run_service_process(tmp_path_factory.mktemp("fuzz") / "fuzz.db", env=env) as running:
        yield running


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_answers_what_its_document_says(case: Case, fuzz_service: RunningService) -> None:
    if case.query and "wait" in case.query:
        case.query["wait"] = LONG_POLL_CAP
    headers = (
        {"Authorization": f"Bearer {TOKEN}"} if (case.headers or {}).get("Authorization") is None else {}
    )
    response = case.call(base_url=fuzz_service.url, headers=headers, timeout=20)
    case.validate_response(response, checks=CHECKS)


def test_fuzzed_service_stayed_up(fuzz_service: RunningService) -> None:
    assert fuzz_service.process is not None and fuzz_service.process.poll() is None
    assert "Traceback" not in fuzz_service.log(), fuzz_service.log()[-4000:]
