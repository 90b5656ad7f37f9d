"""Weight-only quantized layers (depthserve/layers/quantized.py) against their dequantized weights,
the GGUF block decoding against gguf's own dequantization, and the model-level swap."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from depthserve.layers.quantized import (DequantScratch, QuantEmbedding, QuantLinear, QuantPolicy, quantizable,
                                         quantize_rtn)
from depthserve.loading.gguf_loader import _block_codes
from depthserve.loading.quantization import quantize_model, resident_bytes, resolve_dtype, resolve_quantization

# Shapes: SmolLM2's qkv, output widths that are no whole 64-row block of the int4 packing, the
# narrowest input (one group).
SHAPES = [(960, 576), (100, 64), (72, 32), (33, 96)]
ROWS = [1, 3, 5, 17]  # both sides of QuantPolicy.kernel_max_rows (4)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_quant_linear_equals_its_dequantized_weight(bits, dtype, shape):
    torch.manual_seed(bits * 1000 + shape[0])
    weight, bias = torch.randn(shape), torch.randn(shape[0])
    codes = quantize_rtn(weight, bits)
    layer = QuantLinear(codes, bias, dtype, DequantScratch(), QuantPolicy(kernel_max_rows=4))
    # The layer's own weight in the activation dtype (its scales and zeros rounded to it): what both
    # of its paths (the weight-only kernel, dequantize + GEMM) must reproduce.
    served = layer.dequantize()
    exact = codes.dequantize()
    relative = 1e-6 if dtype == torch.float32 else 2e-2  # bf16 scale and zero: 8 bits of mantissa each
    assert (served.float() - exact).abs().max() <= relative * exact.abs().max()
    for rows in ROWS:
        x = torch.randn(rows, shape[1]).to(dtype)
        got = layer(x).double()
        want = _reference(x, served, bias.to(dtype))
        # fp32: summation order only; bf16: the output rounded to bf16 (8 bits of mantissa) and its
        # products accumulated in fp32 by either path.
        tol = 2e-5 if dtype == torch.float32 else 1.6e-2
        assert (got - want).abs().max() <= tol * want.abs().max(), (rows, (got - want).abs().max())


def test_only_whole_groups_of_inputs_are_quantizable():
    assert quantizable((8, 64), 4) and quantizable((8, 64), 8)
    assert not quantizable((8, 70), 4) and not quantizable((8, 70), 8)


def test_rtn_error_is_what_the_format_allows():
    torch.manual_seed(0)
    weight = torch.randn(256, 512)
    for bits, bound in ((4, 0.5 / 15), (8, 0.5 / 127)):
        codes = quantize_rtn(weight, bits)
        error = (codes.dequantize() - weight).abs()
        if bits == 4:  # half a step of its group's range
            groups = weight.view(256, -1, 32)
            step = (groups.amax(2) - groups.amin(2)).repeat_interleave(32, 1)
        else:  # half a step of its row's largest magnitude
            step = weight.abs().amax(1, keepdim=True).expand_as(weight)
        assert (error <= bound * step * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_exactly(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(1)
    array = rng.standard_normal((48, 96)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    stored = quantize(array, qtype)
    codes = _block_codes(stored, kind, array.shape)
    assert codes.bits == (8 if kind == "Q8_0" else 4)
    assert torch.equal(codes.dequantize(), torch.from_numpy(dequantize(stored, qtype).reshape(array.shape)))


class _TiedToy(nn.Module):
    checkpoint_prefix = ""
    packed_modules: dict = {}

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(96, 64)
        self.proj = nn.Linear(64, 64, bias=True)
        self.odd = nn.Linear(40, 8, bias=False)  # no whole group of 32 inputs: stays dense
        self.lm_head = nn.Linear(64, 96, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


def test_quantize_model_ties_the_embedding_to_the_int8_head():
    torch.manual_seed(3)
    model = _TiedToy()
    report = quantize_model(model, "int4", {}, torch.float32)
    assert isinstance(model.proj, QuantLinear) and model.proj.bits == 4
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8
    assert type(model.odd) is nn.Linear and report.dense == ["odd.weight"]
    assert isinstance(model.embed_tokens, QuantEmbedding)
    ids = torch.tensor([0, 5, 95])
    assert torch.equal(model.embed_tokens(ids), model.lm_head.dequantize()[ids])
    assert report.weight_error is not None and 0 < report.weight_error < 0.1
    # The bf16 table (96 x 64 x 4 bytes in fp32) is gone: codes plus scales remain.
    assert resident_bytes(model) < 96 * 64 * 4


def test_auto_quantizes_only_a_gguf_with_bf16_activations_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", "gguf", cpu, torch.bfloat16) == "gguf"
    assert resolve_quantization("auto", "gguf", cpu, torch.float32) == "none"
    assert resolve_quantization("auto", "hf", cpu, torch.bfloat16) == "none"
    assert resolve_quantization("auto", "gguf", torch.device("cuda"), torch.bfloat16) == "none"
    assert resolve_quantization("int4", "hf", cpu, torch.float32) == "int4"
    assert resolve_quantization("gguf", "gguf", cpu, torch.float32) == "gguf"
    assert resolve_dtype("float32", cpu) == torch.float32


def test_auto_dtype_is_bf16_on_a_bf16_cpu_only_for_weights_past_the_cache():
    from depthserve.kernels.cpu_native import cpu_has_native_bf16_gemm
    from depthserve.loading.quantization import SMALL_WEIGHTS_BYTES

    cpu = torch.device("cpu")
    large = torch.bfloat16 if cpu_has_native_bf16_gemm() else torch.float32
    assert resolve_dtype("auto", cpu, SMALL_WEIGHTS_BYTES) == large
    assert resolve_dtype("auto", cpu, None) == large
    assert resolve_dtype("auto", cpu, SMALL_WEIGHTS_BYTES - 1) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), 1) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu, 1) == torch.bfloat16  # asked for: always as asked


def test_the_kernel_crossover_follows_the_kind_of_cpu(monkeypatch):
    """With AMX the bf16 GEMM overtakes the native kernel above 96 rows; without it the kernel runs every
    row count (bench/results/quant-kernels-cpu-*-2core.json), and a model loaded there says so."""
    from depthserve.layers.quantized import EVERY_ROW_COUNT

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert QuantPolicy.for_this_cpu() == QuantPolicy(kernel_max_rows=48, native_max_rows=96)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert QuantPolicy.for_this_cpu() == QuantPolicy(kernel_max_rows=48, native_max_rows=EVERY_ROW_COUNT)
    model = nn.Sequential(nn.Linear(64, 48, bias=False))
    quantize_model(model, "int4", {}, torch.bfloat16)
    layer = model[0]
    assert isinstance(layer, QuantLinear) and layer.policy.native_max_rows == EVERY_ROW_COUNT


def test_weight_bytes_counts_the_stored_weights(tmp_path):
    from depthserve.loading.registry import resolve_model, weight_bytes

    demo = resolve_model("demo-dreamer")
    assert weight_bytes(demo) == (demo.path / "model.safetensors").stat().st_size
    gguf = resolve_model("smollm2-135m-instruct")
    assert weight_bytes(gguf) == gguf.path.stat().st_size > 90 * 2**20


def test_quantization_on_cuda_is_a_configuration_error():
    from depthserve.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="CPU only"):
        resolve_quantization("int8", "gguf", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ConfigurationError, match="not a GGUF"):
        resolve_quantization("gguf", "hf", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigurationError, match="quantization must be"):
        resolve_quantization("int3", "gguf", torch.device("cpu"), torch.bfloat16)
