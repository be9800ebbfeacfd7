"""Which platforms of an image get their layers read. Pure.

Every platform of an image gets its config facts (GPU signals, requirements, environment):
they cost one small blob each. Layers cost what a pull costs, so they are read only where the
answer is used, as syft and trivy pick one platform by default rather than all of them:

- by default, the platforms a GPU fleet runs: linux/amd64 and linux/arm64 (Grace Hopper,
  Jetson), plus every architecture a known server reports (inventory file or agents);
- `GPUBADGE_PLATFORMS` replaces that default with a list (`linux/amd64,linux/ppc64le`), or
  `all` for every linux platform;
- a platform asked for by name (`gpubadge scan --platform linux/s390x`) is read whatever
  the setting says: the user asked for that answer;
- a platform that is not linux never has a layer read: there is no C library or CUDA to find
  in a Windows container, and its base layers are often foreign (hosted elsewhere).

`not_analysed_because` returns the reason a platform is left out, which the report states.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from scanner.models import Platform

DEFAULT_LAYER_ARCHITECTURES = ("amd64", "arm64")
ALL = "all"
SETTING = "GPUBADGE_PLATFORMS"


def parse_platforms(values: Sequence[str]) -> tuple[Platform, ...] | None:
    """The `GPUBADGE_PLATFORMS` entries as platforms; None for `all`. Raises ValueError on a bad one."""
    if any(value.strip().lower() == ALL for value in values):
        if len(values) > 1:
            raise ValueError(f"{SETTING}: `all` cannot be combined with other platforms")
        return None
    return tuple(Platform.parse(value) for value in values)


@dataclass(frozen=True)
class PlatformPolicy:
    """Which platforms get layer analysis (see the module docstring).

    `configured`: the `GPUBADGE_PLATFORMS` entries, empty for the default. `fleet_architectures`:
    the architectures known servers report, added to the default.
    """

    configured: tuple[str, ...] = ()
    fleet_architectures: frozenset[str] = frozenset()

    def not_analysed_because(self, platform: Platform, requested: Platform | None = None) -> str | None:
        """None when `platform`'s layers are read; otherwise why not, in words for the report."""
        if platform.os != "linux":
            return f"{platform}: layers are analysed for linux platforms only"
        if requested is not None and requested.matches(platform):
            return None
        wanted = parse_platforms(self.configured) if self.configured else ()
        if wanted is None:
            return None
        if wanted:
            if any(choice.matches(platform) for choice in wanted):
                return None
            return f"{platform} is not in {SETTING} ({', '.join(self.configured)})"
        architectures = set(DEFAULT_LAYER_ARCHITECTURES) | set(self.fleet_architectures)
        if platform.architecture in architectures:
            return None
        shown = ", ".join(f"linux/{arch}" for arch in sorted(architectures))
        return (
            f"{platform}: no GPU server runs {platform.architecture} (layers are read for {shown};"
            f" {SETTING} adds platforms)"
        )


def with_fleet(policy: PlatformPolicy, architectures: Collection[str]) -> PlatformPolicy:
    """The policy with the fleet's current architectures."""
    return PlatformPolicy(policy.configured, frozenset(architectures))
