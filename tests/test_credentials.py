"""Credentials from settings and Docker's config.json, with real credential-helper programs on PATH."""

from __future__ import annotations

import base64
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from scanner.registry.credentials import CredentialStore, docker_auth_key
from scanner.settings import RegistryConfig, ScannerSettings

HELPER = """#!{python}
import json, os, sys
server = sys.stdin.read()
with open(os.path.join(os.path.dirname(__file__), "calls.log"), "a") as log:
    log.write(json.dumps({{"args": sys.argv[1:], "stdin": server}}) + "\\n")
known = {known}
if server in known:
    print(json.dumps({{"ServerURL": server, "Username": known[server][0], "Secret": known[server][1]}}))
else:
    print("credentials not found in native keychain")
    sys.exit(1)
"""


def install_helper(directory: Path, name: str, known: dict[str, tuple[str, str]]) -> Path:
    """A real `docker-credential-<name>` program speaking the helper protocol."""
    path = directory / f"docker-credential-{name}"
    path.write_text(HELPER.format(python=sys.executable, known=known))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def helper_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "bin"
    directory.mkdir()
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    return directory


def store_for(config: dict[str, object], tmp_path: Path, **extra: object) -> CredentialStore:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return CredentialStore(ScannerSettings(docker_config=path, **extra))  # type: ignore[arg-type]


def calls(helper_dir: Path) -> list[dict[str, object]]:
    log = helper_dir / "calls.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def test_auths_entries_in_every_form(tmp_path: Path) -> None:
    encoded = base64.b64encode(b"hubuser:hub-pass:with-colon").decode()
    store = store_for(
        {
            "auths": {
                "https://index.docker.io/v1/": {"auth": encoded},
                "ghcr.io": {"username": "gh", "password": "gh-pass"},
                "https://quay.io/v2/": {"identitytoken": "refresh-xyz"},
                "broken.example": {"auth": "!!!not base64"},
            }
        },
        tmp_path,
    )
    hub = await store.get("registry-1.docker.io")
    assert hub is not None and hub.username == "hubuser" and hub.password is not None
    assert hub.password.get_secret_value() == "hub-pass:with-colon"
    assert await store.get("docker.io") is hub  # one lookup, cached
    ghcr = await store.get("ghcr.io")
    assert ghcr is not None and ghcr.username == "gh" and ghcr.source == "docker-config:ghcr.io"
    quay = await store.get("quay.io")
    assert quay is not None and quay.identity_token is not None and quay.password is None
    assert await store.get("broken.example") is None
    assert await store.get("elsewhere.io") is None
    assert "hub-pass" not in repr(hub) and "refresh-xyz" not in repr(quay)


async def test_cred_helpers_run_the_real_protocol(tmp_path: Path, helper_dir: Path) -> None:
    install_helper(
        helper_dir,
        "test",
        {"https://index.docker.io/v1/": ("hub", "hub-secret"), "ghcr.io": ("<token>", "identity-123")},
    )
    store = store_for(
        {
            "credHelpers": {"https://index.docker.io/v1/": "test", "ghcr.io": "test", "missing.io": "test"},
            "auths": {"missing.io": {"username": "file", "password": "file-pass"}},
        },
        tmp_path,
    )
    hub = await store.get("docker.io")
    assert hub is not None and hub.username == "hub" and hub.source == "helper:test"
    ghcr = await store.get("ghcr.io")
    assert ghcr is not None and ghcr.identity_token is not None
    assert ghcr.identity_token.get_secret_value() == "identity-123"
    fallback = await store.get("missing.io")  # the helper has nothing: config.json's auths answer
    assert fallback is not None and fallback.username == "file"
    assert calls(helper_dir) == [
        {"args": ["get"], "stdin": "https://index.docker.io/v1/"},
        {"args": ["get"], "stdin": "ghcr.io"},
        {"args": ["get"], "stdin": "missing.io"},
    ]


async def test_creds_store_is_the_default_helper(tmp_path: Path, helper_dir: Path) -> None:
    install_helper(helper_dir, "desktop", {"registry.example.com:5000": ("u", "p")})
    store = store_for({"credsStore": "desktop"}, tmp_path)
    found = await store.get("registry.example.com:5000")
    assert found is not None and found.username == "u"


async def test_missing_or_hanging_helper_falls_back_within_timeout(
    tmp_path: Path, helper_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hanging = helper_dir / "docker-credential-hang"
    pid_file = tmp_path / "helper.pid"
    hanging.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 30\n")
    hanging.chmod(0o755)
    store = store_for(
        {"credHelpers": {"slow.io": "hang", "gone.io": "absent"}}, tmp_path, credential_helper_timeout=0.3
    )
    assert await store.get("slow.io") is None
    with pytest.raises(ProcessLookupError):  # the helper was killed and reaped, not left to run
        os.kill(int(pid_file.read_text()), 0)
    assert await store.get("gone.io") is None
    assert "timed out" in caplog.text and "not installed" in caplog.text


async def test_settings_credentials_win_over_docker_config(tmp_path: Path) -> None:
    store = store_for(
        {"auths": {"ghcr.io": {"username": "file", "password": "file-pass"}}},
        tmp_path,
        registries=[RegistryConfig(host="ghcr.io", username="conf", password=SecretStr("conf-pass"))],
    )
    found = await store.get("ghcr.io")
    assert found is not None and found.username == "conf" and found.source == "settings"


def test_docker_auth_key() -> None:
    assert docker_auth_key("docker.io") == "https://index.docker.io/v1/"
    assert docker_auth_key("registry-1.docker.io") == "https://index.docker.io/v1/"
    assert docker_auth_key("ghcr.io") == "ghcr.io"


# --- settings ------------------------------------------------------------------------------------


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "dockercfg"))
    monkeypatch.setenv(
        "GPUBADGE_REGISTRIES", json.dumps([{"host": "ghcr.io", "username": "me", "password": "env-secret"}])
    )
    monkeypatch.setenv("GPUBADGE_MAX_CONFIG_BYTES", "1234")
    loaded = ScannerSettings()
    assert loaded.docker_config == tmp_path / "dockercfg" / "config.json"
    assert loaded.max_config_bytes == 1234
    entry = loaded.registry_config("ghcr.io")
    assert entry is not None and entry.password is not None
    assert entry.password.get_secret_value() == "env-secret"
    assert "env-secret" not in repr(loaded) + str(loaded) + loaded.model_dump_json()


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_settings_file_with_environment_precedence(
    suffix: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / f"gpubadge{suffix}"
    if suffix == ".toml":
        path.write_text(
            '[scanner]\nretries = 7\nconcurrency_per_registry = 3\ndocker_mirror = "mirror.gcr.io"\n'
            '[[scanner.registries]]\nhost = "lab:5000"\ninsecure = true\n'
        )
    else:
        path.write_text(
            "scanner:\n  retries: 7\n  concurrency_per_registry: 3\n  docker_mirror: mirror.gcr.io\n"
            "  registries:\n    - host: lab:5000\n      insecure: true\n"
        )
    monkeypatch.setenv("GPUBADGE_CONFIG", str(path))
    monkeypatch.setenv("GPUBADGE_CONCURRENCY_PER_REGISTRY", "5")
    loaded = ScannerSettings.load()
    assert loaded.retries == 7
    assert loaded.concurrency_per_registry == 5  # the environment wins over the file
    assert loaded.is_insecure("lab:5000") and not loaded.is_insecure("ghcr.io")
    assert loaded.mirror_for("docker.io") == "mirror.gcr.io" and loaded.mirror_for("ghcr.io") is None
    assert ScannerSettings.load(path, retries=2).retries == 2
