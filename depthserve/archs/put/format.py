"""PUT's checkpoint section and tensors, knob, cache plan and FLOP counting (docs/depth-semantics.md
section 4).

config.json `depth.put`: `n_prefix` plain layers, a core of `n_core` layers run up to `T` times,
`n_suffix` plain layers, and the conv kernel size `conv_kernel` (k, default 2). Every layer has
the Llama tensor names under its own prefix (`model.prefix_layers.i.`, `model.core_layers.j.`,
`model.suffix_layers.i.`); a core layer adds its step embeddings P(1..T) and its conv taps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from depthserve.archs.llama.format import LlamaConfig, attention_flops, layer_weight_flops, plain_flops
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthCounter, DepthParams, DepthPlan, DepthRange, DepthReport, KnobInfo, KnobSpec
from depthserve.loading.checkpoint import FORMAT_VERSION, CheckpointFormatError


@dataclass(frozen=True)
class PUTSpec:
    n_prefix: int
    n_core: int
    n_suffix: int
    steps: int  # T: trained core passes (P(t) exists for t = 1..T)
    conv_kernel: int = 2  # k
    architecture: str = "put"

    @property
    def num_layers(self) -> int:
        return self.n_prefix + self.n_core + self.n_suffix


def read_spec(section: dict[str, Any] | None, hf_config: dict[str, Any]) -> PUTSpec:
    body = (section or {}).get("put")
    if not isinstance(body, dict):
        raise CheckpointFormatError("depth.architecture is 'put' but depth.put is missing")

    def integer(name: str, minimum: int, default: int | None = None) -> int:
        value = body.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise CheckpointFormatError(f"depth.put.{name} must be an integer >= {minimum}, got {value!r}")
        return value

    spec = PUTSpec(integer("n_prefix", 0), integer("n_core", 1), integer("n_suffix", 0), integer("T", 1),
                   integer("conv_kernel", 1, 2))
    layers = hf_config.get("num_hidden_layers")
    if layers != spec.num_layers:
        raise CheckpointFormatError(
            f"depth.put: n_prefix + n_core + n_suffix = {spec.num_layers} must equal num_hidden_layers ({layers})")
    if hf_config.get("attention_bias"):
        raise CheckpointFormatError("depth.put: PUT checkpoints have no attention bias (attention_bias must be false)")
    return spec


def to_section(spec: PUTSpec) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "architecture": "put",
        "put": {"n_prefix": spec.n_prefix, "n_core": spec.n_core, "n_suffix": spec.n_suffix, "T": spec.steps,
                "conv_kernel": spec.conv_kernel},
    }


# ---- tensor names (docs/checkpoint-format.md, "PUT") ------------------------------------------------
def prefix_layer(i: int) -> str:
    return f"model.prefix_layers.{i}."


def core_layer(j: int) -> str:
    return f"model.core_layers.{j}."


def suffix_layer(i: int) -> str:
    return f"model.suffix_layers.{i}."


def step_embedding(j: int) -> str:
    return core_layer(j) + "mlp.step_embedding"  # [T, d_ff]: P(1)..P(T)


def conv_weight(j: int) -> str:
    return core_layer(j) + "mlp.conv.weight"  # [k, d_ff]: row i multiplies Z_{n-i} (row 0: the token itself)


def layer_prefixes(spec: PUTSpec) -> list[str]:
    """Every layer's name prefix, in forward order of one pass (prefix, core, suffix)."""
    return ([prefix_layer(i) for i in range(spec.n_prefix)] + [core_layer(j) for j in range(spec.n_core)]
            + [suffix_layer(i) for i in range(spec.n_suffix)])


# ---- the knob and the plan ------------------------------------------------------------------------
KNOBS = (KnobInfo("loops", "passes of the shared core", elastic=True),)


def knobs(spec: PUTSpec) -> dict[str, KnobSpec]:
    T = spec.steps
    return {"loops": KnobSpec("loops", f"passes of the shared core; P(t) is trained for t = 1..{T}", 1, T, T,
                              elastic=True)}


