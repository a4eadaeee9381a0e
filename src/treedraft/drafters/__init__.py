"""Drafters: each only proposes a :class:`~treedraft.tree.TokenTree`; the engine verifies.

Build them by name through :mod:`treedraft.drafters.registry` (``build``, ``DrafterCache``);
add new ones with :func:`~treedraft.drafters.registry.register`.
"""

from __future__ import annotations

from .prompt_lookup import PromptLookupDrafter
from .registry import DrafterCache, DrafterOptions, build, choices, default_name, names, register

__all__ = [
    "DrafterCache",
    "DrafterOptions",
    "PromptLookupDrafter",
    "build",
    "choices",
    "default_name",
    "names",
    "register",
]
