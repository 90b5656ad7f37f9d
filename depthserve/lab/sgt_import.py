"""`depthserve import-sgt CKPT --out DIR`: an SGT training checkpoint (OLMo v1 layout) -> the native format.

The SGT paper's released training code is built on OLMo v1. Its checkpoints hold OLMo's fused
weights plus, per block, the loop state of the head-subset attention loop (paper 000, Eq. 6).
This module maps them onto the native SGT format (docs/checkpoint-format.md): Hugging Face Llama
weight names and a `depth.sgt` section built from the loop state, following the contract
(docs/depth-semantics.md, sections 0 and 1):

- `att_proj` (rows [q; k; v]) is split into q/k/v_proj; `ff_proj` is split with the FIRST half
  of its rows as up_proj (OLMo's `x, gate = ff_proj(h).chunk(2, -1); silu(gate) * x`) and the
  SECOND half as gate_proj.
- the head set S_l of a looped block is every head with a non-zero `head_decay`
  (`kept_head_indices` order first, then the other such heads in index order); decays other
  than 1 become `head_scales` (the training code scales each head's loop output by its decay).
- a block is looped when `current_loop_depth` K_l > 0; K_l becomes its trained loop count.

What the native format cannot express exactly is refused with an `UnsupportedCheckpointError`
naming the offending config key or tensor (the CLI exits with status 2); nothing is silently
dropped. The weights keep their dtype.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from depthserve.archs.llama.format import LlamaSpec
from depthserve.archs.llama.format import to_section as llama_section
from depthserve.archs.sgt.format import SGTLayer, SGTSpec
from depthserve.archs.sgt.format import to_section as sgt_section
from depthserve.loading.checkpoint import CheckpointFormatError, write_checkpoint

WTE = "transformer.wte.weight"
LN_F = "transformer.ln_f.weight"
HEAD = "transformer.ff_out.weight"
WPE = "transformer.wpe.weight"
BLOCK_WEIGHTS = ("att_proj", "attn_out", "ff_proj", "ff_out", "attn_norm", "ff_norm")
LOOP_BUFFERS = ("current_loop_depth", "kept_head_indices", "head_keep_mask", "head_decay")
# Buffers that are recomputed from the config and carry no weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "causal_attention_bias")

DEFAULT_ROPE_THETA = 10000.0  # OLMo's default
DEFAULT_EPS = 1e-5  # OLMo's default layer_norm_eps
DEFAULT_MAX_LEN = 2048  # when the config has no max_sequence_length


class UnsupportedCheckpointError(CheckpointFormatError):
    """The source checkpoint is malformed or uses a feature the native SGT format cannot express.

    `key` is the offending config key or tensor name; the message starts with it.
    """

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


@dataclass(frozen=True)
class OlmoShape:
    """The model's hyper-parameters, from the config where it has them and the tensors otherwise."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    intermediate: int  # the SwiGLU width (half of the fused ff_proj rows)
    vocab_rows: int  # embedding rows (padded embedding_size included)
    rope_theta: float
    eps: float
    max_len: int
    tied: bool
    norm_affine: bool  # False: OLMo's non-affine norms (weights of ones are written)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class ImportResult:
    out: Path
    spec: LlamaSpec | SGTSpec
    shape: OlmoShape
    notes: list[str] = field(default_factory=list)


# ---- reading the source ---------------------------------------------------------------------------
def find_config(ckpt: Path) -> Path | None:
    """config.json or config.yaml next to the weights (None: everything comes from the tensors)."""
    folder = ckpt if ckpt.is_dir() else ckpt.parent
    for name in ("config.json", "config.yaml", "config.yml"):
        if (folder / name).is_file():
            return folder / name
    return None


def read_source_config(path: Path | None) -> dict[str, Any]:
    """The OLMo model config: a flat dict of model keys, or a training config with a `model` section."""
    if path is None:
        return {}
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise UnsupportedCheckpointError(path.name, "is not a mapping of config keys")
    if isinstance(data.get("model"), dict) and "d_model" not in data:
        data = data["model"]  # OLMo's config.yaml is the training config; the model keys sit under `model`
    return data


