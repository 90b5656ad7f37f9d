"""FLOP counts for `relative_compute`: weight matmuls plus attention score and value products."""

from __future__ import annotations

from depthserve.models.llama import LlamaConfig


def layer_weight_flops(cfg: LlamaConfig) -> float:
    """Weight matmuls of one full decoder layer for one token (QKV, O, gate/up, down)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    return 2 * d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + 2 * cfg.num_heads * hd * d \
        + 2 * 3 * d * cfg.intermediate_size


def attention_flops(num_q_heads: int, head_dim: int, context_sum: float) -> float:
    """Scores (q.k) and values (p.v) over `context_sum` (query, key) pairs per head."""
    return 4 * num_q_heads * head_dim * context_sum


def plain_flops(cfg: LlamaConfig, tokens: int, logit_rows: int) -> float:
    """The plain model over positions 0..tokens-1 (position p attends to p + 1 keys), plus the LM
    head on the `logit_rows` rows whose logits were computed (the sampled positions)."""
    ctx_sum = tokens * (tokens + 1) / 2
    return tokens * cfg.num_layers * layer_weight_flops(cfg) + logit_rows * 2 * cfg.hidden_size * cfg.vocab_size \
        + cfg.num_layers * attention_flops(cfg.num_heads, cfg.head_dim, ctx_sum)
