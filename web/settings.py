"""Service settings: environment variables (prefix GPUBADGE_) plus an optional TOML or YAML file.

They extend the job runtime's settings (`jobs.settings.JobSettings`: the scanner's registries,
credentials and limits, the store, the queue and its workers) with what only the HTTP side reads:
the listen address, secrets, webhooks, agents and admission.
`gpubadge serve --help` prints every field with its variable and default.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from jobs.settings import JobSettings
from scanner.settings import unknown_variables
from web import hooks
from web.bounded_json import INTEROPERABLE_INTEGER, JsonLimits

log = logging.getLogger(__name__)


class ServiceSettings(JobSettings):
    """Everything `gpubadge serve` reads. Field descriptions become `--help` text; a rejected value is
    never echoed (JobSettings' `hide_input_in_errors`): the tokens carry secrets."""

    host: str = Field(default="127.0.0.1", description="listen address")
    port: int = Field(default=8080, ge=0, le=65535, description="listen port (0: any free port)")
    intake_port: int = Field(
        default=8081,
        ge=0,
        le=65535,
        description="the intake port: POST /hooks/{source} on threads of its own, answered without waiting"
        " for the event loop; point registries' webhooks here (the main port answers them too, more slowly"
        " under load). 0: no intake port",
    )
    intake_threads: int = Field(
        default=4,
        ge=1,
        le=64,
        description="threads serving the intake port: deliveries judged and committed at once",
    )
    intake_max_connections: int = Field(
        default=256,
        ge=1,
        description="open connections on the intake port (apart from max_connections); past it a new"
        " connection is answered 503 with Retry-After and closed",
    )
    webhook_secret: SecretStr | None = Field(
        default=None, description="shared webhook secret (Bearer header, ?token=, or HMAC key)"
    )
    webhook_secrets: dict[str, SecretStr] = Field(
        default_factory=dict, description="per-source webhook secrets, e.g. {ghcr: ..., jfrog: ...}"
    )
    api_token: SecretStr | None = Field(
        default=None,
        description="token required by write endpoints, by scans that a read would start, and (public_reads=false) by reads",
    )
    public_reads: bool = Field(
        default=True,
        description="false: every /api read, UI page, badge and /metrics needs the API token"
        " (/healthz, /api/openapi.json and /static stay open)",
    )
    agent_token: SecretStr | None = Field(
        default=None,
        description="the fleet-wide agent token: registers any server, moves a GPU to another server,"
        " releases GPUs and removes servers (gpubadge fleet)",
    )
    agent_tokens: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="per-agent tokens by server name: each acts for its own server only, and never takes"
        " another server's GPUs",
    )
    allow_agents_without_token: bool = Field(
        default=False,
        description="with no agent token configured, accept agents (registrations, heartbeats, polls) from"
        " anyone, each as the fleet-wide token would: only on a network where every client is trusted;"
        " false: agents are refused (401) until agent_token or agent_tokens is set",
    )
    max_server_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="largest registration or GPU report of one server, in bytes (an 8-GPU server's is about"
        " 2 KB, 11 KB with every GPU in MIG mode at 7 devices); a larger one is refused (413) before it is parsed",
    )
    max_servers_per_agent_token: int = Field(
        default=50_000,
        ge=1,
        description="servers the fleet-wide agent token (or, with allow_agents_without_token, no token) may"
        " have registered; a new one past it is refused (403) until servers are removed (gpubadge fleet"
        " forget). A per-agent token registers its own server only",
    )
    coalesce_seconds: float = Field(
        default=0.5, ge=0, description="delay for digest-only push events, so the index job covers them"
    )
    health_timeout: float = Field(
        default=1.5, gt=0, description="/healthz gives the database this long to take a write"
    )
    outdated_scan_wait: float = Field(
        default=10.0,
        ge=0,
        le=60,
        description="seconds a request that may scan (it holds the API token) spends scanning again an image"
        " an older gpubadge analysis read; past it the stored report answers, with a warning, and a queued"
        " scan reads it again. 0: queue that scan at once",
    )
    unscanned_scan_wait: float = Field(
        default=60.0,
        gt=0,
        le=1800,
        description="seconds a request that may scan (it holds the API token) spends scanning an image never"
        " scanned before; past it the scan is queued for the workers and the answer (404) names its job, to"
        " ask again when it is done, so a slow or stalled registry never holds a deploy pipeline's request",
    )
    stall_seconds: float = Field(
        default=300.0,
        gt=0,
        description="/healthz fails when ready jobs wait this long while no worker makes progress",
    )
    max_body_bytes: int = Field(default=1024 * 1024, ge=1, description="largest accepted request body")
    request_head_timeout: float = Field(
        default=10.0,
        gt=0,
        description="seconds a connection has to complete a request head (from its opening, or from the"
        " first byte of a keep-alive connection's next head); a slower one gets 408 and is closed",
    )
    min_body_rate: int = Field(
        default=1024,
        ge=0,
        description="bytes per second a request body must average over each request_head_timeout while it"
        " is still arriving; a slower one gets 408 and is closed (0: judged never)",
    )
    max_connections: int | None = Field(
        default=None,
        ge=1,
        description="open HTTP connections per process, every listener counted; beyond it a new connection is"
        " answered 503 at once"
        " (default: the open-file limit less a tenth of it, at least 256, kept for the store and registries)",
    )
    connection_reserve: int | None = Field(
        default=None,
        ge=0,
        description="connections under max_connections kept for /healthz, agents holding an agent token and"
        " admission reviews: once the rest are open, any other request is answered 503 (Retry-After) and"
        " every answer closes its connection (default: a tenth of the cap, at least 16; at most half)",
    )
    connection_reserve_per_peer: int | None = Field(
        default=None,
        ge=1,
        description="while the reserve is in use, a peer address holding this many connections gets no new"
        " one (503 at once), so one client cannot take the reserve (default: a quarter of the reserve,"
        " at least 4)",
    )
    public_long_poll_max: int | None = Field(
        default=None,
        ge=1,
        description="?wait= long polls (GET /api/images/by-ref, /api/scans/{id}) held at once for callers"
        " without the API token; past it they are answered 503 with Retry-After (default: a quarter of"
        " max_connections)",
    )
    public_long_polls_per_peer: int | None = Field(
        default=None,
        ge=1,
        description="such long polls one peer address may hold at once (default: a quarter of"
        " public_long_poll_max, at least 16)",
    )
    json_max_depth: int = Field(default=32, ge=2, description="deepest nesting of a JSON request body")
    json_max_number: int = Field(
        default=INTEROPERABLE_INTEGER,
        ge=1,
        description="largest magnitude of a number in a JSON request body",
    )
    json_max_string: int = Field(
        default=64 * 1024, ge=256, description="longest string or key in a JSON request body, in characters"
    )
    jfrog_registry: str | None = Field(default=None, description="registry host that JFrog webhooks refer to")
    admission: Literal["warn", "deny"] = Field(
        default="deny",
        description="POST /k8s/admit: deny, or only warn about, a GPU image in a pod that requests no nvidia.com/gpu",
    )
    admission_scan_unknown: bool = Field(
        default=True,
        description="POST /k8s/admit queues a scan of an unknown image on an allowed registry (the answer never waits),"
        " only for a review that carries the API token or a client certificate signed by admission_client_ca;"
        " any other review is answered from stored reports alone",
    )
    admission_client_ca: Path | None = Field(
        default=None,
        description="PEM CA bundle: the HTTPS admission listener asks for a client certificate (the API server's,"
        " from its AdmissionConfiguration kubeconfig) and a review signed by it may queue scans",
    )
    max_scans_per_delivery: int = Field(
        default=500,
        ge=1,
        description="scans one webhook delivery or admission review may queue; a delivery naming more is refused"
        " (413) whole",
    )
    admission_tls_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="also serve POST /k8s/admit over HTTPS on this port (the API server calls webhooks over TLS only)",
    )
    admission_tls_cert: Path | None = Field(
        default=None, description="PEM certificate chain for admission_tls_port"
    )
    admission_tls_key: Path | None = Field(default=None, description="PEM private key for admission_tls_port")
    heartbeat_seconds: float = Field(default=15.0, gt=0, description="how often agents heartbeat")
    stale_after_seconds: float = Field(default=60.0, gt=0, description="servers silent this long drop out")
    heartbeat_flush_seconds: float = Field(
        default=5.0,
        gt=0,
        description="agents' heartbeats are kept in memory and written to the store in one batch this often",
    )
    loop_stall_seconds: float = Field(
        default=0.1,
        ge=0,
        description="an event-loop stall this long is logged with what the loop's thread was running"
        " (jobs/event_loop.py; every lag counts in gpubadge_event_loop_lag_seconds); 0: not logged",
    )
    long_poll_max: int = Field(
        default=12000,
        ge=1,
        description="most agent long polls held at once (one file descriptor each); past it, 503 with Retry-After",
    )
    long_poll_retry_seconds: float = Field(
        default=5.0, gt=0, description="the Retry-After of a long poll refused at long_poll_max"
    )
    eligibility_max_limit: int = Field(
        default=1000, ge=1, description="most eligible servers one /api/eligibility page may ask for"
    )

    @field_validator("webhook_secret", "api_token", "agent_token", mode="after")
    @classmethod
    def _empty_secret_is_unset(cls, value: SecretStr | None) -> SecretStr | None:
        """`GPUBADGE_API_TOKEN=` (set but empty) means unset, which start-up logs as open, never
        "the empty token", which a request without credentials would match."""
        return value if value is not None and value.get_secret_value() else None

    @field_validator("webhook_secrets", mode="after")
    @classmethod
    def _known_sources(cls, secrets: dict[str, SecretStr]) -> dict[str, SecretStr]:
        known = hooks.SOURCES
        unknown = sorted(set(secrets) - set(known))
        if unknown:
            raise ValueError(
                f"webhook_secrets names unknown sources {', '.join(unknown)}; known: {', '.join(known)}"
            )
        empty = sorted(source for source, secret in secrets.items() if not secret.get_secret_value())
        if empty:
            raise ValueError(f"webhook_secrets: empty secret for {', '.join(empty)}")
        return secrets

    @field_validator("agent_tokens", mode="after")
    @classmethod
    def _no_empty_agent_tokens(cls, tokens: dict[str, SecretStr]) -> dict[str, SecretStr]:
        empty = sorted(name for name, token in tokens.items() if not token.get_secret_value())
        if empty:
            raise ValueError(f"agent_tokens: empty token for {', '.join(empty)}")
        return tokens

    def check_consistent(self) -> None:
        """Combinations no single field can check (the environment and the file are merged first)."""
        if not self.public_reads and self.api_token is None:
            raise ValueError("public_reads=false needs an api_token: nobody could read anything")
        if self.intake_port and self.intake_port == self.port:
            raise ValueError(
                f"intake_port and port are both {self.port}: the intake port needs one of its own"
                " (GPUBADGE_INTAKE_PORT; 0: no intake port)"
            )

    def json_limits(self) -> JsonLimits:
        return JsonLimits(
            max_depth=self.json_max_depth, max_number=self.json_max_number, max_string=self.json_max_string
        )

    def webhook_secret_for(self, source: str) -> str | None:
        secret = self.webhook_secrets.get(source) or self.webhook_secret
        return secret.get_secret_value() if secret else None

    def webhook_refused(self, source: str) -> bool:
        """Refused for want of a secret: per-source secrets only and none for this source, or a
        sender that is never open (ACR) with no secret at all (`hooks.refused`)."""
        return hooks.refused(
            hooks.sender(source),
            shared_secret=self.webhook_secret is not None,
            own_secrets=self.webhook_secrets.keys(),
        )

    def open_webhook_sources(self) -> list[str]:
        """Sources whose webhooks are accepted without any secret."""
        if self.webhook_secret is not None or self.webhook_secrets:
            return []
        return [source for source in hooks.SOURCES if not self.webhook_refused(source)]

    def refused_webhook_sources(self) -> list[str]:
        """Sources whose webhooks are refused before they are read, for want of a secret."""
        return [source for source in hooks.SOURCES if self.webhook_refused(source)]

    def webhook_default_registry(self, sender: hooks.Sender) -> str | None:
        """The registry host a sender's payloads leave out, from the setting its record names."""
        if sender.default_registry_setting is None:
            return None
        host: str | None = getattr(self, sender.default_registry_setting)
        return host


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """`scanner.settings.unknown_variables` against every role's settings (ServiceSettings holds them
    all: one ConfigMap feeds every role)."""
    return unknown_variables(environ, ServiceSettings.model_fields)
