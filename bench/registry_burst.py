"""A push burst at the registry's own pace: the blobs uploaded first, then the manifests PUT at once.

A skopeo push is mostly the client's and the registry's CPU (a 2-core host spends it before any
notification goes out), so a burst of skopeo pushes measures them as much as the receivers. Here
the images' blobs are uploaded beforehand (a blob's push event is one the registry is told to
ignore, so nothing is delivered), and the burst is the manifest PUTs alone, by a few concurrent
clients: each is one push event, so the registry's notification queues back up at once and each
endpoint is sent one delivery after another, as fast as it answers. Every image is distinct, so
each delivery queues a real scan (manifest, config, layers) while the next deliveries arrive.
"""

from __future__ import annotations

import hashlib
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fixtures.oci import ImageSpec, LayerSpec, LayoutWriter, fake_elf, file

GLIBC_LOADER = "/lib64/ld-linux-x86-64.so.2"


@dataclass(frozen=True)
class StagedImage:
    """An image whose blobs are in the registry; its manifest is PUT by `put_manifests`."""

    tag: str
    manifest: bytes
    media_type: str


def _send(url: str, method: str, data: bytes, content_type: str) -> dict[str, str]:
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=60) as response:
        if response.status not in (201, 202):
            raise RuntimeError(f"{method} {url}: {response.status}")
        return dict(response.headers)


def upload_blob(registry_url: str, repository: str, data: bytes) -> None:
    """A monolithic blob upload (POST, then PUT with its digest)."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    location = _send(
        f"{registry_url}/v2/{repository}/blobs/uploads/", "POST", b"", "application/octet-stream"
    )["Location"]
    location = location if location.startswith("http") else registry_url + location
    _send(
        f"{location}{'&' if '?' in location else '?'}digest={digest}", "PUT", data, "application/octet-stream"
    )


def stage_images(
    root: Path, registry_url: str, repository: str, count: int, prefix: str = "b"
) -> list[StagedImage]:
    """`count` distinct small glibc images (a shared base layer and one of their own, half of them
    declaring CUDA) with every blob uploaded to `repository`; nothing tagged yet."""
    layout = LayoutWriter(root)
    base = LayerSpec(
        [
            file("bin/sh", fake_elf(GLIBC_LOADER), 0o755),
            file(GLIBC_LOADER.lstrip("/"), fake_elf(None), 0o755),
            file("etc/os-release", 'ID=debian\nVERSION_ID="12"\n'),
        ]
    )
    staged = []
    for n in range(count):
        top = LayerSpec([file(f"app/{prefix}-{n}.txt", f"image {prefix} {n}\n")])
        env = {"CUDA_VERSION": "12.2.2", "NVIDIA_REQUIRE_CUDA": "cuda>=12.2"} if n % 2 else {}
        descriptor = layout.image(ImageSpec([base, top], env=env))
        manifest = (root / "blobs" / "sha256" / descriptor["digest"].removeprefix("sha256:")).read_bytes()
        staged.append(StagedImage(f"{prefix}{n}", manifest, descriptor["mediaType"]))
    uploaded: set[str] = set()
    blobs = []
    for image in staged:
        document = json.loads(image.manifest)
        for descriptor in (document["config"], *document["layers"]):
            if descriptor["digest"] not in uploaded:
                uploaded.add(descriptor["digest"])
                blobs.append(
                    (root / "blobs" / "sha256" / descriptor["digest"].removeprefix("sha256:")).read_bytes()
                )
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda blob: upload_blob(registry_url, repository, blob), blobs))
    return staged


def put_manifests(registry_url: str, repository: str, images: list[StagedImage], clients: int) -> None:
    """Tag every staged image (its manifest PUT by tag), `clients` at a time: one push event each."""

    def put(image: StagedImage) -> None:
        _send(
            f"{registry_url}/v2/{repository}/manifests/{image.tag}", "PUT", image.manifest, image.media_type
        )

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(put, images))
