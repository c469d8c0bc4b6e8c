"""specserve engine: paged KV cache, continuous batching, exact speculative decoding."""

from engine.config import EngineConfig
from engine.errors import InvalidRequestError, StepError
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "InvalidRequestError", "LLMEngine", "RequestOutput", "SamplingParams",
           "StepError"]
