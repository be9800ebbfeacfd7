"""Registry credentials: the tool's own settings first, then Docker's config.json.

Docker's config keeps Hub credentials under `https://index.docker.io/v1/`, may
delegate to `docker-credential-<helper>` programs (`credHelpers` per host, or
one `credsStore`), and stores OAuth refresh tokens as `identitytoken`. Helper
failures fall back to anonymous access with a warning, since many images are public.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, SecretStr

from scanner.settings import ScannerSettings

log = logging.getLogger(__name__)

DOCKER_HUB_AUTH_KEY = "https://index.docker.io/v1/"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}
HELPER_OUTPUT_MAX = 64 * 1024
IDENTITY_TOKEN_USERNAME = "<token>"


class Credentials(BaseModel):
    """What we may present to one registry. Secrets stay `SecretStr` end to end."""

    model_config = ConfigDict(frozen=True)

    username: str | None = None
    password: SecretStr | None = None
    identity_token: SecretStr | None = None
    registry_token: SecretStr | None = None
    source: str = "settings"

    @property
    def has_basic(self) -> bool:
        return self.username is not None and self.password is not None


def docker_auth_key(registry: str) -> str:
    """The key Docker uses for a registry in config.json and with credential helpers."""
    return DOCKER_HUB_AUTH_KEY if registry in _HUB_ALIASES else registry


def _registry_name(registry: str) -> str:
    """Every Docker Hub host is `docker.io`, the name references use."""
    return "docker.io" if registry in _HUB_ALIASES else registry


def _normalise_key(key: str) -> str:
    """`https://host/v1/` and `host` name the same registry in config.json."""
    return _registry_name(key.split("://", 1)[-1].split("/", 1)[0])


def read_docker_config(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable docker config %s: %s", path, type(exc).__name__)
        return {}
    return data if isinstance(data, dict) else {}


def credentials_from_auth_entry(entry: dict[str, Any], source: str) -> Credentials | None:
    """One `auths` entry: `auth` (base64 user:pass), `username`/`password`, `identitytoken`."""
    username = entry.get("username")
    password = entry.get("password")
    encoded = entry.get("auth")
    if isinstance(encoded, str) and encoded:
        try:
            decoded = base64.b64decode(encoded, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            log.warning("ignoring a malformed 'auth' value in %s", source)
            decoded = ""
        if ":" in decoded:
            username, password = decoded.split(":", 1)
    identity = entry.get("identitytoken")
    if isinstance(identity, str) and identity:
        return Credentials(username=username, identity_token=SecretStr(identity), source=source)
    if isinstance(username, str) and isinstance(password, str) and username:
        return Credentials(username=username, password=SecretStr(password), source=source)
    return None


async def run_credential_helper(helper: str, server_url: str, timeout: float) -> Credentials | None:
    """`docker-credential-<helper> get` with the server URL on stdin; None when it has nothing."""
    program = f"docker-credential-{helper}"
    try:
        process = await asyncio.create_subprocess_exec(
            program,
            "get",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError:
        log.warning("credential helper %s is not installed; continuing anonymously", program)
        return None
    try:
        stdout, _ = await asyncio.wait_for(process.communicate(server_url.encode()), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        log.warning("credential helper %s timed out after %.1fs", program, timeout)
        return None
    if process.returncode != 0:
        # "credentials not found in native keychain" is the normal miss; its text holds no secret.
        log.info("credential helper %s has no credentials for %s", program, server_url)
        return None
    try:
        data = json.loads(stdout[:HELPER_OUTPUT_MAX])
        username, secret = data["Username"], data["Secret"]
    except (ValueError, KeyError, TypeError):
        log.warning("credential helper %s returned malformed output", program)
        return None
    if not isinstance(username, str) or not isinstance(secret, str) or not secret:
        return None
    source = f"helper:{helper}"
    if username == IDENTITY_TOKEN_USERNAME:
        return Credentials(identity_token=SecretStr(secret), source=source)
    return Credentials(username=username, password=SecretStr(secret), source=source)


class CredentialStore:
    """Looks credentials up once per registry and remembers the answer (helpers are slow)."""

    def __init__(self, settings: ScannerSettings) -> None:
        self._settings = settings
        self._cache: dict[str, Credentials | None] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _from_settings(self, registry: str) -> Credentials | None:
        entry = self._settings.registry_config(registry)
        if entry is None and registry == "docker.io":
            entry = next(
                (e for e in self._settings.registries if _normalise_key(e.host) == "docker.io"), None
            )
        if entry is None:
            mirror = self._settings.mirror_credentials(registry)
            if mirror is not None:  # a mirror given as https://user:password@host
                return Credentials(username=mirror[0], password=mirror[1], source="settings (mirror URL)")
            return None
        if entry.token is not None:
            return Credentials(username=entry.username, registry_token=entry.token)
        if entry.username is not None and entry.password is not None:
            return Credentials(username=entry.username, password=entry.password)
        return None

    async def _from_docker_config(self, registry: str) -> Credentials | None:
        config = read_docker_config(self._settings.docker_config)
        if not config:
            return None
        server_url = docker_auth_key(registry)
        helpers = config.get("credHelpers") or {}
        helper = None
        if isinstance(helpers, dict):
            helper = helpers.get(server_url) or helpers.get(registry)
        if not helper and isinstance(config.get("credsStore"), str):
            helper = config["credsStore"]
        if isinstance(helper, str) and helper:
            found = await run_credential_helper(helper, server_url, self._settings.credential_helper_timeout)
            if found is not None:
                return found
        auths = config.get("auths") or {}
        if not isinstance(auths, dict):
            return None
        for key, entry in auths.items():
            if isinstance(entry, dict) and _normalise_key(key) == registry:
                found = credentials_from_auth_entry(entry, f"docker-config:{key}")
                if found is not None:
                    return found
        return None

    async def get(self, registry: str) -> Credentials | None:
        """Credentials for a registry name or API host (`registry-1.docker.io` means Hub)."""
        name = _registry_name(registry)
        if name in self._cache:
            return self._cache[name]
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self._cache:
                self._cache[name] = self._from_settings(name) or await self._from_docker_config(name)
            return self._cache[name]
