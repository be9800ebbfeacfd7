"""Talking to a running gpubadge service (`--service URL`) from the CLI, with errors that say what to do.

`service_url` is an argparse type: a URL without `http://` or `https://` is a usage error that
shows the fix. `call` sends one request and returns the JSON answer, or raises `ServiceError`
whose message says what went wrong in words: nothing listening at the address, a host that does
not resolve, no answer in time, an answer that is not gpubadge's, or the service's own error.
"""

from __future__ import annotations

import argparse
import os
from typing import Any
from urllib.parse import urlsplit

TIMEOUT_SECONDS = 120


class ServiceError(RuntimeError):
    """The service could not be asked, or said no; the message is one line for the user. `scan`: the ID of
    the scan the service queued for the answer (an image it could not scan in time), to wait on."""

    def __init__(self, message: str, *, scan: str | None = None) -> None:
        super().__init__(message)
        self.scan = scan


def service_url(text: str) -> str:
    """`http://host:port[/prefix]` or `https://…`, without a trailing slash; else a usage error."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        if "://" in text:
            raise argparse.ArgumentTypeError(f"{text!r}: not an http:// or https:// URL")
        raise argparse.ArgumentTypeError(
            f"{text!r} has no scheme: write http://{text.strip().lstrip('/')} (or https://…)"
        )
    return text.strip().rstrip("/")


SERVICE_ENV = "GPUBADGE"  # the service URL where --service is not given (README's tour exports it)


def service_from_env(
    parser: argparse.ArgumentParser, args: argparse.Namespace, others: tuple[str, ...]
) -> None:
    """Fill `args.service` from $GPUBADGE when neither --service nor another source (`others`, e.g.
    `--servers`) was given; a usage error naming them all when $GPUBADGE is not set either, or not a
    URL."""
    if getattr(args, "service", None) is not None or any(getattr(args, name, None) for name in others):
        return
    text = os.environ.get(SERVICE_ENV, "").strip()
    options = " or ".join(f"--{name}" for name in (*others, "service"))
    if not text:
        parser.error(f"one of {options} is required (or set {SERVICE_ENV} to the service's URL)")
    try:
        args.service = service_url(text)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"{SERVICE_ENV} (the service's URL, as --service takes it): {exc}")


async def call(
    base: str, path: str, token: str | None, *, body: dict[str, Any] | None = None, method: str | None = None
) -> dict[str, Any]:
    """POST `body` (or GET without one; or `method`) to `base + path`; the JSON object answered with 200."""
    import aiohttp

    url = f"{base}{path}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_SECONDS)) as session,
            session.request(
                method or ("POST" if body is not None else "GET"), url, json=body, headers=headers
            ) as response,
        ):
            try:
                answer: Any = await response.json(content_type=None)
            except ValueError:
                answer = None
            status, kind = response.status, response.content_type
    except aiohttp.ClientConnectorDNSError:
        host = urlsplit(base).hostname
        raise ServiceError(f"cannot resolve {host} (--service {base}): check the host name") from None
    except aiohttp.ClientConnectorError as exc:
        number = exc.os_error.errno if exc.os_error is not None else None
        reason = os.strerror(number) if number else str(exc.os_error or exc)
        raise ServiceError(
            f"nothing is listening at {base} ({reason.lower()}): check --service, or start the service"
            " there (`gpubadge serve`)"
        ) from None
    except TimeoutError:
        raise ServiceError(f"{url} did not answer within {TIMEOUT_SECONDS} s") from None
    except aiohttp.ClientError as exc:
        raise ServiceError(f"{url}: {exc or type(exc).__name__}") from None
    if not isinstance(answer, dict):
        raise ServiceError(
            f"{url} answered {status} ({kind or 'no content type'}), not gpubadge's JSON:"
            " is --service the address of a gpubadge service?"
        )
    if status != 200:
        message = answer.get("error", answer)
        hint = " (pass --token, or set GPUBADGE_API_TOKEN)" if status == 401 and not token else ""
        scan = answer.get("scan") if status == 404 else None
        raise ServiceError(
            f"the service answered {status}: {message}{hint}", scan=scan if isinstance(scan, str) else None
        )
    return answer