def prefix_slot_name(i: int) -> str:
    return f"prefix{i}"


def core_slot_name(j: int, t: int) -> str:
    return f"core{j}.step{t}"


def suffix_slot_name(i: int) -> str:
    return f"suffix{i}"


def base_slots(cfg: LlamaConfig, spec: PUTSpec) -> tuple[SlotSpec, ...]:
    """The slots every request has (prefix layers, the core's step 1, suffix layers): they come
    first in every layout, so they sit at the same columns of every request's page table."""
    names = ([prefix_slot_name(i) for i in range(spec.n_prefix)] + [core_slot_name(j, 1) for j in range(spec.n_core)]
             + [suffix_slot_name(i) for i in range(spec.n_suffix)])
    return tuple(SlotSpec(name, SlotKind.DENSE, cfg.num_kv_heads) for name in names)


def base_columns(cfg: LlamaConfig, spec: PUTSpec) -> dict[str, slice]:
    """Name -> columns of the base slots, alike in every request's page table."""
    return dict(CacheLayout(base_slots(cfg, spec)).slot_columns())


def state_bytes(cfg: LlamaConfig, spec: PUTSpec, loops: int, itemsize: int) -> int:
    """The conv state of one sequence: (k-1) rows of Z per (step, core layer), `itemsize` bytes a value."""
    return loops * spec.n_core * (spec.conv_kernel - 1) * cfg.intermediate_size * itemsize


@dataclass(frozen=True, kw_only=True)
class PUTPlan(DepthPlan):
    loops: int  # core passes (a range: its maximum)
    columns: dict[str, slice]  # slot name -> columns of the request's page table (token-covering slots)

    @property
    def min_loops(self) -> int:
        """Passes every token runs: their slots are dense, the later ones routed (section 6)."""
        return self.loops if self.elastic is None else self.elastic.minimum


def level_work(spec: PUTSpec) -> tuple[float, ...]:
    """One token's cost at loops = 0..T in layer applications (n_prefix + n_suffix + loops x
    n_core; index 0, never run, at the level-1 value), for the slo depth policy's cost model."""
    work = [float(spec.n_prefix + spec.n_suffix + loops * spec.n_core) for loops in range(spec.steps + 1)]
    work[0] = work[1]
    return tuple(work)


def plan(cfg: LlamaConfig, spec: PUTSpec, depth: DepthParams, itemsize: int) -> PUTPlan:
    """`itemsize`: bytes of one value in the model's dtype (the conv state is kept in it).

    With a range of loops (section 6) the plan is priced at its maximum: the core passes up to the
    range's minimum, which every token runs, have dense slots; the later passes' slots are routed
    (each holds only the tokens that ran that pass, grown with them). The conv state holds every
    pass up to the maximum (a pass's state is that of the tokens that ran it)."""
    value = depth.get("loops", spec.steps)
    elastic = value if isinstance(value, DepthRange) and value.minimum < value.maximum else None
    loops = value.maximum if isinstance(value, DepthRange) else int(value)
    lowest = loops if elastic is None else elastic.minimum
    base = base_slots(cfg, spec)
    steps = tuple(SlotSpec(core_slot_name(j, t), SlotKind.DENSE, cfg.num_kv_heads)
                  for t in range(2, lowest + 1) for j in range(spec.n_core))
    routed = tuple(SlotSpec(core_slot_name(j, t), SlotKind.ROUTED, cfg.num_kv_heads)
                   for t in range(max(2, lowest + 1), loops + 1) for j in range(spec.n_core))
    layout = CacheLayout(base + steps, routed, base_slots=len(base),
                         state_bytes=state_bytes(cfg, spec, loops, itemsize))
    plain = cfg.num_layers * layer_weight_flops(cfg)
    return PUTPlan(depth=depth, layout=layout, flops_per_token=plain + extra_weight_flops(cfg, spec, loops),
                   plain_flops_per_token=plain + extra_weight_flops(cfg, spec, spec.steps), loops=loops, columns=dict(layout.slot_columns()), elastic=elastic,
                   level=loops, level_work=level_work(spec))


