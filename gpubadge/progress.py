"""The CLI's one-line progress bar: on a terminal only, so pipes and logs stay clean."""

from __future__ import annotations

from typing import TextIO


class Bar:
    """A one-line progress bar on `stream` when it is a terminal; silent otherwise.

    With a `total` it draws a bar and `done/total`; without one (not known yet) a count."""

    def __init__(self, total: int | None, stream: TextIO) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.enabled = stream.isatty()

    def __call__(self, done: int) -> None:
        self.done = done
        if not self.enabled:
            return
        if self.total:
            filled = min(30, int(30 * done / self.total))
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done:,}/{self.total:,} images")
        else:
            self.stream.write(f"\r{done:,} images")
        self.stream.flush()

    def step(self) -> None:
        """One more done."""
        self(self.done + 1)

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 60 + "\r")
            self.stream.flush()
