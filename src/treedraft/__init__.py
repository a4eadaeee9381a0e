"""treedraft: tree-based speculative decoding with Medusa-style draft heads."""

from .api import LLM, load
from .engine import Engine, GenerationConfig, GenerationError, GenerationResult
from .sampling import SamplingParams
from .tree import TokenTree

__all__ = ["LLM", "Engine", "GenerationConfig", "GenerationError", "GenerationResult", "SamplingParams",
           "TokenTree", "load"]
__version__ = "0.1.0"
