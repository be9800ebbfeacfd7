"""`scanner.registry.tls`: aiohttp imported without reading the trust store, which is read on the
first TLS handshake instead, and verifies as before: a server the store trusts answers, one it does
not trust is refused. A real TLS server on loopback; the trust store chosen by SSL_CERT_FILE, as
OpenSSL reads it."""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fixtures.tls import self_signed_certificate

PROBE = """
import asyncio, json, sys
from scanner.registry.tls import import_aiohttp
aiohttp = import_aiohttp()
import aiohttp.connector as connector
context = connector._SSL_CONTEXT_VERIFIED
before = context.cert_store_stats()["x509_ca"]
async def main():
    async with aiohttp.ClientSession() as session:
        try:
            async with session.get(sys.argv[1]) as response:
                result = response.status
        except aiohttp.ClientConnectorCertificateError:
            result = "refused"
    print(json.dumps({"type": type(context).__name__, "before": before, "result": result,
                      "after": context.cert_store_stats()["x509_ca"], "verify": context.verify_mode == 2,
                      "hostname": context.check_hostname}))
asyncio.run(main())
"""


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_certificate(directory)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/v2/", cert
    finally:
        server.shutdown()
        thread.join(timeout=10)
        with contextlib.suppress(OSError):
            server.server_close()


def probe(url: str, trust: Path) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SSL_CERT_FILE": str(trust), "SSL_CERT_DIR": str(trust.parent / "none")},
    )
    assert done.returncode == 0, done.stderr
    answer: dict[str, object] = json.loads(done.stdout)
    return answer


def test_the_trust_store_is_read_at_the_first_handshake_and_verifies(
    tls_server: tuple[str, Path], tmp_path: Path
) -> None:
    url, cert = tls_server
    trusted = probe(url, cert)
    assert trusted == {
        "type": "LazyTrustContext",
        "before": 0,  # aiohttp imported: nothing read yet
        "result": 200,
        "after": 1,  # the store SSL_CERT_FILE names: our server's certificate, and only it
        "verify": True,
        "hostname": True,
    }
    other = tmp_path / "other.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=other",
         "-keyout", str(tmp_path / "other.key"), "-out", str(other)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    assert probe(url, other)["result"] == "refused"  # a store that does not trust it: refused, as before


def test_the_scan_command_imports_aiohttp_without_reading_the_trust_store() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from gpubadge.cli import main; main(['scan', '--no-store', 'UPPER//x']);"
            "import aiohttp.connector as c; print(type(c._SSL_CONTEXT_VERIFIED).__name__,"
            " c._SSL_CONTEXT_VERIFIED.cert_store_stats()['x509_ca'],"
            " sorted(m for m in sys.modules if m.split('.')[0] in ('web', 'placement') or m.startswith('store.export')))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split("\n")[-2] == "LazyTrustContext 0 []", done.stdout + done.stderr
