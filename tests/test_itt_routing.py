"""ITT causal threshold routing on real text: calibrated on one half of c4_sample.jsonl, measured
on the other half, the fraction of prompt tokens selected at step t is within +-0.05 of the
requested ratio while the other step runs at its trained ratio; decode-time fractions are reported.

The checkpoint is a random tiny model, so how far the held-out fraction drifts depends on the
draw (the contract: "the realised fraction is only approximately rho ... it drifts on text unlike
the calibration text"); over seeds 3, 5, 6, 7, 11, 12 the largest per-(layer, step) drift for
rho in {0.3, 0.5, 0.7} was 0.03-0.09. Seed 11 (the engine tests' seed) stays within 0.05. On the
calibration text itself the fractions match to +-0.01 (checked below), so the engine's routing
and the calibration agree; what remains is the text.
"""

from __future__ import annotations

import json

import pytest

from depthserve import LLM, DepthParams, SamplingParams
from depthserve.lab.make_tiny import make_tiny
from depthserve.lab.itt_calibrate import calibrate
from tests.conftest import shared_data_file

TRAINED = [0.5, 0.3]
ITT_LAYERS = (1, 3)  # make-tiny's ITT layers of a 4-layer model, T = 2 steps
ALL_STEPS = {f"{layer}:{step}" for layer in ITT_LAYERS for step in (1, 2)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm_tokenizer):
    lines = shared_data_file("c4_sample.jsonl").read_text().splitlines()
    half = len(lines) // 2
    root = tmp_path_factory.mktemp("itt-c4")
    path = make_tiny("itt", root / "itt", seed=11, tokenizer=smollm_tokenizer)
    (root / "calibration.jsonl").write_text("\n".join(lines[:half]) + "\n")
    calibrate(path, root / "calibration.jsonl", max_len=1000)

    def prompts(docs):
        ids = [smollm_tokenizer.encode(json.loads(doc)["text"], add_special_tokens=False)[:1000] for doc in docs]
        return [p for p in ids if len(p) >= 2]

    llm = LLM(str(path), device="cpu", dtype="float32", load_progress=False, max_model_len=1024)
    return llm, prompts(lines[:half]), prompts(lines[half:])


def _fractions(llm, prompts, ratios) -> dict[str, float]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=1), DepthParams(selection_ratios=ratios))
    tokens = sum(o.depth.tokens for o in outs)
    assert tokens == sum(map(len, prompts))
    keys = outs[0].depth.counters["selected_tokens"].keys()
    return {key: sum(o.depth.counters["selected_tokens"][key] for o in outs) / tokens for key in keys}


@pytest.mark.parametrize("step", [1, 2])
def test_held_out_fraction_is_the_requested_ratio(setup, step):
    llm, _, held_out = setup
    print(f"held-out: {len(held_out)} documents, {sum(map(len, held_out))} tokens")
    for rho in (0.3, 0.5, 0.7):
        ratios = list(TRAINED)
        ratios[step - 1] = rho
        fractions = _fractions(llm, held_out, ratios)
        print(f"step {step} at rho={rho}: " + ", ".join(f"{k}={v:.3f}" for k, v in fractions.items()))
        assert set(fractions) == ALL_STEPS
        for layer in ITT_LAYERS:
            assert abs(fractions[f"{layer}:{step}"] - rho) <= 0.05, (layer, step, rho, fractions)
    assert llm.engine.block_manager.num_used_pages == 0


def test_calibration_text_fraction_is_exact(setup):
    llm, calibration_docs, _ = setup
    fractions = _fractions(llm, calibration_docs, TRAINED)
    assert set(fractions) == ALL_STEPS
    for key, fraction in fractions.items():
        assert abs(fraction - TRAINED[int(key[-1]) - 1]) <= 0.01, (key, fraction)


def test_decode_fractions_are_reported(setup):
    """The reported prompt and decode fractions are the shares of selected positions among the
    prompt's and the generated tokens' recorded decisions, and the counts add up."""
    llm, _, held_out = setup
    prompts = [p[:64] for p in held_out[:6]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        report = out.depth
        assert set(report.fractions["decode_selected_fraction"]) == ALL_STEPS
        assert set(report.fractions["prompt_selected_fraction"]) == ALL_STEPS
        computed = len(prompt) + len(out.token_ids) - 1  # the last sampled token is never run
        assert report.tokens == computed
        for (layer, step), flags in report.decisions.items():
            key = f"{layer}:{step}"
            selected = flags[:computed] == 1
            assert report.counters["selected_tokens"][key] == int(selected.sum())
            assert report.fractions["prompt_selected_fraction"][key] == pytest.approx(selected[: len(prompt)].mean())
            assert report.fractions["decode_selected_fraction"][key] == pytest.approx(selected[len(prompt):].mean())
    mean = {k: sum(o.depth.fractions["decode_selected_fraction"][k] for o in outs) / len(outs) for k in sorted(ALL_STEPS)}
    print("decode-time selected fractions (mean over 6 requests):", {k: round(v, 3) for k, v in mean.items()})
