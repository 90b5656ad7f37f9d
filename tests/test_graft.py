"""`depthserve graft-sgt`: entropy measurement (paper 000 Eq. 4, 5), head selection, the written
SGT checkpoint (engine + reference; loops = 0 is the source model exactly) and CLI errors.

Runs on a tiny random Llama checkpoint with a calibration text written into tmp (no shared data).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from depthserve import LLM, DepthParams, reference
from depthserve.oracles import llama as llama_reference
from depthserve.tools.cli import main
from depthserve.lab.sgt_graft import (
    GRAFT_FILE,
    GraftError,
    attention_entropies,
    calibration_sequences,
    graft,
    last_token_entropy,
    load_source,
    select_heads,
)
from depthserve.archs import read_depth_spec
from depthserve.archs.sgt.format import SGTSpec
from depthserve.lab.make_tiny import make_tiny

DOCS = [
    "The river rose overnight, and by morning the old mill stood in water up to its windows. "
    "Farmers along the valley moved their animals to the hills while the town council met in the church.",
    "To bake bread you need flour, water, salt and yeast. Mix them, knead the dough for ten minutes, "
    "let it rise for an hour, shape it, let it rise again and bake it in a hot oven until golden.",
    "Prime numbers are the integers greater than one whose only divisors are one and themselves: "
    "two, three, five, seven, eleven, thirteen, seventeen, nineteen, twenty-three and so on without end.",
    "She opened the letter slowly. It was from her brother, who had left for the coast twenty years ago "
    "and had never written once, not even when their mother died.",
]
LAYERS, HEADS, LOOPS = 2, 2, 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("graft")
    src = make_tiny("llama", root / "src", seed=7, tokenizer=smollm_tokenizer)
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out = root / "graft"
    rc = main(["graft-sgt", "--model", str(src), "--layers", str(LAYERS), "--heads", str(HEADS),
               "--loops", str(LOOPS), "--calib", str(calib), "--max-len", "48", "--out", str(out)])
    assert rc == 0
    return {"root": root, "src": src, "calib": calib, "out": out}


def _hf_last_token_entropies(path, sequences) -> torch.Tensor:
    """Independent oracle: transformers' eager Llama materialises every attention matrix; take the
    last query row of each head, H / log N (Eq. 4), mean over sequences."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64, attn_implementation="eager").eval()
    total = None
    with torch.no_grad():
        for ids in sequences:
            attn = model(torch.tensor([ids]), output_attentions=True).attentions  # L x [1, H, N, N]
            rows = []
            for a in attn:
                last = a[0, :, -1, :]  # [H, N]
                ent = -(last * torch.log(last.clamp_min(1e-300))).sum(-1) / math.log(len(ids))
                rows.append(ent)
            e = torch.stack(rows)
            total = e if total is None else total + e
    return total / len(sequences)


def test_entropies_match_materialised_attention(setup):
    source = load_source(setup["src"])
    sequences = calibration_sequences(source.tokenizer, setup["calib"], max_len=48)
    assert len(sequences) >= len(DOCS) and all(2 <= len(s) <= 48 for s in sequences)
    assert calibration_sequences(source.tokenizer, setup["calib"], 48, num_sequences=2) == sequences[:2]
    first_two = [source.tokenizer.encode(doc, add_special_tokens=False) for doc in DOCS[:2]]
    cut = [ids[i : i + 48] for ids in first_two for i in range(0, len(ids), 48)]
    assert calibration_sequences(source.tokenizer, setup["calib"], 48, None, num_documents=2) == cut
    ours = attention_entropies(source, sequences)
    assert ours.shape == (4, 4)
    assert ((ours > 0) & (ours <= 1 + 1e-6)).all()
    oracle = _hf_last_token_entropies(setup["src"], sequences)
    torch.testing.assert_close(ours, oracle, rtol=0, atol=1e-5)
    # The checkpoint's graft.json holds the same numbers.
    meta = json.loads((setup["out"] / GRAFT_FILE).read_text())
    torch.testing.assert_close(torch.tensor(meta["head_entropy"], dtype=torch.float64), ours, rtol=0, atol=1e-9)
    assert meta["calibration"]["num_sequences"] == len(sequences)
    assert meta["calibration"]["num_tokens"] == sum(len(s) for s in sequences)


def test_uniform_attention_has_entropy_one(setup):
    """Eq. 4's normalisation: zero queries give a uniform distribution over N tokens, entropy log N / log N."""
    source = load_source(setup["src"])
    source.weights["model.layers.1.self_attn.q_proj.weight"].zero_()
    ref = llama_reference.Reference(source.hf_config, source.weights, read_depth_spec(source.hf_config))
    a = torch.randn(13, source.hf_config["hidden_size"])
    torch.testing.assert_close(last_token_entropy(ref, 1, a), torch.ones(4), rtol=0, atol=1e-6)


