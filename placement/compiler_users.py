"""The packages that may call the kernels a run-time compiler builds (Triton, FlashInfer, tvm-ffi). Pure.

First the installed distributions whose sources import the compiler (pure-Python ones too: SGLang,
Unsloth), then the image's packages with GPU code that are not among them (vLLM's wheel ships both)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from scanner.models import PackageFacts

MAX_USERS_NAMED = 6  # packages named in a line, then how many more


def candidates(user_versions: Mapping[str, str], packages: Sequence[PackageFacts]) -> list[PackageFacts]:
    """The distributions that import the compiler (`user_versions`: name -> version), then `packages` not
    named among them, each once."""
    users = [
        PackageFacts(id=f"python:{name}", name=name, version=version, kind="python")
        for name, version in user_versions.items()
    ]
    named = {package.name for package in users}
    return [*users, *(package for package in packages if package.name not in named)]


def named(users: Sequence[str]) -> str:
    """`users` as a line names them: the first `MAX_USERS_NAMED`, then how many more."""
    more = len(users) - MAX_USERS_NAMED
    return ", ".join(users[:MAX_USERS_NAMED]) + (f" and {more} more" if more > 0 else "")
