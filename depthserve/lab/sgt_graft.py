"""`depthserve graft-sgt`: a training-free SGT graft of any Llama checkpoint.

Paper 000 (Sparse Growing Transformer) chooses where to loop by attention entropy:
- Eq. 4: the length-normalised entropy of head i is the entropy of the LAST token's attention
  distribution divided by log N (N = the sequence length), so it lies in [0, 1];
- Eq. 5: a layer's entropy is the mean over its heads;
- Eq. 7: a looped layer's head set S is the top-h heads by entropy; Eq. 10: looped layers are the
  top-L layers by layer entropy. The paper leaves its first layer out of the candidate pool (its
  heads all sit near entropy 1 and never differentiate, Appendix D), so layer 0 is never chosen here.

The graft measures these on calibration text with the source model as it is (no loops), picks N
layers and H heads per layer, and writes a native SGT checkpoint (docs/checkpoint-format.md)
with the source's weights unchanged, every chosen layer's trained loop count K, and the
measurements in `graft.json`. Nothing is trained: `loops = 0` is the source model exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from depthserve.errors import DepthServeError
from depthserve.oracles import llama as reference
from depthserve.archs.sgt.format import SGTLayer, SGTSpec, to_section
from depthserve.loading.checkpoint import depth_section, write_checkpoint

GRAFT_FILE = "graft.json"
DEFAULT_MAX_LEN = 512
DEFAULT_NUM_SEQUENCES = 64


class GraftError(DepthServeError, ValueError):
    """The graft's settings, source model or calibration text cannot make an SGT checkpoint."""


@dataclass
class SourceModel:
    """A plain Llama checkpoint as the loaders read it: HF-style config, HF-named fp32 weights."""

    name: str
    hf_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    tokenizer: Any

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])


def load_source(model: str | Path) -> SourceModel:
    """Resolve `model` (a built-in name, a .gguf file or a checkpoint directory) with the engine's
    loaders. Only a plain Llama (no depth mechanism) can be grafted."""
    from depthserve.loading.checkpoint import CheckpointFormatError
    from depthserve.loading.gguf_loader import load_gguf
    from depthserve.loading.hf_loader import load_hf_dir
    from depthserve.loading.registry import resolve_model
    from depthserve.loading.tokenizer import load_tokenizer

    source = resolve_model(model)  # UnknownModelError names the accepted forms
    if source.format == "hf":
        config = json.loads((source.path / "config.json").read_text())
        try:
            architecture, _ = depth_section(config)
        except CheckpointFormatError as exc:
            raise GraftError(f"{model}: {exc}") from exc
        if architecture != "llama":
            raise GraftError(f"{model} is already a {architecture} checkpoint; graft a plain Llama checkpoint")
        config, weights = load_hf_dir(source.path, progress=False)
    else:
        read = load_gguf(source.path, progress=False)
        config, weights = read.config, read.dense
    archs = config.get("architectures") or ["LlamaForCausalLM"]
    if archs[0] not in ("LlamaForCausalLM", "MistralForCausalLM"):
        raise GraftError(f"{model}: architecture {archs[0]} is not a Llama; only Llama checkpoints can be grafted")
    weights = {name: t.to(torch.float32).contiguous() for name, t in weights.items()}
    return SourceModel(str(model), config, weights, load_tokenizer(source))


# ---- calibration ----------------------------------------------------------------------------------
def calibration_sequences(tokenizer, calib_file: str | Path, max_len: int = DEFAULT_MAX_LEN,
                          num_sequences: int | None = DEFAULT_NUM_SEQUENCES,
                          num_documents: int | None = None) -> list[list[int]]:
    """Token sequences of a .txt file (one document) or a .jsonl file (each line's "text" a
    document; the first `num_documents`, None: all), as `depthserve calibrate` reads them: every
    document from position 0, cut every `max_len` tokens; the first `num_sequences` (None: all).
    Sequences shorter than 2 tokens are dropped (Eq. 4 divides by log N)."""
    from depthserve.loading.tokenizer import text_sequences

    path = Path(calib_file)
    if not path.is_file():
        raise GraftError(f"calibration text {path} does not exist (a .txt file, or .jsonl with a 'text' field)")
    if max_len < 2:
        raise GraftError(f"--max-len must be at least 2, got {max_len}")
    if num_sequences is not None and num_sequences < 1:
        raise GraftError(f"--num-sequences must be positive, got {num_sequences}")
    if num_documents is not None and num_documents < 1:
        raise GraftError(f"--calib-docs must be positive, got {num_documents}")
    try:
        sequences = text_sequences(tokenizer, path, max_len, None, num_documents)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise GraftError(f"calibration text {path} is not readable as {path.suffix or 'text'}: {exc}") from exc
    except ValueError as exc:  # no text at all
        raise GraftError(str(exc)) from exc
    return sequences[:num_sequences] if num_sequences is not None else sequences


def _reference_model(source: SourceModel) -> reference.Reference:
    return reference.Reference(source.hf_config, source.weights)


