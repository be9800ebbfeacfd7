"""Real NVIDIA wheels for fatbin tests, downloaded at set-up and never committed (NVIDIA's licence).

`pip download --no-deps` into a cache under the repository (`/.cache/`, ignored by git) or
`$GPUBADGE_WHEEL_CACHE`; every file is checked against its pinned sha256 before use.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(
    os.environ.get("GPUBADGE_WHEEL_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "wheels")
)


@dataclass(frozen=True)
class PinnedWheel:
    requirement: str
    filename: str
    sha256: str


NVJPEG_CU12 = PinnedWheel(
    "nvidia-nvjpeg-cu12==12.4.0.76",
    "nvidia_nvjpeg_cu12-12.4.0.76-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "3888f10b32fbd58e80166c48e01073732d752fa5f167b7cb5b9615f1c6375a20",
)
NVJPEG_CU13 = PinnedWheel(
    "nvidia-nvjpeg==13.2.3.58",
    "nvidia_nvjpeg-13.2.3.58-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "552b30b11ac8e2bbfb18fd8de31e48756188ebf9b84a8c342a88f07f81a6cdf1",
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_path(wheel: PinnedWheel) -> Path:
    """The verified wheel file, downloaded from PyPI on first use."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / wheel.filename
    if not path.exists() or _sha256(path) != wheel.sha256:
        path.unlink(missing_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                "manylinux2014_x86_64",
                "--python-version",
                "3.11",
                "--dest",
                str(CACHE),
                wheel.requirement,
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
    actual = _sha256(path)
    if actual != wheel.sha256:
        path.unlink(missing_ok=True)
        raise RuntimeError(f"{wheel.filename}: sha256 {actual} is not the pinned {wheel.sha256}")
    return path


def wheel_members(wheel: PinnedWheel) -> dict[str, bytes]:
    """Every file of the wheel by its path inside the wheel."""
    with zipfile.ZipFile(wheel_path(wheel)) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist() if not info.is_dir()}
