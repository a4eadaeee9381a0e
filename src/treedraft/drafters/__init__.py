"""Drafters: each only proposes a :class:`~treedraft.tree.TokenTree`; the engine verifies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .prompt_lookup import PromptLookupDrafter

if TYPE_CHECKING:
    from ..api import LLM
    from ..engine import Drafter

DRAFTERS = ("none", "prompt-lookup", "medusa", "hybrid")


def make_drafter(name: str, llm: LLM, heads: str | None = "default") -> Drafter | None:
    """A drafter by name for a loaded model; unknown names list the choices."""
    if name in ("none", "plain"):
        return None
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    if name == "medusa":
        from .medusa import MedusaDrafter
        return MedusaDrafter.for_model(llm, heads)
    if name == "hybrid":  # Medusa tree + prompt-lookup branches, verified in one pass
        from .hybrid import HybridDrafter
        from .medusa import MedusaDrafter
        return HybridDrafter([MedusaDrafter.for_model(llm, heads), PromptLookupDrafter()])
    raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")


def default_drafter(llm: LLM, heads: str | None = "default") -> Drafter | None:
    """Medusa heads when shipped/given for this model, else prompt lookup."""
    try:
        from .medusa import MedusaDrafter, shipped_heads_for
    except ImportError:
        return PromptLookupDrafter()
    if heads not in (None, "default") or shipped_heads_for(llm.model_name) is not None:
        return MedusaDrafter.for_model(llm, heads)
    return PromptLookupDrafter()


__all__ = ["DRAFTERS", "PromptLookupDrafter", "default_drafter", "make_drafter"]
