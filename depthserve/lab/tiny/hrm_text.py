"""Random-weight HRM-Text checkpoints, built and saved by transformers' own HrmTextForCausalLM (so
the config.json and tensor names, fused as transformers saves them, are exactly what it writes).

The random weights are made to matter: the projections are drawn at unit gain, z_L_init is not
zero, and the head is scaled up so that the output distributions are peaked and greedy
comparisons with the reference mean something."""

from __future__ import annotations

from pathlib import Path

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16, max_position_embeddings=512)
LAYERS_PER_STACK = 2
HEAD_GAIN = 6.0  # the LM head's weights as a multiple of a unit-gain draw


CLI_FLAGS = ()  # make-tiny flags of its own (registry.TinyCheckpoints): none


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None,
              *, h_cycles: int = 2, l_cycles: int = 2, prefix_lm: bool = True) -> Path:
    """A random HRM-Text checkpoint with the tiny shapes and the given trained cycle counts; `like`
    and `num_kv_heads` are not supported (HRM-Text has its own shapes and no grouped heads)."""
    import torch
    from transformers import HrmTextConfig, HrmTextForCausalLM

    from depthserve.errors import ConfigurationError
    from depthserve.loading.tokenizer import byte_tokenizer

    if like is not None or num_kv_heads is not None:
        raise ConfigurationError("hrm_text make-tiny has no --like or --num-kv-heads: its shapes are its own")
    tokenizer = tokenizer or byte_tokenizer()
    config = HrmTextConfig(vocab_size=len(tokenizer), num_hidden_layers=LAYERS_PER_STACK, H_cycles=h_cycles,
                           L_cycles=l_cycles, prefix_lm=prefix_lm, tie_word_embeddings=False,
                           eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **TINY)
    torch.manual_seed(seed)
    model = HrmTextForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            draw = torch.randn(param.shape, generator=generator)
            if name == "model.z_L_init":
                param.copy_(draw)
            elif name == "model.embed_tokens.weight":
                param.copy_(draw * config.initializer_range)  # the model multiplies by embedding_scale
            elif name == "lm_head.weight":
                param.copy_(draw * HEAD_GAIN / param.shape[1] ** 0.5)
            elif param.dim() == 2:
                param.copy_(draw / param.shape[1] ** 0.5)
    out = Path(out)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
