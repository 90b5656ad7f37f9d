"""SAOBP: one-step belief-propagation attention (depth-semantics.md section 5; paper 003, Eq. 9-11).

For query row j of an SAOBP layer's head, with raw scores s_jk and unrefined causal softmax row A_j:

    out_j = softmax_k(s_jk + c_k) . V            over k <= j
    c_k   = sum_{i < j} log(M_ik / m_0)          rows k <= i < j (masked entries send m_0: no term)
    M_ik  = A_ik + m_0 (1 - A_ik),  m_0 = e^lambda ("high", repulsive) or e^-lambda ("low", attractive)

and with `self_message` the row's own log(M_jk / m_0) is added too (A_j first: two passes over the
keys). log(M_ik / m_0) = log1p(A_ik (1/m_0 - 1)): the engine computes it in that form (`coef` below
is 1/m_0 - 1), in fp32, in log space.

Engine: beside K and V, each sequence has a per-key bias slot (SlotKind.PER_KEY_BIAS) in the paged
cache holding the running c_k per (SAOBP layer, query head, position) in fp32. Rows of a block's
bias live in the page pool itself: a bias page is a KV page whose K half is read as fp32, R =
head_dim * itemsize / 4 rows of `block_size` floats (one row = one (layer, head) for one token
block); a block of tokens takes ceil(L_saobp * H / R) bias pages, accounted in bytes like any page.
The bias changes for every cached key at every step, so it is per sequence: no prefix caching
(`CacheLayout.uses_prefix_cache`), and forks compute their own.

A prefill chunk [start, end) reads the cached c_k (rows < start; positions >= start have none yet)
and adds, for row j, the terms of the chunk's earlier rows (an exclusive cumulative sum over the
chunk's rows; inclusive with the self message), then writes back c_k + all of the chunk's terms.
A decode row attends with the cached bias (its own, newest key: 0), then a second kernel adds
its terms log(M_jk / m_0) to every key's bias (and sets the new key's).

Checkpoint: a plain Llama checkpoint with `depth.architecture = "saobp"` and a `depth.saobp` body
(lambda, variant, self_message, layers); no extra tensors (docs/checkpoint-format.md, "SAOBP").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from depthserve.depth import DepthParams, KnobSpec
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.errors import InvalidDepthError
from depthserve.kernels import ops
from depthserve.layers.attention import AttentionMetadata, KVPool
from depthserve.layers.rotary import rope_tables
from depthserve.loading.checkpoint import FORMAT_VERSION, CheckpointFormatError
from depthserve.models.llama import LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM

VARIANTS = ("high", "low")
BIAS_SLOT = "saobp.bias"


# ---- the checkpoint format ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SAOBPSpec:
    lam: float  # lambda >= 0 (trained; no per-request knob)
    variant: str = "high"  # "high": m_0 = e^lambda (repulsive); "low": m_0 = e^-lambda (attractive)
    self_message: bool = False
    layers: tuple[int, ...] | None = None  # None: every layer
    architecture: str = "saobp"

    @property
    def m0(self) -> float:
        return math.exp(self.lam if self.variant == "high" else -self.lam)

    @property
    def coef(self) -> float:
        """1/m_0 - 1: log(M_ik / m_0) = log1p(A_ik * coef)."""
        return math.expm1(-self.lam if self.variant == "high" else self.lam)

    def layer_indices(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers)) if self.layers is None else self.layers

    def to_section(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "architecture": "saobp",
            "saobp": {
                "lambda": self.lam,
                "variant": self.variant,
                "self_message": self.self_message,
                "layers": None if self.layers is None else list(self.layers),
            },
        }


def read_spec(section: dict[str, Any], hf_config: dict[str, Any]) -> SAOBPSpec:
    body = section.get("saobp")
    if not isinstance(body, dict):
        raise CheckpointFormatError("depth.architecture is 'saobp' but depth.saobp is missing")
    unknown = sorted(set(body) - {"lambda", "variant", "self_message", "layers"})
    if unknown:
        raise CheckpointFormatError(f"depth.saobp has unknown field(s) {unknown}")
    lam = body.get("lambda")
    if not isinstance(lam, (int, float)) or isinstance(lam, bool) or not math.isfinite(lam) or lam < 0:
        raise CheckpointFormatError(f"depth.saobp.lambda must be a finite number >= 0, got {lam!r}")
    variant = body.get("variant", "high")
    if variant not in VARIANTS:
        raise CheckpointFormatError(f"depth.saobp.variant must be one of {VARIANTS}, got {variant!r}")
    self_message = body.get("self_message", False)
    if not isinstance(self_message, bool):
        raise CheckpointFormatError(f"depth.saobp.self_message must be true or false, got {self_message!r}")
    layers = body.get("layers")
    if layers is not None:
        num_layers = hf_config["num_hidden_layers"]
        if (not isinstance(layers, list) or not layers
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers)
                or len(set(layers)) != len(layers) or not all(0 <= v < num_layers for v in layers)):
            raise CheckpointFormatError(
                f"depth.saobp.layers must be null (every layer) or distinct layer indices in 0..{num_layers - 1}, "
                f"got {layers!r}")
        layers = tuple(sorted(layers))
    return SAOBPSpec(float(lam), variant, self_message, layers)


# ---- make-tiny --------------------------------------------------------------------------------------
def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None, *,
              lam: float = 1.0, variant: str = "high", self_message: bool = False,
              layers: list[int] | None = None, max_position_embeddings: int | None = None) -> Path:
    """A random SAOBP checkpoint on the tiny Llama base (tiny.TINY shapes, or `like`'s).

    The tiny default context is 8192 tokens (long-context tests); lambda defaults to 1 so that
    the bias visibly changes the outputs (the paper trains with 0.05-0.2)."""
    from depthserve.loading.checkpoint import write_checkpoint
    from depthserve.tiny import base_config, load_default_tokenizer, model_shapes, random_weights

    shapes = model_shapes(like, num_kv_heads)
    if not like:
        shapes["max_position_embeddings"] = 8192
    if max_position_embeddings is not None:
        shapes["max_position_embeddings"] = int(max_position_embeddings)
    tokenizer = tokenizer or load_default_tokenizer()
    cfg = base_config(tokenizer, shapes, tied=bool(like))
    spec = SAOBPSpec(float(lam), variant, self_message, None if layers is None else tuple(sorted(layers)))
    cfg["depth"] = spec.to_section()
    read_spec(cfg["depth"], cfg)  # the same checks as at load
    weights = random_weights(cfg, spec, torch.Generator().manual_seed(seed))
    return write_checkpoint(Path(out), cfg, weights, tokenizer)


# ---- the reference forward (float64, full sequence, materialised attention matrices) -----------------
def _no_knobs(depth: Any) -> None:
    if depth is None:
        return
    knobs = depth if isinstance(depth, dict) else depth.set_knobs()
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if knobs:
        raise InvalidDepthError(f"SAOBP has no depth knobs (lambda is trained); got {sorted(knobs)}")


def reference_attention(ref, layer: int, x: torch.Tensor, spec: SAOBPSpec) -> torch.Tensor:
    """Section 5 from the materialised [n, n] attention matrix of each head. x: [n, d], normed."""
    from depthserve.reference import attention_dims, rope

    cfg, w = ref.cfg, ref.w
    H, H_kv, hd, theta = attention_dims(cfg)
    p = f"model.layers.{layer}.self_attn."
    n = x.shape[0]
    positions = torch.arange(n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()  # [j, k]: k <= j
    m0 = spec.m0
    out = torch.zeros_like(x)
    for i in range(H):
        g = i // (H // H_kv)
        q = x @ w[p + "q_proj.weight"][i * hd : (i + 1) * hd].T
        k = x @ w[p + "k_proj.weight"][g * hd : (g + 1) * hd].T
        v = x @ w[p + "v_proj.weight"][g * hd : (g + 1) * hd].T
        if p + "q_proj.bias" in w:
            q = q + w[p + "q_proj.bias"][i * hd : (i + 1) * hd]
            k = k + w[p + "k_proj.bias"][g * hd : (g + 1) * hd]
            v = v + w[p + "v_proj.bias"][g * hd : (g + 1) * hd]
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        s = (q @ k.T) / math.sqrt(hd)  # s_jk
        s = s.masked_fill(~causal, float("-inf"))
        A = torch.softmax(s, dim=-1)  # unrefined causal rows; A_ik = 0 for k > i
        M = A + m0 * (1 - A)  # Eq. 9: the message of row i about key k (masked entries: exactly m_0)
        L = torch.log(M / m0)  # log(M_ik / m_0): 0 for masked entries, in [-lambda, 0] (high) / [0, lambda] (low)
        del M
        # c_k for row j = sum over rows i < j (k <= i by construction); with self_message also i = j.
        C = torch.cumsum(L, dim=0)
        if not spec.self_message:
            C = C - L
        del L
        refined = torch.softmax(s + C, dim=-1)  # masked entries stay -inf
        del C, s, A
        out = out + (refined @ v) @ w[p + "o_proj.weight"][:, i * hd : (i + 1) * hd].T
    return out


@torch.no_grad()
def reference_forward(model_dir, token_ids, depth=None, *, dtype=torch.float64, return_decisions: bool = False,
                      force=None, **kwargs):
    """Logits [n, V] of the full-sequence SAOBP forward (section 0 with section 5's attention)."""
    from depthserve import reference as R

    _no_knobs(depth)
    ref = R.load(model_dir, dtype)
    spec: SAOBPSpec = ref.spec
    saobp_layers = set(spec.layer_indices(ref.num_layers))
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    x = ref.w["model.embed_tokens.weight"][ids]
    mask = R.causal_mask(1, len(ids))
    for layer in range(ref.num_layers):
        if layer in saobp_layers:
            h = x + reference_attention(ref, layer, R.norm(ref, layer, "a", x), spec)
            x = h + R.mlp(ref, layer, R.norm(ref, layer, "m", h))
        else:
            x = R.full_layer(ref, layer, x[None], mask)[0]
    logits = R.logits_of(ref, x)
    return (logits, {}) if return_decisions else logits


# ---- the engine's model ---------------------------------------------------------------------------------
@dataclass
class BiasTables:
    """One step's bias row tables: for each batch part, [seqs, blocks, bias pages per block] page ids."""

    pages: torch.Tensor  # [num_pages * R, block_size] fp32 view of the pool's K storage
    prefill: torch.Tensor | None  # [prefill seqs, blocks, P] int64
    decode: torch.Tensor | None  # [decodes, blocks, P] int64
    rows_per_page: int

    def tables(self, base: torch.Tensor | None, column: torch.Tensor, sub: torch.Tensor) -> torch.Tensor | None:
        """[seqs, H, blocks] bias row ids of one layer's heads."""
        if base is None:
            return None
        return (base[:, :, column] * self.rows_per_page + sub).transpose(1, 2)


class SAOBPAttention(LlamaAttention):
    def __init__(self, cfg: LlamaConfig, slot: int, position: int, spec: SAOBPSpec):
        super().__init__(cfg, slot)
        self.position = position  # index among the SAOBP layers
        self.coef = spec.coef
        self.self_message = spec.self_message

    def forward(self, x, cos, sin, pool: KVPool, meta: AttentionMetadata, columns: slice,
                bias: BiasTables, heads: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x, cos, sin)
        ops.store_kv(k, v, pool.k_pages, pool.v_pages, meta.slot_index[:, columns])
        out = torch.empty_like(q)
        column, sub = heads
        if meta.prefills:
            rows = slice(0, meta.num_prefill_tokens)
            packed = meta.packed_prefills()
            tables = packed.page_tables[:, :, columns].transpose(1, 2)
            out[rows] = ops.saobp_prefill_attention(
                q[rows], pool.k_pages, pool.v_pages, tables, bias.pages, bias.tables(bias.prefill, column, sub),
                packed.query_starts, packed.context_lens, self.scale, self.coef, self.self_message)
        if meta.num_decodes:
            rows = slice(meta.num_prefill_tokens, meta.num_tokens)
            table = meta.decode_page_table[:, :, columns].transpose(1, 2)
            bias_table = bias.tables(bias.decode, column, sub)
            out[rows], lse = ops.saobp_decode_attention(
                q[rows], pool.k_pages, pool.v_pages, table, bias.pages, bias_table, meta.decode_context_lens,
                self.scale, self.coef, self.self_message)
            ops.saobp_bias_update(q[rows], pool.k_pages, table, bias.pages, bias_table, meta.decode_context_lens,
                                  lse, self.scale, self.coef)
        return self.o_proj(out.reshape(n, self.q_size))


class SAOBPDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: LlamaConfig, index: int, position: int, spec: SAOBPSpec):
        super().__init__(cfg, index)
        self.self_attn = SAOBPAttention(cfg, index, position, spec)

    def forward(self, x, cos, sin, pool, meta, columns, bias=None, heads=None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, pool, meta, columns, bias, heads)
        return h + self.mlp(self.post_attention_layernorm(h))


class SAOBPForCausalLM(LlamaForCausalLM):
    uses_step_batch = True  # the runner passes per-sequence full page tables (the bias slot's columns)

    def __init__(self, cfg: LlamaConfig, spec: SAOBPSpec, max_positions: int):
        super().__init__(cfg, max_positions)
        self.spec = spec
        self.saobp_layers = spec.layer_indices(cfg.num_layers)
        for position, index in enumerate(self.saobp_layers):
            self.layers[index] = SAOBPDecoderLayer(cfg, index, position, spec)
        self._layouts: dict[int, CacheLayout] = {}
        self._heads: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    # ---- depth: none ------------------------------------------------------------------------------------
    def depth_knobs(self) -> dict[str, KnobSpec]:
        return {}  # lambda is trained: any knob is an error (DepthParams.validate)

    def rows_per_page(self, itemsize: int | None = None) -> int:
        """fp32 rows of block_size floats in the K half of one page (R)."""
        itemsize = itemsize or self.norm.weight.element_size()
        return max(1, self.config.head_dim * itemsize // 4)

    def bias_pages_per_block(self, itemsize: int | None = None) -> int:
        return -(-len(self.saobp_layers) * self.config.num_heads // self.rows_per_page(itemsize))

    def cache_layout(self, depth: DepthParams) -> CacheLayout:
        itemsize = self.norm.weight.element_size()
        layout = self._layouts.get(itemsize)
        if layout is None:
            dense = tuple(SlotSpec(f"layer{i}", SlotKind.DENSE, self.config.num_kv_heads)
                          for i in range(self.config.num_layers))
            bias = SlotSpec(BIAS_SLOT, SlotKind.PER_KEY_BIAS, self.bias_pages_per_block(itemsize))
            layout = self._layouts[itemsize] = CacheLayout(dense + (bias,))
        return layout

    def _head_rows(self, R: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per SAOBP layer: (bias column within the slot, row within the page) of each query head."""
        key = (R, str(device))
        if key not in self._heads:
            H = self.config.num_heads
            out = []
            for position in range(len(self.saobp_layers)):
                r = position * H + torch.arange(H)
                out.append(((r // R).to(device), (r % R).to(device)))
            self._heads[key] = out
        return self._heads[key]

    def _bias_tables(self, pool: KVPool, meta: AttentionMetadata) -> BiasTables:
        k_pages = pool.k_pages
        num_pages, bs = k_pages.shape[0], k_pages.shape[1]
        R = self.rows_per_page(k_pages.element_size())
        pages = k_pages.view(num_pages, -1).view(torch.float32).view(num_pages * R, bs)
        layout = self.cache_layout(DepthParams())
        cols = layout.columns(len(layout.slots) - 1)
        items = meta.batch.items
        num_prefills = len(meta.prefills)

        def stack(part) -> torch.Tensor | None:
            if not part:
                return None
            tables = [item.table[: -(-item.end // bs), cols] for item in part]
            padded = np.zeros((len(tables), max(len(t) for t in tables), cols.stop - cols.start), dtype=np.int64)
            for i, t in enumerate(tables):
                padded[i, : len(t)] = t
            return torch.from_numpy(padded).to(k_pages.device)

        return BiasTables(pages, stack(items[:num_prefills]), stack(items[num_prefills:]), R)

    def forward(self, input_ids, positions, pool: KVPool, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        bias = self._bias_tables(pool, meta)
        heads = self._head_rows(bias.rows_per_page, x.device)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, SAOBPDecoderLayer):
                x = layer(x, cos, sin, pool, meta, self._layout.columns(i), bias, heads[layer.self_attn.position])
            else:
                x = layer(x, cos, sin, pool, meta, self._layout.columns(i))
        return self.norm(x)

    def finish_load(self, device: torch.device) -> None:
        """Rotary tables in fp32 whatever the model dtype; fast CPU linears for fp32."""
        cos, sin = rope_tables(self.config.head_dim, self.rope_cos.shape[0], self.config.rope_theta)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        if device.type == "cpu" and self.norm.weight.dtype == torch.float32:
            from depthserve.layers.linear import optimize_linears_for_cpu

            optimize_linears_for_cpu(self)


def build_model(hf_config: dict[str, Any], spec: SAOBPSpec, max_len: int) -> nn.Module:
    cfg = LlamaConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = SAOBPForCausalLM(cfg, spec, max_positions=max_len)
    model = model.to_empty(device="cpu")
    cos, sin = rope_tables(cfg.head_dim, max_len, cfg.rope_theta)
    model.rope_cos, model.rope_sin = cos, sin
    return model
