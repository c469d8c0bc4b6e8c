"""specserve engine: paged KV cache, continuous batching, exact sampling (speculation next)."""

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
