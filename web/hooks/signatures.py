"""Who sent a delivery: shared-secret tokens and the senders' own signatures, compared in constant time.

`shared_secret` builds a sender's authenticator: `Authorization: Bearer <secret>` (or the bare
secret, as Harbor and GitLab send their configured header verbatim), `?token=<secret>`, and,
for the senders that sign, their signature header (GitHub's `X-Hub-Signature-256`, JFrog's
`X-JFrog-Event-Auth`). A signature header that is present must verify; it is not silently
skipped in favour of a token. Headers arrive with lower-cased names (`common.lower_keys`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from web.hooks.common import Authenticator, Headers, Query, WebhookAuthError

GITHUB_SIGNATURE_HEADER = "x-hub-signature-256"

JFROG_AUTH_HEADER = "x-jfrog-event-auth"


@dataclass(frozen=True, slots=True)
class SignatureHeader:
    """A header in which a sender proves the secret itself; `verify(key, body, value)` raises if not."""

    name: str  # lower-case, as headers are looked up
    shown: str  # as the sender's documentation spells it, for messages
    verify: Callable[[bytes, bytes, str], None]


def shared_secret(source: str, signature: SignatureHeader | None = None) -> Authenticator:
    """The authenticator of a sender that proves the secret by token, or by `signature` when it signs.

    No secret configured: accept (the route refuses senders whose record `needs_secret` first).
    """
    accepted = ["Authorization: Bearer <secret>", "?token=<secret>"]
    if signature is not None:
        accepted.append(signature.shown)
    missing = f"{source} webhook: no credentials; send one of {', '.join(accepted)}"
    mismatch = f"{source} webhook: the token does not match the configured secret"

    def authenticate(body: bytes, headers: Headers, query: Query, secret: str | None) -> None:
        if not secret:
            return
        key = secret.encode()
        if signature is not None:
            value = headers.get(signature.name)
            if value is not None:
                signature.verify(key, body, value)
                return
        authorization = headers.get("authorization")
        if authorization is not None and _equal(_bearer_credential(authorization), key):
            return
        token = query.get("token")
        if authorization is None and token is None:
            raise WebhookAuthError(missing)
        if token is not None and _equal(token.encode(), key):
            return
        raise WebhookAuthError(mismatch)

    return authenticate


def _bearer_credential(authorization: str) -> bytes:
    scheme, _, credential = authorization.strip().partition(" ")
    if scheme.lower() == "bearer" and credential:
        return credential.strip().encode()
    return authorization.strip().encode()


def _check_github_signature(key: bytes, body: bytes, header: str) -> None:
    algorithm, sep, signature = header.strip().partition("=")
    if not sep or algorithm != "sha256":
        raise WebhookAuthError("ghcr webhook: X-Hub-Signature-256 must read 'sha256=<hex HMAC-SHA256>'")
    expected = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    if not _equal(signature.lower().encode(), expected):
        raise WebhookAuthError("ghcr webhook: X-Hub-Signature-256 does not match the body and secret")


def _check_jfrog_auth(key: bytes, body: bytes, header: str) -> None:
    """X-JFrog-Event-Auth holds the secret itself, or (when signing) an HMAC of the body.

    JFrog does not document the signing algorithm. Live captures (akuity/kargo) verify
    plain hex HMAC-SHA256; telegraf expects `sha1=<hex HMAC-SHA1>`. Accept those, and
    `sha256=<hex>`, and nothing else.
    """
    value = header.strip()
    algorithm, sep, signature = value.partition("=")
    if sep and algorithm in ("sha1", "sha256"):
        digestmod = hashlib.sha1 if algorithm == "sha1" else hashlib.sha256
        expected = hmac.new(key, body, digestmod).hexdigest().encode()
        if _equal(signature.lower().encode(), expected):
            return
    else:
        if _equal(value.encode(), key):
            return
        if _equal(value.lower().encode(), hmac.new(key, body, hashlib.sha256).hexdigest().encode()):
            return
    raise WebhookAuthError("jfrog webhook: X-JFrog-Event-Auth is neither the secret nor a valid signature")


GITHUB_SIGNATURE = SignatureHeader(GITHUB_SIGNATURE_HEADER, "X-Hub-Signature-256", _check_github_signature)

JFROG_SIGNATURE = SignatureHeader(JFROG_AUTH_HEADER, "X-JFrog-Event-Auth", _check_jfrog_auth)


def _equal(given: bytes, expected: bytes) -> bool:
    """Constant-time comparison, so response timing does not leak the secret byte by byte."""
    return hmac.compare_digest(given, expected)
