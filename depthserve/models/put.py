"""PUT: Polymorphic Universal Transformer (depth-semantics.md section 4; paper 004, Eq. 6-9).

`n_prefix` plain Llama layers, a core of `n_core` layers run `loops` times (1..T, the request's
knob, default T), `n_suffix` plain Llama layers. A core layer at step t (H the normed input):

    h  = x + W_O . (SiLU(O) * O),  O = Attn(RMSNorm_a(x)) per head          (Eq. 7)
    Z  = ReLU(H W_gate + P(t)) * (H W_up),  H = RMSNorm_m(h)                (Eq. 9)
    U  = SiLU(Z + DWConv_k(Z)),  DWConv_k(Z)_n = sum_{j<k} w_j * Z_{n-j}     (Eq. 8; zero before token 0)
    x' = h + U W_down

Caches: one dense KV slot per prefix layer, per (step, core layer) for the request's `loops`
steps, per suffix layer; the slots every request has (prefix, step 1, suffix) come first and form
the shared base of the page table. The conv state (the last k-1 rows of Z per (step, core layer))
is a per-sequence state (SlotKind.SEQ_STATE, `CacheLayout.state_bytes`): the block manager holds
ceil(bytes / page_bytes) pages of the KV pool for it, taken with the sequence's first pages and
freed with all its pages (finish, abort, preemption), and the model keeps the state *in those
pages*. So the state lives exactly as long as the sequence holds cache, needs no bookkeeping of
its own, and is recomputed with the prompt after a preemption (a chunk at position 0 starts from
zeros). Prefix caching is off for PUT (the state is not part of any KV block).

This module also holds the format side (read_spec / PUTSpec.to_section / tensor names / make_tiny);
the reference forward is depthserve/models/put_reference.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from depthserve.depth import DepthParams, KnobSpec
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.layers.attention import AttentionMetadata, KVPool, paged_attention
from depthserve.layers.norm import RMSNorm
from depthserve.layers.rotary import rope_tables
from depthserve.loading.checkpoint import FORMAT_VERSION, CheckpointFormatError
from depthserve.models.flops import attention_flops, layer_weight_flops, plain_flops
from depthserve.models.llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    load_attention,
    load_decoder_layer,
    load_embeddings_and_head,
)

ARCHITECTURE = "put"


# ==== the format ====================================================================================
@dataclass(frozen=True)
class PUTSpec:
    n_prefix: int
    n_core: int
    n_suffix: int
    steps: int  # T: trained core passes (P(t) exists for t = 1..T)
    conv_kernel: int = 2  # k
    architecture: str = ARCHITECTURE

    @property
    def num_layers(self) -> int:
        return self.n_prefix + self.n_core + self.n_suffix

    def to_section(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "architecture": ARCHITECTURE,
            "put": {"n_prefix": self.n_prefix, "n_core": self.n_core, "n_suffix": self.n_suffix,
                    "T": self.steps, "conv_kernel": self.conv_kernel},
        }


def read_spec(section: dict, hf_config: dict) -> PUTSpec:
    body = section.get("put")
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


# Tensor names (docs/checkpoint-format.md, "PUT"). Every layer has the Llama names under its prefix.
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


LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")


def layer_prefixes(spec: PUTSpec) -> list[str]:
    return ([prefix_layer(i) for i in range(spec.n_prefix)] + [core_layer(j) for j in range(spec.n_core)]
            + [suffix_layer(i) for i in range(spec.n_suffix)])


# ---- make-tiny ------------------------------------------------------------------------------------
TINY_LAYOUT = dict(n_prefix=1, n_core=2, n_suffix=1, steps=3, conv_kernel=2)
LIKE_LAYOUT = {"smollm2-135m-instruct": dict(n_prefix=3, n_core=8, n_suffix=3, steps=3, conv_kernel=2)}
STEP_EMBED_STD = 0.5  # P(t): shifts the ReLU gate enough that the steps compute different functions
CONV_STD = 0.5


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None,
              **layout: int) -> Path:
    """A random PUT checkpoint: TINY shapes (or `like`'s) with TINY_LAYOUT (or LIKE_LAYOUT[like]);
    `layout` overrides any of n_prefix, n_core, n_suffix, steps, conv_kernel."""
    from depthserve.loading.checkpoint import write_checkpoint
    from depthserve.tiny import base_config, llama_weights, load_default_tokenizer, model_shapes, normal_sampler

    if like and like not in LIKE_LAYOUT:
        raise ValueError(f"--like must be one of {sorted(LIKE_LAYOUT)}")
    shapes = model_shapes(like, num_kv_heads)
    spec = PUTSpec(**{**(LIKE_LAYOUT[like] if like else TINY_LAYOUT), **layout})
    shapes["num_hidden_layers"] = spec.num_layers
    tokenizer = tokenizer or load_default_tokenizer()
    cfg = base_config(tokenizer, shapes, tied=bool(like))
    cfg.update(architectures=["PUTForCausalLM"], model_type="put", depth=spec.to_section())
    gen = torch.Generator().manual_seed(seed)
    ffn = cfg["intermediate_size"]
    normal = normal_sampler(gen)

    w = llama_weights(cfg, gen, layer_prefixes(spec))
    for j in range(spec.n_core):
        w[step_embedding(j)] = normal(spec.steps, ffn, std=STEP_EMBED_STD)
        w[conv_weight(j)] = normal(spec.conv_kernel, ffn, std=CONV_STD)
    return write_checkpoint(Path(out), cfg, w, tokenizer)


def reference_forward(model_dir, token_ids, depth=None, *, dtype=torch.float64, **kwargs):
    from depthserve.models import put_reference

    return put_reference.forward(model_dir, token_ids, depth, dtype=dtype, **kwargs)


def build_model(hf_config: dict, spec: PUTSpec, max_len: int) -> "PUTForCausalLM":
    return PUTForCausalLM(LlamaConfig.from_hf(hf_config), spec, max_len)


# ==== the engine's model ============================================================================
def core_slot_name(j: int, t: int) -> str:
    return f"core{j}.step{t}"


@dataclass(frozen=True)
class PUTPlan:
    """One request's core passes, fixed for its lifetime, and where its slots sit."""

    loops: int
    layout: CacheLayout
    columns: dict[str, slice]  # slot name -> columns of the request's page table


class PUTAttention(LlamaAttention):
    """Core attention: Ô = SiLU(O) ⊙ O on every head's output before W_O (Eq. 7)."""

    def forward(self, x, cos, sin, pool: KVPool, meta: AttentionMetadata, columns: slice) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        out = paged_attention(q, k, v, pool, meta, columns, self.scale).reshape(x.shape[0], self.q_size)
        return self.o_proj(F.silu(out) * out)


class ConvContext:
    """The conv states of one step's items and, for a set of items running a core step, where each
    row's k taps come from: its own chunk's Z rows or the state carried from earlier chunks.

    `states` is [items, T, n_core, k-1, d_ff]: zeros for a chunk starting at position 0, else read
    from the sequence's state pages; written back after the forward.
    """

    def __init__(self, step, k: int, steps: int, n_core: int, d_ff: int, pool: KVPool, dtype, device):
        self.step, self.k, self.k1 = step, k, k - 1
        self.pool = pool
        self.states = torch.zeros(len(step.items), steps, n_core, self.k1, d_ff, dtype=dtype, device=device)
        self._taps: dict[tuple[int, ...], tuple[list[torch.Tensor], torch.Tensor]] = {}
        carried = [i for i, item in enumerate(step.items) if item.start > 0] if self.k1 else []
        if carried:
            page_lists = [step.items[i].state for i in carried]
            values = _gather_state_pages(pool, page_lists)
            for i, offset in zip(carried, _state_offsets(pool, page_lists)):
                own = self.states[i, : step.items[i].plan.loops]
                own.copy_(values[offset : offset + own.numel()].view_as(own))

    def taps(self, indices: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """For the items `indices` (their rows packed in this order): per tap j, the index of Z_{n-j}
        in cat(states of the items [m*(k-1) rows], Z [rows]); and the indices of the new states."""
        key = tuple(indices)
        if key not in self._taps:
            k1, m = self.k1, len(indices)
            taps = [[] for _ in range(self.k)]
            new = []
            row = 0
            for i, index in enumerate(indices):
                n = self.step.items[index].num_tokens
                local = np.arange(n)
                for j in range(self.k):
                    own = m * k1 + row + local - j  # Z_{n-j} of this chunk
                    carried = i * k1 + k1 + local - j  # from the state (local - j in [-k1, -1])
                    taps[j].append(np.where(local >= j, own, carried))
                last = np.arange(n - k1, n)
                new.append(np.where(last >= 0, m * k1 + row + last, i * k1 + k1 + last))
                row += n
            device = self.states.device
            as_tensor = lambda parts: torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)  # noqa: E731
            self._taps[key] = ([as_tensor(t) for t in taps], as_tensor(new) if k1 else None)
        return self._taps[key]

    def write_back(self) -> None:
        if not self.k1:
            return
        page_lists = [item.state for item in self.step.items]
        values = self.states.new_zeros(sum(len(pages) for pages in page_lists) * _page_values(self.pool))
        for i, (item, offset) in enumerate(zip(self.step.items, _state_offsets(self.pool, page_lists))):
            own = self.states[i, : item.plan.loops].reshape(-1)
            values[offset : offset + own.numel()] = own
        _scatter_state_pages(self.pool, page_lists, values)


# A sequence's state lives in its state pages in order, each page holding its K half, then its V half.
# Reads and writes move whole pages, all sequences' at once (the unused tail of a last page is zeroed).
def _page_values(pool: KVPool) -> int:
    return 2 * pool.k_pages[0].numel()


def _state_offsets(pool: KVPool, page_lists: list[np.ndarray]) -> list[int]:
    """Where each sequence's state starts in the concatenation of the sequences' state pages."""
    return list(itertools.accumulate((len(pages) * _page_values(pool) for pages in page_lists), initial=0))[:-1]


def _page_index(pool: KVPool, page_lists: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(page_lists).astype(np.int64)).to(pool.k_pages.device)


def _gather_state_pages(pool: KVPool, page_lists: list[np.ndarray]) -> torch.Tensor:
    """The values of these pages in state order, flat: one gather of K halves, one of V halves."""
    index = _page_index(pool, page_lists)
    return torch.stack([pool.k_pages.index_select(0, index), pool.v_pages.index_select(0, index)], dim=1).view(-1)


def _scatter_state_pages(pool: KVPool, page_lists: list[np.ndarray], values: torch.Tensor) -> None:
    index = _page_index(pool, page_lists)
    halves = values.to(pool.k_pages.dtype).view(len(index), 2, *pool.k_pages.shape[1:])
    pool.k_pages.index_copy_(0, index, halves[:, 0])
    pool.v_pages.index_copy_(0, index, halves[:, 1])


class PUTCoreLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, spec: PUTSpec, index: int):
        super().__init__()
        self.index = index  # position in the core
        ffn = cfg.intermediate_size
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = PUTAttention(cfg, slot=-1)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * ffn, bias=False)
        self.down_proj = nn.Linear(ffn, cfg.hidden_size, bias=False)
        self.step_embedding = nn.Parameter(torch.zeros(spec.steps, ffn), requires_grad=False)  # P(1..T)
        self.conv_weight = nn.Parameter(torch.zeros(spec.conv_kernel, ffn), requires_grad=False)  # w_0..w_{k-1}

    def forward(self, x, t: int, cos, sin, pool, meta, columns, conv: ConvContext, indices: list[int]):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, pool, meta, columns)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        z = F.relu(gate + self.step_embedding[t - 1]) * up  # Eq. 9
        taps, new = conv.taps(indices)
        if conv.k1:
            states = conv.states[indices, t - 1, self.index]  # [m, k-1, d_ff]
            history = torch.cat([states.reshape(-1, z.shape[1]), z])
            conv.states[indices, t - 1, self.index] = history.index_select(0, new).view_as(states)
        else:
            history = z
        mixed = z
        for j, index in enumerate(taps):
            mixed = mixed + self.conv_weight[j] * history.index_select(0, index)
        return h + self.down_proj(F.silu(mixed))  # Eq. 8: U = SiLU(Z + DWConv_k(Z)); U W_down


