"""What the OpenAI server needs from an engine (server/app.py, server/serving_engine.py).

`AsyncLLM` is the engine in this process. `depthserve.deploy.remote_engine.RemoteEngine` is the
same interface over engine replicas on Ray Serve, so the server's routes, validation and errors
are written once for both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from depthserve.depth import DepthParams
from depthserve.engine.context_length import ContextOverflow
from depthserve.engine.llm_engine import ModelInfo
from depthserve.outputs import RequestOutput
from depthserve.sampling_params import SamplingParams


class OutputStream(Protocol):
    """One admitted prompt's cumulative outputs; closing it before the end aborts the request."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def close(self) -> None: ...


class EngineClient(Protocol):
    model_info: ModelInfo

    @property
    def model_name(self) -> str: ...

    @property
    def is_healthy(self) -> bool: ...

    def health_message(self) -> str: ...

    def stats(self) -> dict: ...

    async def add_requests(self, prompts: list[str | list[int]], sampling_params: SamplingParams,
                           depth: DepthParams | None, request_ids: list[str],
                           overflow: ContextOverflow = ContextOverflow.CLAMP) -> Sequence[OutputStream]:
        """Admit the prompts of one HTTP request, all or none; raises the request's typed error."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def shutdown(self) -> None: ...
