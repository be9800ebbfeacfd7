"""Who sent a delivery: shared-secret tokens and the senders' own signatures, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from web.hooks.common import SOURCES, UnknownSource, WebhookAuthError, _lower_keys

GITHUB_SIGNATURE_HEADER = "x-hub-signature-256"

JFROG_AUTH_HEADER = "x-jfrog-event-auth"


def authenticate(
    source: str,
    body: bytes,
    headers: Mapping[str, str],
    query: Mapping[str, str],
    secret: str | None,
) -> None:
    """Accept the delivery if it proves knowledge of `secret`; raise WebhookAuthError if not.

    Proofs: `Authorization: Bearer <secret>` (or the bare secret, as Harbor and GitLab send
    their configured header verbatim), `?token=<secret>`, GitHub's `X-Hub-Signature-256`,
    and JFrog's `X-JFrog-Event-Auth`. A signature header that is present must verify;
    it is not silently skipped in favour of a token. No secret configured: accept.
    """
    if source not in SOURCES:
        raise UnknownSource(source)
    if not secret:
        return
    key = secret.encode()
    lowered = _lower_keys(headers)
    if source == "ghcr" and GITHUB_SIGNATURE_HEADER in lowered:
        _check_github_signature(key, body, lowered[GITHUB_SIGNATURE_HEADER])
        return
    if source == "jfrog" and JFROG_AUTH_HEADER in lowered:
        _check_jfrog_auth(key, body, lowered[JFROG_AUTH_HEADER])
        return
    authorization = lowered.get("authorization")
    token = query.get("token")
    if authorization is None and token is None:
        raise WebhookAuthError(_missing_credentials(source))
    if authorization is not None and _equal(_bearer_credential(authorization), key):
        return
    if token is not None and _equal(token.encode(), key):
        return
    raise WebhookAuthError(f"{source} webhook: the token does not match the configured secret")


def _missing_credentials(source: str) -> str:
    accepted = ["Authorization: Bearer <secret>", "?token=<secret>"]
    if source == "ghcr":
        accepted.append("X-Hub-Signature-256")
    if source == "jfrog":
        accepted.append("X-JFrog-Event-Auth")
    return f"{source} webhook: no credentials; send one of {', '.join(accepted)}"


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


def _equal(given: bytes, expected: bytes) -> bool:
    """Constant-time comparison, so response timing does not leak the secret byte by byte."""
    return hmac.compare_digest(given, expected)
