"""The config file and the environment merge, never cancel each other (issue 20, part 3).

Unit tests drive the real loader (`load_settings`, as `serve` calls it); the refusal and
`gpubadge config` are checked on the real CLI in subprocesses; attaching is checked on a real
`gpubadge serve` against two real registries, one configured in the file, one added by the environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures import catalog
from fixtures.oci import push_image
from fixtures.registry import LocalRegistry, run_registry
from fixtures.service import run_service_process
from scanner.registry.referrers import ARTIFACT_TYPE, tag_schema_tag
from scanner.settings_merge import Keyed, SettingsConflict
from tests.test_referrers_service import skopeo_raw, wait_metric
from tests.test_service_e2e import call, wait_job
from web.commands import load_settings
from web.settings import ServiceSettings

FILE_PASSWORD = "file-registry-pw-3e7a"
FILE_PUSH_PASSWORD = "file-push-pw-91bd"
ENV_PASSWORD = "env-registry-pw-5c02"
FILE_GHCR = "file-ghcr-secret-77d1"
ENV_QUAY = "env-quay-secret-0a4f"
FILE_AGENT = "file-agent-token-12ab"
ENV_AGENT = "env-agent-token-c3d4"
API_TOKEN = "merge-api-token-6e6e"
DB_PASSWORD = "db-password-f00d"
SECRETS = (
    FILE_PASSWORD,
    FILE_PUSH_PASSWORD,
    ENV_PASSWORD,
    FILE_GHCR,
    ENV_QUAY,
    FILE_AGENT,
    ENV_AGENT,
    API_TOKEN,
    DB_PASSWORD,
)

FILE = f"""
api_token = "{API_TOKEN}"
port = 8181
platforms = ["linux/amd64"]

[webhook_secrets]
ghcr = "{FILE_GHCR}"

[agent_tokens]
node_a = "{FILE_AGENT}"

[[registries]]
host = "private.example.com"
username = "scanner"
password = "{FILE_PASSWORD}"
mirror = "mirror.example.com"
insecure = true
push_username = "gpubadge"
push_password = "{FILE_PUSH_PASSWORD}"

[[registries]]
host = "open.example.com"
push_anonymous = true
"""


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file above; no GPUBADGE_* variable leaks in from the outer environment."""
    for name in list(os.environ):
        if name.startswith("GPUBADGE_"):
            monkeypatch.delenv(name)
    path = tmp_path / "gpubadge.toml"
    path.write_text(FILE)
    return path


def test_every_list_and_map_setting_merges() -> None:
    """The settings the rule covers; a new list or map setting joins by its type, never silently replaced."""
    assert ServiceSettings.merge_kinds() == {
        "registries": Keyed("host"),
        "platforms": "set",
        "redirect_hosts": "set",
        "webhook_secrets": "map",
        "agent_tokens": "map",
    }


