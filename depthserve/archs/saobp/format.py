"""SAOBP's checkpoint section and cache plan (docs/depth-semantics.md section 5).

config.json `depth.saobp`: the trained `lambda`, the `variant` ("high": m_0 = e^lambda, repulsive;
"low": m_0 = e^-lambda, attractive), `self_message`, and the `layers` it applies to (null: every
layer, every head). No extra tensors: the base is a plain Llama checkpoint
(docs/checkpoint-format.md, "SAOBP"). No per-request knob: lambda is trained.

The cache: beside each layer's dense K/V slot, one per-key bias slot (SlotKind.PER_KEY_BIAS) holds
the running c_k of every (SAOBP layer, query head, position) in fp32. Its pages are pool pages
whose K half is read as fp32: R = head_dim * itemsize / 4 rows of `block_size` floats, one row per
(layer, head) of one token block, so a block of tokens takes ceil(L_saobp * H / R) bias pages and
the page count depends on the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from depthserve.archs.llama.format import LlamaConfig, dense_slots, layer_weight_flops
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthParams, DepthPlan
from depthserve.loading.checkpoint import FORMAT_VERSION, CheckpointFormatError

VARIANTS = ("high", "low")
BIAS_SLOT = "saobp.bias"


@dataclass(frozen=True)
class SAOBPSpec:
    lam: float  # lambda >= 0
    variant: str = "high"
    self_message: bool = False
    layers: tuple[int, ...] | None = None  # None: every layer
    architecture: str = "saobp"

    @property
    def m0(self) -> float:
        return math.exp(self.lam if self.variant == "high" else -self.lam)

    @property
    def coef(self) -> float:
        """1/m_0 - 1: log(M_ik / m_0) = log1p(A_ik * coef), the form the kernels compute."""
        return math.expm1(-self.lam if self.variant == "high" else self.lam)

    def layer_indices(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers)) if self.layers is None else self.layers


def read_spec(section: dict[str, Any] | None, hf_config: dict[str, Any]) -> SAOBPSpec:
    body = (section or {}).get("saobp")
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


def to_section(spec: SAOBPSpec) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "architecture": "saobp",
        "saobp": {
            "lambda": spec.lam,
            "variant": spec.variant,
            "self_message": spec.self_message,
            "layers": None if spec.layers is None else list(spec.layers),
        },
    }


# ---- the cache plan ----------------------------------------------------------------------------------
def rows_per_page(head_dim: int, itemsize: int) -> int:
    """R: fp32 rows of `block_size` floats in the K half of one page of a pool of this itemsize."""
    return max(1, head_dim * itemsize // 4)


def bias_pages_per_block(cfg: LlamaConfig, spec: SAOBPSpec, itemsize: int) -> int:
    return -(-len(spec.layer_indices(cfg.num_layers)) * cfg.num_heads // rows_per_page(cfg.head_dim, itemsize))


def head_rows(num_heads: int, position: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the SAOBP layer at `position` (among the SAOBP layers) keeps each query head's bias:
    (page column within the bias slot, row within that page), for pages of `rows` rows."""
    r = position * num_heads + np.arange(num_heads)
    return r // rows, r % rows


@dataclass(frozen=True, kw_only=True)
class SAOBPPlan(DepthPlan):
    bias_columns: slice  # the bias slot's columns of the request's page table
    rows_per_page: int  # R of the model's dtype


def plan(cfg: LlamaConfig, spec: SAOBPSpec, depth: DepthParams, itemsize: int) -> SAOBPPlan:
    """Every request gets the same plan (no knobs): the dense slots, then the bias slot. The
    refinement adds no weight matmul, so the FLOPs are the plain model's."""
    bias = SlotSpec(BIAS_SLOT, SlotKind.PER_KEY_BIAS, bias_pages_per_block(cfg, spec, itemsize))
    layout = CacheLayout(dense_slots(cfg) + (bias,))
    flops = cfg.num_layers * layer_weight_flops(cfg)
    return SAOBPPlan(depth=depth, layout=layout, flops_per_token=flops, plain_flops_per_token=flops,
                     bias_columns=layout.columns(len(layout.slots) - 1),
                     rows_per_page=rows_per_page(cfg.head_dim, itemsize))
