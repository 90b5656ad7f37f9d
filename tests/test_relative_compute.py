"""`relative_compute` means one thing for every architecture (docs/server.md, "Depth"): a request's FLOPs
over what the same tokens cost at the model's default depth settings, the knobs' defaults that
GET /v1/models lists. So a request at the defaults reports 1, a cheaper setting less, a deeper one more."""

from __future__ import annotations

import pytest

from depthserve import DepthParams, SamplingParams
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import stream_prompts, tiny_llm

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# Per architecture: (the cheapest setting, a setting costlier than the defaults, or None)
SETTINGS = {
    "sgt": ({"loops": 0}, {"loops": 3}),
    "itt": ({"thinking_steps": 0}, None),
    "dreamer": ({"depth": 1}, None),
    "put": ({"loops": 1}, None),
    "dory": ({"loops": 1}, {"loops": 3}),  # trained with 2 passes (depthserve/lab/tiny/dory.py)
}


class TinyEngines(dict):
    """One engine per architecture on a tiny random checkpoint, built when a test first asks for it."""

    def __init__(self, root, tokenizer):
        super().__init__()
        self.root, self.tokenizer = root, tokenizer

    def __missing__(self, arch: str):
        self[arch] = tiny_llm(make_tiny(arch, self.root / arch, seed=5, tokenizer=self.tokenizer))
        return self[arch]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, smollm_tokenizer):
    return TinyEngines(tmp_path_factory.mktemp("relative-compute"), smollm_tokenizer)


def _listed_defaults(llm) -> DepthParams:
    """The knobs' defaults as GET /v1/models lists them."""
    return DepthParams.from_dict({name: knob.default for name, knob in llm.engine.model.depth_knobs().items()})


def _relative_compute(llm, depths: list[DepthParams]) -> list[float]:
    prompts = stream_prompts([13] * len(depths), seed=3)
    return [out.depth.relative_compute for out in llm.generate(prompts, PARAMS, depths)]


@pytest.mark.parametrize("arch", list(SETTINGS))
def test_the_defaults_cost_one_and_other_settings_are_relative_to_them(engines, arch):
    llm = engines[arch]
    cheapest, costlier = SETTINGS[arch]
    depths = [DepthParams(), _listed_defaults(llm), DepthParams.from_dict(cheapest)]
    if costlier is not None:
        depths.append(DepthParams.from_dict(costlier))
    at_defaults, at_listed_defaults, at_cheapest, *at_costlier = _relative_compute(llm, depths)
    assert at_defaults == pytest.approx(1.0, rel=1e-12) and at_listed_defaults == pytest.approx(1.0, rel=1e-12)
    assert at_cheapest < 1.0
    assert all(value > 1.0 for value in at_costlier)
    model = llm.engine.model
    plan = model.plan(DepthParams().normalized(model.depth_knobs()))
    assert plan.relative_compute_estimate == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("arch", ["put", "dreamer"])
def test_a_range_at_the_defaults_maximum_costs_what_the_defaults_cost(engines, arch):
    """Under the server's default policy (fixed) a range runs at its maximum: the defaults here."""
    knob = next(name for name, spec in engines[arch].engine.model.depth_knobs().items() if spec.elastic)
    default = engines[arch].engine.model.depth_knobs()[knob].default
    depth = DepthParams.from_dict({knob: {"min": 1, "max": default}})
    assert _relative_compute(engines[arch], [depth]) == [pytest.approx(1.0, rel=1e-12)]


def test_itt_below_its_trained_ratios_is_compared_with_their_expected_cost(engines):
    llm = engines["itt"]
    trained = llm.engine.model.depth_knobs()["selection_ratios"].default
    halved = DepthParams.from_dict({"selection_ratios": [ratio / 2 for ratio in trained]})
    assert 0.0 < _relative_compute(llm, [halved])[0] < 1.0


@pytest.mark.parametrize("arch", ["llama", "saobp"])
def test_models_without_a_depth_knob_report_nothing_and_are_priced_at_one(engines, arch):
    llm = engines[arch]
    assert llm.generate(stream_prompts([9], seed=4), PARAMS)[0].depth is None
    model = llm.engine.model
    assert model.plan(DepthParams().normalized(model.depth_knobs())).relative_compute_estimate == 1.0
