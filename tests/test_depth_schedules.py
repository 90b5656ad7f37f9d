"""Per-token depth in the references (docs/depth-semantics.md section 6): every architecture's reference
takes a schedule (one knob setting per token). A constant schedule is the fixed knob; a token's
result depends only on its prefix and their settings; a token that runs a level attends only to
the earlier tokens that ran it, so a lone token of depth d reads what the model reads at depth d."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from depthserve import reference
from depthserve.oracles import dreamer as dreamer_reference
from depthserve.oracles import put as put_reference
from depthserve.lab.make_tiny import make_tiny, synthetic_streams

N = 14
SETTINGS = {  # the knob settings a schedule draws from
    "sgt": [{"loops": 0}, {"loops": 1}, {"loops": 3}, {"loops": {"1": 2, "2": 0}}],
    "itt": [{"selection_ratios": [0.0, 0.0]}, {"selection_ratios": [1.0, 0.5]}, {"selection_ratios": [0.3, 0.0]},
            {"thinking_steps": 1}],
    "dreamer": [{"depth": d} for d in (1, 2, 3, 4)],
    "put": [{"loops": t} for t in (1, 2, 3)],
}
OPTIONS = {"dreamer": {"depth": 4}, "put": {"steps": 3}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("schedules")
    out = {arch: make_tiny(arch, root / arch, seed=4, tokenizer=smollm_tokenizer, **OPTIONS.get(arch, {}))
           for arch in SETTINGS}
    # Suffix layers attend over every token's last pass, earlier tokens' deeper ones included.
    out["put-no-suffix"] = make_tiny("put", root / "put-no-suffix", seed=4, tokenizer=smollm_tokenizer, steps=3,
                                     n_suffix=0)
    return out


def _ids(n: int = N, seed: int = 0) -> list[int]:
    return synthetic_streams(49152, 1, n, seed)[0].tolist()


def _schedule(arch: str, seed: int, n: int = N) -> list[dict]:
    rng = random.Random(seed)
    return [rng.choice(SETTINGS[arch]) for _ in range(n)]


@pytest.mark.parametrize("arch", sorted(SETTINGS))
def test_a_constant_schedule_is_the_fixed_knob(ckpts, arch):
    ids = _ids()
    for setting in SETTINGS[arch]:
        fixed = reference.forward(ckpts[arch], ids, setting)
        scheduled = reference.forward(ckpts[arch], ids, schedule=[setting] * len(ids))
        torch.testing.assert_close(scheduled, fixed, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", sorted(SETTINGS))
def test_a_token_depends_only_on_its_prefix_and_their_settings(ckpts, arch):
    ids, schedule = _ids(), _schedule(arch, seed=1)
    full = reference.forward(ckpts[arch], ids, schedule=schedule)
    for cut in (5, 9):
        prefix = reference.forward(ckpts[arch], ids[:cut], schedule=schedule[:cut])
        torch.testing.assert_close(prefix, full[:cut], rtol=0, atol=1e-10)
    # Changing a later token's setting leaves the earlier ones alone, and changes that token.
    other = list(schedule)
    other[10] = next(s for s in SETTINGS[arch] if s != schedule[10])
    changed = reference.forward(ckpts[arch], ids, schedule=other)
    torch.testing.assert_close(changed[:10], full[:10], rtol=0, atol=1e-10)
    assert (changed[10] - full[10]).abs().max() > 1e-6


@pytest.mark.parametrize("arch", ["dreamer", "put-no-suffix"])
def test_a_lone_shallow_token_reads_what_the_model_reads_at_its_depth(ckpts, arch):
    """Every earlier token runs the deepest setting, so each level's slot holds all of them: the
    last token at depth d gets exactly the logits the constant-depth run reads after d levels (for
    PUT without suffix layers, which would read the earlier tokens' deeper passes)."""
    ids = _ids()
    knob, deepest = ("depth", 4) if arch == "dreamer" else ("loops", 3)
    if arch == "dreamer":
        cfg, spec, w = dreamer_reference.load(ckpts[arch])
        per_level, _ = dreamer_reference.run(cfg, spec, w, torch.tensor([ids]), deepest, every_depth=True)
    else:
        per_level = put_reference.run_each_loop(put_reference.load_put(ckpts[arch]), torch.tensor([ids]), deepest)
    for d in range(1, deepest + 1):
        schedule = [{knob: deepest}] * (len(ids) - 1) + [{knob: d}]
        last = reference.forward(ckpts[arch], ids, schedule=schedule)[-1]
        torch.testing.assert_close(last, per_level[d - 1][0, -1], rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", ["sgt", "dreamer", "put"])
def test_a_shallow_token_is_missing_from_the_deeper_levels_only(ckpts, arch):
    """Token 3 runs the shallowest setting: later tokens at deeper levels no longer see it (their
    logits change), and nothing before it changes."""
    ids = _ids()
    deepest, shallowest = SETTINGS[arch][-1 if arch != "sgt" else 2], SETTINGS[arch][0]
    base = reference.forward(ckpts[arch], ids, schedule=[deepest] * len(ids))
    schedule = [deepest] * len(ids)
    schedule[3] = shallowest
    changed = reference.forward(ckpts[arch], ids, schedule=schedule)
    torch.testing.assert_close(changed[:3], base[:3], rtol=0, atol=1e-10)
    assert (changed[4:] - base[4:]).abs().max(dim=-1).values.min() > 1e-8


def test_itt_per_token_ratios_route_each_token_by_its_own_threshold(ckpts):
    ids = _ids()
    schedule = _schedule("itt", seed=2)
    _, decisions = reference.forward(ckpts["itt"], ids, schedule=schedule, return_decisions=True)
    for (layer, t), d in decisions.items():
        off = np.array([(setting.get("selection_ratios") or [1.0, 1.0])[t - 1] == 0
                        or (setting.get("thinking_steps") is not None and t > setting["thinking_steps"])
                        for setting in schedule])
        assert not d["selected"][off].any() and np.isinf(d["margin"][off]).all()
        assert np.allclose(d["margin"][~off], np.abs(d["score"] - d["threshold"])[~off])


def test_a_schedule_needs_one_setting_per_token(ckpts):
    with pytest.raises(ValueError, match="one setting per token"):
        reference.forward(ckpts["put"], _ids(), schedule=[{"loops": 1}])
