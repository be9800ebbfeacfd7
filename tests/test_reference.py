"""Reference parsing: Docker's normalisation, and errors that name the bad part."""

from __future__ import annotations

import pytest

from scanner.reference import Reference, ReferenceError, parse_reference

DIGEST = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest", "canonical"),
    [
        ("alpine", "docker.io", "library/alpine", "latest", None, "docker.io/library/alpine:latest"),
        ("alpine:3.19", "docker.io", "library/alpine", "3.19", None, "docker.io/library/alpine:3.19"),
        ("docker.io/alpine", "docker.io", "library/alpine", "latest", None, None),
        ("index.docker.io/library/alpine", "docker.io", "library/alpine", "latest", None, None),
        ("nvidia/cuda:12.4.1-base", "docker.io", "nvidia/cuda", "12.4.1-base", None, None),
        ("ghcr.io/owner/app:v1", "ghcr.io", "owner/app", "v1", None, "ghcr.io/owner/app:v1"),
        ("127.0.0.1:5000/team/app", "127.0.0.1:5000", "team/app", "latest", None, None),
        ("localhost/app", "localhost", "app", "latest", None, "localhost/app:latest"),
        ("localhost:5000/a/b/c:t", "localhost:5000", "a/b/c", "t", None, None),
        ("[::1]:5000/app:1", "[::1]:5000", "app", "1", None, None),
        (
            f"alpine@{DIGEST}",
            "docker.io",
            "library/alpine",
            None,
            DIGEST,
            f"docker.io/library/alpine@{DIGEST}",
        ),
        (
            f"alpine:3@{DIGEST}",
            "docker.io",
            "library/alpine",
            "3",
            DIGEST,
            f"docker.io/library/alpine:3@{DIGEST}",
        ),
        ("my-org/my_app.x__y:Tag_1.0-rc", "docker.io", "my-org/my_app.x__y", "Tag_1.0-rc", None, None),
    ],
)
def test_parse_and_normalise(
    text: str, registry: str, repository: str, tag: str | None, digest: str | None, canonical: str | None
) -> None:
    ref = parse_reference(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag, digest)
    if canonical:
        assert str(ref) == canonical
    # The canonical form parses back to the same reference.
    assert parse_reference(str(ref)) == ref


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("", "empty"),
        ("Alpine", "must be lowercase"),
        ("ghcr.io/Owner/app", "'Owner/app' must be lowercase"),
        ("alpine:bad+tag", "invalid tag 'bad+tag'"),
        ("alpine:-dash", "invalid tag '-dash'"),
        ("alpine:" + "x" * 129, "invalid tag"),
        ("alpine@sha256:abc", "needs 64 hex characters, got 3"),
        ("alpine@sha256:" + "A" * 64, "lowercase hexadecimal"),
        ("alpine@md5:" + "a" * 32, "unsupported algorithm 'md5'"),
        ("alpine@", "empty digest"),
        ("https://ghcr.io/a/b", "URL scheme"),
        ("ghcr.io/a//b", "repository component ''"),
        ("ghcr.io/a/-b", "repository component '-b'"),
        ("a" * 64, "image ID"),
        ("bad_host.io:/x", "registry host 'bad_host.io:'"),
        ("ex_ample.com/app", "registry host 'ex_ample.com'"),
        ("my-registry-.io:5000/app", "registry host 'my-registry-.io:5000'"),
        ("ghcr.io/" + "a" * 260, "longer than 255"),
    ],
)
def test_errors_name_the_bad_part(text: str, names: str) -> None:
    with pytest.raises(ReferenceError) as caught:
        parse_reference(text)
    assert names in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_identifier_api_host_and_replacements() -> None:
    ref = parse_reference("alpine:3")
    assert ref.identifier == "3"
    assert ref.api_host == "registry-1.docker.io"
    assert parse_reference("ghcr.io/a/b").api_host == "ghcr.io"
    pinned = ref.with_digest(DIGEST)
    assert pinned.identifier == DIGEST
    assert str(pinned) == f"docker.io/library/alpine:3@{DIGEST}"
    assert str(pinned.with_tag(None)) == f"docker.io/library/alpine@{DIGEST}"
    assert pinned.with_digest(OTHER).digest == OTHER
    with pytest.raises(ReferenceError, match="needs 64 hex"):
        ref.with_digest("sha256:00")
    with pytest.raises(ReferenceError, match="invalid tag"):
        ref.with_tag("no spaces")
    assert Reference("docker.io", "library/alpine", None, None).identifier == "latest"
