"""Per-request depth: the knobs a request sets, the plan a model makes of them, the report of
what the request spent (docs/depth-semantics.md; no torch, so the scheduler can carry plans).

An architecture declares its knobs to the registry as `KnobInfo`s (name, meaning, value shape); a
model declares the knobs it accepts, with the checkpoint's ranges, as `KnobSpec`s.
`DepthParams` is a mapping knob name -> value that names no knob itself; `DepthParams.normalized`
checks a request against the model's KnobSpecs (a knob sent to a model that lacks it is an error,
never ignored). The model turns the normalized knobs into a `DepthPlan` once per request; the
engine carries it on the sequence. When the request finishes, the model reports a `DepthReport`: typed fields that
metrics, `usage.depth` and multi-prompt combining read without knowing the architecture.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from depthserve.cache import CacheLayout
from depthserve.errors import InvalidDepthError

AUTO = "auto"  # a range knob written as its whole range


@dataclass(frozen=True)
class DepthRange:
    """A knob value the server chooses within, token by token (docs/depth-semantics.md section 6): the
    request's inclusive range. Written `{"min": a, "max": b}`, or "auto" for the knob's whole range.
    The request is priced at its maximum; the depth policy picks each token's value."""

    minimum: int
    maximum: int

    def as_json(self) -> dict[str, int]:
        return {"min": self.minimum, "max": self.maximum}


@dataclass(frozen=True)
class KnobInfo:
    """A knob as its architecture declares it to the registry, before any checkpoint is read: its
    name, what it sets, its value's shape (a `KnobSpec.kind`) and whether it takes a range. The
    HTTP schema of `depth` and the early check of knob names are built from these; the ranges
    are each checkpoint's own (`KnobSpec`)."""

    name: str
    description: str
    kind: str = "int"
    elastic: bool = False

    def value_schema(self) -> dict[str, Any]:
        """The JSON schema of one value of this knob."""
        integer = {"type": "integer"}
        shapes: list[dict[str, Any]] = {
            "int": [integer],
            "int_or_map": [integer, {"type": "object", "additionalProperties": integer}],  # layer -> count
            "ratio_list": [{"type": "array", "items": {"type": "number"}}],
        }[self.kind]
        if self.elastic:
            shapes += [{"type": "object", "properties": {"min": integer, "max": integer}, "required": ["min", "max"]},
                       {"const": AUTO}]
        return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}


@dataclass(frozen=True)
class KnobSpec:
    """One knob a model accepts, with its range. `kind` says the value's shape:

    - "int": an integer in [minimum, maximum];
    - "int_or_map": an integer, or a map from one of `keys` (layer indices; JSON string keys are
      accepted) to an integer, each in [minimum, maximum];
    - "ratio_list": exactly `length` numbers, each in [minimum, maximum].

    An `elastic` knob also takes a range (`DepthRange`): `{"min": a, "max": b}` or "auto".
    """

    name: str
    description: str
    minimum: float
    maximum: float
    default: Any
    kind: str = "int"
    length: int | None = None
    keys: tuple[int, ...] | None = None
    elastic: bool = False  # takes a range the server chooses each token's value within

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check(self, value: Any, model_name: str = "this model") -> Any:
        """The value in canonical form (map keys as ints, ratios as floats, a range as DepthRange),
        or InvalidDepthError."""
        where = f"depth knob '{self.name}' of {model_name}"
        if value == AUTO or (isinstance(value, dict) and set(value) & {"min", "max"}):
            return self._check_range(value, where)
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

    def _check_range(self, value: Any, where: str) -> DepthRange:
        if not self.elastic:
            raise InvalidDepthError(f"{where} takes one value: this model does not run per-token depth ranges")
        if value == AUTO:
            return DepthRange(int(self.minimum), int(self.maximum))
        if set(value) != {"min", "max"}:
            raise InvalidDepthError(f"{where}: a range is {{\"min\": a, \"max\": b}} or \"auto\", got {value!r}")
        low, high = (self._check_int(value[key], f"{where} ({key})") for key in ("min", "max"))
        if low > high:
            raise InvalidDepthError(f"{where}: the range's min ({low}) is above its max ({high})")
        return DepthRange(low, high)

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


