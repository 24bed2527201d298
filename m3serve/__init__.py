"""m3serve: a PyTorch + Triton inference engine for MiniMax-M3 on Hopper GPUs."""

from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.structured_params import StructuredOutputsParams
from m3serve.llm import LLM, embedded_drafter

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "embedded_drafter"]
__version__ = "0.1.0"
