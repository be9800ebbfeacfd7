"""Image references, parsed and normalised the way Docker does it.

`alpine` means `docker.io/library/alpine:latest`, and Docker Hub's API lives at
`registry-1.docker.io`. Parsing is pure; errors name the part that is wrong so a
user can fix the reference without reading a grammar.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
from dataclasses import dataclass

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
LEGACY_DOCKER_HUB = "index.docker.io"
OFFICIAL_PREFIX = "library/"
DEFAULT_TAG = "latest"
NAME_TOTAL_LENGTH_MAX = 255

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_RE = re.compile(rf"^(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?$")
_PATH_COMPONENT_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG_RE = re.compile(r"^[\w][\w.-]{0,127}$")
_HEX_RE = re.compile(r"^[a-f0-9]+$")
_BARE_ID_RE = re.compile(r"^[a-f0-9]{64}$")
DIGEST_HEX_LENGTHS = {"sha256": 64, "sha512": 128}


class ReferenceError(ValueError):
    """A reference that does not parse; the message names the bad part."""


@dataclass(frozen=True)
class Reference:
    """A normalised image reference: registry, repository, and a tag and/or digest."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        text = self.name
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text

    @property
    def name(self) -> str:
        """`registry/repository`, without tag or digest."""
        return f"{self.registry}/{self.repository}"

    @property
    def identifier(self) -> str:
        """What goes after `/manifests/`: the digest when pinned, else the tag."""
        if self.digest:
            return self.digest
        return self.tag or DEFAULT_TAG

    @property
    def api_host(self) -> str:
        """The host that serves the registry API (Docker Hub's differs from its name)."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    def with_digest(self, digest: str) -> Reference:
        return dataclasses.replace(self, digest=validate_digest(digest))

    def with_tag(self, tag: str | None) -> Reference:
        if tag is not None:
            _validate_tag(tag)
        return dataclasses.replace(self, tag=tag)


def validate_digest(digest: str) -> str:
    """Check `algorithm:hex` (sha256 or sha512, lowercase hex of the right length); return it."""
    algorithm, sep, hex_part = digest.partition(":")
    if not sep or not algorithm:
        raise ReferenceError(f"invalid digest {digest!r}: expected 'sha256:<64 hex characters>'")
    expected = DIGEST_HEX_LENGTHS.get(algorithm)
    if expected is None:
        raise ReferenceError(
            f"invalid digest {digest!r}: unsupported algorithm {algorithm!r} (use sha256 or sha512)"
        )
    if not _HEX_RE.match(hex_part):
        raise ReferenceError(f"invalid digest {digest!r}: the hex part must be lowercase hexadecimal")
    if len(hex_part) != expected:
        raise ReferenceError(
            f"invalid digest {digest!r}: {algorithm} needs {expected} hex characters, got {len(hex_part)}"
        )
    return digest


def _validate_tag(tag: str) -> None:
    if not _TAG_RE.match(tag):
        raise ReferenceError(
            f"invalid tag {tag!r}: a tag is 1-128 characters of letters, digits, '_', '.', '-' "
            "and may not start with '.' or '-'"
        )


def _split_domain(name: str) -> tuple[str, str]:
    """Docker's rule: the first part is a registry only if it looks like a host."""
    first, sep, rest = name.partition("/")
    if sep and (first == "localhost" or "." in first or ":" in first or first != first.lower()):
        domain, remainder = first, rest
    else:
        domain, remainder = DOCKER_HUB, name
    if domain == LEGACY_DOCKER_HUB:
        domain = DOCKER_HUB
    if domain == DOCKER_HUB and "/" not in remainder:
        remainder = OFFICIAL_PREFIX + remainder
    return domain, remainder


def _validate_repository(repository: str, original: str) -> None:
    if not repository:
        raise ReferenceError(f"invalid reference {original!r}: the repository name is empty")
    if repository != repository.lower():
        raise ReferenceError(f"invalid reference {original!r}: repository {repository!r} must be lowercase")
    for component in repository.split("/"):
        if not _PATH_COMPONENT_RE.match(component):
            raise ReferenceError(
                f"invalid reference {original!r}: repository component {component!r} may only hold "
                "lowercase letters and digits separated by '.', '_', '__' or '-'"
            )


def parse_reference(text: str) -> Reference:
    """Parse `[registry/]repo[:tag][@digest]`; `latest` when neither tag nor digest is given."""
    original = text
    text = text.strip()
    if not text:
        raise ReferenceError("invalid reference '': it is empty")
    if "://" in text:
        raise ReferenceError(f"invalid reference {original!r}: drop the URL scheme (no 'https://')")

    name, at, digest = text.partition("@")
    digest_value: str | None = None
    if at:
        if not digest:
            raise ReferenceError(f"invalid reference {original!r}: empty digest after '@'")
        digest_value = validate_digest(digest)

    tag: str | None = None
    last_slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > last_slash:
        name, tag = name[:colon], name[colon + 1 :]
        _validate_tag(tag)

    if not name:
        raise ReferenceError(f"invalid reference {original!r}: the repository name is empty")
    if _BARE_ID_RE.match(name):
        raise ReferenceError(
            f"invalid reference {original!r}: a 64-character hex string is an image ID, not a repository"
        )
    domain, repository = _split_domain(name)
    if not _DOMAIN_RE.match(domain):
        raise ReferenceError(f"invalid reference {original!r}: registry host {domain!r} is not valid")
    _validate_repository(repository, original)
    if len(domain) + 1 + len(repository) > NAME_TOTAL_LENGTH_MAX:
        raise ReferenceError(
            f"invalid reference {original!r}: the name is longer than {NAME_TOTAL_LENGTH_MAX} characters"
        )
    if tag is None and digest_value is None:
        tag = DEFAULT_TAG
    return Reference(registry=domain, repository=repository, tag=tag, digest=digest_value)


def split_host(host: str) -> str:
    """The hostname without port (and without IPv6 brackets)."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") > 1:
        return host
    return host.rsplit(":", 1)[0]


@functools.lru_cache(maxsize=256)
def is_loopback(host: str) -> bool:
    """`127.0.0.1:5000`, `[::1]:80`, `localhost` -> True: where plain HTTP is allowed by default.

    Cached: it is asked on every request, and hosts are few.
    """
    name = split_host(host).lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
