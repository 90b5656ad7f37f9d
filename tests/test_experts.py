"""depthserve/layers/experts.py: mixture-of-experts maths in each of its forms (grouped by expert in
eager steps, every expert on every token at static shapes)."""

from __future__ import annotations

import pytest
import torch

from depthserve.layers.experts import EveryExpert, ExpertGroups, mix_experts, plan_experts


def _linear(weight: torch.Tensor):
    return lambda rows, e: rows @ weight[e].transpose(-1, -2)


def test_the_eager_form_reads_only_the_experts_hit_when_few_are():
    """One decoding sequence hits one of two experts: one matmul on that expert, not a batched matmul
    over both experts' weights; with both hit, the batched matmul; at static shapes, every expert on
    every token whatever the choices."""
    assert plan_experts(torch.tensor([[0]]), 2, static_shapes=False).width is None
    assert plan_experts(torch.tensor([[0], [1]]), 2, static_shapes=False).width == 1
    assert isinstance(plan_experts(torch.tensor([[1], [1], [1]]), 2, static_shapes=True), EveryExpert)
    many = torch.tensor([[e % 8, (e + 1) % 8] for e in range(40)])  # 10 pairs per expert, rows: 8 x 10 <= 4 x 80
    assert plan_experts(many, 8, static_shapes=False).width == 10
    assert plan_experts(many, 64, static_shapes=False).width is None  # 64 x 10 rows for 80 pairs


@pytest.mark.parametrize("form", ["looped", "padded", "static"])
def test_every_form_equals_each_token_through_its_experts(monkeypatch, form):
    generator = torch.Generator().manual_seed(0)
    tokens, experts, k, d, out = 23, 5, 2, 16, 12
    x = torch.randn(tokens, d, generator=generator, dtype=torch.float64)
    weight = torch.randn(experts, out, d, generator=generator, dtype=torch.float64)
    top = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=generator, dtype=torch.float64)
    from depthserve.layers import experts as experts_layer

    monkeypatch.setattr(experts_layer, "PADDED_EXPERTS_MAX_ROWS_PER_PAIR", 10**6 if form == "padded" else 0)
    plan = plan_experts(top, experts, static_shapes=form == "static")
    assert isinstance(plan, EveryExpert if form == "static" else ExpertGroups)
    assert form == "static" or (plan.width is None) == (form == "looped")
    mixed = mix_experts(plan, x, _linear(weight), weights)
    expected = torch.stack([sum(weights[i, j] * (weight[top[i, j]] @ x[i]) for j in range(k))
                            for i in range(tokens)])
    torch.testing.assert_close(mixed, expected, rtol=1e-12, atol=1e-12)
