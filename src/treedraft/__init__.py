"""treedraft: tree-based speculative decoding with Medusa-style draft heads."""

from .api import LLM, load
from .engine import Engine, GenerationConfig, GenerationStats
from .interfaces import DraftContext, Drafter, GenerationError, TargetModel
from .sampling import SamplingParams
from .text import Chunk, GenerationResult, TextGenerator
from .tree import TokenTree

__all__ = [
    "LLM",
    "Chunk",
    "DraftContext",
    "Drafter",
    "Engine",
    "GenerationConfig",
    "GenerationError",
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "TargetModel",
    "TextGenerator",
    "TokenTree",
    "load",
]
__version__ = "0.1.0"