def find_weights(ckpt: Path) -> list[Path]:
    if ckpt.is_file():
        return [ckpt]
    shards = sorted(ckpt.glob("*.safetensors"))
    if shards:
        return shards
    for name in ("model.pt", "pytorch_model.bin"):
        if (ckpt / name).is_file():
            return [ckpt / name]
    raise UnsupportedCheckpointError("model.safetensors", f"no model.safetensors, *.safetensors, model.pt or "
                                     f"pytorch_model.bin in {ckpt}")


def read_state_dict(files: list[Path]) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for file in files:
        if file.suffix == ".safetensors":
            part = load_file(str(file))
        else:
            part = torch.load(str(file), map_location="cpu", weights_only=True)
            for wrapper in ("model", "state_dict"):  # a trainer checkpoint wrapping the model's state
                if isinstance(part, dict) and isinstance(part.get(wrapper), dict) and WTE not in part:
                    part = part[wrapper]
        if not isinstance(part, dict):
            raise UnsupportedCheckpointError(file.name, "does not hold a state dict")
        for key in part:
            if key in state:
                raise UnsupportedCheckpointError(key, "appears in more than one weight file")
        state.update(part)
    return strip_prefix(state)


def strip_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """Drop a wrapper prefix before `transformer.` (hf_olmo's `model.`, torch.compile's `_orig_mod.`)."""
    hits = [key for key in state if key.endswith(WTE)]
    if len(hits) != 1 or hits[0] == WTE:
        return state
    prefix = hits[0][: -len(WTE)]
    return {key[len(prefix):] if key.startswith(prefix) else key: value for key, value in state.items()}


# ---- checks ----------------------------------------------------------------------------------------
def check_config(cfg: dict[str, Any]) -> None:
    """Refuse the OLMo options the native format cannot express (each error names its key)."""
    refusals = [
        ("clip_qkv", lambda v: v is not None, "QKV clipping is not part of the native format"),
        ("attention_layer_norm", bool, "attention layer norm (q/k norms) is not part of the native format"),
        ("layer_norm_type", lambda v: v is not None and str(v).lower() != "rms",
         "only RMS layer norm ('rms') is supported"),
        ("include_bias", bool, "biases are not supported (the native attention_bias covers q/k/v only; "
                               "OLMo's include_bias also adds them to attn_out, ff_proj and ff_out)"),
        ("bias_for_layer_norm", bool, "layer norm biases are not supported"),
        ("block_type", lambda v: v is not None and str(v).lower() != "sequential",
         "only OLMo's 'sequential' block is supported (not parallel or other block types)"),
        ("activation_type", lambda v: v is not None and str(v).lower() != "swiglu", "only SwiGLU is supported"),
        ("alibi", bool, "ALiBi positions are not supported (the native format uses RoPE)"),
        ("rope", lambda v: v is not None and not v, "the model has no rotary embedding (the native format uses RoPE)"),
        ("scale_logits", bool, "logit scaling is not supported"),
        ("norm_after", bool, "post-norm blocks are not supported"),
        ("rope_scaling", lambda v: v is not None, "rotary scaling is not supported"),
    ]
    for key, refused, why in refusals:
        if key in cfg and refused(cfg[key]):
            raise UnsupportedCheckpointError(key, f"{why} (got {cfg[key]!r})")


def block_index(key: str) -> int | None:
    match = re.match(r"transformer\.blocks\.(\d+)\.", key)
    return int(match.group(1)) if match else None


def check_tensor_names(state: dict[str, Any]) -> None:
    """Refuse tensors of unsupported features before anything else is read."""
    for key in sorted(state):
        if re.search(r"\.(q_norm|k_norm)\.", key):
            raise UnsupportedCheckpointError(key, "attention layer norm (q/k norms) is not part of the native format")
        if key == WPE:
            raise UnsupportedCheckpointError(key, "learned positional embeddings are not supported (RoPE only)")
        if key.endswith(".bias") and ".loop_attention." not in key:
            raise UnsupportedCheckpointError(key, "biases are not supported (the native attention_bias covers "
                                                  "q/k/v only)")


