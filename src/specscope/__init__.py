"""specscope: a PyTorch-native EAGLE-3 speculative-decoding engine in which every cycle is measured.

Public API: `LLM`, `SamplingParams`, `SpecConfig`.
"""

from specscope.config import SamplingParams, SpecConfig
from specscope.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "SpecConfig"]
__version__ = "0.1.0"