@pytest.mark.parametrize(
    "variable",
    [
        "new.example.com,private.example.com",
        json.dumps([{"host": "new.example.com"}, {"host": "private.example.com", "token": "env-token"}]),
    ],
    ids=["hosts", "json"],
)
def test_the_environment_adds_hosts_and_the_files_fields_stay(
    config: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv("GPUBADGE_REGISTRIES", variable)
    settings = load_settings(config)
    assert [entry.host for entry in settings.registries] == [
        "private.example.com",
        "open.example.com",
        "new.example.com",
    ]
    private = settings.registry_config("private.example.com")
    assert private is not None and private.may_push()
    assert private.password is not None and private.password.get_secret_value() == FILE_PASSWORD
    assert (
        private.push_password is not None and private.push_password.get_secret_value() == FILE_PUSH_PASSWORD
    )
    assert (private.username, private.push_username) == ("scanner", "gpubadge")
    assert private.insecure and settings.mirror_for("private.example.com") == "mirror.example.com"
    if variable.startswith("["):  # a field the file does not set is added beside the file's
        assert private.token is not None and private.token.get_secret_value() == "env-token"
    opened = settings.registry_config("open.example.com")
    assert opened is not None and opened.push_anonymous and opened.may_push()
    added = settings.registry_config("new.example.com")
    assert added is not None and not added.may_push()
    assert settings.allows("new.example.com") and settings.allows("mirror.example.com")
    origin = settings.origin("registries")
    assert origin.source == "merged"
    assert dict(origin.entries) == {
        "private.example.com": "merged",
        "open.example.com": "file",
        "new.example.com": "environment",
    }


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"password": ENV_PASSWORD}, "password"),
        ({"insecure": False}, "insecure"),
        ({"mirror": "other-mirror.example.com"}, "mirror"),
        ({"push_username": "someone-else"}, "push_username"),
    ],
)
def test_a_field_given_two_values_is_refused_naming_both_sources(
    config: Path, monkeypatch: pytest.MonkeyPatch, entry: dict[str, object], field: str
) -> None:
    monkeypatch.setenv("GPUBADGE_REGISTRIES", json.dumps([{"host": "private.example.com", **entry}]))
    with pytest.raises(SettingsConflict) as raised:
        load_settings(config)
    message = str(raised.value)
    assert "registries" in message and "host private.example.com" in message and f"field {field}" in message
    assert f"the file {config}" in message and "the environment (GPUBADGE_REGISTRIES)" in message
    assert not any(secret in message for secret in SECRETS)
    assert "other-mirror" not in message and "someone-else" not in message


def test_the_same_value_in_both_places_is_no_conflict(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "GPUBADGE_REGISTRIES", json.dumps([{"host": "open.example.com", "push_anonymous": True}])
    )
    monkeypatch.setenv("GPUBADGE_WEBHOOK_SECRETS", json.dumps({"ghcr": FILE_GHCR}))
    settings = load_settings(config)
    assert settings.origin("registries").entries["open.example.com"] == "merged"
    assert settings.webhook_secret_for("ghcr") == FILE_GHCR


