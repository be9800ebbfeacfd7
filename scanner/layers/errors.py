"""What reading a layer can fail with (beside `scanner.layers.limits.LimitExceeded`)."""

from __future__ import annotations


class LayerError(Exception):
    """A layer could not be read. Messages name the problem, never credentials."""


class CorruptLayer(LayerError):
    """The layer is not a valid (compressed) tar archive."""


class AnalysisCrashed(LayerError):
    """The analysis process reading the layer died mid-scan; scanning again may well succeed."""
