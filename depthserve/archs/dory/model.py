"""Dory (NVIDIA Nemotron-Labs): a looped nGPT decoder (docs/depth-semantics.md, "Public looped
models: Dory"), computed as transformers' DoryForCausalLM computes it.

    x   = embed(ids)
    x   = prelude layers (n_input_layers, once)
    p   = N(x)                                     N: projection onto the unit sphere
    x   = recurrent layers over N(x) + p, `loops` times
    x   = coda layers (n_output_layers, once)
    out = (W_head N(x)) * logit_scale

A decoder layer interpolates on the sphere instead of adding:

    h  = N(x);  h = h + |a1| * (N(Attn(h)) - h)
    h  = N(h);  x' = h + |a2| * (N(MLP(h)) - h)

Attention: unit-norm queries and keys per head, rotated (the rope theta of the layer's type),
queries scaled per channel by sqk^2, a sliding window on sliding layers; its output gated by
sigmoid(g * s_gate^2) and normed before W_O. MLP: down(N(silu(gate * suv_gate) * (up * suv_up))).

Caches (DoryConfig.recurrent_kv_cache_mode): per_loop gives each (pass, recurrent layer) its own
slot; last_loop gives each recurrent layer one slot that every pass writes in turn, so after the
forward it holds the last pass's keys, and pass t of a chunk attends over the earlier forwards'
last-pass keys plus this chunk's pass-t keys (what transformers computes for that chunk).

Per-token loops (docs/depth-semantics.md section 6; "Public looped models: Dory"): a request whose
`loops` is a range runs each step's tokens at the depth policy's level (all its tokens of the step
alike), and pass t runs over the rows whose level is at least t. per_loop: passes up to the range's
minimum have dense slots; each later pass's slots are routed and hold, in order, only the tokens
that ran the pass. A routed slot stores no positions, so a sliding-window layer's pass masks its
keys by the positions the sequence's recorded levels give them (`RoutedWindow`), reading only from
the first entry inside the window (the block manager gives back the pages behind it). last_loop: the
one slot of a recurrent layer holds each token's own last pass, whatever pass that was: a token
that stopped before pass t is read there at its last pass, by earlier forwards and its own alike.
No confidence exit: the coda layers attend over the earlier tokens' coda states, so a pass's
output is no readout of the token (as for PUT with suffix layers).

A decode-only step whose projections run on the native CPU kernel runs the prelude, each full pass
over the recurrent layers and the coda as one native call each (native_decode.py): the same ops.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import nn

from depthserve.archs.base import BuildOptions, DepthModel, RequestState, StaticDecodeSpec
from depthserve.archs.dory.format import (
    DoryConfig,
    DoryPlan,
    base_slots,
    knobs,
    layer_slot_name,
    parameter_name,
    recurrent_slot_name,
)
from depthserve.archs.dory.format import plan as dory_plan
from depthserve.archs.dory.format import report as dory_report
from depthserve.archs.dory.native_decode import NativeDoryLayers, Rope
from depthserve.cache import CacheLayout
from depthserve.depth import DepthParams, DepthReport, KnobSpec
from depthserve.errors import CheckpointFormatError
from depthserve.layers.attention import AttentionMetadata, KVPool, call_region, paged_attention
from depthserve.layers.batch import BatchItem
from depthserve.layers.embedding import checkpoint_embedding
from depthserve.layers.ngpt import gated_l2_normalize, interpolate, l2_normalize, swiglu_l2_normalize, unit_rope
from depthserve.layers.rotary import rope_tables
from depthserve.layers.rows import StepRows, step_rows
from depthserve.loading.weights import keep_stored_width

L2_EPS = 1e-6  # transformers' DoryL2Norm


def unit_norm(x: torch.Tensor) -> torch.Tensor:
    """x projected onto the unit sphere along its last dimension (computed in fp32)."""
    return l2_normalize(x, L2_EPS)


def _scale(size: int, init: float) -> nn.Parameter:
    return nn.Parameter(torch.full((size,), init), requires_grad=False)


def _derived(module: nn.Module, *names: str) -> None:
    """Buffers (moved and cast with the module, never saved) that `derive_scales` fills once the
    weights are loaded."""
    for name in names:
        module.register_buffer(name, None, persistent=False)


class RoutedWindow:
    """A sliding-window layer's pass t over rows of which some hold the pass in a routed slot: the
    keys a query sees are those of the slot at positions p - window < q <= p. A routed slot's j-th
    key is the j-th token that ran pass t, so the keys' positions come from the sequence's recorded
    levels (BatchItem.levels: the loops each earlier position ran) and the step's own tokens, which
    all run the pass (one level per sequence and step)."""

    def __init__(self, level: StepRows, slot: str, t: int):
        self.level, self.slot, self.t = level, slot, t

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, meta: AttentionMetadata,
                  scale: float, window: int) -> torch.Tensor:
        """Store the rows' keys and values (`meta`: the level's metadata over the slot), then attend."""
        meta.kernels.store_kv(k, v, pool.k_pages, pool.v_pages, meta.slot_index)
        step = self.level.meta.batch
        out, row = torch.empty_like(q), 0
        for index, count in zip(self.level.item_indices, self.level.item_row_counts):
            item = step.items[index]
            keys, values, key_positions = self._keys(item, pool, step.block_size, window)
            positions = torch.arange(item.start, item.end, device=q.device)
            visible = (key_positions[None, :] <= positions[:, None]) & (key_positions[None, :] > positions[:, None] - window)
            out[row: row + count] = _attend(q[row: row + count], keys, values, visible, scale)
            row += count
        return out

    def _keys(self, item: BatchItem, pool: KVPool, block_size: int,
              window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys and values [kv heads, keys, head_dim] an item's queries may see, and their positions."""
        first = max(0, item.start - window + 1)  # the earliest key position the step's first query sees
        if self.slot not in item.routed:  # the item's dense slot: every position
            pages = item.table[first // block_size: -(-item.end // block_size), item.slot_columns[self.slot]]
            offset, key_positions = first - first // block_size * block_size, np.arange(first, item.end)
        else:
            table, committed = item.routed[self.slot]
            earlier = np.flatnonzero(np.asarray(item.levels[first: item.start]) >= self.t) + first
            begin = committed - len(earlier)  # the routed index of the first of them
            pages = table[begin // block_size: -(-(committed + item.num_tokens) // block_size)]
            offset, key_positions = begin - begin // block_size * block_size, np.concatenate(
                [earlier, np.arange(item.start, item.end)])
        device = pool.k_pages.device
        index = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64)).to(device)  # [blocks, kv heads]

        def gather(cache: torch.Tensor) -> torch.Tensor:
            per_head = cache[index].transpose(0, 1).flatten(1, 2)  # [kv heads, blocks * block_size, head_dim]
            return per_head[:, offset: offset + len(key_positions)]

        return gather(pool.k_pages), gather(pool.v_pages), torch.from_numpy(key_positions).to(device)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Softmax attention of q [n, heads, d] over keys/values [kv heads, m, d] where `visible` [n, m]."""
    groups = q.shape[1] // keys.shape[0]
    keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
    scores = torch.einsum("nhd,hmd->hnm", q.float(), keys.float()) * scale
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hnm,hmd->nhd", weights, values.float()).to(q.dtype)


class DoryAttention(nn.Module):
    def __init__(self, cfg: DoryConfig, index: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # W_Q, W_K, W_V and the output gate's W_G as one product (the checkpoint's four, rows stacked;
        # the gate has no bias: its rows of the bias are zeros)
        self.shard_sizes = (q_size, kv_size, kv_size, q_size)
        self.qkvg_proj = nn.Linear(cfg.hidden_size, sum(self.shard_sizes), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.sqk = _scale(q_size, cfg.initializer_range)
        self.s_gate = _scale(q_size, cfg.initializer_range)
        # the stored scales are used as s * (their init value) / initializer_range
        self.sqk_factor = cfg.head_dim**0.5 / cfg.initializer_range
        self.s_gate_factor = cfg.hidden_size**0.25 / cfg.initializer_range
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.window(index)
        _derived(self, "q_scale", "gate_scale")

    def derive_scales(self) -> None:
        """The learned scales as the forward applies them, computed once from the loaded weights."""
        self.q_scale = (self.sqk * self.sqk_factor).square()
        self.gate_scale = (self.s_gate * self.s_gate_factor).square()

    def forward(self, x, cos, sin, pool: KVPool, meta: AttentionMetadata, columns: slice,
                routed_window: RoutedWindow | None = None) -> torch.Tensor:
        n = x.shape[0]
        q, k, v, gate = self.qkvg_proj(x).split(self.shard_sizes, dim=-1)
        q = unit_rope(q.view(n, self.num_heads, self.head_dim), cos, sin, self.q_scale, L2_EPS)
        k = unit_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin, None, L2_EPS)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if routed_window is not None and self.window is not None:
            out = routed_window.attention(q, k, v, pool, meta, self.scale, self.window).reshape(n, -1)
        else:
            out = paged_attention(q, k, v, pool, meta, columns, self.scale, self.window).reshape(n, -1)
        return self.o_proj(gated_l2_normalize(out, gate, self.gate_scale, L2_EPS))


class DoryMLP(nn.Module):
    def __init__(self, cfg: DoryConfig):
        super().__init__()
        self.shard_sizes = (cfg.intermediate_size, cfg.intermediate_size)  # W_gate and W_up as one product
        self.gate_up_proj = nn.Linear(cfg.hidden_size, sum(self.shard_sizes), bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.suv_gate = _scale(cfg.intermediate_size, 1.0)
        self.suv_up = _scale(cfg.intermediate_size, 1.0)
        self.suv_factor = cfg.hidden_size**0.5
        _derived(self, "gate_scale", "up_scale")

    def derive_scales(self) -> None:
        self.gate_scale = self.suv_gate * self.suv_factor
        self.up_scale = self.suv_up * self.suv_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.shard_sizes, dim=-1)
        return self.down_proj(swiglu_l2_normalize(gate, up, self.gate_scale, self.up_scale, L2_EPS))


class DoryDecoderLayer(nn.Module):
    def __init__(self, cfg: DoryConfig, index: int):
        super().__init__()
        self.layer_type = cfg.layer_types[index]
        self.self_attn = DoryAttention(cfg, index)
        self.mlp = DoryMLP(cfg)
        self.lambda_1 = _scale(cfg.hidden_size, cfg.initializer_range)
        self.lambda_2 = _scale(cfg.hidden_size, cfg.initializer_range)
        self.lambda_factor = cfg.ngpt_alpha_init / cfg.initializer_range
        _derived(self, "attention_rate", "mlp_rate")

    def derive_scales(self) -> None:
        self.attention_rate = (self.lambda_1 * self.lambda_factor).abs()
        self.mlp_rate = (self.lambda_2 * self.lambda_factor).abs()
        self.self_attn.derive_scales()
        self.mlp.derive_scales()

    def forward(self, x, cos, sin, pool, meta, columns, routed_window: RoutedWindow | None = None) -> torch.Tensor:
        h = unit_norm(x)
        attention = self.self_attn(h, cos, sin, pool, meta, columns, routed_window)
        h = interpolate(h, attention, self.attention_rate, L2_EPS, normalize=True)
        return interpolate(h, self.mlp(h), self.mlp_rate, L2_EPS, normalize=False)


class DoryForCausalLM(nn.Module, DepthModel):
    uses_step_batch = True

    def __init__(self, cfg: DoryConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.max_positions = max_positions
        self.embed_tokens = checkpoint_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DoryDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        # W_head a plain linear layer, so that it is quantized with the others (loading/quantization.py);
        # its learned per-token scale is used as logit_scale / initializer_range
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logit_scale = _scale(cfg.vocab_size, cfg.initializer_range)
        self.logit_factor = 1 / cfg.initializer_range
        _derived(self, "logits_scale")
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # filled by finish_load
        self.base_columns = dict(CacheLayout(base_slots(cfg)).slot_columns())  # alike in every request's table
        # runs of layers (a section's, or one recurrent layer) with a native decode step (finish_load; native_decode.py)
        self.native_runs: dict[tuple[int, ...], NativeDoryLayers] = {}

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def forward(self, input_ids, positions, pool: KVPool, meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.config
        rope = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in self.rope.items()}
        x = self.embed_tokens(input_ids)
        x = self.run_layers(tuple(range(cfg.n_input_layers)), x, rope, pool, meta)
        x = self.recurrent(x, rope, pool, meta)
        x = self.run_layers(tuple(cfg.output_layers), x, rope, pool, meta)
        return unit_norm(x)

    def run_layers(self, indices: tuple[int, ...], x, rope: Rope, pool, meta: AttentionMetadata,
                   columns: list[slice] | None = None) -> torch.Tensor:
        """Layers `indices` in turn over `meta`, layer indices[j] on the cache columns columns[j]
        (default: its slot of the base table); as one native call where that applies."""
        if columns is None:
            columns = [self.base_columns[layer_slot_name(i)] for i in indices]
        native = self.native_runs.get(indices)
        if native is not None and native.applies(x, meta):
            return native(x, rope, pool, meta, [c.start or 0 for c in columns])
        for i, layer_columns in zip(indices, columns):
            x = call_region(self.layers[i], meta, x, *rope[self.config.layer_types[i]], pool, meta, layer_columns)
        return x

    def recurrent(self, x, rope: Rope, pool, meta) -> torch.Tensor:
        """The recurrent section's passes: pass t over the rows whose tokens run at least t loops
        (their request's, or with a range the step's level), each pass restarting from N(x) + N(prelude
        output)."""
        cfg, rows = self.config, step_rows(meta)
        loops = rows.setting(0)
        prelude = unit_norm(x)
        for t in range(1, rows.deepest(loops, cfg.max_loops) + 1):
            level = rows.narrow(loops, t)
            xs = unit_norm(level.take(x)) + level.take(prelude)
            level_rope = {kind: (level.take(cos), level.take(sin)) for kind, (cos, sin) in rope.items()}
            x = level.merge(x, self.recurrent_pass(t, level, xs, level_rope, pool))
        return x

    def recurrent_pass(self, t: int, level: StepRows, xs, rope: Rope, pool) -> torch.Tensor:
        """Pass t of the recurrent layers over the level's rows: one run when every layer attends
        through the same metadata (every row runs the pass, dense slots), else layer by layer."""
        cfg, layers = self.config, tuple(self.config.recurrent_layers)
        slots = [recurrent_slot_name(cfg, i, t) for i in layers]
        attends = [level.attend(slot) for slot in slots]
        windows = [self._routed_window(level, slot, t, i) for slot, i in zip(slots, layers)]
        if all(sub_meta is attends[0][0] for sub_meta, _ in attends) and all(w is None for w in windows):
            return self.run_layers(layers, xs, rope, pool, attends[0][0], [columns for _, columns in attends])
        for i, (sub_meta, columns), routed_window in zip(layers, attends, windows):
            if routed_window is None:
                xs = self.run_layers((i,), xs, rope, pool, sub_meta, [columns])
            else:
                xs = self.layers[i](xs, *rope[cfg.layer_types[i]], pool, sub_meta, columns, routed_window)
        return xs

    def _routed_window(self, level: StepRows, slot: str, t: int, layer: int) -> RoutedWindow | None:
        """A sliding-window layer's pass that some of the rows hold in a routed slot (module doc)."""
        if self.config.window(layer) is None or level.meta.batch is None:
            return None
        step = level.meta.batch
        if not any(slot in step.items[index].routed for index in level.item_indices):
            return None
        return RoutedWindow(level, slot, t)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float() * self.logits_scale

    # ---- depth ------------------------------------------------------------------------------------
    def depth_knobs(self) -> dict[str, KnobSpec]:
        return knobs(self.config)

    def plan(self, depth: DepthParams) -> DoryPlan:
        return dory_plan(self.config, depth)

    def static_decode_spec(self) -> StaticDecodeSpec:
        """Rows hold the slots of the deepest loop count (per_loop: every pass's; last_loop: one per
        recurrent layer, which a row writes only at the passes it runs); a row's setting is its
        loops, and a batch runs capped at its deepest row's. A range of loops decodes eagerly. The
        layer is compiled as a region: one graph per layer kind serves every pass at every cap."""
        deepest = self.plan(DepthParams(loops=self.config.max_loops)).layout
        return StaticDecodeSpec(deepest, settings=1, levels=tuple(range(1, self.config.max_loops + 1)),
                                compiled_regions=(DoryDecoderLayer,))

    def row_settings(self, plan: DoryPlan, level: int | None) -> np.ndarray:
        return np.array([plan.step_level(level)], dtype=np.float32)

    def report(self, request: RequestState) -> DepthReport:
        return dory_report(self.config, request.plan, request.num_computed_tokens, request.num_output_tokens,
                           request.levels)

    # ---- weights ----------------------------------------------------------------------------------
    checkpoint_prefix = ""

    @torch.no_grad()
    def take_weights(self, weights: dict[str, torch.Tensor], source: str) -> set[str]:
        """Every tensor, by its name in any of the checkpoint spellings (format.parameter_name), read
        and copied one at a time (the weights may be read lazily: loading/hf_loader.py); the packed
        projections' (PACKED_PROJECTIONS) into their rows of the packed matrix. A tensor stored wider
        than the dtype the model was built in (`build`) keeps its own dtype."""
        params = dict(self.named_parameters())
        filled, shards = set(), {}
        for checkpoint_name in [name for name in weights if _target(name) in params]:
            target, shard = _placement(checkpoint_name)
            tensor, param = weights.pop(checkpoint_name), params[target]
            keep_stored_width(param, tensor)
            rows = param if shard is None else self._shard_rows(target, param, shard)
            if tuple(tensor.shape) != tuple(rows.shape):
                raise CheckpointFormatError(f"{source}: {checkpoint_name} must be {list(rows.shape)}, "
                                            f"got {list(tensor.shape)}")
            rows.copy_(tensor)
            if shard is None:
                filled.add(target)
            else:
                shards.setdefault(target, set()).add(shard)
        for target, present in shards.items():
            expected = _expected_shards(target)
            if present != expected:
                missing = sorted(expected - present)
                raise CheckpointFormatError(f"{source}: {target} is packed from {len(expected)} checkpoint tensors; "
                                            f"shards {missing} are missing")
            if target.endswith(GATED_BIAS):  # the gate's rows: W_G has no bias
                self._shard_rows(target, params[target], GATE_SHARD).zero_()
            filled.add(target)
        return filled

    def _shard_rows(self, target: str, param: torch.Tensor, shard: int) -> torch.Tensor:
        """The rows of a packed parameter that checkpoint shard `shard` fills."""
        sizes = self.get_submodule(target.rsplit(".", 2)[0]).shard_sizes
        return param.narrow(0, sum(sizes[:shard]), sizes[shard])

    def after_load(self, loaded: set[str]) -> set[str]:
        if self.config.tie_word_embeddings or "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed_tokens.weight
            return {"lm_head.weight"}
        return set()

    def finish_load(self, device: torch.device) -> None:
        """The rotary tables of each layer type (its own theta), fp32 whatever the model dtype; the
        learned scales as the forward applies them (each layer's `derive_scales`); the native decode
        steps of the sections and of each recurrent layer, where their projections run on the native kernel."""
        self.rope = {kind: tuple(t.to(device) for t in rope_tables(self.config.head_dim, self.max_positions, theta))
                     for kind, theta in self.config.rope_thetas.items()}
        with torch.no_grad():
            self.logits_scale = self.logit_scale.float() * self.logit_factor
            for layer in self.layers:
                layer.derive_scales()
        cfg = self.config
        runs = [tuple(range(cfg.n_input_layers)), tuple(cfg.recurrent_layers), tuple(cfg.output_layers)]
        runs += [(i,) for i in cfg.recurrent_layers]  # a pass that only some rows run goes layer by layer
        natives = {run: NativeDoryLayers.of([self.layers[i] for i in run], L2_EPS) for run in runs if run}
        self.native_runs = {run: native for run, native in natives.items() if native is not None}