class DepthParams(Mapping[str, Any]):
    """A request's depth knobs: knob name -> value, as sent (a knob left at None is not set).

        DepthParams(passes=2) == DepthParams({"passes": 2})  # "passes": a knob of some model

    The names and values are the model's to check (`normalized`, against its KnobSpecs)."""

    __slots__ = ("_knobs",)

    def __init__(self, knobs: Mapping[str, Any] | None = None, /, **named: Any):
        given = {**(knobs or {}), **named}
        self._knobs: dict[str, Any] = {name: value for name, value in given.items() if value is not None}

    def __getitem__(self, name: str) -> Any:
        return self._knobs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._knobs)

    def __len__(self) -> int:
        return len(self._knobs)

    def __repr__(self) -> str:
        return f"DepthParams({self._knobs!r})"

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, known: Collection[str] | None = None) -> "DepthParams":
        """The knobs of a JSON object; with `known` (every registered architecture's knob names,
        `depthserve.archs.knob_names`), a name outside it is refused before any model is at hand."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise InvalidDepthError(f"depth must be an object, got {type(data).__name__}")
        if known is not None:
            unknown = sorted(set(data) - set(known))
            if unknown:
                raise InvalidDepthError(f"unknown depth knob(s) {unknown}; known knobs are {sorted(known)}")
        return cls(data)

    def set_knobs(self) -> dict[str, Any]:
        """The knobs this request sets explicitly."""
        return dict(self._knobs)

    def is_default(self) -> bool:
        return not self._knobs

    def cache_key(self) -> tuple:
        """Hashable identity of the settings (part of the prefix-cache key)."""
        def freeze(value: Any) -> Any:
            if isinstance(value, DepthRange):
                return ("range", value.minimum, value.maximum)
            if isinstance(value, dict):
                return tuple(sorted(value.items()))
            if isinstance(value, list):
                return tuple(value)
            return value

        return tuple((name, freeze(value)) for name, value in sorted(self._knobs.items()))

    def validate(self, knobs: dict[str, KnobSpec], model_name: str = "this model") -> None:
        """Reject knobs the model does not have and values outside each knob's range."""
        self.normalized(knobs, model_name)

    def normalized(self, knobs: dict[str, KnobSpec], model_name: str = "this model") -> "DepthParams":
        """A copy with every set knob checked against its KnobSpec and in canonical form."""
        values = {}
        for name, value in self._knobs.items():
            if name not in knobs:
                accepted = sorted(knobs) or "none"
                raise InvalidDepthError(
                    f"depth knob '{name}' is not supported by {model_name} (accepted knobs: {accepted})"
                )
            values[name] = knobs[name].check(value, model_name)
        return DepthParams(values)


