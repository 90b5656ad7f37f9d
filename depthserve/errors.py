"""Typed errors raised by the public API. Every one names what was wrong."""


class DepthServeError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidRequestError(DepthServeError, ValueError):
    """The request itself is wrong (the HTTP layer maps this to 400)."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range or of the wrong type."""


class InvalidDepthError(InvalidRequestError):
    """A depth setting is out of range or names a knob the model lacks."""


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the model's context."""


class UnknownModelError(DepthServeError, LookupError):
    """The model name is neither a built-in name nor a readable checkpoint path."""


class CacheCapacityError(DepthServeError):
    """The KV cache budget can never hold this request, even alone."""


class EngineDeadError(DepthServeError):
    """The engine loop failed; no further requests can be served."""
