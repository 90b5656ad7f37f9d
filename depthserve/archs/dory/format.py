"""Dory's checkpoint: the transformers `config.json` (model_type "dory") read as transformers reads
it, the tensor names transformers saves, the knob `loops`, the cache plan and FLOP counting
(docs/depth-semantics.md, "Public looped models: Dory"; docs/checkpoint-format.md, "Dory").

A Dory checkpoint carries no `depth` section: `model_type: "dory"` names the architecture
(loading/checkpoint.py). Every field defaults as transformers' DoryConfig does; a released-style
config lists each layer's attention and MLP as two entries of `layer_types` (`..., "mlp"`) with
doubled layer counts, which are halved here as transformers halves them.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthCounter, DepthParams, DepthPlan, DepthRange, DepthReport, KnobInfo, KnobSpec
from depthserve.loading.checkpoint import CheckpointFormatError

SLIDING = "sliding_attention"
FULL = "full_attention"
CACHE_MODES = ("per_loop", "last_loop")
# DoryConfig's defaults for the rope theta of each layer type when `rope_parameters` is absent.
DEFAULT_ROPE_THETAS = {SLIDING: 10_000.0, FULL: 10_000_000.0}
# The ceiling of `loops` when the config names none: this many times the trained loop count.
MAX_LOOPS_FACTOR = 4
# last_loop mode: the prompt's forwards, in tokens counted from its first token (the engine's
# split, which the reference reproduces; never chosen by the load).
LAST_LOOP_PREFILL_CHUNK = 32


@dataclass(frozen=True)
class DoryConfig:
    """The fields of a Dory config.json the engine computes with, after transformers' conversion
    of released-style layouts (one entry per decoder layer in `layer_types`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    initializer_range: float
    ngpt_alpha_init: float
    layer_types: tuple[str, ...]
    rope_thetas: dict[str, float]  # layer type -> rope theta
    sliding_window: int
    n_input_layers: int
    n_recurrent_layers: int
    n_output_layers: int
    n_recurrent_loops: int  # the trained loop count: the knob's default
    max_loops: int  # the knob's ceiling
    recurrent_kv_cache_mode: str  # "per_loop" or "last_loop"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    architecture: str = "dory"

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def recurrent_layers(self) -> range:
        return range(self.n_input_layers, self.n_input_layers + self.n_recurrent_layers)

    @property
    def output_layers(self) -> range:
        return range(self.num_layers - self.n_output_layers, self.num_layers)

    def window(self, layer: int) -> int | None:
        """Keys a query of this layer sees, itself included (None: every earlier key)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


def _integer(hf: dict[str, Any], name: str, default: int | None, minimum: int = 0) -> int:
    value = hf.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointFormatError(f"dory config.json: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _number(hf: dict[str, Any], name: str, default: float) -> float:
    value = hf.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise CheckpointFormatError(f"dory config.json: {name} must be a positive number, got {value!r}")
    return float(value)


def _layer_types(hf: dict[str, Any]) -> tuple[list[str] | None, int, int, int, int | None]:
    """(layer types, num_hidden_layers, n_input_layers, n_output_layers, n_recurrent_layers) as
    DoryConfig.__post_init__ leaves them: a released-style list (attention, "mlp", ...) halved."""
    types = hf.get("layer_types")
    layers = _integer(hf, "num_hidden_layers", 36, 1)
    n_input, n_output = _integer(hf, "n_input_layers", 8), _integer(hf, "n_output_layers", 8)
    n_recurrent = hf.get("n_recurrent_layers")
    if n_recurrent is not None:
        n_recurrent = _integer(hf, "n_recurrent_layers", None)
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
        raise CheckpointFormatError(f"dory config.json: layer_types must be a list of strings, got {types!r}")
    if types is not None and "mlp" in types:
        if types[1::2] != ["mlp"] * (len(types) // 2) or len(types) % 2:
            raise CheckpointFormatError("dory config.json: a released-style layer_types alternates an attention "
                                        "type and 'mlp'")
        types = types[::2]
        layers, n_input, n_output = layers // 2, n_input // 2, n_output // 2
        n_recurrent = None if n_recurrent is None else n_recurrent // 2
    return types, layers, n_input, n_output, n_recurrent


def _rope_thetas(hf: dict[str, Any], types: tuple[str, ...]) -> dict[str, float]:
    params = hf.get("rope_parameters")
    if params is None:
        return {t: DEFAULT_ROPE_THETAS[t] for t in set(types)}
    if not isinstance(params, dict):
        raise CheckpointFormatError(f"dory config.json: rope_parameters must be an object, got {params!r}")
    thetas = {}
    for layer_type in set(types):
        entry = params.get(layer_type)
        if not isinstance(entry, dict) or not isinstance(entry.get("rope_theta"), (int, float)):
            raise CheckpointFormatError(f"dory config.json: rope_parameters.{layer_type}.rope_theta is missing")
        if entry.get("rope_type", "default") != "default":
            raise CheckpointFormatError(f"dory config.json: rope_parameters.{layer_type}.rope_type "
                                        f"{entry['rope_type']!r} is not served (only 'default')")
        thetas[layer_type] = float(entry["rope_theta"])
    return thetas


def read_config(hf: dict[str, Any]) -> DoryConfig:
    """The Dory config of a transformers config.json (CheckpointFormatError naming the field)."""
    types, layers, n_input, n_output, n_recurrent = _layer_types(hf)
    if types is None:
        types = [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(layers)]
    if len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
        raise CheckpointFormatError(f"dory config.json: layer_types must list {layers} layers, each "
                                    f"{SLIDING!r} or {FULL!r}, got {types!r}")
    if n_recurrent is None:
        n_recurrent = layers - n_input - n_output
    if n_recurrent < 1 or n_input + n_recurrent + n_output != layers:
        raise CheckpointFormatError(f"dory config.json: n_input_layers ({n_input}) + n_recurrent_layers "
                                    f"({n_recurrent}) + n_output_layers ({n_output}) must equal num_hidden_layers "
                                    f"({layers}) with at least one recurrent layer")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointFormatError(f"dory config.json: hidden_act {hf['hidden_act']!r} is not served (only 'silu')")
    mode = hf.get("recurrent_kv_cache_mode", "per_loop")
    if mode not in CACHE_MODES:
        raise CheckpointFormatError(f"dory config.json: recurrent_kv_cache_mode must be one of {CACHE_MODES}, "
                                    f"got {mode!r}")
    heads, kv_heads = _integer(hf, "num_attention_heads", 16, 1), _integer(hf, "num_key_value_heads", 4, 1)
    if heads % kv_heads:
        raise CheckpointFormatError(f"dory config.json: num_attention_heads ({heads}) must be a multiple of "
                                    f"num_key_value_heads ({kv_heads})")
    loops = _integer(hf, "n_recurrent_loops", 2, 1)
    return DoryConfig(
        vocab_size=_integer(hf, "vocab_size", 131072, 1), hidden_size=_integer(hf, "hidden_size", 2560, 1),
        intermediate_size=_integer(hf, "intermediate_size", 7168, 1), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=_integer(hf, "head_dim", 256, 2), max_position_embeddings=_integer(hf, "max_position_embeddings", 8192, 1),
        initializer_range=_number(hf, "initializer_range", 0.0177), ngpt_alpha_init=_number(hf, "ngpt_alpha_init", 0.05),
        layer_types=tuple(types), rope_thetas=_rope_thetas(hf, tuple(types)),
        sliding_window=_integer(hf, "sliding_window", 1024, 1), n_input_layers=n_input, n_recurrent_layers=n_recurrent,
        n_output_layers=n_output, n_recurrent_loops=loops,
        max_loops=_integer(hf, "max_recurrent_loops", MAX_LOOPS_FACTOR * loops, loops),
        recurrent_kv_cache_mode=mode, attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


def read_spec(section: dict[str, Any] | None, hf_config: dict[str, Any]) -> DoryConfig:
    """The registry's reader: a Dory checkpoint has no `depth` section, its config is the spec."""
    if section is not None:
        raise CheckpointFormatError("a Dory checkpoint (model_type 'dory') carries no `depth` section")
    return read_config(hf_config)


# ---- tensor names (docs/checkpoint-format.md, "Dory") ----------------------------------------------
# Three spellings name the same tensors, read as transformers reads them: the released layout
# (`backbone.layers.{2i}.mixer.*` the attention of layer i, `backbone.layers.{2i+1}.mixer.*` its MLP,
# `attn_alpha` / `mlp_alpha` its rates, `backbone.embeddings`), the layout transformers saves
# (`backbone.layers.{i}.self_attn.g_proj`, `lambda_1`, ...) and transformers' module names
# (`model.layers.{i}.self_attn.gate_proj`, `model.embed_tokens`). The engine's parameters carry the
# module names without the `model.` prefix.
_BLOCK = re.compile(r"^layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)")
_RATES = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}


