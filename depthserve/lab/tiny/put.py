"""Random-weight PUT checkpoints: Llama-shaped prefix, core and suffix layers, with step
embeddings and conv taps large enough that every core pass computes a different function."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from depthserve.lab.tiny.llama import base_config, llama_weights, model_shapes, normal_sampler
from depthserve.archs.put.format import PUTSpec, conv_weight, layer_prefixes, read_spec, step_embedding, to_section
from depthserve.loading.checkpoint import write_checkpoint
from depthserve.loading.tokenizer import default_tokenizer

TINY_LAYOUT = PUTSpec(n_prefix=1, n_core=2, n_suffix=1, steps=3, conv_kernel=2)
LIKE_LAYOUT = {"smollm2-135m-instruct": PUTSpec(n_prefix=3, n_core=8, n_suffix=3, steps=3, conv_kernel=2)}
STEP_EMBED_STD = 0.5  # P(t): shifts the ReLU gate enough that the steps compute different functions
CONV_STD = 0.5


CLI_FLAGS = ()  # make-tiny flags of its own (registry.TinyCheckpoints): none


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None,
              *, n_prefix: int | None = None, n_core: int | None = None, n_suffix: int | None = None,
              steps: int | None = None, conv_kernel: int | None = None) -> Path:
    """A random PUT checkpoint: the tiny shapes (or `like`'s) with TINY_LAYOUT (or LIKE_LAYOUT[like]);
    the options override any of its n_prefix, n_core, n_suffix, steps (T), conv_kernel."""
    import torch

    if like and like not in LIKE_LAYOUT:
        raise ValueError(f"--like must be one of {sorted(LIKE_LAYOUT)}")
    given = dict(n_prefix=n_prefix, n_core=n_core, n_suffix=n_suffix, steps=steps, conv_kernel=conv_kernel)
    spec = replace(LIKE_LAYOUT[like] if like else TINY_LAYOUT, **{k: v for k, v in given.items() if v is not None})
    shapes = model_shapes(like, num_kv_heads)
    shapes["num_hidden_layers"] = spec.num_layers
    tokenizer = tokenizer or default_tokenizer()
    cfg = base_config(tokenizer, shapes, tied=bool(like))
    cfg.update(architectures=["PUTForCausalLM"], model_type="put", depth=to_section(spec))
    read_spec(cfg["depth"], cfg)  # the checks a load makes, before anything is written
    gen = torch.Generator().manual_seed(seed)
    normal = normal_sampler(gen)
    w = llama_weights(cfg, gen, layer_prefixes(spec))
    for j in range(spec.n_core):
        w[step_embedding(j)] = normal(spec.steps, cfg["intermediate_size"], std=STEP_EMBED_STD)
        w[conv_weight(j)] = normal(spec.conv_kernel, cfg["intermediate_size"], std=CONV_STD)
    return write_checkpoint(Path(out), cfg, w, tokenizer)
