"""The native checkpoint format, make-tiny / calibrate, and the reference forwards (the test oracle).

The reference of the base decoder is checked against Hugging Face transformers on the same
weights; SGT with loops=0 and ITT with every step off reduce to it; ITT routing is causal, its
decisions carry margins, and forcing decisions works.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from depthserve import reference
from depthserve.oracles import itt as itt_reference
from depthserve.archs import read_depth_spec
from depthserve.archs.itt.format import CALIBRATION_FILE, threshold
from depthserve.errors import CheckpointFormatError, MissingCalibrationError
from depthserve.lab.make_tiny import make_tiny, synthetic_streams


@pytest.fixture(scope="module")
def tokenizer():
    from depthserve.lab.make_tiny import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(arch, root / arch, seed=3, tokenizer=tokenizer) for arch in ("llama", "sgt", "itt")}


def _ids(n: int, seed: int = 0) -> list[int]:
    return synthetic_streams(49152, 1, n, seed)[0].tolist()


def test_make_tiny_writes_the_native_format(ckpts):
    for arch, path in ckpts.items():
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["depth"]["architecture"] == arch
        assert (path / "tokenizer.json").is_file()
        spec = read_depth_spec(cfg)
        assert spec.architecture == arch
    itt = json.loads((ckpts["itt"] / "config.json").read_text())["depth"]["itt"]
    assert itt["calibration"]["file"] == CALIBRATION_FILE and (ckpts["itt"] / CALIBRATION_FILE).is_file()
    sgt = read_depth_spec(json.loads((ckpts["sgt"] / "config.json").read_text()))
    assert [s.heads for s in sgt.layers] == [(3, 0), (1, 2, 3), (1, 0)]


def test_reference_base_decoder_matches_transformers(ckpts):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(ckpts["llama"]), torch_dtype=torch.float64).eval()
    ids = _ids(40)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = reference.forward(ckpts["llama"], ids)
    # transformers computes the rotary angles in fp32 even for an fp64 model: ~1e-5 on logits.
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_outputs_are_peaked(ckpts):
    logits = reference.forward(ckpts["llama"], _ids(64, seed=5))
    top2 = logits.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    assert float(gap.median()) > 0.2 and float(gap.min()) > 1e-4
    assert float(torch.softmax(logits, -1).max(-1).values.mean()) > 0.1  # far from uniform (2e-5)


def test_sgt_loops_zero_is_the_base_decoder_and_loops_change_it(ckpts):
    ids = _ids(30, seed=1)
    base = reference.forward(ckpts["sgt"], ids, {"loops": 0})
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(ckpts["sgt"]), torch_dtype=torch.float64).eval()
    with torch.no_grad():
        torch.testing.assert_close(base, hf(torch.tensor([ids])).logits[0], atol=1e-4, rtol=0)
    looped = reference.forward(ckpts["sgt"], ids)  # trained loop counts
    assert (looped - base).abs().max() > 1e-2
    # A per-layer map: layers not in the map keep their trained count.
    assert torch.equal(reference.forward(ckpts["sgt"], ids, {"loops": {"1": 2}}), looped)


def test_itt_routing_is_causal_and_reports_margins(ckpts):
    ids = _ids(60, seed=2)
    full, decisions = reference.forward(ckpts["itt"], ids, return_decisions=True)
    prefix, prefix_decisions = reference.forward(ckpts["itt"], ids[:35], return_decisions=True)
    torch.testing.assert_close(prefix, full[:35], atol=1e-9, rtol=1e-9)
    assert set(decisions) == {(1, 1), (1, 2), (3, 1), (3, 2)}
    for key, d in decisions.items():
        assert np.array_equal(prefix_decisions[key]["selected"], d["selected"][:35])
        assert np.allclose(d["margin"], np.abs(d["score"] - d["threshold"]))
        assert 0 < d["selected"].sum() < len(ids)


def test_itt_forced_decisions(ckpts):
    ids = _ids(40, seed=3)
    natural, decisions = reference.forward(ckpts["itt"], ids, return_decisions=True)
    forced = {key: d["selected"] for key, d in decisions.items()}
    assert torch.equal(reference.forward(ckpts["itt"], ids, force=forced), natural)
    flipped = dict(forced)
    flipped[(1, 1)] = forced[(1, 1)].copy()
    flipped[(1, 1)][10] = not flipped[(1, 1)][10]
    changed = reference.forward(ckpts["itt"], ids, force=flipped)
    assert torch.equal(changed[:10], natural[:10])  # causal: earlier tokens are untouched
    assert (changed[10] - natural[10]).abs().max() > 1e-3


def test_itt_ratio_extremes(ckpts):
    ids = _ids(30, seed=4)
    _, all_on = reference.forward(ckpts["itt"], ids, {"selection_ratios": [1.0, 1.0]}, return_decisions=True)
    assert all(d["selected"].all() for d in all_on.values())
    _, off = reference.forward(ckpts["itt"], ids, {"thinking_steps": 0}, return_decisions=True)
    assert off == {}
    _, one = reference.forward(ckpts["itt"], ids, {"thinking_steps": 1}, return_decisions=True)
    assert set(one) == {(1, 1), (3, 1)}


def test_calibration_selects_the_trained_fraction_on_its_own_tokens(ckpts):
    windows = synthetic_streams(49152, 16, 128, seed=3)  # the streams make-tiny calibrated on
    tables = itt_reference.calibrate(ckpts["itt"], windows)
    ref = itt_reference.load_itt(ckpts["itt"], torch.float32)
    for layer, table in tables.items():  # make-tiny stored exactly this table
        assert torch.equal(ref.extras[layer]["quantiles"], table)
    # The calibration table is sorted and the threshold interpolates it.
    for layer, table in tables.items():
        assert table.shape == (2, 101) and bool((table.diff(dim=1) >= 0).all())
        q = table[0].double().numpy()
        assert threshold(q, 1.0) == -np.inf and threshold(q, 0.0) == np.inf
        assert abs(threshold(q, 0.5) - float(np.float32(q[50]))) < 1e-6
    _, decisions = itt_reference.run(ref, windows)
    for (layer, t), d in decisions.items():
        rho = ref.spec.trained_ratios[t - 1]
        assert abs(float(np.mean(d["selected"])) - rho) < 0.03, (layer, t)


def test_malformed_depth_sections_are_refused(ckpts, tmp_path):
    cfg = json.loads((ckpts["sgt"] / "config.json").read_text())
    bad = json.loads(json.dumps(cfg))
    bad["depth"]["sgt"]["head_sets"][0] = [0, 99]
    with pytest.raises(CheckpointFormatError, match="head_sets"):
        read_depth_spec(bad)
    bad = json.loads(json.dumps(cfg))
    bad["depth"]["architecture"] = "moe"
    with pytest.raises(CheckpointFormatError, match="architecture"):
        read_depth_spec(bad)


def test_itt_without_calibration_is_refused_until_calibrated(ckpts, tmp_path, tokenizer):
    from depthserve import LLM
    from depthserve.tools.cli import main

    path = make_tiny("itt", tmp_path / "itt", seed=3, tokenizer=tokenizer)
    (path / CALIBRATION_FILE).unlink()
    cfg = json.loads((path / "config.json").read_text())
    cfg["depth"]["itt"]["calibration"] = None
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MissingCalibrationError, match="depthserve calibrate --model"):
        LLM(str(path), device="cpu", dtype="float32", load_progress=False)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    assert main(["calibrate", "--model", str(path), "--text", str(text), "--max-len", "64"]) == 0
    llm = LLM(str(path), device="cpu", dtype="float32", load_progress=False, max_model_len=128)
    assert llm.generate([[5, 6, 7]])[0].finish_reason is not None


def test_make_tiny_command_line(tmp_path):
    from depthserve.tools.cli import main

    assert main(["make-tiny", "--arch", "sgt", "--out", str(tmp_path / "m"), "--seed", "7", "--num-kv-heads", "4"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 4 and cfg["depth"]["architecture"] == "sgt"


@pytest.mark.parametrize("arch, options, section, expected", [
    ("dreamer", ["depth=3", "attn_experts=0"], "dreamer", {"depth": 3, "attn_experts": 0}),
    ("put", ["steps=2", "conv_kernel=3"], "put", {"T": 2, "conv_kernel": 3}),
    ("saobp", ["variant=low", "self_message=true", "lam=0.5"], "saobp", {"variant": "low", "self_message": True}),
])
def test_make_tiny_options_reach_the_architecture(tmp_path, arch, options, section, expected):
    from depthserve.tools.cli import main

    argv = ["make-tiny", "--arch", arch, "--out", str(tmp_path / "m")]
    for option in options:
        argv += ["--option", option]
    assert main(argv) == 0
    depth = json.loads((tmp_path / "m" / "config.json").read_text())["depth"]
    assert depth["architecture"] == arch
    assert {key: depth[section][key] for key in expected} == expected


@pytest.mark.parametrize("argv, message", [
    (["--arch", "llama", "--option", "depth=2"], "applies to"),
    (["--arch", "put", "--option", "bogus=1"], "bogus"),
])
def test_make_tiny_refuses_options_it_cannot_use(tmp_path, capsys, argv, message):
    from depthserve.tools.cli import main

    assert main(["make-tiny", "--out", str(tmp_path / "m"), *argv]) == 2
    assert message in capsys.readouterr().err