# checkpoint projections the engine runs as one matrix product: (the engine's packed module, the shard
# whose rows they fill, in shard order)
PACKED_PROJECTIONS = {"self_attn.q_proj": ("self_attn.qkvg_proj", 0), "self_attn.k_proj": ("self_attn.qkvg_proj", 1),
                      "self_attn.v_proj": ("self_attn.qkvg_proj", 2), "self_attn.gate_proj": ("self_attn.qkvg_proj", 3),
                      "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1)}


GATE_SHARD, GATED_BIAS = 3, "self_attn.qkvg_proj.bias"


def _expected_shards(target: str) -> set[int]:
    """The shards a packed parameter is filled from."""
    module = target.rsplit(".", 2)[-2]
    shards = {shard for packed, shard in PACKED_PROJECTIONS.values() if packed.endswith("." + module)}
    return shards - {GATE_SHARD} if target.endswith(GATED_BIAS) else shards


def _placement(checkpoint_name: str) -> tuple[str, int | None]:
    """The engine's parameter of a checkpoint tensor and, for a packed projection, its shard (the
    head's scale lives beside the head)."""
    name = parameter_name(checkpoint_name)
    if name == "lm_head.logit_scale":
        return "logit_scale", None
    for module, (packed, shard) in PACKED_PROJECTIONS.items():
        if f".{module}." in name:
            return name.replace(f".{module}.", f".{packed}."), shard
    return name, None


def _target(checkpoint_name: str) -> str:
    """The engine's parameter of a checkpoint tensor."""
    return _placement(checkpoint_name)[0]


# config.json's `dtype` (`torch_dtype` before transformers 4.56): what the tensors are stored in
STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def stored_dtype(hf_config: dict) -> torch.dtype:
    """The dtype the checkpoint says its tensors are stored in (fp32 when it names none)."""
    return STORED_DTYPES.get(hf_config.get("dtype") or hf_config.get("torch_dtype"), torch.float32)


def build(hf_config: dict, spec: DoryConfig, options: BuildOptions) -> DoryForCausalLM:
    """`options.max_loops`: the engine's ceiling of `loops` instead of the checkpoint's. The model
    is built in the checkpoint's stored dtype, so a bf16 checkpoint is loaded, quantized and served
    in bf16 without ever being held in fp32 (8 GB instead of 16 for the 4B model)."""
    if options.max_loops is not None:
        spec = replace(spec, max_loops=options.max_loops)
    return DoryForCausalLM(spec, options.max_len).to(stored_dtype(hf_config))
