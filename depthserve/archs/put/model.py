"""PUT: Polymorphic Universal Transformer (docs/depth-semantics.md section 4; paper 004, Eq. 6-9).

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

Per-token loops (docs/depth-semantics.md section 6): a request whose `loops` is a range runs each
step's tokens at the depth policy's level (`BatchItem.level`). Passes up to the range's minimum
have dense slots; each later pass's slot is routed and holds only the tokens that ran it. The
pass-t conv state is the last k-1 rows of Z of the tokens that ran pass t: a step whose tokens
stop before pass t leaves it as it was. The state holds every pass up to the range's maximum.

Readouts (the confidence exit, layers/early_exit.py): with no suffix layers, the LM head reads the
output of a token's last pass, so the head over pass t's output is exactly what the token gives
if it stops after t, and a token may stop at any pass of its range. With suffix layers it is not:
they attend over the earlier tokens' suffix states, which in a prefill chunk exist only once
those tokens have run all their passes, so such a model declares no readout.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from depthserve.archs.base import BuildOptions, DepthModel, RequestState, StaticDecodeSpec
from depthserve.archs.llama.format import PACKED_MODULES, LlamaConfig
from depthserve.archs.llama.model import LlamaAttention, LlamaDecoderLayer, fp32_rope_tables, tie_lm_head
from depthserve.archs.put.format import (
    PUTPlan,
    PUTRecord,
    PUTSpec,
    base_columns,
    core_slot_name,
    knobs,
    prefix_slot_name,
    suffix_slot_name,
)
from depthserve.archs.put.format import plan as put_plan
from depthserve.archs.put.format import report as put_report
from depthserve.depth import DepthParams, DepthReport, KnobSpec
from depthserve.layers.attention import AttentionMetadata, KVPool, StaticRows, paged_attention
from depthserve.layers.batch import StepBatch
from depthserve.layers.norm import RMSNorm
from depthserve.layers.rotary import rope_tables
from depthserve.layers.rows import StepRows, step_rows


class ConvContext:
    """The conv states of one step's items and, for a set of items running a core step, where each
    row's k taps come from: its own chunk's Z rows or the state carried from earlier chunks.

    `states` is [items, T, n_core, k-1, d_ff]: zeros for a chunk starting at position 0, else read
    from the sequence's state pages; written back after the forward.
    """

    def __init__(self, step: StepBatch, spec: PUTSpec, d_ff: int, pool: KVPool, dtype: torch.dtype,
                 device: torch.device):
        self.step, self.k, self.k1 = step, spec.conv_kernel, spec.conv_kernel - 1
        self.pool = pool
        self.states = torch.zeros(len(step.items), spec.steps, spec.n_core, self.k1, d_ff, dtype=dtype, device=device)
        self._taps: dict[tuple[int, ...], tuple[list[torch.Tensor], torch.Tensor | None]] = {}
        carried = [i for i, item in enumerate(step.items) if item.start > 0] if self.k1 else []
        if carried:
            page_lists = [step.items[i].state for i in carried]
            values = _gather_state_pages(pool, page_lists)
            for i, offset in zip(carried, _state_offsets(pool, page_lists)):
                own = self.states[i, : step.items[i].plan.loops]
                own.copy_(values[offset : offset + own.numel()].view_as(own))

    def apply(self, level: StepRows, t: int, layer: int, z: torch.Tensor, conv: CausalDWConv) -> torch.Tensor:
        """DWConv_k(Z) of core layer `layer` at step t for the rows of `level` (Z [rows, d_ff])."""
        history, taps = self.window(level.item_indices, level.item_row_counts, t, layer, z)  # Z_{n-j}
        return conv(history, taps)

    def window(self, indices: list[int], counts: list[int], t: int, layer: int,
               z: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """For Z [rows, d_ff] of core layer `layer` at step t over the items `indices`, `counts[i]`
        rows each (packed in this order; an item's tokens that stopped before t are not among them):
        the rows the taps read (the items' carried states, then Z) and, per tap j, the index of
        Z_{n-j} in them, n-j counting only the tokens that ran t (section 6). Keeps the last k-1 of
        each item's rows as its new state."""
        taps, new = self.taps(indices, counts)
        if not self.k1:
            return z, taps
        states = self.states[indices, t - 1, layer]  # [m, k-1, d_ff]
        history = torch.cat([states.reshape(-1, z.shape[1]), z])
        self.states[indices, t - 1, layer] = history.index_select(0, new).view_as(states)
        return history, taps

    def taps(self, indices: list[int], counts: list[int]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """For the items `indices` (`counts` rows each, packed in this order): per tap j, the index of
        Z_{n-j} in cat(states of the items [m*(k-1) rows], Z [rows]); and the indices of the new states."""
        key = (tuple(indices), tuple(counts))
        if key not in self._taps:
            k1, m = self.k1, len(indices)
            taps = [[] for _ in range(self.k)]
            new = []
            row = 0
            for i, n in enumerate(counts):
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


def _read_pages(pool: KVPool, pages: torch.Tensor) -> torch.Tensor:
    """[*pages.shape, 2, block_size, head_dim] the values of these pages, each its K half then its V half."""
    return torch.stack([pool.k_pages[pages], pool.v_pages[pages]], dim=pages.dim())


def _gather_state_pages(pool: KVPool, page_lists: list[np.ndarray]) -> torch.Tensor:
    """The values of these pages in state order, flat."""
    return _read_pages(pool, _page_index(pool, page_lists)).view(-1)


def _scatter_state_pages(pool: KVPool, page_lists: list[np.ndarray], values: torch.Tensor) -> None:
    index = _page_index(pool, page_lists)
    halves = values.to(pool.k_pages.dtype).view(len(index), 2, *pool.k_pages.shape[1:])
    pool.k_pages.index_copy_(0, index, halves[:, 0])
    pool.v_pages.index_copy_(0, index, halves[:, 1])


class DecodeConv:
    """The conv states of a decode step at static shapes (one token per row): read from every row's
    state pages (zeros for a row at position 0), and a pass's new state kept where the row runs it."""

    def __init__(self, spec: PUTSpec, d_ff: int, pool: KVPool, static: StaticRows, kernels, x: torch.Tensor):
        self.spec, self.pool, self.static, self.kernels = spec, pool, static, kernels
        self.shape = (x.shape[0], spec.steps, spec.n_core, spec.conv_kernel - 1, d_ff)
        if spec.conv_kernel > 1:
            values = _read_pages(pool, static.state_pages.clamp(min=0)).reshape(static.state_pages.shape[0], -1)
            self.stored = torch.where((static.positions > 0)[:, None], values, torch.zeros_like(values))
            self.states = self.stored[:, : math.prod(self.shape[1:])].view(self.shape)
        else:
            self.states = x.new_zeros(self.shape)
        self.new: dict[tuple[int, int], torch.Tensor] = {}  # (step, layer) -> the states after it

    def apply(self, level: StepRows, t: int, layer: int, z: torch.Tensor, conv: CausalDWConv) -> torch.Tensor:
        state = self.states[:, t - 1, layer]  # [rows, k-1, d_ff], oldest first
        k1 = state.shape[1]
        history = torch.cat([state, z[:, None]], dim=1)  # Z_{n-k+1} .. Z_n
        out = conv.weight[0] * z
        for j in range(1, k1 + 1):
            out = out + conv.weight[j] * history[:, k1 - j]
        self.new[t, layer] = level.merge(state, history[:, 1:])
        return out

    def write_back(self) -> None:
        """Store every row's states (those of passes no row ran as they were) into its state pages
        (pages of -1: nothing)."""
        if self.spec.conv_kernel == 1:
            return
        rows = self.shape[0]
        kept = torch.stack([self.new.get((t, j), self.states[:, t - 1, j]) for t in range(1, self.spec.steps + 1)
                            for j in range(self.spec.n_core)], dim=1).reshape(rows, -1)
        values = torch.cat([kept, self.stored[:, kept.shape[1]:]], dim=1)
        pages = self.static.state_pages
        (num_pages, bs, hd) = pages.shape[1:] + self.pool.k_pages.shape[1:]
        halves = values.view(rows, num_pages, 2, bs, hd)
        offsets = torch.arange(bs, device=values.device)
        index = torch.where(pages[:, :, None] >= 0, pages[:, :, None] * bs + offsets, -1)
        self.kernels.store_kv(halves[:, :, 0].reshape(rows, num_pages * bs, hd),
                              halves[:, :, 1].reshape(rows, num_pages * bs, hd),
                              self.pool.k_pages, self.pool.v_pages, index.reshape(rows, num_pages * bs))


# ==== the modules ===================================================================================
class PUTAttention(LlamaAttention):
    """Core attention: Ô = SiLU(O) ⊙ O on every head's output before W_O (Eq. 7)."""

    def forward(self, x, cos, sin, pool: KVPool, meta: AttentionMetadata, columns: slice) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        out = paged_attention(q, k, v, pool, meta, columns, self.scale).reshape(x.shape[0], self.q_size)
        return self.o_proj(F.silu(out) * out)


class CausalDWConv(nn.Module):
    """DWConv_k(Z)_n = sum_{j<k} w_j ⊙ Z_{n-j}, the taps shared by every step (Eq. 8)."""

    def __init__(self, kernel: int, features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(kernel, features), requires_grad=False)  # w_0..w_{k-1}

    def forward(self, history: torch.Tensor, taps: list[torch.Tensor]) -> torch.Tensor:
        out = self.weight[0] * history.index_select(0, taps[0])
        for j in range(1, len(taps)):
            out = out + self.weight[j] * history.index_select(0, taps[j])
        return out


class PUTMLP(nn.Module):
    """U W_down with Z = ReLU(H W_gate + P(t)) ⊙ (H W_up) and U = SiLU(Z + DWConv_k(Z)) (Eq. 8-9)."""

    def __init__(self, cfg: LlamaConfig, spec: PUTSpec, index: int):
        super().__init__()
        self.index = index  # position in the core
        ffn = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * ffn, bias=False)
        self.down_proj = nn.Linear(ffn, cfg.hidden_size, bias=False)
        self.step_embedding = nn.Parameter(torch.zeros(spec.steps, ffn), requires_grad=False)  # P(1..T)
        self.conv = CausalDWConv(spec.conv_kernel, ffn)

    def forward(self, H: torch.Tensor, t: int, conv: ConvContext | DecodeConv, level: StepRows) -> torch.Tensor:
        z = self.z(H, t)
        return self.down_proj(F.silu(z + conv.apply(level, t, self.index, z, self.conv)))  # Eq. 8

    def z(self, H: torch.Tensor, t: int) -> torch.Tensor:
        gate, up = self.gate_up_proj(H).chunk(2, dim=-1)
        return F.relu(gate + self.step_embedding[t - 1]) * up  # Eq. 9


class PUTCoreLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, spec: PUTSpec, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = PUTAttention(cfg, slot=-1)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = PUTMLP(cfg, spec, index)

    def forward(self, x, t: int, cos, sin, pool, meta, columns, conv: ConvContext | DecodeConv, level: StepRows):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, pool, meta, columns)
        return h + self.mlp(self.post_attention_layernorm(h), t, conv, level)


class PUTForCausalLM(nn.Module, DepthModel):
    uses_step_batch = True
    packed_modules = PACKED_MODULES

    def __init__(self, cfg: LlamaConfig, spec: PUTSpec, max_positions: int):
        super().__init__()
        self.config = cfg
        self.spec = spec
        self.readout_every_level = spec.n_suffix == 0  # module docstring: readouts
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
        self.base_columns = base_columns(cfg, spec)  # the base slots sit alike in every request's table

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def forward(self, input_ids, positions, pool: KVPool, meta: AttentionMetadata) -> torch.Tensor:
        base = self.base_columns
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for i, layer in enumerate(self.prefix_layers):
            x = layer(x, cos, sin, pool, meta, base[prefix_slot_name(i)])
        x = self.core(x, cos, sin, pool, meta)
        for i, layer in enumerate(self.suffix_layers):
            x = layer(x, cos, sin, pool, meta, base[suffix_slot_name(i)])
        return self.norm(x)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of core outputs read as final (no suffix layers: module docstring)."""
        return self.compute_logits(self.norm(x))

    def core(self, x, cos, sin, pool, meta) -> torch.Tensor:
        """The core's passes 1..loops: pass t over the rows whose requests run it.

        A request runs its plan's loops, or with a range knob the depth policy's level for this step
        (section 6; all its tokens in the step alike). Pass t attends over its own slots, which
        with a range knob past its minimum hold only the tokens that ran t. A request that stops
        before t leaves its pass-t conv state as it was: the state is that of the tokens that ran t."""
        rows, spec = step_rows(meta), self.spec
        loops = rows.confidence_exit(0)  # each row's loops, lowered as tokens exit (eager steps)
        if rows.static_shapes:
            conv = DecodeConv(spec, self.config.intermediate_size, pool, meta.static, meta.kernels, x)
        else:
            conv = ConvContext(meta.batch, spec, self.config.intermediate_size, pool, x.dtype, x.device)
        for t in range(1, rows.deepest(loops.levels, spec.steps) + 1):
            level = rows.narrow(loops.levels, t)
            if level.empty:  # every token stopped early
                break
            xs, cs, ss = level.take(x), level.take(cos), level.take(sin)
            for j, layer in enumerate(self.core_layers):
                sub_meta, columns = level.attend(core_slot_name(j, t))
                xs = layer(xs, t, cs, ss, pool, sub_meta, columns, conv, level)
            x = level.merge(x, xs)
            if self.readout_every_level:
                loops.check(self.readout, xs, level.rows, t)
        conv.write_back()
        loops.finish()
        rows.emit(loops.readouts(x.device)[:, None])
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- depth ------------------------------------------------------------------------------------
    def depth_knobs(self) -> dict[str, KnobSpec]:
        return knobs(self.spec)

    def plan(self, depth: DepthParams) -> PUTPlan:
        return put_plan(self.config, self.spec, depth, self.norm.weight.element_size())  # the activation dtype's

    def static_decode_spec(self) -> StaticDecodeSpec:
        """Rows hold every core pass's slots and state (T passes); a row's setting is its loop count."""
        deepest = self.plan(DepthParams(loops=self.spec.steps)).layout
        return StaticDecodeSpec(deepest, settings=1, state_bytes=deepest.state_bytes, decisions=1,
                                levels=tuple(range(1, self.spec.steps + 1)))

    def row_settings(self, plan: PUTPlan, level: int | None) -> np.ndarray:
        return np.array([plan.step_level(level)], dtype=np.float32)

    def new_record(self, plan: PUTPlan) -> PUTRecord:
        return PUTRecord()

    def record_decisions(self, record: PUTRecord, start: int, decisions: np.ndarray) -> dict[str, int]:
        record.write(start, decisions[:, 0])
        return {}

    def report(self, request: RequestState) -> DepthReport:
        return put_report(self.config, self.spec, request.plan, request.num_computed_tokens,
                          request.num_output_tokens, request.levels, request.record)

    # ---- weights ----------------------------------------------------------------------------------
    def after_load(self, loaded: set[str]) -> set[str]:
        return tie_lm_head(self, loaded)

    def finish_load(self, device: torch.device) -> None:
        fp32_rope_tables(self, device)


def build(hf_config: dict, spec: PUTSpec, options: BuildOptions) -> PUTForCausalLM:
    return PUTForCausalLM(LlamaConfig.from_hf(hf_config), spec, options.max_len)