def parameter_name(checkpoint_name: str) -> str:
    """The engine's parameter of a checkpoint tensor, in any of the three spellings."""
    name = checkpoint_name
    for prefix in ("backbone.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.startswith("embeddings."):
        name = "embed_tokens." + name[len("embeddings."):]
    if (block := _BLOCK.match(name)) is not None:
        index, part = int(block[1]), block[2]
        part = _RATES.get(part, ("self_attn", "mlp")[index % 2])
        name = f"layers.{index // 2}.{part}" + name[block.end():]
    return name.replace(".self_attn.g_proj.", ".self_attn.gate_proj.")


# ---- the knob and the plan ------------------------------------------------------------------------
KNOBS = (KnobInfo("loops", "passes of the recurrent section", elastic=True),)


def knobs(cfg: DoryConfig) -> dict[str, KnobSpec]:
    return {"loops": KnobSpec("loops", f"passes of the recurrent section; trained with {cfg.n_recurrent_loops}",
                              1, cfg.max_loops, cfg.n_recurrent_loops, elastic=True)}


def layer_slot_name(i: int) -> str:
    """The slot of a prelude or coda layer."""
    return f"layer{i}"


def recurrent_slot_name(cfg: DoryConfig, i: int, t: int) -> str:
    """The slot recurrent layer i writes at pass t: its own per pass (per_loop), one for every
    pass (last_loop, where each pass overwrites the chunk's keys and the last one stays)."""
    return f"layer{i}" if cfg.recurrent_kv_cache_mode == "last_loop" else f"layer{i}.pass{t}"


def base_slots(cfg: DoryConfig) -> tuple[SlotSpec, ...]:
    """The slots every request has (every layer once: pass 1 of the recurrent section)."""
    names = [layer_slot_name(i) if i not in cfg.recurrent_layers else recurrent_slot_name(cfg, i, 1)
             for i in range(cfg.num_layers)]
    return tuple(SlotSpec(name, SlotKind.DENSE, cfg.num_kv_heads, cfg.window(i)) for i, name in enumerate(names))


# Request serials of the ranged last_loop plans (DoryPlan.cache_key).
_SCHEDULED_PLANS = itertools.count(1)


@dataclass(frozen=True, kw_only=True)
class DoryPlan(DepthPlan):
    loops: int  # passes of the recurrent section (a range: its maximum)
    columns: dict[str, slice]  # slot name -> columns of the request's page table (token-covering slots)
    # A ranged request in last_loop mode: its own serial, so that its blocks are never shared. Its
    # slots are dense, and what they hold depends on the schedule the depth policy ran, which the
    # prefix-cache key cannot name before the request runs (per_loop ranges have routed slots, which
    # keep any request off the prefix cache). 0: the blocks are shared by equal knobs.
    cache_serial: int = field(default=0, compare=False)

    @property
    def min_loops(self) -> int:
        """Passes every token runs: in per_loop mode their slots are dense, the later ones routed."""
        return self.loops if self.elastic is None else self.elastic.minimum

    @property
    def cache_key(self) -> tuple:
        return self.depth.cache_key() if not self.cache_serial else (*self.depth.cache_key(), ("serial", self.cache_serial))


def layer_weight_flops(cfg: DoryConfig) -> float:
    """Weight matmuls of one decoder layer for one token (q, k, v, gate, o; MLP gate, up, down)."""
    d, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    return 2 * d * (3 * q + 2 * cfg.num_kv_heads * cfg.head_dim) + 2 * 3 * d * cfg.intermediate_size


def token_flops(cfg: DoryConfig, loops: int) -> float:
    layers = cfg.n_input_layers + cfg.n_output_layers + loops * cfg.n_recurrent_layers
    return layers * layer_weight_flops(cfg)


def level_work(cfg: DoryConfig) -> tuple[float, ...]:
    """One token's cost at loops = 0..max_loops in layer applications (index 0, never run, at the
    level-1 value), for the slo depth policy's cost model."""
    work = [float(cfg.n_input_layers + cfg.n_output_layers + loops * cfg.n_recurrent_layers)
            for loops in range(cfg.max_loops + 1)]
    work[0] = work[1]
    return tuple(work)


def plan(cfg: DoryConfig, depth: DepthParams) -> DoryPlan:
    """With a range of loops (docs/depth-semantics.md section 6) the plan is priced at its maximum.
    per_loop: the passes up to the range's minimum, which every token runs, have dense slots; each
    later pass's slots are routed (they hold only the tokens that ran the pass). last_loop: the
    slots are the same whatever the loops (each token writes its own last pass)."""
    value = depth.get("loops", cfg.n_recurrent_loops)
    elastic = value if isinstance(value, DepthRange) and value.minimum < value.maximum else None
    loops = value.maximum if isinstance(value, DepthRange) else int(value)
    lowest = loops if elastic is None else elastic.minimum
    last_loop = cfg.recurrent_kv_cache_mode == "last_loop"
    base = base_slots(cfg)
    later = () if last_loop else tuple(
        SlotSpec(recurrent_slot_name(cfg, i, t), SlotKind.DENSE, cfg.num_kv_heads, cfg.window(i))
        for t in range(2, lowest + 1) for i in cfg.recurrent_layers)
    # a routed slot of pass t holds the positions that ran at least t loops: a sliding-window layer's
    # pass masks by the keys' positions (model.py, RoutedWindow), and its entries behind the window
    # give their pages back (BlockManager)
    routed = () if last_loop else tuple(
        SlotSpec(recurrent_slot_name(cfg, i, t), SlotKind.ROUTED, cfg.num_kv_heads, cfg.window(i), from_level=t)
        for t in range(max(2, lowest + 1), loops + 1) for i in cfg.recurrent_layers)
    # last_loop: the cached keys depend on how the tokens were split into forwards, so the prompt
    # runs in fixed chunks and only blocks of whole chunks are shared through the prefix cache
    chunk = LAST_LOOP_PREFILL_CHUNK if last_loop else None
    layout = CacheLayout(base + later, routed, base_slots=len(base), prefix_chunk=chunk)
    return DoryPlan(depth=depth, layout=layout, flops_per_token=token_flops(cfg, loops),
                    plain_flops_per_token=token_flops(cfg, cfg.n_recurrent_loops), loops=loops,
                    columns=dict(layout.slot_columns()), level=loops, elastic=elastic, level_work=level_work(cfg),
                    prefill_chunk=chunk, cache_serial=next(_SCHEDULED_PLANS) if last_loop and elastic else 0)


def report(cfg: DoryConfig, plan: DoryPlan, tokens: int, generated: int,
           levels: list[int] | tuple[int, ...] = ()) -> DepthReport:
    """Weight FLOPs of the tokens computed and of the LM head rows, at the request's loops and at the
    trained loop count (the `plain` reference of a Dory request). `levels`: with a range of loops,
    the loops each computed position ran (Sequence.levels), reported per token."""
    head = generated * 2 * cfg.hidden_size * cfg.vocab_size
    ranged = plan.elastic is not None
    per_token = np.asarray(levels[:tokens] if ranged else [plan.loops] * tokens, dtype=np.int64)
    settings: dict[str, Any] = {"loops": plan.loops, "trained_loops": cfg.n_recurrent_loops,
                                "recurrent_kv_cache_mode": cfg.recurrent_kv_cache_mode}
    if ranged:
        settings["loops"] = plan.elastic.as_json()
        settings["mean_depth"] = round(float(per_token.mean()), 4) if tokens else 0.0
    counters = {"recurrent_layer_passes": int(per_token.sum()) * cfg.n_recurrent_layers}
    flops = float(sum(token_flops(cfg, int(n)) for n in per_token)) if ranged else tokens * plan.flops_per_token
    return DepthReport(architecture="dory", tokens=tokens, flops=flops + head,
                       plain_flops=tokens * plan.plain_flops_per_token + head, settings=settings,
                       counters=counters,
                       counter_samples=tuple(DepthCounter(name, count) for name, count in counters.items()),
                       per_token=per_token.tolist() if ranged else None)
