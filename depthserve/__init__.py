"""depthserve: an inference serving engine for adaptive-depth transformers."""

from depthserve.depth import DepthParams
from depthserve.outputs import CompletionOutput, Logprob, RequestOutput
from depthserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "DepthParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    # Import the engine (and torch) lazily, so torch-free modules stay importable without it.
    if name == "LLM":
        from depthserve.api import LLM

        return LLM
    raise AttributeError(name)
