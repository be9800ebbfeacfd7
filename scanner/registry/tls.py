"""TLS for a command's registry connections without paying for it where no registry speaks TLS.

aiohttp builds two TLS contexts as it is imported (aiohttp/connector.py: `_SSL_CONTEXT_VERIFIED`
by `ssl.create_default_context()`, `_SSL_CONTEXT_UNVERIFIED` with `set_default_verify_paths()`),
and each reads the system's trust store: about 45 ms of CPU in every process, a tenth of a
`gpubadge scan`'s start-up, spent even when every registry is plain HTTP on loopback.

`import_aiohttp()` imports aiohttp (once, before anything else has) with its verified context a
`LazyTrustContext`, which reads the trust store on its first TLS handshake instead (the same
store, the same verification: CERT_REQUIRED and host names checked), and its unverified one
without the trust store it never consults. The service imports aiohttp the ordinary way.
"""

from __future__ import annotations

import ssl
import sys
import threading
from types import ModuleType
from typing import Any


class LazyTrustContext(ssl.SSLContext):
    """`ssl.create_default_context()`'s client context, whose trust store (`load_default_certs`)
    is read on the first handshake (`wrap_bio`, `wrap_socket`) rather than when it is made."""

    def __new__(cls, *args: Any, **kwargs: Any) -> LazyTrustContext:
        return super().__new__(cls, ssl.PROTOCOL_TLS_CLIENT)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self._trust_lock = threading.Lock()
        self._trust_loaded = False

    def load_trust(self) -> None:
        """Read the system's trust store now (once), as `create_default_context` would have."""
        with self._trust_lock:
            if not self._trust_loaded:
                self.load_default_certs(ssl.Purpose.SERVER_AUTH)
                self._trust_loaded = True

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        self.load_trust()
        return super().wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        self.load_trust()
        return super().wrap_socket(*args, **kwargs)


def import_aiohttp() -> ModuleType:
    """aiohttp, imported with lazy trust (see the module) unless something imported it already."""
    if "aiohttp.connector" in sys.modules:
        import aiohttp

        return aiohttp
    create_default_context = ssl.create_default_context
    set_default_verify_paths = ssl.SSLContext.set_default_verify_paths

    def verified(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        if args or kwargs:  # not aiohttp's plain call: the real thing
            return create_default_context(*args, **kwargs)
        return LazyTrustContext()

    ssl.create_default_context = verified
    ssl.SSLContext.set_default_verify_paths = lambda self: None  # type: ignore[method-assign]
    try:
        import aiohttp.connector
    finally:
        ssl.create_default_context = create_default_context
        ssl.SSLContext.set_default_verify_paths = set_default_verify_paths  # type: ignore[method-assign]
    import aiohttp

    return aiohttp