class PUTForCausalLM(nn.Module):
    uses_step_batch = True

    def __init__(self, cfg: LlamaConfig, spec: PUTSpec, max_positions: int):
        super().__init__()
        self.config = cfg
        self.spec = spec
        self.max_positions = max_positions
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.prefix_layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(spec.n_prefix))
        self.core_layers = nn.ModuleList(PUTCoreLayer(cfg, spec, j) for j in range(spec.n_core))
        self.suffix_layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(spec.n_suffix))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, max_positions, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._plans: dict[int, PUTPlan] = {}

    # ---- depth ----------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def depth_knobs(self) -> dict[str, KnobSpec]:
        T = self.spec.steps
        return {"loops": KnobSpec("loops", f"passes of the shared core; P(t) is trained for t = 1..{T}", 1, T, T)}

    def plan_depth(self, depth: DepthParams) -> PUTPlan:
        depth = depth.normalized(self.depth_knobs())
        loops = self.spec.steps if depth.loops is None else int(depth.loops)
        if loops not in self._plans:
            kv, spec = self.config.num_kv_heads, self.spec
            base = ([SlotSpec(f"prefix{i}", SlotKind.DENSE, kv) for i in range(spec.n_prefix)]
                    + [SlotSpec(core_slot_name(j, 1), SlotKind.DENSE, kv) for j in range(spec.n_core)]
                    + [SlotSpec(f"suffix{i}", SlotKind.DENSE, kv) for i in range(spec.n_suffix)])
            steps = [SlotSpec(core_slot_name(j, t), SlotKind.DENSE, kv)
                     for t in range(2, loops + 1) for j in range(spec.n_core)]
            layout = CacheLayout(tuple(base + steps), base_slots=len(base), state_bytes=self.state_bytes(loops))
            self._plans[loops] = PUTPlan(loops, layout, layout.slot_columns())
        return self._plans[loops]

    def state_bytes(self, loops: int) -> int:
        """The conv state of one sequence: (k-1) rows of Z per (step, core layer), in the model dtype."""
        element = self.embed_tokens.weight.element_size()
        return loops * self.spec.n_core * (self.spec.conv_kernel - 1) * self.config.intermediate_size * element

    def cache_layout(self, depth: DepthParams) -> CacheLayout:
        return self.plan_depth(depth).layout

    def depth_report(self, seq) -> dict:
        plan: PUTPlan = seq.state["depth_plan"]
        cfg, spec = self.config, self.spec
        tokens = seq.num_computed_tokens
        ctx_sum = tokens * (tokens + 1) / 2
        # The plain model: every layer once (the core as one pass of plain layers).
        base = plain_flops(cfg, tokens, len(seq.output_token_ids))
        extra_pass = spec.n_core * (tokens * layer_weight_flops(cfg) + attention_flops(cfg.num_heads, cfg.head_dim, ctx_sum))
        conv = plan.loops * spec.n_core * tokens * 2 * spec.conv_kernel * cfg.intermediate_size
        flops = base + (plan.loops - 1) * extra_pass + conv
        return {
            "architecture": ARCHITECTURE,
            "loops": plan.loops,
            "trained_loops": spec.steps,
            "tokens": tokens,
            "core_layer_passes": tokens * plan.loops * spec.n_core,  # (token, step, core layer) computed
            "state_bytes": plan.layout.state_bytes,
            "flops": flops,  # this request's FLOPs (depthserve/models/flops.py, plus the conv)
            "plain_flops": base,  # every layer once, as a plain model, on the same tokens
            "relative_compute": flops / base if base else 1.0,
        }

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, input_ids, positions, pool: KVPool, meta: AttentionMetadata) -> torch.Tensor:
        step = meta.batch
        base = self.plan_depth(DepthParams(loops=1)).columns  # the base slots sit alike in every request
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for i, layer in enumerate(self.prefix_layers):
            x = layer(x, cos, sin, pool, meta, base[f"prefix{i}"])
        spec = self.spec
        conv = ConvContext(step, spec.conv_kernel, spec.steps, spec.n_core, self.config.intermediate_size, pool,
                           x.dtype, x.device)
        for t in range(1, spec.steps + 1):
            indices = [i for i, item in enumerate(step.items) if item.plan.loops >= t]
            if not indices:
                break
            items = [step.items[i] for i in indices]
            rows = step.rows(items)
            if rows is None:
                xs, cs, ss = x, cos, sin
            else:
                xs, cs, ss = x.index_select(0, rows), cos.index_select(0, rows), sin.index_select(0, rows)
            for j, layer in enumerate(self.core_layers):
                name = core_slot_name(j, t)
                if t == 1:  # every request runs step 1: its slots are in the batch's base table
                    sub_meta, columns = meta, base[name]
                else:
                    sub_meta = step.slot_meta(items, [item.plan.columns[name] for item in items])
                    columns = slice(None)
                xs = layer(xs, t, cs, ss, pool, sub_meta, columns, conv, indices)
            x = xs if rows is None else x.index_copy(0, rows, xs)
        conv.write_back()
        for i, layer in enumerate(self.suffix_layers):
            x = layer(x, cos, sin, pool, meta, base[f"suffix{i}"])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- weights --------------------------------------------------------------------------------
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        source = getattr(self, "checkpoint_path", "this checkpoint")

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise CheckpointFormatError(f"{source}: PUT weight {name} is missing")
            return weights.pop(name)

        bias = self.config.attention_bias
        with torch.no_grad():
            load_embeddings_and_head(self, weights, get)
            plain = [(layer, prefix_layer(i)) for i, layer in enumerate(self.prefix_layers)] + \
                    [(layer, suffix_layer(i)) for i, layer in enumerate(self.suffix_layers)]
            for layer, p in plain:
                load_decoder_layer(layer, get, p, bias)
            for j, layer in enumerate(self.core_layers):
                p = core_layer(j)
                load_attention(layer.self_attn, get, p, bias)
                layer.gate_up_proj.weight.copy_(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
                layer.down_proj.weight.copy_(get(p + "mlp.down_proj.weight"))
                layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight"))
                for name, param in ((step_embedding(j), layer.step_embedding), (conv_weight(j), layer.conv_weight)):
                    value = get(name)
                    if tuple(value.shape) != tuple(param.shape):
                        raise CheckpointFormatError(f"{source}: {name} must be {list(param.shape)}, got {list(value.shape)}")
                    param.copy_(value)
        leftover = [k for k in weights if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise CheckpointFormatError(f"{source}: unexpected weights in a PUT checkpoint: {leftover[:5]}")

    def finish_load(self, device: torch.device) -> None:
        """The rotary tables stay fp32 whatever dtype the model was cast to; plans are re-priced."""
        cos, sin = rope_tables(self.config.head_dim, self.max_positions, self.config.rope_theta, device=device)
        self.rope_cos, self.rope_sin = cos, sin
        self._plans.clear()  # state_bytes depends on the dtype
