"""The one rule that picks an op's form (kernels/ops.py): a toy op whose forms give different
results, run on CPU fp32, CPU bf16 and under torch.compile, and the library's own ops and layers
that go through it."""

from __future__ import annotations

import pytest
import torch

from depthserve.kernels import cpu_native
from depthserve.kernels.ops import Form, KernelOp, Target


def toy_op(compiled: bool = True, built: bool = True) -> tuple[KernelOp, list[str]]:
    """A toy op whose forms add 1 (torch), 2 (CPU, bf16 only), 3 (CUDA) and 4 (compiled), and the
    list of times its CPU form's `cpu_built` was asked."""
    asked: list[str] = []

    def cpu_built() -> bool:
        asked.append("built?")
        return built

    op = KernelOp("toy", torch=lambda x: x + 1, cpu=lambda x: x + 2, cpu_dtypes=(torch.bfloat16,),
                  cpu_built=cpu_built, cuda=lambda x: x + 3, compiled=(lambda x: x + 4) if compiled else None)
    return op, asked


def added(result: torch.Tensor, x: torch.Tensor) -> int:
    return int((result.float() - x.float()).unique().item())


def test_cpu_fp32_runs_the_torch_form_and_cpu_bf16_the_cpu_form():
    op, _ = toy_op()
    x = torch.zeros(4)
    assert added(op(x), x) == 1
    assert added(op(x.bfloat16()), x) == 2


def test_the_cpu_form_needs_its_kernels_built():
    op, _ = toy_op(built=False)
    x = torch.zeros(4, dtype=torch.bfloat16)
    assert added(op(x), x) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_compiled_form, expected", [(True, 4), (False, 1)])
def test_a_compiled_forward_runs_the_compiled_form_else_the_torch_form(dtype, has_compiled_form, expected):
    op, _ = toy_op(compiled=has_compiled_form)
    x = torch.zeros(4, dtype=dtype)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: op(t) * 1, fullgraph=True, backend="eager")
    assert added(compiled(x), x) == expected
    assert added(op(x), x) == (2 if dtype == torch.bfloat16 else 1)  # eager calls keep their own form


def test_the_form_is_chosen_once_per_device_and_dtype():
    op, asked = toy_op()
    x = torch.zeros(4, dtype=torch.bfloat16)
    for _ in range(3):
        op(x)
    op(torch.zeros(2))  # fp32: the CPU form does not take it, so nothing is asked
    assert asked == ["built?"]


def test_the_rule_for_devices_and_backends():
    op, _ = toy_op()
    assert op.form(Target("cuda", torch.bfloat16)) is Form.CUDA
    assert op.form(Target("cpu", torch.bfloat16, backend="torch")) is Form.TORCH
    assert op.form(Target("cpu", torch.bfloat16, backend="triton")) is Form.CUDA
    assert op.form(Target("cpu", torch.bfloat16, native_cpu=False)) is Form.TORCH  # an engine on CUDA
    assert op.form(Target("cpu", torch.bfloat16, compiling=True)) is Form.COMPILED
    without_cuda = KernelOp("plain", torch=op.torch)
    assert without_cuda.form(Target("cuda", torch.float32)) is Form.TORCH
    with pytest.raises(ValueError, match="no cpu form"):
        without_cuda.implementation(Form.CPU)


needs_native = pytest.mark.skipif(cpu_native.unavailable_reason() is not None,
                                  reason=f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")


@needs_native
def test_the_layers_ops_take_their_native_forms_on_the_cpu_and_triton_forms_on_cuda():
    from depthserve.layers.activation import SILU_AND_MUL
    from depthserve.layers.norm import RMS_NORM
    from depthserve.layers.quantized import WEIGHT_ONLY_MATMUL
    from depthserve.layers.rotary import APPLY_ROPE

    for op in (RMS_NORM, APPLY_ROPE):
        assert [op.form(Target("cpu", d)) for d in (torch.float32, torch.bfloat16)] == [Form.CPU, Form.CPU]
    for op in (SILU_AND_MUL, WEIGHT_ONLY_MATMUL):  # bf16 only: fp32 rows keep torch's arithmetic
        assert [op.form(Target("cpu", d)) for d in (torch.float32, torch.bfloat16)] == [Form.TORCH, Form.CPU]
    assert RMS_NORM.form(Target("cuda", torch.bfloat16)) is Form.TORCH  # F.rms_norm, torch's own CUDA kernel
    for op in (APPLY_ROPE, SILU_AND_MUL):  # one Triton launch each (kernels/triton/pointwise.py)
        assert op.form(Target("cuda", torch.bfloat16)) is Form.CUDA
        assert op.form(Target("cuda", torch.bfloat16, compiling=True)) is Form.TORCH  # Inductor fuses the torch form
    for op in (RMS_NORM, APPLY_ROPE, SILU_AND_MUL):
        assert op.form(Target("cpu", torch.bfloat16, compiling=True)) is Form.TORCH


@needs_native
def test_rms_norm_calls_the_native_kernel_eagerly_and_not_when_compiled(monkeypatch):
    from depthserve.layers import norm

    calls = []

    def counted(x, weight, eps):
        calls.append(x.dtype)
        return cpu_native.rms_norm(x, weight, eps)

    monkeypatch.setattr(norm, "RMS_NORM", KernelOp("rms_norm", torch=norm.RMS_NORM.torch, cpu=counted))
    layer = norm.RMSNorm(16, 1e-5).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    eager = layer(x)
    assert calls == [torch.bfloat16]
    torch._dynamo.reset()
    traced = torch.compile(layer, fullgraph=True, backend="eager")(x)
    assert calls == [torch.bfloat16]  # the compiled forward ran the torch form
    torch.testing.assert_close(traced, eager, rtol=2**-7, atol=1e-6)


def test_kernels_bind_the_attention_ops_by_the_same_rule():
    from depthserve.kernels import Kernels, paged
    from depthserve.kernels.dispatch import kernel_op

    op = kernel_op("paged", "paged_decode_attention")
    assert op.torch is paged.paged_decode_attention
    assert Kernels("torch").paged_decode_attention is paged.paged_decode_attention
    gpu_engine = Kernels("auto", native_cpu=False)
    assert getattr(gpu_engine.paged_decode_attention, "__wrapped__", gpu_engine.paged_decode_attention) \
        is paged.paged_decode_attention


def test_only_a_declared_plain_llama_runs_the_whole_model_native_step():
    from depthserve.archs.llama.model import LlamaForCausalLM

    class LoopsItsOwnWay(LlamaForCausalLM):
        pass

    class DeclaresThePlainLoop(LlamaForCausalLM):
        plain_layer_loop = True

    assert LlamaForCausalLM.plain_layer_loop
    assert not LoopsItsOwnWay.plain_layer_loop
    assert DeclaresThePlainLoop.plain_layer_loop
