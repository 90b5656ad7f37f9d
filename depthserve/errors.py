"""Typed errors raised by the public API, in one place. Every one names what was wrong.

Each class carries the HTTP status and OpenAI error `type` the server answers it with, so the
server maps any `DepthServeError` to a response without knowing the class
(`server/app.py`), and a `retry_after` (seconds) where waiting helps.
"""

from __future__ import annotations


class DepthServeError(Exception):
    """Base class of every error this package raises on purpose."""

    status: int = 500
    error_type: str = "internal_error"
    retry_after: int | None = None


class InvalidRequestError(DepthServeError, ValueError):
    """The request itself is wrong (HTTP 400)."""

    status = 400
    error_type = "invalid_request_error"


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range or of the wrong type."""


class InvalidDepthError(InvalidRequestError):
    """A depth setting is out of range or names a knob the model lacks."""


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the model's context."""


class UnadmittableRequestError(InvalidRequestError):
    """The request can never be admitted, however long one waits: more prompts than the server's
    queue holds, or more tokens than its KV cache holds (HTTP 400, not 503: retrying cannot help)."""


class ModelNotFoundError(DepthServeError, LookupError):
    """The request names a model id this server does not serve (HTTP 404)."""

    status = 404
    error_type = "not_found_error"


class UnknownModelError(DepthServeError, LookupError):
    """The model name is neither a built-in name nor a readable checkpoint path."""

    status = 404
    error_type = "not_found_error"


class HubModelError(UnknownModelError):
    """A Hugging Face Hub id that resolves to no servable checkpoint: no such repository or revision,
    access refused (a gated or private model: HF_TOKEN), not cached while the Hub cannot be reached,
    or no config.json and safetensors weights in it. The message says which, and what to do."""


class CheckpointFormatError(DepthServeError, ValueError):
    """A checkpoint's `depth` section or its weights are malformed or incomplete."""


class MissingCalibrationError(CheckpointFormatError):
    """An ITT checkpoint has no router-score calibration table."""


class UnknownArchitectureError(CheckpointFormatError, LookupError):
    """A checkpoint names an architecture that no `depthserve.archs.register` call made known."""


class ConfigurationError(DepthServeError, ValueError):
    """An engine setting is invalid (EngineArgs, a command-line option)."""


class CacheCapacityError(ConfigurationError):
    """The engine's settings leave no room: the KV cache cannot hold one full-length sequence."""


class QueueFullError(DepthServeError):
    """Too many requests are waiting; retry later (HTTP 503 with Retry-After)."""

    status = 503
    error_type = "server_overloaded"
    retry_after = 1


class ConstraintViolationError(DepthServeError):
    """A sampled token the request's structured-output constraint does not allow (never expected:
    the mask forbids it), or a per-step bound of the grammar engine exceeded, found after the
    request was admitted: a fault of its generation, not of what it asked (HTTP 500), which fails
    that request alone."""

    status = 500
    error_type = "internal_error"


class EngineDeadError(DepthServeError):
    """The engine loop failed (a fault no request could be blamed for) or is shutting down;
    no further requests can be served (HTTP 503)."""

    status = 503
    error_type = "service_unavailable"


class RequestFailedError(DepthServeError):
    """Running this request raised an error that was traced to it alone (the step it was in was
    re-run without it, or it failed alone); the engine goes on serving every other request."""

    status = 500
    error_type = "internal_error"
