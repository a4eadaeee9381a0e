"""The one error type of the models layer."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model file or directory cannot be loaded; the message says what to change."""
