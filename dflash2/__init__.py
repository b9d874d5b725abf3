"""dflash2: an LLM inference serving engine."""
from __future__ import annotations

from dflash2.engine.served_model import ModelSpec
from dflash2.entrypoints.llm import LLM
from dflash2.request import CompletionOutput, RequestOutput
from dflash2.sampling_params import SamplingParams
from dflash2.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "ModelSpec", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
