"""specscope: a PyTorch-native EAGLE-3 speculative-decoding engine in which every cycle is measured.

Public API: `LLM` and `SamplingParams`.
"""

from specscope.config import SamplingParams
from specscope.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
