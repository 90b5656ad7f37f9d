"""Mixture-of-experts maths, one entry point (`plan_experts`, then `mix_experts`) for both step kinds.

Eager steps group the (token, expert) pairs by expert and run each expert once on its own rows: one
matmul per active expert, or all experts in one batched matmul over their rows padded to the busiest
expert's count (the counts are read on the host). Static-shape steps (torch.compile, no host
synchronisation, no shape that depends on values) run every expert on every token and weight each
token's outputs by its gates scattered over the experts (zero for the experts it did not pick): the
same rows a grouped form padded to the token count would compute, without the sort and the row
gathers around the matmul, which a compiled step pays for in launches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Eager steps run all experts as one batched matmul (rows padded to the busiest expert's count) when
# that computes at most this many rows per (token, expert) pair, and at least this share of the
# experts have pairs (the batched matmul reads every expert's weights: where few are hit, as for one
# decoding sequence, one matmul per hit expert reads less); else one matmul per active expert.
PADDED_EXPERTS_MAX_ROWS_PER_PAIR = 4
PADDED_EXPERTS_MIN_ACTIVE_SHARE = 0.75

# expert(rows, e): expert e on its rows [n, d] (e an int), or every expert on its own rows
# [num_experts, n, d] (e = slice(None)); `weight[e]` selects the weights for either.
Expert = Callable[[torch.Tensor, int | slice], torch.Tensor]


@dataclass
class EveryExpert:
    """Static shapes: every expert on every token, weighted by the tokens' choices `top` [tokens, k]."""

    top: torch.Tensor
    num_experts: int


@dataclass
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert (stably: by token within an expert), and the
    form to run them in."""

    order: torch.Tensor  # [pairs] each pair's index in the flattened [tokens, k] choices
    tokens: torch.Tensor  # [pairs] each pair's token
    experts: torch.Tensor  # [pairs] each pair's expert, ascending
    counts: torch.Tensor  # [num_experts] pairs per expert
    num_tokens: int
    width: int | None  # rows per expert in the padded form; None: one matmul per active expert
    per_expert: list[int]  # `counts` on the host


def plan_experts(top: torch.Tensor, num_experts: int, static_shapes: bool) -> ExpertGroups | EveryExpert:
    """How the experts of `top` [tokens, k] (each token's k distinct experts) run. At static shapes,
    every expert on every token; in eager steps grouped by expert, padded to the busiest expert's count
    where that computes at most PADDED_EXPERTS_MAX_ROWS_PER_PAIR rows per pair and most experts are hit
    (decode-sized batches, where one small matmul per expert costs more in calls than in arithmetic),
    else one matmul per active expert."""
    if static_shapes:
        return EveryExpert(top, num_experts)
    num_tokens, k = top.shape
    flat = top.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    per_expert = counts.tolist()
    width: int | None = max(per_expert)
    active = sum(1 for count in per_expert if count)
    if (num_experts * width > PADDED_EXPERTS_MAX_ROWS_PER_PAIR * flat.shape[0]
            or active < PADDED_EXPERTS_MIN_ACTIVE_SHARE * num_experts):
        width = None
    return ExpertGroups(order, order // k, flat[order], counts, num_tokens, width, per_expert)


def mix_experts(plan: ExpertGroups | EveryExpert, x: torch.Tensor, expert: Expert,
                weights: torch.Tensor) -> torch.Tensor:
    """Each token's experts' outputs [tokens, out] weighted by `weights` [tokens, k] (in the order of
    the `top` the plan came from) and summed."""
    if isinstance(plan, EveryExpert):
        every = expert(x.expand(plan.num_experts, -1, -1), slice(None))  # [experts, tokens, out]
        gates = weights.new_zeros(x.shape[0], plan.num_experts).scatter(1, plan.top, weights)
        return torch.einsum("ne,eno->no", gates, every)
    if plan.width is None:
        pair_out = _looped(plan, x, expert)
    else:
        pair_out = _padded(plan, x, expert, plan.width)
    pair_out = pair_out * weights.reshape(-1)[plan.order][:, None]
    return pair_out.new_zeros(plan.num_tokens, pair_out.shape[1]).index_add_(0, plan.tokens, pair_out)


def _looped(groups: ExpertGroups, x: torch.Tensor, expert: Expert) -> torch.Tensor:
    """One matmul per active expert on its rows (reads the counts on the host: eager steps only)."""
    outs, start = [], 0
    for e, count in enumerate(groups.per_expert):
        if count:
            outs.append(expert(x.index_select(0, groups.tokens[start : start + count]), e))
            start += count
    return torch.cat(outs)


def _padded(groups: ExpertGroups, x: torch.Tensor, expert: Expert, width: int) -> torch.Tensor:
    """Every expert in one batched call, each expert's rows padded to `width` (the padding rows are
    zeros, computed and never read)."""
    num_experts = groups.counts.shape[0]
    first = torch.cumsum(groups.counts, 0) - groups.counts  # each expert's first pair
    slot = torch.arange(groups.tokens.shape[0], device=x.device) - first[groups.experts]
    position = groups.experts * width + slot
    rows = x.new_zeros(num_experts * width, x.shape[1]).index_copy_(0, position, x.index_select(0, groups.tokens))
    out = expert(rows.view(num_experts, width, x.shape[1]), slice(None))
    return out.reshape(num_experts * width, -1).index_select(0, position)
