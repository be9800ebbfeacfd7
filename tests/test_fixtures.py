"""The harness itself: the registry is real, skopeo pushes keep the digests we computed, and ports picked for
services started next are not taken by other test processes first."""

from __future__ import annotations

import urllib.request

import pytest

from fixtures import registry as registry_fixture
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


def test_free_port_picks_from_its_workers_own_slice_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port picked and released for a process started next can be taken before that process binds it:
    by a port-0 bind or an outgoing connection (the ephemeral range) or by another pytest-xdist worker.
    Each worker's slice lies below the ephemeral range, apart from the others'."""
    slices = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        slices.append(set(registry_fixture._port_slice()))
    assert all(len(ports) >= 1_000 for ports in slices)
    assert not (slices[0] & slices[1] or slices[1] & slices[2] or slices[0] & slices[2])
    assert max(max(ports) for ports in slices) < registry_fixture._ephemeral_start()
    port = registry_fixture.free_port()
    assert port in registry_fixture._PORTS and port < registry_fixture._ephemeral_start()
