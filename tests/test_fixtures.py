"""The harness itself: the registry is real and skopeo pushes keep the digests we computed."""

from __future__ import annotations

import urllib.request

from fixtures.oci import ImageSpec, LayerSpec, directory, fake_elf, file
from fixtures.registry import LocalRegistry
from tests.conftest import Pusher


def test_push_preserves_digest(registry: LocalRegistry, push: Pusher) -> None:
    spec = ImageSpec([LayerSpec([directory("bin"), file("bin/sh", fake_elf("/lib/ld-musl-x86_64.so.1"))])])
    digest = push(spec, "harness/one:1")
    request = urllib.request.Request(
        f"{registry.url}/v2/harness/one/manifests/1",
        method="HEAD",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Docker-Content-Digest"] == digest