def test_select_heads():
    e = torch.tensor([
        [0.99, 0.99, 0.99, 0.99],  # layer 0: highest, never chosen
        [0.10, 0.20, 0.30, 0.40],  # mean 0.25
        [0.50, 0.90, 0.50, 0.10],  # mean 0.50: heads 1, then 0 and 2 tie -> 0
        [0.30, 0.30, 0.30, 0.30],  # mean 0.30: all tie -> 0, 1
        [0.60, 0.20, 0.70, 0.10],  # mean 0.40
    ])
    spec = select_heads(e, 3, 2, loops=2)
    assert isinstance(spec, SGTSpec)
    assert spec.looped_layers == (2, 3, 4)
    assert [s.heads for s in spec.layers] == [(1, 0), (0, 1), (2, 0)]
    assert all(s.loops == 2 for s in spec.layers) and spec.max_loops == 2
    assert select_heads(e, 1, 4, loops=3).layers[0].heads == (1, 0, 2, 3)
    assert select_heads(e, 1, 1, loops=3).max_loops == 3
    assert select_heads(e, 1, 1, loops=1, max_loops=5).max_loops == 5
    # Layer ties go to the lower index.
    flat = torch.full((4, 2), 0.5)
    assert select_heads(flat, 2, 1).looped_layers == (1, 2)
    with pytest.raises(GraftError, match="layer 0"):
        select_heads(e, 5, 1)
    with pytest.raises(GraftError, match="--heads"):
        select_heads(e, 1, 5)
    with pytest.raises(GraftError, match="--max-loops"):
        select_heads(e, 1, 1, loops=3, max_loops=2)


def test_written_checkpoint(setup):
    src, out = setup["src"], setup["out"]
    cfg = json.loads((out / "config.json").read_text())
    spec = read_depth_spec(cfg)
    meta = json.loads((out / GRAFT_FILE).read_text())
    assert isinstance(spec, SGTSpec) and len(spec.layers) == LAYERS and 0 not in spec.looped_layers
    assert all(len(s.heads) == HEADS and s.loops == LOOPS for s in spec.layers) and spec.max_loops == 2
    # The chosen layers/heads are the highest-entropy ones of the recorded measurements.
    assert spec == select_heads(torch.tensor(meta["head_entropy"]), LAYERS, HEADS, LOOPS)
    assert [m["layer"] for m in meta["selected"]] == list(spec.looped_layers)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (out / "tokenizer.json").is_file()
    # Same weights, bit for bit.
    src_ref, graft_ref = llama_reference.load(src, torch.float32), llama_reference.load(out, torch.float32)
    assert src_ref.w.keys() == graft_ref.w.keys()
    assert all(torch.equal(src_ref.w[k], graft_ref.w[k]) for k in src_ref.w)

    ids = calibration_sequences(load_source(src).tokenizer, setup["calib"], 40)[1]
    # Reference: loops = 0 is the source exactly; loops = K differs.
    ref0 = reference.forward(out, ids, {"loops": 0})
    assert torch.equal(ref0, reference.forward(src, ids))
    ref1 = reference.forward(out, ids, {"loops": 1})
    assert (ref1 - ref0).abs().max() > 1e-2

    def llm(path):
        return LLM(str(path), device="cpu", dtype="float32", load_progress=False, max_model_len=128, block_size=8)

    source_scores = llm(src).score([ids])[0]
    grafted = llm(out)
    assert grafted.tokenizer.chat_template is not None
    s0 = grafted.score([ids], DepthParams(loops=0))[0]
    s1 = grafted.score([ids], DepthParams(loops=1))[0]
    assert s0 == source_scores  # exactly: the graft changes nothing with the loops off
    assert s1 != s0
    # loops = 1 in the engine is the reference's loops = 1 (float tolerance).
    ref_lp = torch.log_softmax(ref1.double(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(s1[1:], dtype=torch.float64), ref_lp, rtol=0, atol=1e-4)


def test_cli_errors(setup, tmp_path, capsys):
    base = ["graft-sgt", "--model", str(setup["src"]), "--calib", str(setup["calib"]), "--out", str(tmp_path / "o")]
    for extra, message in ((["--heads", "5"], "--heads 5"), (["--layers", "4"], "--layers 4"),
                           (["--layers", "0"], "--layers 0"), (["--loops", "-1"], "--loops")):
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err
    missing = ["graft-sgt", "--model", str(setup["src"]), "--calib", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")]
    assert main(missing) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(base[:4] + [str(bad)] + base[5:]) == 2
    assert "not readable" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(base[:4] + [str(empty)] + base[5:]) == 2
    assert "no text" in capsys.readouterr().err
    assert main(["graft-sgt", "--model", str(tmp_path / "nomodel"), "--calib", str(setup["calib"]),
                 "--out", str(tmp_path / "o")]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(base[:-1] + [str(setup["src"])]) == 2  # would overwrite the source
    assert "source checkpoint" in capsys.readouterr().err
    assert main(["graft-sgt", "--model", str(setup["out"]), "--calib", str(setup["calib"]),
                 "--out", str(tmp_path / "o")]) == 2  # already an SGT checkpoint
    assert "already a sgt checkpoint" in capsys.readouterr().err
    with pytest.raises(GraftError):
        graft(setup["src"], tmp_path / "o", layers=1, heads=9, calib_file=setup["calib"])
    assert not (tmp_path / "o").exists()
