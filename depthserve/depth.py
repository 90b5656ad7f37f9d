"""Per-request depth settings (the knobs of depth-semantics.md, one meaning each).

A model declares the knobs it accepts as `KnobSpec`s; `DepthParams.validate` checks a
request against them. A knob sent to a model that lacks it is an error, never ignored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from depthserve.errors import InvalidDepthError

KNOB_NAMES = ("loops", "selection_ratios", "thinking_steps", "depth")


@dataclass(frozen=True)
class KnobSpec:
    name: str
    description: str
    minimum: float
    maximum: float
    default: Any

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DepthParams:
    loops: int | dict[int, int] | None = None
    selection_ratios: list[float] | None = None
    thinking_steps: int | None = None
    depth: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "DepthParams":
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise InvalidDepthError(f"depth must be an object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(KNOB_NAMES))
        if unknown:
            raise InvalidDepthError(
                f"unknown depth knob(s) {unknown}; known knobs are {list(KNOB_NAMES)}"
            )
        return cls(**data)

    def set_knobs(self) -> dict[str, Any]:
        """The knobs this request sets explicitly."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def is_default(self) -> bool:
        return not self.set_knobs()

    def cache_key(self) -> tuple:
        """Hashable identity of the settings (part of the prefix-cache key)."""
        def freeze(value: Any) -> Any:
            if isinstance(value, dict):
                return tuple(sorted(value.items()))
            if isinstance(value, list):
                return tuple(value)
            return value

        return tuple((name, freeze(value)) for name, value in sorted(self.set_knobs().items()))

    def validate(self, knobs: dict[str, KnobSpec], model_name: str = "this model") -> None:
        """Reject knobs the model does not have. Range checks live with each mechanism."""
        for name in self.set_knobs():
            if name not in knobs:
                accepted = sorted(knobs) or "none"
                raise InvalidDepthError(
                    f"depth knob '{name}' is not supported by {model_name} (accepted knobs: {accepted})"
                )
