"""The ops as `torch.library` custom ops, for forwards run through `torch.compile`.

A custom op is opaque to the compiler: the graph calls it as one node (with a fake implementation
that gives its output shapes), so a paged attention that reads pages through a table, or a Triton
kernel, sits in a `fullgraph=True` graph without a break, and the compiler fuses what lies
between them (norms, rotary, residuals, SwiGLU).

Each op is registered once per kernel backend (`depthserve::<backend>_<op>`): under "torch" and
"triton" the op runs that implementation on every device; under "auto" the torch one on CPU and
the Triton kernel on CUDA (the op's CUDA kernel). Only the ops a decode step calls are here; the
prefill ops run eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from depthserve.kernels import dispatch


@dataclass(frozen=True)
class OpSchema:
    family: str
    schema: str
    mutates: tuple[str, ...] = ()
    outputs: Callable[..., object] | None = None  # fake implementation: the outputs' shapes


def _like_first(q: torch.Tensor, *_args) -> torch.Tensor:
    return torch.empty_like(q)


def _attention_and_lse(q: torch.Tensor, *_args) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


SCHEMAS: dict[str, OpSchema] = {
    "store_kv": OpSchema(
        "paged", "(Tensor k, Tensor v, Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor slot_index) -> ()",
        ("k_pages", "v_pages")),
    "paged_decode_attention": OpSchema(
        "paged", "(Tensor q, Tensor k_pages, Tensor v_pages, Tensor page_table, Tensor context_lens, float scale)"
        " -> Tensor", outputs=_like_first),
    "depth_attention": OpSchema(
        "depth", "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor num_valid, float scale) -> Tensor",
        outputs=_like_first),
    "saobp_decode_attention": OpSchema(
        "saobp", "(Tensor q, Tensor k_pages, Tensor v_pages, Tensor page_table, Tensor bias_pages, "
        "Tensor bias_table, Tensor context_lens, float scale, float coef, bool self_message) -> (Tensor, Tensor)",
        outputs=_attention_and_lse),
    "saobp_bias_update": OpSchema(
        "saobp", "(Tensor q, Tensor k_pages, Tensor page_table, Tensor(a!) bias_pages, Tensor bias_table, "
        "Tensor context_lens, Tensor lse, float scale, float coef) -> ()", ("bias_pages",)),
}


@functools.cache
def custom_op(backend: str, name: str) -> Callable:
    """`name` as the custom op `depthserve::<backend>_<name>` (registered on first use)."""
    spec = SCHEMAS[name]
    torch_impl = getattr(dispatch.module(spec.family, triton=False), name)
    triton_module = dispatch.module(spec.family, triton=True) if backend != "torch" else None
    triton_impl = getattr(triton_module, name) if triton_module is not None else None
    impl = triton_impl if backend == "triton" else torch_impl
    op = torch.library.custom_op(f"depthserve::{backend}_{name}", impl, mutates_args=spec.mutates,
                                 schema=spec.schema)
    if backend == "auto" and triton_impl is not None:
        op.register_kernel("cuda", triton_impl)
    op.register_fake(spec.outputs or (lambda *args: None))
    return op
