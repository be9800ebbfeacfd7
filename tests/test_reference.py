"""Reference parsing: Docker's normalisation, and errors that name the bad part."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scanner.registry.reference import Reference, ReferenceError, parse_reference

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
        ("ghcr.io/a//b", "repository component is empty"),
        ("ghcr.io/a/-b", "repository component '-b'"),
        ("a" * 64, "image ID"),
        ("bad_host.io:/x", "registry host 'bad_host.io:'"),
        ("ex_ample.com/app", "registry host 'ex_ample.com'"),
        ("my-registry-.io:5000/app", "registry host 'my-registry-.io:5000'"),
        ("ghcr.io/" + "a" * 260, "over the 255-character limit"),
        ("alpine\n", "surrounding whitespace"),
        ("alpine:lätest", "only ASCII"),
    ],
)
def test_errors_name_the_bad_part(text: str, names: str) -> None:
    with pytest.raises(ReferenceError) as caught:
        parse_reference(text)
    assert names in str(caught.value)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("text", "shows"),
    [
        ("", "[registry[:port]/]repository[:tag]"),
        ("https://ghcr.io/a/b", "[registry[:port]/]repository[:tag]"),
        ("ghcr.io/Owner/app", "(e.g. 'owner/app')"),
        ("alpine:bad+tag", "(e.g. 'v1.2.0-cuda12')"),
        ("alpine@md5:" + "a" * 32, "'sha256:<64 hex characters>'"),
        ("ghcr.io/a/b_-c", "(e.g. 'my-org/my_app.v2')"),
        ("ex_ample.com/app", "(e.g. 'registry.example.com:5000'"),
    ],
)
def test_errors_show_the_expected_form(text: str, shows: str) -> None:
    with pytest.raises(ReferenceError) as caught:
        parse_reference(text)
    assert shows in str(caught.value)


def test_errors_stay_short_for_huge_input() -> None:
    with pytest.raises(ReferenceError) as caught:
        parse_reference("ghcr.io/" + "A" * 100_000)
    assert len(str(caught.value)) < 1000


def _reference_cases() -> list[dict[str, Any]]:
    path = Path(__file__).resolve().parent.parent / "fixtures" / "reference_cases.json"
    cases: list[dict[str, Any]] = json.loads(path.read_text())["cases"]
    return cases


@pytest.mark.parametrize(
    "case", _reference_cases(), ids=lambda case: f"{case['source'].split()[1]}:{case['input'][:60]!r}"
)
def test_reference_implementations_tables(case: dict[str, Any]) -> None:
    """distribution/reference's and go-containerregistry's own cases; differences are noted in the data."""
    if not case["valid"]:
        with pytest.raises(ReferenceError):
            parse_reference(case["input"])
        return
    ref = parse_reference(case["input"])
    got = {"registry": ref.registry, "repository": ref.repository, "tag": ref.tag, "digest": ref.digest}
    assert got == {key: case[key] for key in got}, case.get("note", case["source"])


def test_reference_tables_cover_both_implementations() -> None:
    sources = {case["source"].split("@")[0] for case in _reference_cases()}
    assert {"distribution/reference", "google/go-containerregistry"} <= sources
    assert sum(not case["valid"] for case in _reference_cases()) > 50


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
