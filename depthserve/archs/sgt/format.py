"""SGT's checkpoint section, knob, cache plan and FLOP counting (docs/depth-semantics.md section 1).

config.json `depth.sgt`: `looped_layers`, one ordered query-head set per looped layer
(`head_sets`), the trained `loop_counts`, optional fractional `head_scales`, and `max_loops`
(the default ceiling of the `loops` knob). No extra weights: the loops reuse the layer's own.

The `loops` knob also takes a range (`{"min": a, "max": b}` or "auto", section 6): each step's
tokens run the depth policy's level, one loop count for every looped layer. Slot (l, k) holds the
tokens with loops >= k: iterations up to the range's minimum are head-subset slots as for a fixed
knob, the deeper ones routed slots (the same KV heads) that grow only with the tokens that ran them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from depthserve.archs.llama.format import LlamaConfig, attention_flops, dense_slots, layer_weight_flops, plain_flops
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthCounter, DepthParams, DepthPlan, DepthRange, DepthReport, KnobInfo, KnobSpec
from depthserve.loading.checkpoint import FORMAT_VERSION, CheckpointFormatError, float_list, int_list


@dataclass(frozen=True)
class SGTLayer:
    layer: int
    heads: tuple[int, ...]  # ordered query-head set S_l
    loops: int  # trained loop count K_l
    head_scales: tuple[float, ...] | None = None  # per-head output scale (fractional head_decay)


@dataclass(frozen=True)
class SGTSpec:
    layers: tuple[SGTLayer, ...]
    max_loops: int  # default ceiling of the `loops` knob (the engine may override it)
    architecture: str = "sgt"

    def layer(self, index: int) -> SGTLayer:
        for spec in self.layers:
            if spec.layer == index:
                return spec
        raise KeyError(index)

    @property
    def looped_layers(self) -> tuple[int, ...]:
        return tuple(spec.layer for spec in self.layers)

    @property
    def trained_loops(self) -> dict[int, int]:
        return {s.layer: s.loops for s in self.layers}


def read_spec(section: dict[str, Any] | None, hf_config: dict[str, Any]) -> SGTSpec:
    body = (section or {}).get("sgt")
    if not isinstance(body, dict):
        raise CheckpointFormatError("depth.architecture is 'sgt' but depth.sgt is missing")
    num_layers, num_heads = hf_config["num_hidden_layers"], hf_config["num_attention_heads"]
    layers = int_list(body.get("looped_layers"), "sgt.looped_layers")
    head_sets = body.get("head_sets")
    counts = int_list(body.get("loop_counts"), "sgt.loop_counts")
    scales = body.get("head_scales")
    if not isinstance(head_sets, list) or len(head_sets) != len(layers) or len(counts) != len(layers):
        raise CheckpointFormatError("depth.sgt: looped_layers, head_sets and loop_counts must have equal lengths")
    if scales is not None and (not isinstance(scales, list) or len(scales) != len(layers)):
        raise CheckpointFormatError("depth.sgt.head_scales must be null or one list per looped layer")
    if len(set(layers)) != len(layers):
        raise CheckpointFormatError("depth.sgt.looped_layers has duplicates")
    specs = []
    for i, layer in enumerate(layers):
        if not 0 <= layer < num_layers:
            raise CheckpointFormatError(f"depth.sgt: looped layer {layer} is outside 0..{num_layers - 1}")
        heads = int_list(head_sets[i], f"sgt.head_sets[{i}]")
        if not heads or len(set(heads)) != len(heads) or not all(0 <= h < num_heads for h in heads):
            raise CheckpointFormatError(
                f"depth.sgt.head_sets[{i}] must be distinct query-head indices in 0..{num_heads - 1}")
        if counts[i] < 0:
            raise CheckpointFormatError("depth.sgt.loop_counts must be >= 0")
        head_scales = None
        if scales is not None and scales[i] is not None:
            head_scales = float_list(scales[i], f"sgt.head_scales[{i}]", len(heads))
        specs.append(SGTLayer(layer, heads, counts[i], head_scales))
    max_loops = body.get("max_loops", max([2 * c for c in counts] + [1]))
    if not isinstance(max_loops, int) or max_loops < max(counts, default=0):
        raise CheckpointFormatError("depth.sgt.max_loops must be an integer >= every trained loop count")
    return SGTSpec(tuple(sorted(specs, key=lambda s: s.layer)), max_loops)


def to_section(spec: SGTSpec) -> dict[str, Any]:
    scales = [list(s.head_scales) if s.head_scales is not None else None for s in spec.layers]
    return {
        "format_version": FORMAT_VERSION,
        "architecture": "sgt",
        "sgt": {
            "looped_layers": [s.layer for s in spec.layers],
            "head_sets": [list(s.heads) for s in spec.layers],
            "loop_counts": [s.loops for s in spec.layers],
            "head_scales": scales if any(x is not None for x in scales) else None,
            "max_loops": spec.max_loops,
        },
    }


# ---- the knob and the plan ------------------------------------------------------------------------
def loop_slot_name(layer: int, iteration: int) -> str:
    return f"layer{layer}.loop{iteration}"


def kv_heads_of(cfg: LlamaConfig, layer: SGTLayer) -> list[int]:
    """The KV heads a loop slot stores: the groups of the layer's selected query heads."""
    group = cfg.num_heads // cfg.num_kv_heads
    return sorted({h // group for h in layer.heads})


KNOBS = (KnobInfo("loops", "extra head-subset attention iterations per looped layer: an integer for all, or a map "
                          "layer -> count", kind="int_or_map", elastic=True),)


def loops_knob(spec: SGTSpec, max_loops: int) -> KnobSpec:
    trained = spec.trained_loops
    default = next(iter(trained.values())) if len(set(trained.values())) == 1 else trained
    return KnobSpec(
        "loops",
        f"extra head-subset attention iterations per looped layer {list(trained)} "
        f"(an integer for all, or a map layer -> count; trained: {trained}; "
        f"above the trained count is extrapolation, up to max_loops={max_loops}; "
        f"or a range {{\"min\": a, \"max\": b}} or \"auto\": the server picks each token's count for "
        "every looped layer within it)",
        0, max_loops, default, kind="int_or_map", keys=tuple(trained), elastic=True,
    )


@dataclass(frozen=True, kw_only=True)
class SGTPlan(DepthPlan):
    loops: dict[int, int]  # looped layer -> iterations (a range: its maximum, on every looped layer)
    columns: dict[str, slice]  # head-subset loop slot name -> columns of the request's page table

    def step_loops(self, layer: int, level: int | None) -> int:
        """Iterations of looped layer `layer` for a step's tokens of this request: the depth
        policy's level with a range knob (every looped layer alike), else the fixed count."""
        return self.loops[layer] if self.elastic is None else self.step_level(level)

    def subset_loops(self, layer: int) -> int:
        """Iterations every token runs: their slots are head-subset columns; the deeper ones (a
        range past its minimum) routed slots holding only the tokens that ran them (section 6)."""
        return self.loops[layer] if self.elastic is None else self.elastic.minimum


def plan(cfg: LlamaConfig, spec: SGTSpec, depth: DepthParams) -> SGTPlan:
    loops = spec.trained_loops
    value = depth.get("loops")
    elastic = None
    if isinstance(value, DepthRange):
        # One count for every looped layer, priced at the range's maximum.
        loops = {layer: value.maximum for layer in loops}
        elastic = value if value.minimum < value.maximum else None
    elif isinstance(value, int):
        loops = {layer: value for layer in loops}
    elif isinstance(value, dict):
        loops.update(value)  # layers not in the map keep their trained count
    slots = list(dense_slots(cfg))
    routed = []
    for s in spec.layers:
        heads = len(kv_heads_of(cfg, s))
        lowest = loops[s.layer] if elastic is None else elastic.minimum
        slots += [SlotSpec(loop_slot_name(s.layer, k), SlotKind.HEAD_SUBSET, heads) for k in range(1, lowest + 1)]
        routed += [SlotSpec(loop_slot_name(s.layer, k), SlotKind.ROUTED, heads)
                   for k in range(lowest + 1, loops[s.layer] + 1)]
    layout = CacheLayout(tuple(slots), tuple(routed))
    columns = {name: cols for name, cols in layout.slot_columns().items() if ".loop" in name}
    base = cfg.num_layers * layer_weight_flops(cfg)
    per_loop = {s.layer: loop_weight_flops(cfg, s) for s in spec.layers}
    extra = sum(loops[layer] * flops for layer, flops in per_loop.items())
    # Level i: every looped layer capped at i iterations (a range runs exactly i). For a fixed knob
    # `level` is its deepest layer's count, whose cost is the plan's own.
    level = max(loops.values(), default=0)
    work = tuple((base + sum(min(loops[layer], i) * flops for layer, flops in per_loop.items())) / base
                 for i in range(level + 1))
    default = base + sum(spec.trained_loops[layer] * flops for layer, flops in per_loop.items())
    return SGTPlan(depth=depth, layout=layout, flops_per_token=base + extra, plain_flops_per_token=default,
                   loops=loops, columns=columns, elastic=elastic, level=level, level_work=work)


# ---- FLOP counting and the report ------------------------------------------------------------------
def loop_weight_flops(cfg: LlamaConfig, layer: SGTLayer) -> float:
    """Weight matmuls of one loop iteration for one token (the subset's Q/K/V rows and O columns)."""
    q, kv, d, hd = len(layer.heads), len(kv_heads_of(cfg, layer)), cfg.hidden_size, cfg.head_dim
    return 2 * d * (q + 2 * kv) * hd + 2 * q * hd * d


def schedule_loop_flops(cfg: LlamaConfig, layer: SGTLayer, loops: np.ndarray) -> float:
    """FLOPs of one looped layer's iterations over positions 0..n-1, position p running loops[p]
    (section 6: iteration k of a token attends to the earlier tokens with loops >= k and itself)."""
    loops = np.asarray(loops, dtype=np.int64)
    flops = 0.0
    for k in range(1, int(loops.max(initial=0)) + 1):
        ran = float(np.count_nonzero(loops >= k))
        flops += ran * loop_weight_flops(cfg, layer) + attention_flops(len(layer.heads), cfg.head_dim,
                                                                       ran * (ran + 1) / 2)
    return flops


def fixed_loop_flops(cfg: LlamaConfig, spec: SGTSpec, loops: dict[int, int], tokens: int) -> float:
    """The looped layers' iterations over positions 0..tokens-1, layer l running loops[l] for every token."""
    ctx_sum = tokens * (tokens + 1) / 2
    return sum(loops[s.layer] * (tokens * loop_weight_flops(cfg, s) + attention_flops(len(s.heads), cfg.head_dim, ctx_sum))
               for s in spec.layers)


def report(cfg: LlamaConfig, spec: SGTSpec, plan: SGTPlan, tokens: int, generated: int,
           levels: list[int] | None = None) -> DepthReport:
    """`levels`: with a range knob, the loops each computed position ran (Sequence.levels)."""
    trained = spec.trained_loops
    base = plain_flops(cfg, tokens, generated)
    default = base + fixed_loop_flops(cfg, spec, trained, tokens)  # the same tokens at the trained counts
    if plan.elastic is not None:
        ran = np.asarray(list(levels or ())[:tokens], dtype=np.int64)
        if len(ran) < tokens:  # not expected: every computed position of a range request has a level
            ran = np.concatenate([ran, np.full(tokens - len(ran), plan.level, dtype=np.int64)])
        extra = sum(schedule_loop_flops(cfg, s, ran) for s in spec.layers)
        deepest = int(ran.max(initial=0))
        return DepthReport(
            architecture="sgt",
            tokens=tokens,
            flops=base + extra,  # this request's FLOPs on the schedule it ran
            plain_flops=default,
            settings={"loops": plan.elastic.as_json(), "trained_loops": trained,
                      "mean_depth": round(float(ran.mean()), 4) if tokens else 0.0},
            counters={"loop_iterations": {layer: int(ran.sum()) for layer in plan.loops}},
            counter_samples=loop_samples({layer: int(ran.sum()) for layer in plan.loops}),
            extrapolated=tuple(sorted(layer for layer in plan.loops if deepest > trained[layer])),
            per_token=ran.tolist(),  # the loops each position ran (every looped layer alike)
        )
    return DepthReport(
        architecture="sgt",
        tokens=tokens,
        flops=base + fixed_loop_flops(cfg, spec, plan.loops, tokens),  # this request's FLOPs
        plain_flops=default,
        settings={"loops": dict(plan.loops), "trained_loops": trained},
        # per looped layer: (token, iteration) pairs run over the tokens this request processed
        counters={"loop_iterations": {layer: tokens * n for layer, n in plan.loops.items()}},
        counter_samples=loop_samples({layer: tokens * n for layer, n in plan.loops.items()}),
        extrapolated=tuple(sorted(layer for layer, n in plan.loops.items() if n > trained[layer])),
    )


def loop_samples(iterations: dict[int, int]) -> tuple[DepthCounter, ...]:
    """The loop iterations run per looped layer, as typed counts."""
    return tuple(DepthCounter("loop_iterations", count, (("layer", str(layer)),)) for layer, count in iterations.items())
