"""The first connection to PostgreSQL, before a store opens its pools: a server that is not
answering yet is waited for, one that refuses what the URL asks is reported at once.

A pool told to wait for its first connection retries in silence and then says only that it timed
out (and psycopg's pool logs every failed try). Here each try's own error is kept: a server that
refuses the connection outright (an unknown role or database, a wrong password, no `pg_hba.conf`
entry for this client, a malformed URL, TLS required of a server without it or a certificate that
does not verify) fails on the first try, in the server's words; any other
failure (connection refused, no answer, a name not resolved yet, a server starting up) is tried
again every RETRY_SECONDS until the timeout, with one warning when the wait begins, and then fails
with the last try's words. The words never carry the URL (it may hold a password).
"""

from __future__ import annotations

import logging
import time

import psycopg

from store.postgres_errors import describe_error

log = logging.getLogger(__name__)

RETRY_SECONDS = 0.5

# What a server (or libpq, reading the URL) answers when trying again cannot help.
REFUSED_OUTRIGHT = (
    "password authentication failed",
    "does not exist",  # the role or the database
    "no pg_hba.conf entry",
    "invalid",  # a malformed URL or option
    "unsupported",
    "does not support ssl",  # sslmode=require against a server without TLS
    "certificate",  # a server certificate that does not verify
)


def refused_outright(exc: BaseException) -> bool:
    """Whether a failed connection is one that no retry will mend."""
    text = str(exc).lower()
    return any(words in text for words in REFUSED_OUTRIGHT)


def wait_for_server(url: str, timeout: float, application_name: str) -> None:
    """Return once one connection to `url` opens (and close it), within `timeout` seconds; raise
    the last `psycopg.OperationalError` otherwise, or the first that `refused_outright`."""
    deadline = time.monotonic() + timeout
    waiting = False
    while True:
        left = deadline - time.monotonic()
        try:
            psycopg.connect(url, connect_timeout=max(1, int(left)), application_name=application_name).close()
            if waiting:
                log.info("PostgreSQL answers")
            return
        except psycopg.OperationalError as exc:
            if refused_outright(exc) or time.monotonic() + RETRY_SECONDS >= deadline:
                raise
            if not waiting:
                log.warning(
                    "PostgreSQL does not answer yet (%s); trying again for up to %.0f s",
                    describe_error(exc),
                    left,
                )
                waiting = True
        time.sleep(RETRY_SECONDS)
