"""Dory served as users run it on a CPU (docs/quantization.md): bf16 activations, and every linear
layer (the LM head included) quantized at load with `--quantization int8|int4`, against
transformers' DoryForCausalLM in fp32.

The oracle of a quantized engine is transformers on a "fake-quantized" copy of the checkpoint:
every tensor the engine serves from codes replaced by its round-to-nearest dequantization
(tests/test_quantized_engine.py does the same for the other architectures, with the same bounds:
the fp32 engine's 1e-4 with fp32 activations, its BF16 bound with bf16 ones). And the load: a bf16
checkpoint is read tensor by tensor from its files into a model built in bf16."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from depthserve import LLM, DepthParams, SamplingParams
from depthserve.oracles import dory as dory_reference
from depthserve.archs.dory.model import _target as engine_parameter
from depthserve.lab.tiny.dory import make_tiny
from depthserve.layers.quantized import QuantLinear, quantize_rtn
from depthserve.loading.hf_loader import LazyWeights, read_weights
from tests.depth_helpers import BLOCK_SIZE, check_logprobs
from tests.test_quantized_engine import BF16, FP32

VOCAB = 257  # the byte tokenizer's
PROMPT_LENGTHS = [5, 19, 33]
LOOPS = [1, 2, 3]  # one request per loop count, in one batch
MAX_TOKENS = [6, 4, 5]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("dory-quantized") / "fp32", seed=7, loops=2, sliding_window=8)


def engine(path: Path, dtype: str, quantization: str = "none") -> LLM:
    return LLM(str(path), device="cpu", dtype=dtype, quantization=quantization, load_progress=False,
               max_model_len=64, block_size=BLOCK_SIZE, max_num_batched_tokens=16, enable_prefix_caching=False)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def generate_mixed_loops(llm: LLM):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in MAX_TOKENS]
    outputs = llm.generate(prompts(), params, [DepthParams(loops=n) for n in LOOPS])
    assert llm.engine.block_manager.num_used_pages == 0
    return outputs


def fake_quantized_copy(path: Path, quantized: list[str], bits: int, out: Path) -> Path:
    """The checkpoint with each tensor the engine serves from codes replaced by their dequantization."""
    shutil.copytree(path, out)
    weights = load_file(out / "model.safetensors")
    covered = set()
    for name, tensor in weights.items():
        if engine_parameter(name) in quantized:
            weights[name] = quantize_rtn(tensor.float(), bits).dequantize().to(tensor.dtype)
            covered.add(engine_parameter(name))
    assert covered == set(quantized)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def assert_matches_reference(path: Path, outputs, tolerance) -> dict:
    stats = {"tokens": 0, "max_err": 0.0}
    for prompt, loops, out in zip(prompts(), LOOPS, outputs, strict=True):
        logits = dory_reference.forward(path, prompt + out.outputs[0].token_ids[:-1], {"loops": loops})
        check_logprobs(torch.log_softmax(logits, dim=-1), len(prompt), out.outputs[0], stats, tol=tolerance.logprob,
                       near_tie=tolerance.near_tie)
    assert stats["tokens"] == sum(MAX_TOKENS)
    return stats


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_dory_equals_transformers_on_its_codes(checkpoint, tmp_path, bits, dtype):
    llm = engine(checkpoint, dtype, f"int{bits}")
    model, report = llm.engine.model, llm.engine.quantization
    # every projection of every layer (q, k, v and the output gate packed as one, o; the MLP's gate and
    # up packed as one, down) and the LM head
    assert "lm_head.weight" in report.quantized and not report.dense
    assert len(report.quantized) == 4 * model.config.num_layers + 1
    assert all(isinstance(model.get_submodule(name.removesuffix(".weight")), QuantLinear) and
               model.get_submodule(name.removesuffix(".weight")).bits == bits for name in report.quantized)
    outputs = generate_mixed_loops(llm)
    fake = fake_quantized_copy(checkpoint, report.quantized, bits, tmp_path / f"int{bits}")
    assert_matches_reference(fake, outputs, FP32 if dtype == "float32" else BF16)


def test_bf16_dory_runs_close_to_fp32_transformers(checkpoint):
    llm = engine(checkpoint, "bfloat16")
    assert {p.dtype for p in llm.engine.model.parameters()} == {torch.bfloat16}
    assert_matches_reference(checkpoint, generate_mixed_loops(llm), BF16)


@pytest.fixture(scope="module")
def bf16_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint stored in bf16, as transformers saves a bf16 model (config dtype bfloat16)."""
    out = tmp_path_factory.mktemp("dory-bf16") / "bf16"
    shutil.copytree(checkpoint, out)
    weights = {name: t.to(torch.bfloat16) for name, t in load_file(out / "model.safetensors").items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return out


def test_dory_weights_are_read_one_tensor_at_a_time(bf16_checkpoint, monkeypatch):
    weights = read_weights(bf16_checkpoint, progress=False)
    assert isinstance(weights, LazyWeights)
    reads = []
    get_tensor = LazyWeights.__getitem__
    monkeypatch.setattr(LazyWeights, "__getitem__", lambda self, name: reads.append(name) or get_tensor(self, name))
    names = list(weights)
    assert len(names) == len(weights) > 0 and not reads  # listing the names reads no tensor
    stored = load_file(bf16_checkpoint / "model.safetensors")
    first = weights.pop(names[0])
    assert reads == [names[0]] and names[0] not in weights and torch.equal(first, stored[names[0]])
    weights.clear()
    assert len(weights) == 0 and reads == [names[0]]


def test_a_bf16_dory_checkpoint_is_built_and_quantized_in_bf16(bf16_checkpoint, checkpoint):
    """No fp32 copy of a bf16 checkpoint: the model is built in bf16 (torch's default dtype is fp32),
    and serving it in fp32 gives the tokens the bf16 weights give."""
    from depthserve.archs.dory.model import stored_dtype

    assert stored_dtype(json.loads((bf16_checkpoint / "config.json").read_text())) == torch.bfloat16
    assert stored_dtype(json.loads((checkpoint / "config.json").read_text())) == torch.float32
    llm = engine(bf16_checkpoint, "bfloat16", "int8")
    assert not llm.engine.quantization.dense
    generate_mixed_loops(llm)
    fp32 = engine(bf16_checkpoint, "float32")
    assert_matches_reference(bf16_checkpoint, generate_mixed_loops(fp32), FP32)


def test_a_tensor_stored_wider_than_the_config_says_keeps_its_precision(checkpoint, tmp_path):
    """A config naming bf16 over fp32 tensors: the model is built in bf16, but no weight is rounded."""
    out = tmp_path / "mislabelled"
    shutil.copytree(checkpoint, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    llm = engine(out, "float32")
    assert_matches_reference(checkpoint, generate_mixed_loops(llm), FP32)
