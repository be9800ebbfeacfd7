"""The write side of the registry client: blobs, manifests and indexes pushed with oras-py.

scanner/registry/client.py reads (pulls with the scanner's credentials); this module is the only
code that writes to a registry, and only with gpubadge's own push credentials for it
(`registries[].push_username` / `push_password`), never the pull credentials, the Docker
config or anything a webhook carried.

Where the line with oras-py (0.2.x) falls:
- oras does the authentication (Basic, or the Bearer token dance with those credentials,
  via its `TokenAuth` backend) and blob uploads (`upload_blob`: HEAD, then POST + PUT).
- Everything else goes through its authenticated request layer (`do_request`), because oras
  cannot: its `upload_manifest` re-serialises the dict (so the digest the registry computes
  is not one we computed) and PUTs by tag only, it cannot PUT an index, and it knows nothing
  of `artifactType`, `subject`, `OCI-Subject` or the referrers API. We PUT the exact bytes we
  hashed, by digest, and read `Docker-Content-Digest` back to check.
- oras' `do_request` is wrapped in a retry decorator that sleeps 3 s to 83 s between
  attempts (and retries authentication failures). Each of our oras clients gets the
  undecorated function (`__wrapped__`) as its own `do_request`, every request gets a
  timeout, and retries happen at the attach level instead.
- oras' `token` auth backend answers a Basic challenge by asking the realm for a token;
  we probe `/v2/` once per registry and pick its `basic` backend for Basic registries.

What oras does not guard, this module does, as the read path does (scanner/registry/client.py):
- A token realm is checked (`auth.check_realm`, the pull credentials' rules) before anything
  is sent to it: the registry's own host, a well-known auth host of it, a host on the allowlist
  (GPUBADGE_REGISTRIES) or loopback for a loopback registry; push credentials travel only over
  https, or to loopback for a loopback registry. `_CheckedTokenAuth` replaces oras'
  `TokenAuth.request_token` and `request_anonymous_token` for that.
- Every request goes through `_GuardedSession.send`: to the registry's own host, to a realm
  that passed that check, or (Authorization stripped) to a host `redirects.hop_allowed` allows;
  anything else is refused before it is contacted. No redirect is followed on the push path
  (a 3xx is the answer), so no hop escapes the check.
- Every answer is read bounded: at most GPUBADGE_MAX_MANIFEST_BYTES (the read path's cap for
  manifests and referrers indexes), within GPUBADGE_REQUEST_TIMEOUT; a larger or slower answer
  is a `PushError`, never held whole in memory. An error body shown in a message is cut to
  2 KiB and comes only from a host that was allowed.

oras is synchronous (requests); callers run these methods in a worker thread.
"""

from __future__ import annotations

import tempfile
import threading
import time
import types
from dataclasses import dataclass
from http.cookiejar import DefaultCookiePolicy
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import oras.auth
import oras.auth.utils
import oras.container
import oras.provider
import requests
import requests.adapters

from scanner.registry import redirects
from scanner.registry.auth import RealmRefused, check_configured_realm, parse_token_response
from scanner.registry.descriptors import compute_digest
from scanner.settings import ScannerSettings

_UNDECORATED_DO_REQUEST = oras.provider.Registry.do_request.__wrapped__
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
_ERROR_BODY_MAX = 2048


