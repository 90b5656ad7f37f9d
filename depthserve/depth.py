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
    """One knob a model accepts, with its range. `kind` says the value's shape:

    - "int": an integer in [minimum, maximum];
    - "int_or_map": an integer, or a map from one of `keys` (layer indices; JSON string keys are
      accepted) to an integer, each in [minimum, maximum];
    - "ratio_list": exactly `length` numbers, each in [minimum, maximum].
    """

    name: str
    description: str
    minimum: float
    maximum: float
    default: Any
    kind: str = "int"
    length: int | None = None
    keys: tuple[int, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check(self, value: Any, model_name: str = "this model") -> Any:
        """The value in canonical form (map keys as ints, ratios as floats), or InvalidDepthError."""
        where = f"depth knob '{self.name}' of {model_name}"
        if self.kind == "ratio_list":
            if not isinstance(value, (list, tuple)) or not all(_is_number(v) for v in value):
                raise InvalidDepthError(f"{where} must be a list of numbers, got {value!r}")
            if self.length is not None and len(value) != self.length:
                raise InvalidDepthError(
                    f"{where} needs exactly {self.length} values (one per step), got {len(value)}")
            for v in value:
                if not self.minimum <= v <= self.maximum:
                    raise InvalidDepthError(
                        f"{where}: every value must lie in [{self.minimum:g}, {self.maximum:g}], got {v!r}")
            return [float(v) for v in value]
        if self.kind == "int_or_map" and isinstance(value, dict):
            out = {}
            for key, count in value.items():
                try:
                    layer = int(key) if isinstance(key, str) else key
                except ValueError:
                    layer = key
                if not _is_int(layer) or (self.keys is not None and layer not in self.keys):
                    raise InvalidDepthError(f"{where}: {key!r} is not one of its layers {list(self.keys or ())}")
                out[layer] = self._check_int(count, f"{where} (layer {layer})")
            return out
        return self._check_int(value, where)

    def _check_int(self, value: Any, where: str) -> int:
        if not _is_int(value):
            shape = "an integer or a map from layer to integer" if self.kind == "int_or_map" else "an integer"
            raise InvalidDepthError(f"{where} must be {shape}, got {value!r}")
        if not self.minimum <= value <= self.maximum:
            raise InvalidDepthError(
                f"{where} must lie in {int(self.minimum)}..{int(self.maximum)}, got {value} ({self.description})")
        return int(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


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
        """Reject knobs the model does not have and values outside each knob's range."""
        self.normalized(knobs, model_name)

    def normalized(self, knobs: dict[str, KnobSpec], model_name: str = "this model") -> "DepthParams":
        """A copy with every set knob checked against its KnobSpec and in canonical form."""
        values = {}
        for name, value in self.set_knobs().items():
            if name not in knobs:
                accepted = sorted(knobs) or "none"
                raise InvalidDepthError(
                    f"depth knob '{name}' is not supported by {model_name} (accepted knobs: {accepted})"
                )
            values[name] = knobs[name].check(value, model_name)
        return DepthParams(**values)
