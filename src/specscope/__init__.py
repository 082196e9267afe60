"""specscope: a PyTorch-native EAGLE-3 speculative-decoding engine in which every cycle is measured.

Public API: `LLM`, `SamplingParams`, `SpecConfig`, `SpecPolicy`, `StructuredOutputs`.
"""

from specscope.config import SamplingParams, SpecConfig, SpecPolicy, StructuredOutputs
from specscope.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "SpecConfig", "SpecPolicy", "StructuredOutputs"]
__version__ = "0.1.0"