# ---- FLOP counting and the report ------------------------------------------------------------------
def conv_flops(cfg: LlamaConfig, spec: PUTSpec) -> float:
    """The depthwise convolution of one core layer for one token (k multiply-adds per feature)."""
    return 2 * spec.conv_kernel * cfg.intermediate_size


def extra_weight_flops(cfg: LlamaConfig, spec: PUTSpec, loops: int) -> float:
    """Per token, beyond the plain model's weight matmuls: the core's passes after the first, and
    the conv of every pass."""
    return spec.n_core * ((loops - 1) * layer_weight_flops(cfg) + loops * conv_flops(cfg, spec))


def schedule_flops(cfg: LlamaConfig, spec: PUTSpec, loops: np.ndarray, logit_rows: int) -> float:
    """FLOPs of positions 0..n-1 each at its own loops (section 6: at pass t a token attends to the
    earlier tokens that ran pass t and itself), plus the LM head rows: the plain model (every layer
    once, the core's first pass included), the core's later passes over the tokens that ran them,
    and the conv of every pass run."""
    loops = np.asarray(loops, dtype=np.int64)
    tokens = len(loops)
    flops = plain_flops(cfg, tokens, logit_rows)
    for t in range(2, int(loops.max(initial=0)) + 1):
        ran = int(np.count_nonzero(loops >= t))
        flops += spec.n_core * (ran * layer_weight_flops(cfg) + attention_flops(cfg.num_heads, cfg.head_dim,
                                                                                 ran * (ran + 1) / 2))
    return flops + spec.n_core * float(loops.sum()) * conv_flops(cfg, spec)


class PUTRecord:
    """The readouts the confidence exit took at each position of one sequence (the LM head over a
    pass's output, beside the final one): PUT's only recorded decision."""

    def __init__(self):
        self.readouts = np.zeros(64, dtype=np.int32)

    def write(self, start: int, readouts: np.ndarray) -> None:
        end = start + len(readouts)
        if end > len(self.readouts):
            self.readouts = np.concatenate([self.readouts, np.zeros(max(end, 2 * len(self.readouts)) - len(self.readouts),
                                                                    np.int32)])
        self.readouts[start:end] = readouts


def report(cfg: LlamaConfig, spec: PUTSpec, plan: PUTPlan, tokens: int, generated: int,
           levels: list[int] | None = None, record: PUTRecord | None = None) -> DepthReport:
    """`levels`: with a range of loops, the loops each computed position ran (Sequence.levels);
    `record`: the confidence exit's readouts."""
    per_token = np.full(tokens, plan.loops, dtype=np.int64)
    settings: dict[str, Any] = {"loops": plan.loops, "trained_loops": spec.steps,
                                "state_bytes": plan.layout.state_bytes}
    ranged = plan.elastic is not None and levels is not None
    if ranged:
        per_token = np.asarray(levels[:tokens], dtype=np.int64)
        settings["loops"] = plan.elastic.as_json()
        settings["mean_depth"] = round(float(per_token.mean()), 4) if tokens else 0.0
    passes = int(per_token.sum()) * spec.n_core  # (token, step, core layer) computed
    counters = {"core_layer_passes": passes}
    readouts = 0 if record is None else int(record.readouts[:tokens].sum())
    if readouts:
        counters["exit_readouts"] = readouts  # LM head reads beside the final one (confidence exit)
    return DepthReport(
        architecture="put",
        tokens=tokens,
        flops=schedule_flops(cfg, spec, per_token, generated + readouts),  # this request's FLOPs
        # the same tokens at the default, T passes
        plain_flops=schedule_flops(cfg, spec, np.full(tokens, spec.steps, dtype=np.int64), generated),
        settings=settings,
        counters=counters,
        counter_samples=tuple(DepthCounter(name, count) for name, count in counters.items()),
        per_token=per_token.tolist() if ranged else None,  # with a range knob: the loops each position ran
    )
