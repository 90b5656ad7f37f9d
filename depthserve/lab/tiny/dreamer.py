"""Random-weight Dreamer checkpoints: one shared block with spread-out router logits (clear top-k
margins, so the engine's choices match the reference's) and peaked output distributions."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from depthserve.archs.dreamer.format import P, DreamerSpec, read_spec, tensor_shapes, to_section
from depthserve.lab.tiny.llama import EMBED_STD, LOGIT_STD, QK_STD, base_config, model_shapes
from depthserve.loading.checkpoint import write_checkpoint
from depthserve.loading.tokenizer import default_tokenizer

if TYPE_CHECKING:
    import torch

ROUTER_KEY_STD = 2.0  # spread-out router logits: clear top-k margins
ROUTER_BIAS_STD = 0.2
ATTN_EXPERT_GAIN = 0.8  # attention experts and the shared expert, relative to 1 / sqrt(fan_in)


def tiny_spec(like: str | None = None, *, depth: int = 4, attn_experts: int = 2, da_rope: str = "reversed_half",
              num_experts: int | None = None, top_k: int = 2) -> DreamerSpec:
    if like:
        return DreamerSpec(depth=depth, da_dim=64, num_experts=num_experts or 32, top_k=top_k, expert_rank=32,
                           expert_intermediate_size=256, attn_experts=attn_experts, da_rope=da_rope)
    return DreamerSpec(depth=depth, da_dim=16, num_experts=num_experts or 6, top_k=top_k, expert_rank=8,
                       expert_intermediate_size=32, attn_experts=attn_experts, da_rope=da_rope,
                       router_rope_theta=100.0, da_rope_theta=100.0)


def random_weights(cfg: dict, spec: DreamerSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    import torch

    d = cfg["hidden_size"]
    w = {}
    for name, shape in tensor_shapes(cfg, spec).items():
        std = 1.0 / shape[-1] ** 0.5
        if name == "model.embed_tokens.weight":
            std = EMBED_STD
        elif name == "lm_head.weight":
            std = LOGIT_STD / d**0.5  # peaked output distributions
        elif name.startswith((P + "da.q_proj", P + "da.k_proj")):
            std = QK_STD / d**0.5
        elif name.startswith((P + "sa.experts.", P + "sa.shared_expert.")):
            std = ATTN_EXPERT_GAIN / shape[-1] ** 0.5
        elif name.endswith("router.keys"):
            std = ROUTER_KEY_STD
        elif name.endswith("router.bias"):
            std = ROUTER_BIAS_STD
        tensor = torch.randn(*shape, generator=gen) * std
        if name.endswith("norm.weight"):
            tensor = 1 + torch.randn(*shape, generator=gen) * 0.1
        w[name] = tensor.contiguous()
    return w


CLI_FLAGS = ()  # make-tiny flags of its own (registry.TinyCheckpoints): none


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None,
              *, depth: int = 4, attn_experts: int = 2, da_rope: str = "reversed_half",
              num_experts: int | None = None, top_k: int = 2) -> Path:
    """A random Dreamer checkpoint: the tiny shapes (or `like`'s) with trained depth `depth`, `attn_experts`
    attention experts (0: dense), `num_experts` EA experts of which `top_k` run, and the DA RoPE mode."""
    import torch

    shapes = model_shapes(like, num_kv_heads)
    spec = tiny_spec(like, depth=depth, attn_experts=attn_experts, da_rope=da_rope, num_experts=num_experts,
                     top_k=top_k)
    tokenizer = tokenizer or default_tokenizer()
    cfg = base_config(tokenizer, shapes, tied=bool(like))
    cfg.update(architectures=["DreamerForCausalLM"], model_type="dreamer",
               num_hidden_layers=1,  # the one shared block
               intermediate_size=spec.expert_intermediate_size, depth=to_section(spec))
    read_spec(cfg["depth"], cfg)  # the checks a load makes, before anything is written
    return write_checkpoint(Path(out), cfg, random_weights(cfg, spec, torch.Generator().manual_seed(seed)), tokenizer)