def test_webhook_secrets_and_agent_tokens_merge_by_key(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUBADGE_WEBHOOK_SECRETS", json.dumps({"quay": ENV_QUAY}))
    monkeypatch.setenv("GPUBADGE_AGENT_TOKENS__NODE_B", ENV_AGENT)  # one entry, by nested variable
    settings = load_settings(config)
    assert (
        settings.webhook_secret_for("ghcr") == FILE_GHCR and settings.webhook_secret_for("quay") == ENV_QUAY
    )
    assert not settings.webhook_refused("ghcr") and not settings.webhook_refused("quay")
    assert settings.webhook_refused("harbor")
    tokens = {name: token.get_secret_value() for name, token in settings.agent_tokens.items()}
    assert tokens == {"node_a": FILE_AGENT, "node_b": ENV_AGENT}
    assert dict(settings.origin("agent_tokens").entries) == {"node_a": "file", "node_b": "environment"}
    assert settings.origin("webhook_secrets").source == "merged"


@pytest.mark.parametrize(
    ("variable", "value", "what"),
    [
        ("GPUBADGE_WEBHOOK_SECRETS", json.dumps({"ghcr": ENV_QUAY}), "webhook_secrets: key 'ghcr'"),
        ("GPUBADGE_AGENT_TOKENS__NODE_A", ENV_AGENT, "agent_tokens: key 'node_a'"),
    ],
)
def test_a_key_given_two_values_is_refused(
    config: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, what: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsConflict) as raised:
        load_settings(config)
    message = str(raised.value)
    assert what in message and f"the file {config}" in message and f"the environment ({variable})" in message
    assert not any(secret in message for secret in SECRETS)


def test_platforms_are_the_union_and_all_beside_named_is_refused(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUBADGE_PLATFORMS", "linux/arm64,linux/amd64")
    assert load_settings(config).platforms == ["linux/amd64", "linux/arm64"]
    monkeypatch.setenv("GPUBADGE_PLATFORMS", "all")
    with pytest.raises(SettingsConflict, match="platforms: `all` beside named entries"):
        load_settings(config)


def test_a_single_value_from_the_environment_wins_and_says_so(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUBADGE_PORT", "9191")
    settings = load_settings(config, host="0.0.0.0")
    assert settings.port == 9191
    assert settings.origin("port").source == "environment" and settings.origin("port").shadows
    assert settings.origin("host").source == "command line"
    assert settings.origin("api_token").source == "file" and settings.origin("db").source == "default"


def cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {name: value for name, value in os.environ.items() if not name.startswith("GPUBADGE_")}
    return subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--port", "1"],
        ["worker"],
        ["scan", "--no-store", "private.example.com/team/app:1"],
        ["config"],
    ],
    ids=["serve", "worker", "scan", "config"],
)
def test_the_commands_refuse_to_start_on_a_conflict(tmp_path: Path, args: list[str]) -> None:
    path = tmp_path / "gpubadge.toml"
    path.write_text(FILE)
    env = {
        "GPUBADGE_CONFIG": str(path),
        "GPUBADGE_DB": str(tmp_path / "never.db"),
        "GPUBADGE_REGISTRIES": json.dumps([{"host": "private.example.com", "password": ENV_PASSWORD}]),
    }
    result = cli(args, env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"gpubadge {args[0]}: invalid settings" in result.stderr
    assert "host private.example.com: field password" in result.stderr
    assert f"the file {path}" in result.stderr and "the environment (GPUBADGE_REGISTRIES)" in result.stderr
    assert not any(secret in result.stdout + result.stderr for secret in SECRETS)
    assert not (tmp_path / "never.db").exists()  # refused before anything was opened


def test_gpubadge_config_prints_each_setting_with_its_source_and_no_secret(tmp_path: Path) -> None:
    path = tmp_path / "gpubadge.toml"
    path.write_text(FILE)
    env = {
        "GPUBADGE_REGISTRIES": "new.example.com",
        "GPUBADGE_WEBHOOK_SECRETS": json.dumps({"quay": ENV_QUAY}),
        "GPUBADGE_PORT": "9292",
        "GPUBADGE_DATABASE_URL": f"postgresql://gpubadge:{DB_PASSWORD}@db.example.com/gpubadge",
    }
    result = cli(["config", "--json", "--config", str(path)], env)
    assert result.returncode == 0, result.stderr
    assert not any(secret in result.stdout + result.stderr for secret in SECRETS)
    document = json.loads(result.stdout)
    assert document["config_file"] == str(path)
    rows = {row["name"]: row for row in document["settings"]}
    assert set(rows) == set(ServiceSettings.model_fields)
    assert (rows["port"]["source"], rows["port"]["value"], rows["port"]["shadows_file"]) == (
        "environment",
        9292,
        True,
    )
    assert (rows["api_token"]["source"], rows["api_token"]["value"]) == ("file", "[redacted]")
    assert (rows["database_url"]["source"], rows["database_url"]["value"]) == ("environment", "[redacted]")
    assert (rows["agent_token"]["source"], rows["agent_token"]["value"]) == ("default", None)  # unset: null
    assert rows["webhook_secrets"]["source"] == "merged"
    assert rows["webhook_secrets"]["value"] == {"ghcr": "[redacted]", "quay": "[redacted]"}
    assert rows["webhook_secrets"]["entries"] == {"ghcr": "file", "quay": "environment"}
    assert rows["registries"]["source"] == "merged"
    assert rows["registries"]["entries"] == {
        "private.example.com": "file",
        "open.example.com": "file",
        "new.example.com": "environment",
    }
    private = rows["registries"]["value"][0]
    assert private["host"] == "private.example.com" and private["username"] == "scanner"
    assert private["password"] == "[redacted]" and private["push_password"] == "[redacted]"
    assert private["token"] is None and private["mirror"] == "mirror.example.com"
    assert rows["platforms"] == {**rows["platforms"], "source": "file", "value": ["linux/amd64"]}
    assert rows["max_layers"]["source"] == "default"

    text = cli(["config", "--config", str(path)], env)
    assert text.returncode == 0, text.stderr
    assert not any(secret in text.stdout for secret in SECRETS)
    lines = text.stdout.splitlines()
    assert lines[0] == f"# config file: {path}"
    assert any(line.split()[:2] == ["GPUBADGE_REGISTRIES", "merged"] for line in lines)
    assert any(line.split() == ["new.example.com", "environment"] for line in lines)
    assert any(line.split()[:4] == ["GPUBADGE_PORT", "environment", "(over", "the"] for line in lines)


@pytest.fixture(scope="module")
def other_registry() -> Iterator[LocalRegistry]:
    """A second real registry: the one the environment adds, with no push credentials anywhere."""
    with run_registry() as running:
        yield running


def test_a_host_added_by_the_environment_keeps_the_files_push_account(
    registry: LocalRegistry, other_registry: LocalRegistry, tmp_path: Path
) -> None:
    """The issue's case: push_anonymous in the file, GPUBADGE_REGISTRIES in the environment.
    Reports are still attached where the file allows it; where nothing does, one WARNING per registry."""
    path = tmp_path / "gpubadge.toml"
    path.write_text(f'[[registries]]\nhost = "{registry.host}"\npush_anonymous = true\n')
    attached = push_image(catalog.plain_glibc(), f"{registry.host}/merge/app:1", tmp_path / "a")
    skipped = [
        f"{other_registry.host}/merge/first:1",
        f"{other_registry.host}/merge/second:1",
    ]
    push_image(catalog.alpine_gpu(), skipped[0], tmp_path / "b")
    push_image(catalog.static_scratch(), skipped[1], tmp_path / "c")
    env = {
        "GPUBADGE_CONFIG": str(path),
        # Both hosts, as an operator who lists every allowed registry in the environment would.
        "GPUBADGE_REGISTRIES": f"{registry.host},{other_registry.host}",
        "GPUBADGE_API_TOKEN": API_TOKEN,
        "GPUBADGE_ATTACH_REPORTS": "true",
        "GPUBADGE_ATTACH_NFD": "false",
        "DOCKER_CONFIG": str(tmp_path / "docker"),
    }
    auth = {"Authorization": f"Bearer {API_TOKEN}"}
    with run_service_process(tmp_path / "service.db", env=env) as service:
        for ref in [f"{registry.host}/merge/app:1", *skipped]:
            reply = call("POST", f"{service.url}/api/scans", {"ref": ref}, auth)
            assert reply.status == 202, reply.text
            assert wait_job(service.url, str(reply.body["id"]))["state"] == "done"
        done = wait_metric(service.url, "gpubadge_referrer_attach_total", '{result="attached"}', 1)
        assert done == 1, service.log()[-3000:]
        assert wait_metric(service.url, "gpubadge_referrer_attach_total", '{result="skipped"}', 2) == 2
        log = service.log()
    index = skopeo_raw(registry.host, f"merge/app:{tag_schema_tag(attached)}")
    assert [entry["artifactType"] for entry in index["manifests"]] == [ARTIFACT_TYPE]
    warnings = [line for line in log.splitlines() if " WARNING " in line and "no push credentials" in line]
    assert len(warnings) == 1, log[-3000:]
    assert other_registry.host in warnings[0] and registry.host not in warnings[0]


def test_one_host_twice_in_one_source_merges_or_is_refused(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within one source the same rule holds: the environment naming a host twice must agree with itself."""
    monkeypatch.setenv(
        "GPUBADGE_REGISTRIES",
        json.dumps([{"host": "twice.example.com", "mirror": "m.example.com"}, {"host": "twice.example.com"}]),
    )
    entry = load_settings(config).registry_config("twice.example.com")
    assert entry is not None and entry.mirror == "m.example.com"
    monkeypatch.setenv(
        "GPUBADGE_REGISTRIES",
        json.dumps(
            [
                {"host": "twice.example.com", "insecure": True},
                {"host": "twice.example.com", "insecure": False},
            ]
        ),
    )
    with pytest.raises(SettingsConflict, match=r"twice in the environment \(GPUBADGE_REGISTRIES\)"):
        load_settings(config)
