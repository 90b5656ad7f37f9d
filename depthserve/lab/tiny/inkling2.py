"""Random-weight Inkling-2 loop text checkpoints, built and saved by transformers' own
Inkling2LoopForCausalLM (so config.json and the tensor names are what transformers writes).

The random weights are made to matter: the zero-initialised queries of the block and message
attention residuals, the dynamic convolutions' static taps and the router's score correction get
random values, and the output projections are scaled so that the final logits (softcapped at
`final_logit_softcapping`) are peaked and greedy comparisons with the reference mean something."""

from __future__ import annotations

from pathlib import Path

# Two layers per attention-residual block; the looped band (layers 2..5) spans two blocks, so the
# messages of a pass read the block states of the previous one, not only its last hidden state.
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
            swa_num_key_value_heads=2, swa_head_dim=16, d_rel=4, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_layers_per_attn_res_block=2, loop_layer_index_start=2,
            loop_layer_index_end=6, loop_gate_rank=8, max_position_embeddings=512)
TINY_LAYER_TYPES = ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid", "hybrid", "hybrid_sliding",
                    "hybrid_sliding", "hybrid"]
LOGIT_GAIN = 6.0  # the LM head's rows as a multiple of a unit-variance projection
# Gentler message gates and residual queries than unit-variance ones: with those, transformers in fp32
# disagrees with itself by up to 1e-3 in logprobs between a batch of one and of two at 4 passes
# (rounding amplified pass after pass); with these, by 3e-5.
MESSAGE_GAIN = 0.3
QUERY_STD = 0.3


CLI_FLAGS = ()  # make-tiny flags of its own (registry.TinyCheckpoints): none


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None,
              *, loops: int = 2, sliding_window: int = 8, rel_extent: int = 12, log_scaling_n_floor: int = 16) -> Path:
    """A random Inkling-2 loop text checkpoint with the tiny shapes and `loops` trained passes of the
    looped band; `rel_extent` and `log_scaling_n_floor` small so that test prompts reach past both."""
    import torch
    from transformers import Inkling2LoopForCausalLM, Inkling2LoopTextConfig

    from depthserve.errors import ConfigurationError
    from depthserve.loading.tokenizer import byte_tokenizer

    if like is not None:
        raise ConfigurationError("inkling2 make-tiny has no --like: its shapes are Inkling-2's own tiny ones")
    tokenizer = tokenizer or byte_tokenizer()
    kv_heads = num_kv_heads or TINY["num_key_value_heads"]
    shapes = {**TINY, "num_key_value_heads": kv_heads, "swa_num_key_value_heads": kv_heads}
    config = Inkling2LoopTextConfig(
        vocab_size=len(tokenizer), unpadded_vocab_size=len(tokenizer), num_hidden_layers=len(TINY_LAYER_TYPES),
        layer_types=list(TINY_LAYER_TYPES), sliding_window_size=sliding_window, rel_extent=rel_extent,
        log_scaling_n_floor=log_scaling_n_floor, loop_num_passes=loops, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, **shapes)
    torch.manual_seed(seed)
    model = Inkling2LoopForCausalLM(config).float().eval()
    randomize(model, seed)
    out = Path(out)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def randomize(model, seed: int) -> None:
    """Random weights of the scales described above, in place, for a transformers Inkling2LoopForCausalLM."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(shape, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lm_head.weight"):
                param.copy_(normal(param.shape, LOGIT_GAIN / param.shape[1] ** 0.5))
            elif "message_gate" in name:
                param.copy_(normal(param.shape, MESSAGE_GAIN / param.shape[1] ** 0.5))
            elif name.endswith("weight") and param.dim() == 2 and "embed" not in name:
                param.copy_(normal(param.shape, 1 / param.shape[1] ** 0.5))
            elif name.endswith(("gate_up_proj", "down_proj")) and param.dim() == 3:
                param.copy_(normal(param.shape, 1 / param.shape[2] ** 0.5))
            elif name.endswith(".query"):
                param.copy_(normal(param.shape, QUERY_STD))
            elif name.endswith("static_weight"):
                param.copy_(normal(param.shape, 0.5))
            elif name.endswith(".proj"):
                param.copy_(normal(param.shape, 1.0))
            elif name.endswith(".scale") or name.endswith("norm.weight"):
                param.copy_(1 + normal(param.shape, 0.2))
            elif name.endswith("conv1d.weight"):
                param.copy_(normal(param.shape, 0.5))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(normal(buffer.shape, 0.1))