class PushError(Exception):
    """A write to the registry failed; the message names the step and status, never a credential."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Fetched:
    """A manifest or index read by the pusher: exact bytes, their digest and the ETag, if any."""

    raw: bytes
    digest: str
    media_type: str
    etag: str | None


@dataclass(frozen=True)
class PushedManifest:
    digest: str
    oci_subject: str | None  # the OCI-Subject response header: the registry indexed the subject


class _TimeoutAdapter(requests.adapters.HTTPAdapter):
    """requests has no default timeout; oras passes none. A hung registry must not hang a thread."""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self._timeout = timeout

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:  # type: ignore[override]
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = self._timeout
        return super().send(request, **kwargs)


class _GuardedSession(requests.Session):
    """The only way the push path reaches the network: each request's host checked before it is
    sent, no redirect followed, every answer read within a byte cap and a deadline."""

    def __init__(self, pusher: RegistryPusher) -> None:
        super().__init__()
        self._pusher = pusher
        self.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))  # as oras: no cookie jar
        self.headers["Accept-Encoding"] = "identity"  # the cap counts what the registry sends
        adapter = _TimeoutAdapter(pusher.settings.request_timeout)
        self.mount("http://", adapter)
        self.mount("https://", adapter)

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        pusher = self._pusher
        parts = urlsplit(request.url or "")
        host = parts.netloc
        if parts.scheme not in ("http", "https") or not host:
            raise PushError(f"{pusher.host}: refusing to send a push request to a non-http(s) URL")
        if host.lower() != pusher.host.lower():
            if (parts.scheme, host) in pusher.approved_realms:
                pass  # `_CheckedTokenAuth` checked this realm (scheme included) before adding it
            elif redirects.hop_allowed(pusher.settings, pusher.host, host):
                request.headers.pop("Authorization", None)
            else:
                raise PushError(
                    f"{pusher.host} sent the push to {host}, which is neither a configured registry nor a "
                    f"known storage host; refusing to contact it (add {host} to "
                    f"{redirects.REDIRECT_SETTING} to allow it)"
                )
            if (
                parts.scheme == "http"
                and (parts.scheme, host) not in pusher.approved_realms
                and not redirects.plain_http_allowed(pusher.settings, host)
            ):
                raise PushError(f"{pusher.host}: refusing plain HTTP to {host}")
        kwargs["allow_redirects"] = False  # with `get_redirect_target` below: no hop, no body read for one
        kwargs["stream"] = True
        response = super().send(request, **kwargs)
        return _read_bounded(response, pusher.settings, f"{request.method} {host}{parts.path}")

    def get_redirect_target(self, response: requests.Response) -> None:
        """None: requests would otherwise read a 3xx answer's whole body (unbounded) to follow it, even
        with redirects off. A 3xx is the answer on the push path."""
        return None


def _read_bounded(response: requests.Response, settings: ScannerSettings, what: str) -> requests.Response:
    """Read the body whole, but never more than max_manifest_bytes nor (give or take one socket read,
    itself bounded by the request timeout) for longer than the request timeout; past either, the
    connection is closed and PushError raised."""
    limit = settings.max_manifest_bytes
    try:
        declared = int(response.headers.get("Content-Length", ""))
    except ValueError:
        declared = None
    if declared is not None and declared > limit:
        response.close()
        raise PushError(
            f"{what}: the answer is {declared} bytes, over the {limit}-byte limit (GPUBADGE_MAX_MANIFEST_BYTES)"
        )
    deadline = time.monotonic() + settings.request_timeout
    body = bytearray()
    try:
        while True:
            chunk = response.raw.read1(65536, decode_content=True)  # what has arrived: never waits for 64 KiB
            if not chunk:
                break
            body += chunk
            if len(body) > limit:
                raise PushError(
                    f"{what}: the answer exceeds the {limit}-byte limit (GPUBADGE_MAX_MANIFEST_BYTES)"
                )
            if time.monotonic() > deadline:
                raise PushError(
                    f"{what}: the answer took longer than {settings.request_timeout:g} s "
                    "(GPUBADGE_REQUEST_TIMEOUT)"
                )
    except PushError:
        response.close()
        raise
    except Exception as exc:  # urllib3's read errors: one message, never a traceback
        response.close()
        raise PushError(f"{what}: reading the answer failed ({type(exc).__name__})") from None
    response._content = bytes(body)
    response._content_consumed = True
    response.close()  # the body is held; the connection goes back to the pool
    return response


class _CheckedTokenAuth(oras.auth.TokenAuth):  # type: ignore[misc]
    """oras' token backend, whose two token requests check the realm first (the read path's rules)."""

    def __init__(self, pusher: RegistryPusher) -> None:
        super().__init__()
        self._pusher = pusher

    def request_token(self, h: oras.auth.utils.authHeader) -> str | None:
        return self._fetch(h, getattr(self, "_basic_auth", None))

    def request_anonymous_token(self, h: oras.auth.utils.authHeader) -> str | None:
        return self._fetch(h, None)

    def _fetch(self, h: oras.auth.utils.authHeader, basic: str | None) -> str | None:
        realm = h.realm
        if not realm:
            return None
        if not realm.startswith("http"):
            realm = f"{self.prefix}://{realm}"
        pusher = self._pusher
        try:
            check_configured_realm(pusher.settings, pusher.host, realm, sends_credentials=bool(basic))
        except RealmRefused as exc:
            raise PushError(f"{exc} (push credentials were not sent)", status=401) from None
        checked = urlsplit(realm)
        pusher.approved_realms.add((checked.scheme, checked.netloc))
        params = {key: value for key, value in (("service", h.service), ("scope", h.scope)) if value}
        headers = {"Accept": "application/json"}
        if basic:
            headers["Authorization"] = f"Basic {basic}"
        response = self.session.get(realm, headers=headers, params=params, verify=self._tls_verify)
        if response.status_code != 200:
            return None
        try:
            token, _ = parse_token_response(response.content)
        except ValueError:
            return None
        return token


class RegistryPusher:
    """Pushes to one registry host. Thread-safe: one oras session per repository, used under a lock."""

    def __init__(self, settings: ScannerSettings, host: str) -> None:
        self.settings = settings
        self.host = host
        self._sessions: dict[str, tuple[oras.provider.Registry, threading.Lock]] = {}
        self._lock = threading.Lock()
        self._backend: str | None = None
        self.approved_realms: set[tuple[str, str]] = set()  # (scheme, host) of realms `check_realm` passed

    @property
    def insecure(self) -> bool:
        return redirects.plain_http_allowed(self.settings, self.host)

    def _session(self, repository: str) -> tuple[oras.provider.Registry, threading.Lock]:
        """oras keeps one token per client, so one client per repository keeps scopes apart."""
        with self._lock:
            found = self._sessions.get(repository)
            if found is None:
                backend = self._auth_backend()
                registry = oras.provider.Registry(
                    hostname=self.host, insecure=self.insecure, auth_backend=backend
                )
                # This instance only: bypass oras' sleeping retry decorator (see the module docstring).
                registry.do_request = types.MethodType(_UNDECORATED_DO_REQUEST, registry)
                # Every request, the auth backend's included, through the guarded session.
                registry.session.close()
                registry.session = _GuardedSession(self)
                if backend == "token":
                    registry.auth = _CheckedTokenAuth(self)
                    registry.auth.prefix = "http" if self.insecure else "https"
                    registry.auth._tls_verify = True
                registry.auth.session = registry.session
                entry = self.settings.registry_config(self.host)
                if entry is not None and entry.push_username and entry.push_password:
                    registry.auth.set_basic_auth(entry.push_username, entry.push_password.get_secret_value())
                found = (registry, threading.Lock())
                self._sessions[repository] = found
            return found

    def _auth_backend(self) -> str:
        """oras' `token` backend cannot answer a Basic challenge (it asks the realm for a token): ask once."""
        if self._backend is None:
            backend = "token"
            try:
                with _GuardedSession(self) as probe:
                    response = probe.get(self._url_root())
                challenge = response.headers.get("WWW-Authenticate", "")
                if response.status_code == 401 and challenge.lower().startswith("basic"):
                    backend = "basic"
            except (requests.RequestException, PushError):
                pass  # the real request will fail with a clear error
            self._backend = backend
        return self._backend

    def _url_root(self) -> str:
        return f"{'http' if self.insecure else 'https'}://{self.host}/v2/"

    def _url(self, repository: str, path: str) -> str:
        scheme = "http" if self.insecure else "https"
        return f"{scheme}://{self.host}/v2/{repository}/{path}"

    def _request(
        self,
        repository: str,
        method: str,
        path: str,
        *,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> requests.Response:
        registry, lock = self._session(repository)
        with lock:
            try:
                response: requests.Response = registry.do_request(
                    self._url(repository, path), method, data=data, headers=dict(headers or {})
                )
            except requests.RequestException as exc:
                raise PushError(
                    f"{method} {self.host}/v2/{repository}/{path}: {type(exc).__name__}"
                ) from None
            except ValueError as exc:  # oras: "Cannot respond to request for authentication."
                raise PushError(f"{method} {self.host}/v2/{repository}/{path}: {exc}", status=401) from None
        return response

    def upload_blob(self, repository: str, data: bytes, media_type: str) -> str:
        """Upload one small blob (skipped by oras when the registry already has it); returns its digest."""
        digest = compute_digest(data)
        layer = {"mediaType": media_type, "digest": digest, "size": len(data)}
        registry, lock = self._session(repository)
        container = oras.container.Container(f"{self.host}/{repository}")
        with tempfile.TemporaryDirectory(prefix="gpubadge-blob-") as directory:
            path = Path(directory) / "blob"
            path.write_bytes(data)
            with lock:
                try:
                    response = registry.upload_blob(str(path), container, layer)
                except (
                    ValueError
                ):  # no upload session URL: oras then fails parsing the body (requests' JSONDecodeError)
                    raise PushError(
                        f"blob upload {self.host}/{repository}@{digest}: the registry refused to open an "
                        "upload session (read-only, or no push permission for gpubadge's push credentials)"
                    ) from None
                except requests.RequestException as exc:
                    raise PushError(
                        f"blob upload {self.host}/{repository}@{digest}: {type(exc).__name__}"
                    ) from None
        if response.status_code not in (200, 201, 202):
            raise PushError(
                f"blob upload {self.host}/{repository}@{digest}: status {response.status_code}",
                status=response.status_code,
            )
        return digest

    def put_manifest(
        self, repository: str, reference: str, raw: bytes, media_type: str, *, if_match: str | None = None
    ) -> PushedManifest:
        """PUT these exact bytes under a digest or tag; checks the digest the registry reports.

        `if_match` (an ETag we read) makes the PUT conditional where the registry honours it;
        a 412 comes back as PushError(status=412).
        """
        digest = compute_digest(raw)
        headers = {"Content-Type": media_type}
        if if_match:
            headers["If-Match"] = if_match
        response = self._request(repository, "PUT", f"manifests/{reference}", data=raw, headers=headers)
        if response.status_code != 201:
            raise PushError(
                f"PUT manifest {self.host}/{repository}:{reference}: status {response.status_code}"
                f"{_error_text(response)}",
                status=response.status_code,
            )
        claimed = response.headers.get("Docker-Content-Digest")
        if claimed and claimed != digest:
            raise PushError(
                f"PUT manifest {self.host}/{repository}: registry stored {claimed}, we sent {digest}"
            )
        return PushedManifest(digest, response.headers.get("OCI-Subject"))

    def get_manifest(self, repository: str, reference: str, accept: str) -> Fetched | None:
        """GET a manifest or index; None on 404. The digest is computed from the bytes received."""
        response = self._request(repository, "GET", f"manifests/{reference}", headers={"Accept": accept})
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise PushError(
                f"GET manifest {self.host}/{repository}:{reference}: status {response.status_code}"
                f"{_error_text(response)}",
                status=response.status_code,
            )
        raw = response.content  # read by `_GuardedSession`, at most max_manifest_bytes
        media_type = response.headers.get("Content-Type", "").split(";", 1)[0].strip()
        return Fetched(raw, compute_digest(raw), media_type, response.headers.get("ETag"))

    def get_referrers(self, repository: str, digest: str) -> bytes | None:
        """The referrers API's index for `digest`, or None where the registry lacks the API."""
        response = self._request(repository, "GET", f"referrers/{digest}", headers={"Accept": OCI_INDEX})
        media_type = response.headers.get("Content-Type", "").split(";", 1)[0].strip()
        if response.status_code == 200 and media_type == OCI_INDEX:
            return response.content  # read by `_GuardedSession`, at most max_manifest_bytes
        return None

    def close(self) -> None:
        with self._lock:
            for registry, _ in self._sessions.values():
                registry.session.close()
            self._sessions.clear()


def _error_text(response: requests.Response) -> str:
    text = response.text[:_ERROR_BODY_MAX].strip()
    return f": {text}" if text else ""