def take(state: dict[str, Any], key: str, shape: tuple[int, ...] | None):
    """Pop a tensor, checking that it exists and has `shape` (None: any)."""
    if key not in state:
        raise UnsupportedCheckpointError(key, "tensor is missing")
    tensor = state.pop(key)
    if shape is not None and tuple(tensor.shape) != shape:
        raise UnsupportedCheckpointError(key, f"has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def _config_int(cfg: dict[str, Any], key: str, derived: int) -> int:
    value = cfg.get(key)
    if value is None:
        return derived
    if not isinstance(value, int) or value != derived:
        raise UnsupportedCheckpointError(key, f"config says {value!r} but the tensors give {derived}")
    return value


def _num_heads_from_loop_state(state: dict[str, Any]) -> int | None:
    for key, tensor in state.items():
        if key.endswith(("loop_attention.head_decay", "loop_attention.head_keep_mask")):
            return int(tensor.numel())
    return None


def infer_shape(cfg: dict[str, Any], state: dict[str, Any]) -> OlmoShape:
    """Shapes from the tensors, checked against the config where it states them."""
    if WTE not in state:
        raise UnsupportedCheckpointError(WTE, "tensor is missing (not an OLMo-layout state dict?)")
    wte = state[WTE]
    if wte.dim() != 2:
        raise UnsupportedCheckpointError(WTE, f"must be 2-D, has shape {tuple(wte.shape)}")
    rows, d_model = (int(s) for s in wte.shape)
    d_model = _config_int(cfg, "d_model", d_model)

    blocks = {i for i in map(block_index, state) if i is not None}
    n_layers = cfg.get("n_layers")
    if n_layers is None:
        n_layers = max(blocks) + 1 if blocks else 0
    if not isinstance(n_layers, int) or n_layers < 1:
        raise UnsupportedCheckpointError("n_layers", f"must be a positive integer, got {n_layers!r}")
    extra = sorted(i for i in blocks if i >= n_layers)
    if extra:
        raise UnsupportedCheckpointError(f"transformer.blocks.{extra[0]}", f"is beyond n_layers={n_layers}")

    n_heads = cfg.get("n_heads")
    if n_heads is None:
        n_heads = _num_heads_from_loop_state(state)
    if n_heads is None:
        raise UnsupportedCheckpointError("n_heads", "the config does not give it and no head_decay tensor shows it")
    if not isinstance(n_heads, int) or n_heads < 1 or d_model % n_heads:
        raise UnsupportedCheckpointError("n_heads", f"{n_heads!r} must be a positive divisor of d_model={d_model}")
    head_dim = d_model // n_heads

    att = "transformer.blocks.0.att_proj.weight"
    if att not in state:
        raise UnsupportedCheckpointError(att, "tensor is missing")
    kv_rows = int(state[att].shape[0]) - d_model
    if kv_rows <= 0 or kv_rows % (2 * head_dim):
        raise UnsupportedCheckpointError(
            att, f"has {state[att].shape[0]} rows, not d_model + 2 * n_kv_heads * head_dim")
    n_kv_heads = kv_rows // (2 * head_dim)
    if cfg.get("n_kv_heads") is not None:
        n_kv_heads = _config_int(cfg, "n_kv_heads", n_kv_heads)
    elif cfg.get("multi_query_attention") and n_kv_heads != 1:
        raise UnsupportedCheckpointError("multi_query_attention", f"is set but the tensors give {n_kv_heads} KV heads")
    if n_heads % n_kv_heads:
        raise UnsupportedCheckpointError("n_kv_heads", f"{n_kv_heads} does not divide n_heads={n_heads}")

    ff = "transformer.blocks.0.ff_proj.weight"
    if ff not in state:
        raise UnsupportedCheckpointError(ff, "tensor is missing")
    fused = int(state[ff].shape[0])
    if fused % 2:
        raise UnsupportedCheckpointError(ff, f"has an odd number of rows ({fused}); SwiGLU needs [up; gate]")
    if cfg.get("mlp_hidden_size") is not None:
        _config_int(cfg, "mlp_hidden_size", fused)
    elif cfg.get("mlp_ratio") is not None and cfg["mlp_ratio"] * d_model != fused:
        raise UnsupportedCheckpointError("mlp_ratio", f"{cfg['mlp_ratio']} * d_model = {cfg['mlp_ratio'] * d_model} "
                                                      f"but {ff} has {fused} rows")

    expected_rows = cfg.get("embedding_size") or cfg.get("vocab_size")
    if expected_rows is not None and expected_rows != rows:
        key = "embedding_size" if cfg.get("embedding_size") else "vocab_size"
        raise UnsupportedCheckpointError(key, f"config says {expected_rows} but {WTE} has {rows} rows")
    if cfg.get("vocab_size") is not None and cfg["vocab_size"] > rows:
        raise UnsupportedCheckpointError("vocab_size", f"{cfg['vocab_size']} exceeds the {rows} embedding rows")

    tied = cfg.get("weight_tying")
    if tied is None:
        tied = HEAD not in state
    if tied and HEAD in state:
        raise UnsupportedCheckpointError("weight_tying", f"is true but the checkpoint has an untied head {HEAD}")

    return OlmoShape(
        d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, n_layers=n_layers, intermediate=fused // 2,
        vocab_rows=rows, rope_theta=float(cfg.get("rope_theta") or DEFAULT_ROPE_THETA),
        eps=float(cfg.get("layer_norm_eps") or DEFAULT_EPS),
        max_len=int(cfg.get("max_sequence_length") or DEFAULT_MAX_LEN), tied=bool(tied),
        norm_affine=cfg.get("layer_norm_with_affine", True) is not False,
    )


# ---- weights ----------------------------------------------------------------------------------------
def take_norm(state: dict[str, Any], key: str, shape: OlmoShape, like):
    import torch

    if key not in state and not shape.norm_affine:
        return torch.ones(shape.d_model, dtype=like.dtype)  # OLMo's non-affine norm = weight of ones
    return take(state, key, (shape.d_model,))


def convert_weights(state: dict[str, Any], shape: OlmoShape) -> dict[str, Any]:
    """Pop every model tensor of the OLMo state dict and return them under HF Llama names."""
    d, hd, I = shape.d_model, shape.head_dim, shape.intermediate
    q_rows, kv_rows = shape.n_heads * hd, shape.n_kv_heads * hd
    wte = take(state, WTE, (shape.vocab_rows, d))
    out = {"model.embed_tokens.weight": wte,
           "model.norm.weight": take_norm(state, LN_F, shape, wte)}
    if not shape.tied:
        out["lm_head.weight"] = take(state, HEAD, (shape.vocab_rows, d))
    for i in range(shape.n_layers):
        src, dst = f"transformer.blocks.{i}.", f"model.layers.{i}."
        qkv = take(state, src + "att_proj.weight", (q_rows + 2 * kv_rows, d))
        q, k, v = qkv.split([q_rows, kv_rows, kv_rows], dim=0)
        up, gate = take(state, src + "ff_proj.weight", (2 * I, d)).split([I, I], dim=0)  # value first, then gate
        out.update({
            dst + "self_attn.q_proj.weight": q,
            dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": take(state, src + "attn_out.weight", (d, q_rows)),
            dst + "mlp.up_proj.weight": up,
            dst + "mlp.gate_proj.weight": gate,
            dst + "mlp.down_proj.weight": take(state, src + "ff_out.weight", (d, I)),
            dst + "input_layernorm.weight": take_norm(state, src + "attn_norm.weight", shape, wte),
            dst + "post_attention_layernorm.weight": take_norm(state, src + "ff_norm.weight", shape, wte),
        })
    return {name: tensor.clone().contiguous() for name, tensor in out.items()}


# ---- loop state -> depth.sgt --------------------------------------------------------------------------
def head_decays(state: dict[str, Any], prefix: str, n_heads: int) -> tuple[list[float], list[int]]:
    """(decay per head, kept_head_indices order) of one block's loop state.

    head_decay is what the training code multiplies each head's loop output by; without it the
    keep mask (as 0/1), without that the kept indices (1 for kept) stand in for it.
    """
    kept: list[int] = []
    key = prefix + "kept_head_indices"
    if key in state:
        tensor = state[key]
        if tensor.dim() > 1:
            raise UnsupportedCheckpointError(key, f"must be 1-D, has shape {tuple(tensor.shape)}")
        values = [float(v) for v in tensor.flatten().tolist()]
        if any(v != int(v) or not 0 <= v < n_heads for v in values) or len(set(values)) != len(values):
            raise UnsupportedCheckpointError(key, f"must be distinct head indices in 0..{n_heads - 1}, got {values}")
        kept = [int(v) for v in values]
    for name in ("head_decay", "head_keep_mask"):
        key = prefix + name
        if key in state:
            tensor = state[key]
            if tuple(tensor.shape) != (n_heads,):
                raise UnsupportedCheckpointError(key, f"has shape {tuple(tensor.shape)}, expected ({n_heads},)")
            decays = [float(v) for v in tensor.double().tolist()]
            if not all(math.isfinite(v) for v in decays):
                raise UnsupportedCheckpointError(key, f"has non-finite values {decays}")
            return decays, kept
    if prefix + "kept_head_indices" in state:
        return [1.0 if h in kept else 0.0 for h in range(n_heads)], kept
    raise UnsupportedCheckpointError(prefix + "head_decay", "tensor is missing (and no head_keep_mask or "
                                                           "kept_head_indices stands in for it)")


def loop_layer(state: dict[str, Any], layer: int, n_heads: int, notes: list[str]) -> SGTLayer | None:
    """The SGTLayer of one block, or None when it is not looped (K_l = 0, missing, or no live head)."""
    prefix = f"transformer.blocks.{layer}.loop_attention."
    key = prefix + "current_loop_depth"
    loops = 0
    if key in state:
        tensor = state[key]
        value = float(tensor.flatten()[0]) if tensor.numel() == 1 else -1.0
        if value < 0 or value != int(value):
            raise UnsupportedCheckpointError(key, f"must be one non-negative integer, got {tensor.tolist()}")
        loops = int(value)
    if loops == 0:
        return None
    decays, kept = head_decays(state, prefix, n_heads)
    heads = [h for h in kept if decays[h] != 0.0]
    heads += [h for h in range(n_heads) if decays[h] != 0.0 and h not in heads]
    if not heads:
        notes.append(f"block {layer}: current_loop_depth={loops} but every head_decay is 0 "
                     "(the loop adds nothing): imported as a plain layer")
        return None
    scales = [decays[h] for h in heads]
    dropped = [h for h in kept if decays[h] == 0.0]
    if dropped:
        notes.append(f"block {layer}: kept heads {dropped} have head_decay 0 and are left out of the head set")
    return SGTLayer(layer, tuple(heads), loops, tuple(scales) if any(s != 1.0 for s in scales) else None)


def depth_spec(state: dict[str, Any], shape: OlmoShape, max_loops: int | None,
               notes: list[str]) -> LlamaSpec | SGTSpec:
    """The depth section: SGT with one entry per looped block (plain Llama when none is looped)."""
    layers = [spec for i in range(shape.n_layers) if (spec := loop_layer(state, i, shape.n_heads, notes))]
    trained = max((spec.loops for spec in layers), default=0)
    if max_loops is not None and max_loops < trained:
        raise UnsupportedCheckpointError("--max-loops",
                                         f"{max_loops} is below the largest trained loop count {trained}")
    if not layers:
        notes.append("no block is looped (current_loop_depth 0 or missing everywhere): a plain Llama checkpoint")
        return LlamaSpec()
    return SGTSpec(tuple(layers), max_loops if max_loops is not None else trained)


def check_leftovers(state: dict[str, Any], notes: list[str]) -> None:
    """After the model tensors are taken: loop buffers and recomputable buffers may remain; a
    leftover weight (or anything unknown) is refused rather than dropped."""
    ignored = []
    for key in sorted(state):
        if ".loop_attention." in key:
            if key.rsplit(".", 1)[-1] in LOOP_BUFFERS or not key.endswith((".weight", ".bias")):
                ignored.append(key)
                continue
            raise UnsupportedCheckpointError(key, "the loop has a weight of its own, which SGT does not define")
        if key.endswith(IGNORED_SUFFIXES):
            ignored.append(key)
            continue
        raise UnsupportedCheckpointError(key, "unknown tensor (refused rather than dropped)")
    extra = [key for key in ignored if key.rsplit(".", 1)[-1] not in LOOP_BUFFERS]
    if extra:
        notes.append(f"ignored buffers without weights: {extra}")


# ---- tokenizer and config --------------------------------------------------------------------------------
def load_tokenizer_for(ckpt: Path, option: str | None, eos_token_id: int | None):
    """--tokenizer (a directory or name for AutoTokenizer, or a tokenizer.json file); default: the
    checkpoint's own tokenizer files, else the default model's tokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = ckpt if ckpt.is_dir() else ckpt.parent
    if option is None:
        if (folder / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(folder))
        if (folder / "tokenizer.json").is_file():
            option = str(folder / "tokenizer.json")
        else:
            from depthserve.loading.tokenizer import default_tokenizer

            return default_tokenizer()
    if option.endswith(".json") and Path(option).is_file():
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=option)
        if tokenizer.eos_token is None and eos_token_id is not None and eos_token_id < len(tokenizer):
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_token_id)
        return tokenizer
    return AutoTokenizer.from_pretrained(option)


def native_config(cfg: dict[str, Any], shape: OlmoShape, spec: LlamaSpec | SGTSpec, tokenizer,
                  dtype: str) -> dict[str, Any]:
    eos = cfg.get("eos_token_id")
    bos = cfg.get("bos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_rows,  # padded embedding rows included
        "hidden_size": shape.d_model,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_len,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.eps,
        "tie_word_embeddings": shape.tied,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": bos if bos is not None else tokenizer.bos_token_id,
        "eos_token_id": eos if eos is not None else tokenizer.eos_token_id,
        "pad_token_id": cfg.get("pad_token_id"),
        "torch_dtype": dtype,
        "depth": sgt_section(spec) if isinstance(spec, SGTSpec) else llama_section(spec),
    }


# ---- the import ---------------------------------------------------------------------------------------------
def import_sgt(ckpt: str | Path, out: str | Path, tokenizer: str | None = None,
               max_loops: int | None = None) -> ImportResult:
    """Convert the SGT/OLMo checkpoint `ckpt` (a directory or a weight file) into a native SGT
    checkpoint directory `out`. Raises UnsupportedCheckpointError (naming the key) on refusal."""
    ckpt, out = Path(ckpt), Path(out)
    if not ckpt.exists():
        raise UnsupportedCheckpointError(str(ckpt), "does not exist")
    source_dir = (ckpt if ckpt.is_dir() else ckpt.parent).resolve()
    if out.resolve() == source_dir:
        raise UnsupportedCheckpointError("--out", "must not be the source checkpoint's directory")
    cfg = read_source_config(find_config(ckpt))
    check_config(cfg)
    state = read_state_dict(find_weights(ckpt))
    check_tensor_names(state)
    shape = infer_shape(cfg, state)
    notes: list[str] = []
    spec = depth_spec(state, shape, max_loops, notes)
    weights = convert_weights(state, shape)
    check_leftovers(state, notes)
    tok = load_tokenizer_for(ckpt, tokenizer, cfg.get("eos_token_id"))
    if len(tok) > shape.vocab_rows:
        raise UnsupportedCheckpointError(
            "--tokenizer", f"the tokenizer has {len(tok)} tokens but the model embeds only {shape.vocab_rows}; "
                           "pass the model's own tokenizer")
    dtype = str(weights["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    config = native_config(cfg, shape, spec, tok, dtype)
    write_checkpoint(out, config, weights, tok)
    return ImportResult(out, spec, shape, notes)


# ---- command line ----------------------------------------------------------------------------------------------
def add_subcommands(sub) -> None:
    p = sub.add_parser("import-sgt", help="convert an SGT training checkpoint (OLMo v1 layout) to the native format")
    p.add_argument("ckpt", help="source checkpoint: a directory (config.json/config.yaml + model.safetensors, "
                                "model.pt or pytorch_model.bin) or a weight file")
    p.add_argument("--out", required=True, help="output directory (native SGT checkpoint)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory/name or tokenizer.json (default: the checkpoint's own tokenizer files, "
                        "else the default model's tokenizer)")
    p.add_argument("--max-loops", type=int, default=None,
                   help="ceiling of the `loops` knob written to the checkpoint (default: the largest trained count)")
    p.set_defaults(func=_cmd_import_sgt)


def _cmd_import_sgt(ns: argparse.Namespace) -> int:
    from depthserve.errors import DepthServeError

    try:
        result = import_sgt(ns.ckpt, ns.out, ns.tokenizer, ns.max_loops)
    except (DepthServeError, ValueError, OSError) as exc:  # OSError: unreadable files, missing tokenizer
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(f"note: {note}")
    spec = result.spec
    if isinstance(spec, SGTSpec):
        looped = ", ".join(f"{s.layer}: heads {list(s.heads)} x{s.loops}"
                           + (f" scales {list(s.head_scales)}" if s.head_scales else "") for s in spec.layers)
        print(f"wrote an SGT checkpoint to {result.out} (looped layers {looped}; max_loops {spec.max_loops})")
    else:
        print(f"wrote a plain Llama checkpoint to {result.out}")
    return 0
