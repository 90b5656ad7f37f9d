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
from depthserve.layers.attention import AttentionMetadata, KVPool, paged_attention
from depthserve.layers.embedding import checkpoint_embedding
from depthserve.layers.norm import RMSNorm
from depthserve.layers.rotary import register_rope_buffers
from depthserve.layers.rows import StepRows, step_rows


class ConvState:
    """The conv states of one step's sequences, [sequences, T, n_core, k-1, d_ff] (the last k-1 rows
    of Z per pass and core layer, oldest first): read from each sequence's state pages (zeros for a
    sequence starting at position 0), carried from row to row through the step, and written back.

    A pass's rows (`StepRows`) run the conv over cat(their sequences' states, their Z rows) through
    the window the rows give (`causal_window`: a prefill chunk's rows read their own chunk's Z, its
    first rows the state; a decode row reads its state); a sequence none of whose rows run the pass
    keeps its state as it was. Pages of -1 hold nothing: a sequence with fewer passes than T has
    state pages for its own passes only.
    """

    def __init__(self, rows: StepRows, spec: PUTSpec, d_ff: int, pool: KVPool, x: torch.Tensor):
        self.pool, self.kernels, self.k1 = pool, rows.meta.kernels, spec.conv_kernel - 1
        self.pages, carried = rows.sequence_state_pages()
        self.shape = (self.pages.shape[0], spec.steps, spec.n_core, self.k1, d_ff)
        if not self.k1:
            self.stored = self.states = x.new_zeros(self.shape)
            return
        values = _read_pages(pool, self.pages.clamp(min=0)).reshape(self.pages.shape[0], -1).to(x.dtype)
        self.stored = torch.where(carried[:, None], values, torch.zeros_like(values))
        size = math.prod(self.shape[1:])
        self.states = F.pad(self.stored, (0, max(0, size - self.stored.shape[1])))[:, :size].reshape(self.shape)

    def apply(self, level: StepRows, t: int, layer: int, z: torch.Tensor, conv: CausalDWConv) -> torch.Tensor:
        """DWConv_k(Z) of core layer `layer` at pass t for the rows of `level` (Z [rows, d_ff])."""
        every = self.states[:, t - 1, layer]  # [sequences, k-1, d_ff]
        own = level.of_sequences(every)
        history = torch.cat([own.reshape(-1, z.shape[1]), z])  # Z_{n-j}: carried, then this pass's rows
        taps, kept = level.causal_window(self.k1 + 1)
        if self.k1:
            self.states[:, t - 1, layer] = level.merge_sequences(every, history.index_select(0, kept).view_as(own))
        return conv(history, taps)

    def write_back(self) -> None:
        """Every sequence's states into its state pages (the values past them in its last page as read)."""
        if not self.k1:
            return
        rows, have = self.pages.shape[0], self.stored.shape[1]
        values = torch.cat([self.states.reshape(rows, -1), self.stored[:, math.prod(self.shape[1:]):]], dim=1)
        num_pages, (bs, hd) = self.pages.shape[1], self.pool.k_pages.shape[1:]
        halves = values[:, :have].to(self.pool.k_pages.dtype).view(rows, num_pages, 2, bs, hd)
        offsets = torch.arange(bs, device=values.device)
        index = torch.where(self.pages[:, :, None] >= 0, self.pages[:, :, None] * bs + offsets, -1)
        self.kernels.store_kv(halves[:, :, 0].reshape(rows, num_pages * bs, hd),
                              halves[:, :, 1].reshape(rows, num_pages * bs, hd),
                              self.pool.k_pages, self.pool.v_pages, index.reshape(rows, num_pages * bs))


def _read_pages(pool: KVPool, pages: torch.Tensor) -> torch.Tensor:
    """[*pages.shape, 2, block_size, head_dim] the values of these pages, each its K half then its V half
    (a sequence's state lives in its state pages in order)."""
    return torch.stack([pool.k_pages[pages], pool.v_pages[pages]], dim=pages.dim())


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

    def forward(self, H: torch.Tensor, t: int, conv: ConvState, level: StepRows) -> torch.Tensor:
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

    def forward(self, x, t: int, cos, sin, pool, meta, columns, conv: ConvState, level: StepRows):
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
        self.embed_tokens = checkpoint_embedding(cfg.vocab_size, cfg.hidden_size)
        self.prefix_layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(spec.n_prefix))
        self.core_layers = nn.ModuleList(PUTCoreLayer(cfg, spec, j) for j in range(spec.n_core))
        self.suffix_layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(spec.n_suffix))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        register_rope_buffers(self, cfg.head_dim, max_positions)
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
        conv = ConvState(rows, spec, self.config.intermediate_size, pool, x)
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
