"""Inkling-2 served with `--quantization int8|int4` (docs/quantization.md): every projection whose
shape the codes allow is served from codes, the routed experts' included (one linear layer per
expert and kind, so that with bf16 activations they run on the native kernels).

With fp32 activations the engine is held to transformers' Inkling2LoopForCausalLM in fp32 on a
"fake-quantized" copy of the checkpoint (every tensor the engine serves from codes replaced by its
round-to-nearest dequantization), as tests/test_dory_quantized.py does for Dory. With bf16
activations the tiny model is no oracle: its routing margins are ~1e-4, so bf16 rounding flips
expert choices (the dense bf16 engine is 4-5 off the fp32 reference in logprob on these prompts).
So the bf16 experts are checked as a module: on the native kernels, each token's sum over its
chosen experts equals that sum computed token by token from the experts' codes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from depthserve import DepthParams, SamplingParams
from depthserve.archs.inkling2.model import EXPERT_TENSORS, Experts, parameter_name, softcap
from depthserve.kernels import cpu_native
from depthserve.lab.tiny.inkling2 import make_tiny
from depthserve.layers.quantized import QuantLinear, quantize_rtn
from depthserve.oracles import inkling2 as inkling2_reference
from tests.depth_helpers import check_logprobs
from tests.test_dory_quantized import engine  # the same small engine, any checkpoint
from tests.test_inkling2 import ROUTING_DELTA, VOCAB, WINDOW
from tests.test_quantized_engine import FP32

PROMPT_LENGTHS = [9, 23, 17]
LOOPS = [1, 2, 3]  # one request per loop count, in one batch
MAX_TOKENS = [6, 4, 5]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("inkling2-quantized") / "fp32", seed=3, loops=2,
                     sliding_window=WINDOW)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(6)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def expert_layers(model) -> list[str]:
    """The parameter names of every expert's linear layers."""
    return [f"{name}.{kind}.{expert}.weight" for name, module in model.named_modules() if isinstance(module, Experts)
            for kind in ("gate_up", "down") for expert in range(len(module.gate_up))]


def fake_quantized_copy(path: Path, quantized: list[str], bits: int, out: Path) -> Path:
    """The checkpoint with each tensor the engine serves from codes replaced by its dequantization;
    an experts tensor [experts, out, in] by each expert's rows (rounding is per row, so the order of
    the rows, interleaved in the checkpoint, does not matter)."""
    shutil.copytree(path, out)
    weights = load_file(out / "model.safetensors")
    served, covered = set(quantized), set()
    for name, tensor in weights.items():
        target = parameter_name(name)
        if target.endswith(EXPERT_TENSORS):
            names = {f"{target}.{expert}.weight" for expert in range(tensor.shape[0])}
            if names <= served:
                rows = tensor.float().reshape(-1, tensor.shape[-1])
                weights[name] = quantize_rtn(rows, bits).dequantize().reshape(tensor.shape).to(tensor.dtype)
                covered |= names
        elif target in served:
            weights[name] = quantize_rtn(tensor.float(), bits).dequantize().to(tensor.dtype)
            covered.add(target)
    assert covered == served
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_inkling2_equals_transformers_on_its_codes(checkpoint, tmp_path, bits):
    llm = engine(checkpoint, "float32", f"int{bits}")
    model, report = llm.engine.model, llm.engine.quantization
    experts, cfg = expert_layers(model), model.config
    assert set(experts) <= set(report.quantized) and len(experts) == 2 * cfg.num_experts * cfg.num_layers
    assert "unembed.weight" in report.quantized
    assert all(isinstance(model.get_submodule(name.removesuffix(".weight")), QuantLinear) and
               model.get_submodule(name.removesuffix(".weight")).bits == bits for name in report.quantized)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in MAX_TOKENS]
    outputs = llm.generate(prompts(), params, [DepthParams(loops=n) for n in LOOPS])
    assert llm.engine.block_manager.num_used_pages == 0

    fake = fake_quantized_copy(checkpoint, report.quantized, bits, tmp_path / f"int{bits}")
    stats = {"tokens": 0, "max_err": 0.0}
    for prompt, loops, out in zip(prompts(), LOOPS, outputs, strict=True):
        ids = prompt + out.outputs[0].token_ids[:-1]
        logits, margins = inkling2_reference.forward_with_margins(fake, ids, {"loops": loops})
        # equal logits mean equal expert choices only away from a flip
        assert float(margins.min()) > ROUTING_DELTA, "a routing decision close to flipping: pick other prompts"
        check_logprobs(torch.log_softmax(logits, dim=-1), len(prompt), out.outputs[0], stats, tol=FP32.logprob,
                       near_tie=FP32.near_tie)
    assert stats["tokens"] == sum(MAX_TOKENS)


def experts_token_by_token(experts: Experts, x: torch.Tensor, choice: torch.Tensor, weights: torch.Tensor,
                           gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> torch.Tensor:
    """Each token's weighted sum over its chosen experts, one token and expert at a time, in float64,
    with each expert's weights [out, in] as given."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for row in range(x.shape[0]):
        for expert, weight in zip(choice[row].tolist(), weights[row].double()):
            gate, up = (gate_up[expert] @ x[row].double()).chunk(2)
            hidden = softcap(gate, experts.gate_cap) * torch.sigmoid(gate) * softcap(up, experts.up_cap)
            out[row] += weight * (down[expert] @ hidden)
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_experts_run_from_their_codes_on_the_native_kernels(checkpoint, bits):
    if cpu_native.unavailable_reason() is not None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    model = engine(checkpoint, "bfloat16", f"int{bits}").engine.model
    experts = next(module for module in model.modules() if isinstance(module, Experts))
    linears = [*experts.gate_up, *experts.down]
    assert all(isinstance(linear, QuantLinear) and linear.native is not None and linear.bits == bits
               for linear in linears)
    generator = torch.Generator().manual_seed(bits)
    rows, k = 12, model.config.experts_per_token
    x = torch.randn(rows, model.config.hidden_size, generator=generator).bfloat16()
    choice = torch.stack([torch.randperm(len(experts.gate_up), generator=generator)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=generator)
    got = experts(x, choice, weights).double()
    codes = [cpu_native.group_dequantize(linear.native, torch.float32).double() for linear in linears]
    want = experts_token_by_token(experts, x, choice, weights, codes[: len(experts.gate_up)],
                                  codes[len(experts.gate_up):])
    # the kernel rounds each group of 32 activations to int8 (tests/test_cpu_native.py), and the
    # hidden activations are rounded to bf16: measured 0.3-0.6% of the largest output
    assert (got - want).abs().max() <= 2e-2 * want.abs().max(), float((got - want).abs().max() / want.abs().max())
