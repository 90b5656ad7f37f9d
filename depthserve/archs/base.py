"""The seam where an architecture plugs into the engine: the `DepthModel` protocol the engine calls
(the `Architecture` record that registers one, and the one registry: registry.py).

An architecture's serving code lives in its own folder (`depthserve/archs/<name>/`): `format.py`
(its config section, weight names, knobs, plan and FLOP accounting) and `model.py` (the engine's
model: only the modules and their forward, read like the paper). Its plain full-sequence oracle,
which the tests compare against, is `depthserve/oracles/<name>.py`; its random-weight test
checkpoints and offline tools (a demo recipe, checkpoint converters) are in `depthserve/lab/`. It
registers itself with one `register(Architecture(...))` call in its `__init__.py`, naming those by
dotted path; nothing else in the engine names it.

The engine never probes a model with hasattr: every optional hook has its default here, and a
model class states what it is by subclassing `DepthModel` next to `nn.Module`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from depthserve.cache import CacheLayout, SlotKind
from depthserve.depth import DepthParams, DepthPlan, DepthReport, KnobSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class BuildOptions:
    """What the engine decides about a model at load time (everything else is the checkpoint's)."""

    max_len: int  # positions the rotary tables cover (the engine's max_model_len)
    max_loops: int | None = None  # ceiling of a loop-count knob; None: the checkpoint's own


class DepthModel(Protocol):
    """What the engine asks of a model. Subclass it beside `torch.nn.Module`; the methods with a
    body are defaults an architecture overrides only when it has the feature."""

    # True when the forward needs `meta.batch` (per-sequence rows, plans, page tables, row settings).
    uses_step_batch: ClassVar[bool] = False
    # True when every depth level's state can be read out by the LM head (compute_logits), so a
    # token may stop at any level of its range (the confidence exit, BatchItem.exit_threshold). A
    # class or, where it depends on the checkpoint's layout (PUT), an instance attribute.
    readout_every_level: bool = False

    @property
    def head_dim(self) -> int: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: Any, meta: Any) -> torch.Tensor:
        """Hidden states [tokens, hidden] of a packed step (AttentionMetadata `meta`, pages `pool`)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def plan(self, depth: DepthParams) -> DepthPlan:
        """A request's normalized knobs as this model runs them (called once per request)."""
        ...

    def depth_knobs(self) -> dict[str, KnobSpec]:
        return {}

    def static_decode_spec(self) -> StaticDecodeSpec | None:
        """How a decode-only step runs at static shapes (depthserve/engine/static_decode.py): the
        forward then reads only the metadata's tensors, `meta.static` instead of `meta.batch` (its
        loops through layers/rows.py's masked rows), with no host synchronisation and no
        data-dependent shape, so the engine may pad the step to a bucket and run it compiled. None:
        this model's decode steps run eagerly."""
        return None

    def row_settings(self, plan: DepthPlan, level: int | None) -> np.ndarray:
        """A request's per-row values for a step whose tokens run at `level` (a range knob's; None:
        the fixed setting), float32, StaticDecodeSpec.settings long: what the forward's loops read
        per row (layers/rows.py, StepRows.setting), in eager and static steps alike."""
        return np.zeros(0, np.float32)

    def static_level(self, plan: DepthPlan) -> int:
        """The level (one of StaticDecodeSpec.levels) a request's static decode step needs: the
        forward, capped at the batch's deepest level (`meta.static.level_cap`), must give its rows
        the same results as uncapped."""
        return plan.level

    def record_decisions(self, record: Any, start: int, decisions: np.ndarray) -> dict[str, int]:
        """After a step: the decisions its forward emitted (StepRows.emit) for one sequence's tokens
        at positions start.. ([tokens, StaticDecodeSpec.decisions] int32) into its record
        (new_record); returns the tokens each routed slot stored (a static decode step gives the
        rest of its reservation back)."""
        return {}

    def new_record(self, plan: DepthPlan) -> Any:
        """An empty per-sequence record of the decisions the forward takes (routing, experts),
        filled after each step by record_decisions; None when there is nothing to record."""
        return None

    def report(self, request: RequestState) -> DepthReport | None:
        """What a finished sequence spent on depth; None for a plain model."""
        return None

    def step_cache_bytes_bound(self, max_step_tokens: int) -> int:
        """The most bytes of caches that live for one step only (outside the page pool)."""
        return 0

    def step_cache_bytes(self) -> tuple[dict[SlotKind, int], dict[SlotKind, int]]:
        """Bytes of step-lived caches: held now, and the last step's peak."""
        return {}, {}

    def finish_load(self, device: torch.device) -> None:
        """After the weights are loaded and the model is cast: tensors that keep their own dtype
        (rotary tables, fp32 routers), rebuilt on `device`."""

    # ---- checkpoint names (depthserve/loading/weights.py reads these) ------------------------------
    checkpoint_prefix: ClassVar[str] = "model."
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {}

    def take_weights(self, weights: dict[str, torch.Tensor], source: str) -> set[str]:
        """Pop the checkpoint tensors this architecture places itself; return the parameters filled."""
        return set()

    def after_load(self, loaded: set[str]) -> set[str]:
        """Fill parameters derived from loaded ones (tied heads, copies); return their names."""
        return set()

    def after_quantization(self) -> None:
        """Refill the copies `after_load` made (other than tied heads) from the weights as served
        once the linear layers are quantized, so that a copy equals its source's served weight
        (loading/quantization.py leaves the copies' layers dense)."""


@dataclass(frozen=True)
class RequestState:
    """What a model sees of one sequence after it ran (made by the engine, never its Sequence)."""

    plan: DepthPlan
    record: Any  # the decisions its steps recorded (DepthModel.new_record), or None
    num_computed_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    levels: tuple[int, ...] = ()  # a range knob: the level each computed position ran at


@dataclass(frozen=True)
class StaticDecodeSpec:
    """The inputs of a model's decode step at static shapes, beyond token ids and positions."""

    # A decode row's page-table columns: every slot the deepest request can hold, by name, the
    # routed slots' pages after the token-covering ones (`columns`). A row's slots land at these
    # columns; the slots it lacks read the scratch page and store nothing.
    layout: CacheLayout
    settings: int = 0  # float32 values per row (DepthModel.row_settings: loop counts, depths)
    state_bytes: int = 0  # per-sequence state (SlotKind.SEQ_STATE) of a row, at most
    decisions: int = 0  # int32 values per row the forward emits (StepRows.emit: routing, experts, readouts)
    # The depth levels a step may be capped at (DepthModel.static_level): the engine compiles (and on
    # CUDA captures) the step once per level, and runs a batch at its deepest row's level, so a
    # batch of shallow requests does not pay for the model's deepest setting. Empty: no levels.
    levels: tuple[int, ...] = ()
    # Regional compilation: module classes whose forward is compiled on its own, once for all their
    # instances, while the rest of the step runs eagerly around them (layers/attention.call_region),
    # instead of the whole forward as one graph. For a looped model, whose step unrolls the same
    # layers once per pass and per level cap: the graphs to compile stop growing with the loops.
    compiled_regions: tuple[type, ...] = ()

    @property
    def width(self) -> int:
        return self.layout.row_width + self.layout.routed_width

    def columns(self) -> dict[str, slice]:
        """Name -> columns of a static decode row's page table (token-covering slots, then routed)."""
        columns = dict(self.layout.slot_columns())
        start = self.layout.row_width
        for slot in self.layout.routed_slots:
            columns[slot.name] = slice(start, start + slot.num_heads)
            start += slot.num_heads
        return columns