@dataclass(frozen=True, kw_only=True)
class DepthPlan:
    """One request's depth settings as its model runs them, made once per request
    (`DepthModel.plan`) and fixed for the request's lifetime. Architectures subclass it with
    what their forward needs (loop counts, thresholds, slot columns)."""

    depth: DepthParams  # the normalized knobs
    layout: CacheLayout  # the cache slots the request needs (a range: at its maximum)
    # A range knob (section 6): the levels the depth policy may run each token at, inclusive, in the
    # architecture's unit (Dreamer: recurrences). None: every token runs the fixed setting, `level`.
    elastic: DepthRange | None = None
    level: int = 1
    # A range knob: the cost of one token at each level (index = level), in any unit proportional
    # to its time (the slo policy fits step times to it); empty: the level itself (cost grows
    # with the level from zero, as Dreamer's recurrences do).
    level_work: tuple[float, ...] = ()
    flops_per_token: float = 0.0  # weight-matrix FLOPs of one token at these settings (estimate)
    # The same at the model's default depth settings (the knobs' defaults GET /v1/models lists): the
    # reference of relative_compute for every architecture (docs/server.md, "Depth").
    plain_flops_per_token: float = 0.0
    # A model whose results depend on how a sequence's tokens are split into forwards (Dory's
    # last_loop cache): its prompt runs in chunks of this many tokens counted from its first token
    # (in one forward where the engine does not chunk prompts), every later token in a forward of
    # its own (`forward_tokens`). None: any split gives the same.
    prefill_chunk: int | None = None

    def forward_tokens(self, computed: int, prompt_len: int, chunked: bool = True) -> int | None:
        """With `prefill_chunk`: the tokens the next forward of a sequence with `computed` tokens
        computed must take (the rest of the prompt chunk, or of the prompt when not `chunked`; after
        the prompt, one); None: any number."""
        if self.prefill_chunk is None:
            return None
        if computed >= prompt_len:
            return 1
        if not chunked:
            return prompt_len - computed
        return min(prompt_len, (computed // self.prefill_chunk + 1) * self.prefill_chunk) - computed

    def step_level(self, level: int | None) -> int:
        """The level a step's tokens of this request run at: the depth policy's `level` (within
        the range) for a range knob, else the fixed setting."""
        if self.elastic is None:
            return self.level
        if level is None or not self.elastic.minimum <= level <= self.elastic.maximum:
            raise ValueError(f"a depth range {self.elastic.as_json()} needs a level within it, got {level}")
        return level

    def work_at(self, level: int) -> float:
        """One token's cost at `level` (level_work)."""
        return self.level_work[level] if self.level_work else float(level)

    @property
    def cache_key(self) -> tuple:
        """Part of the prefix-cache key: blocks are shared only between equal settings."""
        return self.depth.cache_key()

    @property
    def relative_compute_estimate(self) -> float:
        return self.flops_per_token / self.plain_flops_per_token if self.plain_flops_per_token else 1.0


@dataclass(frozen=True)
class DepthCounter:
    """One count a finished request adds to a counter, typed for metrics
    (`depthserve_depth_counter{model,name,...labels}`): the counter's name (its key in
    DepthReport.counters), the labels of this count (such as a layer and a step) and the count."""

    name: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class DepthReport:
    """What one finished request spent on depth (one sequence: the first of the request).

    `settings` are the knobs as run and the checkpoint's trained values (equal across the prompts
    of a request or dropped when combined); `counters` add up across prompts (an int, or a map
    name -> int such as loop iterations per layer); `fractions` are per-prompt shares. `decisions`
    holds per-position routing choices for inspection; like `per_token`, the room left for the
    depth each token ran, it never goes into `usage.depth`. `counter_samples` are the counters
    again as typed counts with labels, for metrics (so no reader parses a counter's keys)."""

    architecture: str
    tokens: int
    flops: float
    plain_flops: float  # the same tokens at the model's default depth settings (relative_compute's reference)
    settings: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)
    fractions: dict[str, Any] = field(default_factory=dict)
    extrapolated: tuple[int, ...] | None = None
    decisions: Any = None
    per_token: Any = None
    counter_samples: tuple[DepthCounter, ...] = ()

    @property
    def relative_compute(self) -> float:
        return self.flops / self.plain_flops if self.plain_flops else 1.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON of `usage.depth`."""
        out: dict[str, Any] = {"architecture": self.architecture, **self.settings, "tokens": self.tokens,
                               **self.counters, **self.fractions}
        if self.extrapolated is not None:
            out["extrapolated"] = list(self.extrapolated)
        out.update(flops=self.flops, plain_flops=self.plain_flops, relative_compute=self.relative_compute)
        return out


def combine_reports(reports: list[DepthReport]) -> dict[str, Any]:
    """`usage.depth` for a request of several prompts: tokens, FLOPs and counters summed,
    `relative_compute` as total FLOPs over total plain FLOPs, settings and fractions kept where
    every prompt agrees, extrapolated layers united, and each prompt's own report in `per_prompt`."""
    if len(reports) == 1:
        return reports[0].to_dict()
    first = reports[0]
    flops = sum(r.flops for r in reports)
    plain = sum(r.plain_flops for r in reports)
    counters: dict[str, Any] = {}
    for name in first.counters:
        values = [r.counters.get(name) for r in reports]
        if all(isinstance(v, dict) for v in values):
            merged: dict = {}
            for value in values:
                for key, count in value.items():
                    merged[key] = merged.get(key, 0) + count
            counters[name] = merged
        else:
            counters[name] = sum(v or 0 for v in values)
    out: dict[str, Any] = {"architecture": first.architecture}
    for part in ("settings", "fractions"):
        for name, value in getattr(first, part).items():
            if all(getattr(r, part).get(name) == value for r in reports):
                out[name] = value
    out.update(tokens=sum(r.tokens for r in reports), **counters)
    if first.extrapolated is not None:
        out["extrapolated"] = sorted({layer for r in reports for layer in r.extrapolated or ()})
    out.update(flops=flops, plain_flops=plain, relative_compute=flops / plain if plain else 1.0,
               per_prompt=[r.to_dict() for r in reports])
    return out