def last_token_entropy(ref, layer: int, a: torch.Tensor) -> torch.Tensor:
    """Eq. 4 for every query head of `layer`: -1/log N * sum_j A_Nj log A_Nj, with A_N the last
    token's causal attention distribution over all N tokens. a: [N, d], the layer's RMSNorm_a input.
    Returns [heads]."""
    attention_dims, rope = reference.attention_dims, reference.rope

    cfg, w = ref.cfg, ref.w
    H, H_kv, hd, theta = attention_dims(cfg)
    n = a.shape[0]
    p = f"model.layers.{layer}.self_attn."
    q = a[-1:] @ w[p + "q_proj.weight"].T  # [1, H * hd]: only the last token's queries
    k = a @ w[p + "k_proj.weight"].T  # [N, H_kv * hd]
    if p + "q_proj.bias" in w:
        q, k = q + w[p + "q_proj.bias"], k + w[p + "k_proj.bias"]
    q = rope(q.view(1, H, hd).transpose(0, 1), torch.tensor([n - 1]), theta)  # [H, 1, hd]
    k = rope(k.view(n, H_kv, hd).transpose(0, 1), torch.arange(n), theta)  # [H_kv, N, hd]
    k = k.repeat_interleave(H // H_kv, dim=0)  # query head i reads KV group i // (H / H_kv)
    probs = torch.softmax((q @ k.transpose(-1, -2))[:, 0] / math.sqrt(hd), dim=-1)  # [H, N]
    return torch.special.entr(probs).sum(-1) / math.log(n)  # entr(0) = 0


@torch.no_grad()
def sequence_entropies(ref, ids: list[int]) -> torch.Tensor:
    """[layers, heads] Eq. 4 entropies of one sequence, through the plain forward (section 0)."""
    n = len(ids)
    if n < 2:
        raise GraftError("a calibration sequence needs at least 2 tokens (Eq. 4 divides by log N)")
    x = ref.w["model.embed_tokens.weight"][torch.as_tensor(ids)][None]  # [1, N, d]
    mask = reference.causal_mask(1, n)
    rows = []
    for layer in range(ref.num_layers):
        rows.append(last_token_entropy(ref, layer, reference.norm(ref, layer, "a", x)[0]))
        if layer + 1 < ref.num_layers:  # the last layer's output is not needed
            x = reference.full_layer(ref, layer, x, mask)
    return torch.stack(rows)


def attention_entropies(source: SourceModel, sequences: list[list[int]], progress: bool = False) -> torch.Tensor:
    """[layers, heads]: each head's Eq. 4 entropy, averaged over the calibration sequences (fp64)."""
    if not sequences:
        raise GraftError("no calibration sequences")
    ref = _reference_model(source)
    total = torch.zeros(source.num_layers, source.num_heads, dtype=torch.float64)
    for ids in tqdm(sequences, desc="head entropies", unit="sequence", disable=not progress):
        total += sequence_entropies(ref, ids).double()
    return total / len(sequences)


# ---- selection ------------------------------------------------------------------------------------
def check_counts(num_layers: int, num_heads: int, model_layers: int, model_heads: int) -> None:
    if not 1 <= num_layers <= model_layers - 1:
        raise GraftError(f"--layers {num_layers}: must be in 1..{model_layers - 1} "
                         f"(the model has {model_layers} layers and layer 0 is never looped)")
    if not 1 <= num_heads <= model_heads:
        raise GraftError(f"--heads {num_heads}: must be in 1..{model_heads} (query heads per layer)")


def select_heads(entropies: torch.Tensor, num_layers: int, num_heads: int, loops: int = 1,
                 max_loops: int | None = None) -> SGTSpec:
    """The SGT spec of the graft: the `num_layers` layers of highest layer entropy (Eq. 5, the mean
    over heads; layer 0 excluded), each looping its `num_heads` heads of highest entropy (Eq. 7),
    head sets ordered by descending entropy; ties go to the lower index. Every chosen layer gets
    `loops` as its trained count K; max_loops defaults to max(K, 2)."""
    L, H = entropies.shape
    check_counts(num_layers, num_heads, L, H)
    if loops < 0:
        raise GraftError(f"--loops must be >= 0, got {loops}")
    max_loops = max(loops, 2) if max_loops is None else max_loops
    if max_loops < max(loops, 1):
        raise GraftError(f"--max-loops {max_loops}: must be >= --loops {loops} and >= 1")
    values = entropies.double()
    layer_entropy = values.mean(dim=1)  # Eq. 5
    ranked = sorted(range(1, L), key=lambda l: (-float(layer_entropy[l]), l))
    layers = []
    for layer in sorted(ranked[:num_layers]):
        heads = sorted(range(H), key=lambda i: (-float(values[layer, i]), i))[:num_heads]
        layers.append(SGTLayer(layer, tuple(heads), loops))
    return SGTSpec(tuple(layers), max_loops)


# ---- writing ---------------------------------------------------------------------------------------
def graft_config(source: SourceModel, spec: SGTSpec) -> dict[str, Any]:
    """HF Llama fields of the source (a GGUF source's metadata gets the keys HF expects) + depth."""
    cfg = {k: v for k, v in source.hf_config.items() if k not in ("depth", "quantization_config")}
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    cfg.setdefault("hidden_act", "silu")
    cfg["attention_bias"] = any(name.endswith("self_attn.q_proj.bias") for name in source.weights)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    cfg["torch_dtype"] = "float32"
    cfg["depth"] = to_section(spec)
    return cfg


def write_graft(source: SourceModel, out: str | Path, spec: SGTSpec, metadata: dict[str, Any]) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise GraftError(f"--out {out} exists and is not a directory")
    cfg = graft_config(source, spec)
    weights = dict(source.weights)
    if cfg["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)  # the tied head is the embedding
    write_checkpoint(out, cfg, weights, source.tokenizer)  # tokenizer files carry the chat template
    (out / GRAFT_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    return out


def graft(model: str | Path, out: str | Path, layers: int = 3, heads: int = 2, loops: int = 1,
          calib_file: str | Path | None = None, max_len: int = DEFAULT_MAX_LEN,
          num_sequences: int | None = DEFAULT_NUM_SEQUENCES, max_loops: int | None = None,
          progress: bool = False, num_documents: int | None = None) -> Path:
    """Graft SGT head loops onto `model` (built-in name, .gguf or checkpoint dir); write to `out`."""
    if calib_file is None:
        raise GraftError("a calibration text is required (--calib FILE: .txt, or .jsonl with a 'text' field)")
    if not Path(calib_file).is_file():
        raise GraftError(f"calibration text {calib_file} does not exist (a .txt file, or .jsonl with a 'text' field)")
    out = Path(out)
    model_path = Path(str(model)).expanduser()
    if model_path.is_dir() and out.exists() and out.resolve() == model_path.resolve():
        raise GraftError("--out must not be the source checkpoint directory")
    source = load_source(model)
    check_counts(layers, heads, source.num_layers, source.num_heads)
    sequences = calibration_sequences(source.tokenizer, calib_file, max_len, num_sequences, num_documents)
    entropies = attention_entropies(source, sequences, progress)
    spec = select_heads(entropies, layers, heads, loops, max_loops)
    layer_entropy = entropies.mean(dim=1)
    metadata = {
        "method": "training-free SGT graft: head entropy = length-normalised last-token attention entropy "
                  "(paper 000 Eq. 4), layer entropy = mean over heads (Eq. 5), top-h heads (Eq. 7) of the "
                  "top-N layers, layer 0 excluded",
        "source_model": source.name,
        "num_layers": layers,
        "num_heads": heads,
        "loops": loops,
        "max_loops": spec.max_loops,
        "calibration": {
            "source": str(calib_file),
            "num_sequences": len(sequences),
            "num_tokens": int(sum(len(s) for s in sequences)),
            "max_len": max_len,
        },
        "selected": [
            {"layer": s.layer, "layer_entropy": float(layer_entropy[s.layer]), "heads": list(s.heads),
             "head_entropies": [float(entropies[s.layer, h]) for h in s.heads]}
            for s in spec.layers
        ],
        "layer_entropy": [float(v) for v in layer_entropy],
        "head_entropy": [[float(v) for v in row] for row in entropies],
    }
    return write_graft(source, out, spec, metadata)


# ---- command line ----------------------------------------------------------------------------------
def add_subcommands(sub) -> None:
    from depthserve.loading.registry import DEFAULT_MODEL

    p = sub.add_parser("graft-sgt", help="training-free SGT: loop the highest-entropy heads of any Llama checkpoint")
    p.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, .gguf file or plain Llama checkpoint dir")
    p.add_argument("--layers", type=int, default=3, help="N looped layers (highest mean entropy, layer 0 excluded)")
    p.add_argument("--heads", type=int, default=2, help="H looped query heads per layer (highest entropy)")
    p.add_argument("--loops", type=int, default=1, help="K: the loop count of every looped layer (request default)")
    p.add_argument("--max-loops", type=int, default=None, help="ceiling of the `loops` knob (default max(K, 2))")
    p.add_argument("--calib", required=True, help="calibration text (.txt, or .jsonl with a 'text' field)")
    p.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN, help="documents are cut every this many tokens")
    p.add_argument("--num-sequences", type=int, default=DEFAULT_NUM_SEQUENCES, help="calibration sequences used")
    p.add_argument("--calib-docs", type=int, default=None,
                   help="only the first this many documents of a .jsonl calibration text (default: all)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.set_defaults(func=_cmd_graft)


def _cmd_graft(ns: argparse.Namespace) -> int:
    try:
        path = graft(ns.model, ns.out, ns.layers, ns.heads, ns.loops, ns.calib, ns.max_len, ns.num_sequences,
                     ns.max_loops, progress=True, num_documents=ns.calib_docs)
    except (DepthServeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta = json.loads((path / GRAFT_FILE).read_text())
    for entry in meta["selected"]:
        heads = ", ".join(f"{h} ({e:.3f})" for h, e in zip(entry["heads"], entry["head_entropies"]))
        print(f"layer {entry['layer']} (entropy {entry['layer_entropy']:.3f}): heads {heads}")
    print(f"wrote an SGT graft of {ns.model} (loops {ns.loops}) to {path}")
    return 0
