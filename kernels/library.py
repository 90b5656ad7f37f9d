"""The ops as `torch.library` custom ops, for forwards run through `torch.compile`.

A custom op is opaque to the compiler: the graph calls it as one node (with a fake implementation
that gives its output shapes), so a paged attention that reads pages through a table, or a Triton
kernel, sits in a `fullgraph=True` graph without a break, and the compiler fuses what lies
between them (norms, rotary, residuals, SwiGLU).

Each op is registered once per kernel backend (`depthserve::<backend>_<op>`): under "torch" and
"triton" the op runs that implementation on every device; under "auto" the torch one on CPU and
the Triton kernel on CUDA (the op's CUDA kernel). Only the ops a decode step calls are here; the
prefill ops run eagerly.

A custom op must name the tensor it mutates as the graph holds it: SAOBP's bias update writes
the bias rows, a dtype view of the K pool, and declared as mutating that view, the compiled step
ended with the whole K pool copied onto itself (functionalization writes a mutated view back into
its base; measured on CPU: a loop over all of k_pages per decode step, a pass over the pool that on
a GPU with a 40 GB cache would cost ~13 ms a step). So that op is registered as mutating k_pages
and rebuilds the bias rows from it inside (`OpSchema.on_op`, `OpSchema.calling`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from depthserve.kernels import dispatch
from depthserve.kernels.saobp import pool_bias_rows


@dataclass(frozen=True)
class OpSchema:
    family: str
    schema: str
    mutates: tuple[str, ...] = ()
    outputs: Callable[..., object] | None = None  # fake implementation: the outputs' shapes
    # Where the op's arguments differ from the implementation's (module docstring): `on_op` makes the
    # op's implementation out of the public one, `calling` the public signature out of the op.
    on_op: Callable[[Callable], Callable] | None = None
    calling: Callable[[Callable], Callable] | None = None


def _like_first(q: torch.Tensor, *_args) -> torch.Tensor:
    return torch.empty_like(q)


def _attention_and_lse(q: torch.Tensor, *_args) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


def _bias_update_on_pool(impl: Callable) -> Callable:
    """saobp_bias_update as the op runs it: the bias rows rebuilt from the K pool it mutates."""

    def on_pool(q, k_pages, page_table, bias_table, context_lens, lse, scale: float, coef: float) -> None:
        impl(q, k_pages, page_table, pool_bias_rows(k_pages), bias_table, context_lens, lse, scale, coef)

    return on_pool


def _bias_update_call(op: Callable) -> Callable:
    """The public signature of saobp_bias_update over the op, whose `bias_pages` must be the pool's
    own bias rows (`pool_bias_rows(k_pages)`, the engine's layout): checked by shape and type, and by
    address where the call runs eagerly."""

    def call(q, k_pages, page_table, bias_pages, bias_table, context_lens, lse, scale: float, coef: float) -> None:
        rows = pool_bias_rows(k_pages)
        if bias_pages.shape != rows.shape or bias_pages.dtype != rows.dtype or (
                not torch.compiler.is_compiling() and bias_pages.data_ptr() != rows.data_ptr()):
            raise ValueError("a compiled SAOBP bias update needs the bias rows of the K pool it is given "
                             "(kernels.saobp.pool_bias_rows)")
        op(q, k_pages, page_table, bias_table, context_lens, lse, scale, coef)

    return call


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
        "saobp", "(Tensor q, Tensor(a!) k_pages, Tensor page_table, Tensor bias_table, Tensor context_lens, "
        "Tensor lse, float scale, float coef) -> ()", ("k_pages",),
        on_op=_bias_update_on_pool, calling=_bias_update_call),
}


@functools.cache
def custom_op(backend: str, name: str) -> Callable:
    """`name` as the custom op `depthserve::<backend>_<name>` (registered on first use)."""
    spec = SCHEMAS[name]
    torch_impl = getattr(dispatch.module(spec.family, triton=False), name)
    triton_module = dispatch.module(spec.family, triton=True) if backend != "torch" else None
    triton_impl = getattr(triton_module, name) if triton_module is not None else None
    on_op = spec.on_op or (lambda implementation: implementation)
    impl = on_op(triton_impl if backend == "triton" else torch_impl)
    op = torch.library.custom_op(f"depthserve::{backend}_{name}", impl, mutates_args=spec.mutates,
                                 schema=spec.schema)
    if backend == "auto" and triton_impl is not None:
        op.register_kernel("cuda", on_op(triton_impl))
    if backend == "auto" and (native := dispatch.native_cpu_op(name)) is not None:
        op.register_kernel("cpu", on_op(native))
    op.register_fake(spec.outputs or (lambda *args: None))
    return spec.calling(op) if spec.calling is not None else op
