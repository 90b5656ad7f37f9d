"""Mixture-of-experts maths grouped by expert: a step's (token, expert) pairs are sorted by expert and
each expert runs once on its own rows, either one matmul per active expert or all experts in one
batched matmul over their rows padded to a common width. The padded form needs no host-known value
when its width is a bound rather than the busiest expert's count: a token picks an expert at most
once, so no expert has more pairs than the step has tokens. So one form serves both step kinds: eager
steps choose the width (or the loop) from the counts, static-shape steps (torch.compile, no host
synchronisation) pad to the token count, the rows that running every expert on every token costs.
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

# expert(rows, e): expert e on its rows [n, d] (e an int), or every expert on its padded rows
# [num_experts, width, d] (e = slice(None)); `weight[e]` selects the weights for either.
Expert = Callable[[torch.Tensor, int | slice], torch.Tensor]


@dataclass
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert (stably: by token within an expert), and the
    form to run them in."""

    order: torch.Tensor  # [pairs] each pair's index in the flattened [tokens, k] choices
    tokens: torch.Tensor  # [pairs] each pair's token
    experts: torch.Tensor  # [pairs] each pair's expert, ascending
    counts: torch.Tensor  # [num_experts] pairs per expert
    num_tokens: int
    width: int | None  # rows per expert in the padded form; None: one matmul per active expert (eager)
    per_expert: list[int] | None  # `counts` on the host (eager steps; None at static shapes)


def group_by_expert(top: torch.Tensor, num_experts: int, static_shapes: bool) -> ExpertGroups:
    """The pairs of `top` [tokens, k] (each token's k distinct experts) grouped by expert. At static
    shapes they run padded to the token count (a shape, not a value: no host synchronisation); in
    eager steps padded to the busiest expert's count where that computes at most
    PADDED_EXPERTS_MAX_ROWS_PER_PAIR rows per pair and most experts are hit (decode-sized batches,
    where one small matmul per expert costs more in calls than in arithmetic), else one matmul per
    active expert."""
    num_tokens, k = top.shape
    flat = top.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # index_add_ rather than bincount: its output's shape does not depend on the values (torch.compile)
    counts = flat.new_zeros(num_experts).index_add_(0, flat, torch.ones_like(flat))
    width: int | None = num_tokens
    per_expert = None
    if not static_shapes:
        per_expert = counts.tolist()
        width = max(per_expert)
        active = sum(1 for count in per_expert if count)
        if (num_experts * width > PADDED_EXPERTS_MAX_ROWS_PER_PAIR * flat.shape[0]
                or active < PADDED_EXPERTS_MIN_ACTIVE_SHARE * num_experts):
            width = None
    return ExpertGroups(order, order // k, flat[order], counts, num_tokens, width, per_expert)


def run_experts(groups: ExpertGroups, x: torch.Tensor, expert: Expert) -> torch.Tensor:
    """Each pair's expert output [pairs, out], in pair order: its token's row of x [tokens, d] through
    its expert."""
    if groups.width is None:
        return _looped(groups, x, expert)
    return _padded(groups, x, expert, groups.width)


def mix_experts(groups: ExpertGroups, x: torch.Tensor, expert: Expert, weights: torch.Tensor) -> torch.Tensor:
    """Each token's experts' outputs [tokens, out] weighted by `weights` [tokens, k] (in the order of
    the `top` the groups came from) and summed."""
    pair_out = run_experts(groups, x, expert) * weights.reshape(-1)[groups.order][:, None]
    return pair_out.new_zeros(groups.num_tokens, pair_out.shape[1]).index_add_(0, groups.tokens, pair_out)


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
