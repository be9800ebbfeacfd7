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
# distribution/reference's RepositoryNameTotalLengthMax: counts the repository path, not the domain.
REPOSITORY_PATH_LENGTH_MAX = 255
EXPECTED_FORM = "[registry[:port]/]repository[:tag][@sha256:<64 hex>], e.g. ghcr.io/org/app:1.0"

# The grammar of distribution/reference (regexp.go), ASCII only and matched with `fullmatch`, so a
# trailing newline (which `$` accepts) or a non-ASCII letter (which `\w` accepts) never passes.
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_RE = re.compile(
    rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?", re.ASCII
)
_PATH_COMPONENT_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*", re.ASCII)
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
_HEX_RE = re.compile(r"[a-f0-9]+", re.ASCII)
_BARE_ID_RE = re.compile(r"[a-f0-9]{64}", re.ASCII)
DIGEST_HEX_LENGTHS = {"sha256": 64, "sha512": 128}


def _shown(text: str) -> str:
    """The user's input in an error message, bounded so a hostile reference cannot flood a log."""
    return repr(text if len(text) <= 300 else text[:300] + "...")


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
        raise ReferenceError(f"invalid digest {_shown(digest)}: expected 'sha256:<64 hex characters>'")
    expected = DIGEST_HEX_LENGTHS.get(algorithm)
    if expected is None:
        raise ReferenceError(
            f"invalid digest {_shown(digest)}: unsupported algorithm {algorithm[:40]!r}; expected "
            "'sha256:<64 hex characters>' or 'sha512:<128 hex characters>'"
        )
    if not _HEX_RE.fullmatch(hex_part):
        raise ReferenceError(
            f"invalid digest {_shown(digest)}: the part after '{algorithm}:' must be lowercase "
            f"hexadecimal (0-9, a-f), {expected} characters"
        )
    if len(hex_part) != expected:
        raise ReferenceError(
            f"invalid digest {_shown(digest)}: {algorithm} needs {expected} hex characters,"
            f" got {len(hex_part)}"
        )
    return digest


def _validate_tag(tag: str) -> None:
    if not _TAG_RE.fullmatch(tag):
        raise ReferenceError(
            f"invalid tag {_shown(tag)}: a tag is 1-128 ASCII letters, digits, '_', '.' or '-', "
            "not starting with '.' or '-' (e.g. 'v1.2.0-cuda12')"
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
        raise ReferenceError(
            f"invalid reference {_shown(original)}: the repository name is empty; expected {EXPECTED_FORM}"
        )
    if repository != repository.lower():
        raise ReferenceError(
            f"invalid reference {_shown(original)}: repository {_shown(repository)} must be lowercase "
            f"(e.g. {_shown(repository.lower())})"
        )
    for component in repository.split("/"):
        if not _PATH_COMPONENT_RE.fullmatch(component):
            what = (
                "is empty (two '/' in a row, or a trailing '/')"
                if not component
                else (
                    f"{_shown(component)} may only hold lowercase ASCII letters and digits, separated by "
                    "'.', '_', '__' or '-' (e.g. 'my-org/my_app.v2')"
                )
            )
            raise ReferenceError(f"invalid reference {_shown(original)}: repository component {what}")
    if len(repository) > REPOSITORY_PATH_LENGTH_MAX:
        raise ReferenceError(
            f"invalid reference {_shown(original)}: the repository path is {len(repository)} characters, over "
            f"the {REPOSITORY_PATH_LENGTH_MAX}-character limit (the registry name does not count)"
        )


def parse_reference(text: str) -> Reference:
    """Parse `[registry/]repo[:tag][@digest]`; `latest` when neither tag nor digest is given.

    As strict as distribution/reference's ParseNormalizedNamed: no surrounding whitespace, ASCII
    only. Docker Hub names are normalised (`alpine` -> `docker.io/library/alpine`).
    """
    original = text
    if not text:
        raise ReferenceError(f"invalid reference '': it is empty; expected {EXPECTED_FORM}")
    if "://" in text:
        raise ReferenceError(
            f"invalid reference {_shown(original)}: drop the URL scheme (no 'https://');"
            f" expected {EXPECTED_FORM}"
        )
    if text != text.strip():
        raise ReferenceError(f"invalid reference {_shown(original)}: remove the surrounding whitespace")
    if not text.isascii():
        raise ReferenceError(
            f"invalid reference {_shown(original)}: only ASCII characters are allowed;"
            f" expected {EXPECTED_FORM}"
        )

    name, at, digest = text.partition("@")
    digest_value: str | None = None
    if at:
        if not digest:
            raise ReferenceError(
                f"invalid reference {_shown(original)}: empty digest after '@'; expected '@sha256:<64 hex>'"
            )
        digest_value = validate_digest(digest)

    tag: str | None = None
    last_slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > last_slash:
        name, tag = name[:colon], name[colon + 1 :]
        _validate_tag(tag)

    if not name:
        raise ReferenceError(
            f"invalid reference {_shown(original)}: the repository name is empty; expected {EXPECTED_FORM}"
        )
    if _BARE_ID_RE.fullmatch(name):
        raise ReferenceError(
            f"invalid reference {_shown(original)}: a 64-character hex string is an image ID,"
            " not a repository "
            "(name the registry to mean a repository: docker.io/<hex>)"
        )
    domain, repository = _split_domain(name)
    if not _DOMAIN_RE.fullmatch(domain):
        raise ReferenceError(
            f"invalid reference {_shown(original)}: registry host {_shown(domain)} is not valid;"
            " expected a host "
            "name or IP, optionally with a numeric port (e.g. 'registry.example.com:5000', '[::1]:5000')"
        )
    _validate_repository(repository, original)
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
