"""Random-weight Dory checkpoints, built and saved by transformers' own DoryForCausalLM (so the
config.json and tensor names are exactly what transformers writes: the released layout).

The random weights are made to matter: the interpolation rates, query scales and gates vary per
channel, and the logit scale is raised so that the output distributions are peaked and greedy
comparisons with the reference mean something."""

from __future__ import annotations

from pathlib import Path

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            n_input_layers=2, n_recurrent_layers=2, n_output_layers=2, max_position_embeddings=512)
# sliding, full in each section, so every section has both kinds of layer
TINY_LAYER_TYPES = ["sliding_attention", "full_attention"] * 3
LOGIT_SHARPNESS = 60.0  # logit_scale as a multiple of its initial value


CLI_FLAGS = ()  # make-tiny flags of its own (registry.TinyCheckpoints): none


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None,
              *, loops: int = 2, cache_mode: str = "per_loop", sliding_window: int = 8) -> Path:
    """A random Dory checkpoint with the tiny shapes, `loops` trained recurrent passes and the
    given KV cache mode; `like` is not supported (Dory has its own shapes)."""
    import torch
    from transformers import DoryConfig, DoryForCausalLM

    from depthserve.errors import ConfigurationError
    from depthserve.loading.tokenizer import byte_tokenizer

    if like is not None:
        raise ConfigurationError("dory make-tiny has no --like: its shapes are Dory's own tiny ones")
    tokenizer = tokenizer or byte_tokenizer()
    shapes = {**TINY, "num_key_value_heads": num_kv_heads or TINY["num_key_value_heads"]}
    config = DoryConfig(vocab_size=len(tokenizer), num_hidden_layers=len(TINY_LAYER_TYPES),
                        layer_types=list(TINY_LAYER_TYPES), sliding_window=sliding_window, n_recurrent_loops=loops,
                        recurrent_kv_cache_mode=cache_mode, tie_word_embeddings=False,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **shapes)
    torch.manual_seed(seed)
    model = DoryForCausalLM(config).float().eval()
    init = config.initializer_range
    generator = torch.Generator().manual_seed(seed)

    def uniform(shape, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(shape, generator=generator)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif name.endswith(("lambda_1", "lambda_2")):
                param.copy_(uniform(param.shape, 2 * init, 8 * init))
            elif name.endswith(("sqk", "s_gate")):
                param.copy_(uniform(param.shape, 0.5 * init, 1.5 * init))
            elif name.endswith(("suv_gate", "suv_up")):
                param.copy_(uniform(param.shape, 0.5, 1.5))
            elif name.endswith("logit_scale"):
                param.copy_(uniform(param.shape, 0.8 * LOGIT_SHARPNESS * init, 1.2 * LOGIT_SHARPNESS * init))
    out = Path(out)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
