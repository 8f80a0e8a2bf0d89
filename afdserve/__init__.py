"""afdserve: an inference engine for Mixture-of-Experts models with Attention-FFN Disaggregation."""

from __future__ import annotations

from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.structured import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch.distributed and the launcher; import it only when asked for.
    if name == "LLM":
        from afdserve.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from afdserve.frontend import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
