"""The native CPU kernels (kernels/csrc/group_gemm.cpp): group-quantized weights times activations
quantized to int8 per group of 32, against the same arithmetic written in torch, and against the
unquantized activations within the bound the activation rounding allows."""

from __future__ import annotations

import pytest
import torch

from depthserve.kernels import cpu_native
from depthserve.layers.quantized import DequantScratch, QuantEmbedding, QuantLinear, QuantPolicy, quantize_rtn

if cpu_native.unavailable_reason() is not None:
    pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}", allow_module_level=True)

# (out, in): SmolLM2's qkv, outputs that are no whole block of 16 rows, one group of inputs
SHAPES = [(960, 576), (100, 64), (33, 96), (16, 32)]
ROWS = [1, 3, 4, 5, 8, 9, 17, 33]  # the kernel's row tiles are 8, 4 and 1


def _weight(shape: tuple[int, int], bits: int, seed: int):
    """Random unsigned codes with fp16-exact scales and offsets, and the fp64 weight they stand for."""
    generator = torch.Generator().manual_seed(seed)
    out, width = shape
    codes = torch.randint(0, 1 << bits, (out, width), generator=generator, dtype=torch.uint8)
    scale = (torch.rand(out, width // 32, generator=generator) * 0.02 + 1e-3).half().float()
    low = (-torch.rand(out, width // 32, generator=generator) * 0.1).half().float()
    if bits == 8:  # GGUF Q8_0: code q + 128, low = -128 scale
        low = -128 * scale
    weight = codes.double().view(out, -1, 32) * scale.double()[..., None] + low.double()[..., None]
    return cpu_native.pack(codes, scale, low, bits), codes, weight.view(out, width)


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The kernel's rounding of x, in torch: per group of 32, q = round(x * (127 / max|x|)), x ~ q * max|x| / 127."""
    groups = x.float().view(x.shape[0], -1, 32)
    peak = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(peak > 0, 127.0 / peak, torch.zeros_like(peak))
    q = torch.round(groups * inverse)  # half to even, as the kernel's conversion
    return (q.double() * (peak.double() / 127)).view_as(x)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_group_gemm_is_the_int8_activation_arithmetic(bits, shape):
    packed, _, weight = _weight(shape, bits, seed=shape[0] + bits)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
        x[0, :32] = 0.0  # an all-zero group
        got = cpu_native.group_gemm(x, packed).double()
        want = _quantized_activations(x) @ weight.t()
        # the same products, summed in fp32 in another order
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (rows, (got - want).abs().max())
        # and against x itself: each activation moves by at most half a step, max|x_g| / 254
        half_steps = x.double().view(rows, -1, 32).abs().amax(dim=-1) / 254  # [rows, groups]
        weight_mass = weight.abs().view(shape[0], -1, 32).sum(dim=-1)  # [out, groups]
        bound = half_steps @ weight_mass.t() + 1e-5 * want.abs().max()
        assert ((got - x.double() @ weight.t()).abs() <= bound).all()
        bf16 = cpu_native.group_gemm(x.bfloat16(), packed)
        assert bf16.dtype == torch.bfloat16
        exact_bf16 = (_quantized_activations(x.bfloat16()) @ weight.t()).bfloat16()
        assert (bf16.float() - exact_bf16.float()).abs().max() <= 8e-3 * exact_bf16.float().abs().max()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_and_row_reads_give_the_weight(bits, shape):
    packed, codes, weight = _weight(shape, bits, seed=7 * shape[0] + bits)
    assert torch.equal(cpu_native.group_dequantize(packed, torch.float32).double(), weight)
    assert torch.equal(cpu_native.group_dequantize(packed, torch.bfloat16), weight.float().bfloat16())
    index = torch.tensor([0, shape[0] - 1, shape[0] // 2, 0])
    assert torch.equal(cpu_native.dequantize_rows(packed, index).double(), weight[index])
    assert torch.equal(cpu_native.unpack_rows(packed, index)[0], codes[index])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("refine", [False, True])
def test_each_row_is_bit_identical_in_any_batch(bits, refine):
    """A row's output depends on that row only (batch invariance): one row alone and the same row in
    batches of 16, 21 and 48 (row tiles of 8, 4 and 1 in every mix) give the same bits, fp32 and
    bf16, the refined (LM head) arithmetic too."""
    packed, _, _ = _weight((100, 96), bits, seed=bits)
    generator = torch.Generator().manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(48, 96, generator=generator) * 3).to(dtype)
        x[5, 32:64] = 0.0  # an all-zero group
        alone = torch.cat([cpu_native.group_gemm(x[i:i + 1], packed, refine) for i in range(48)])
        for rows in (16, 21, 48):
            assert torch.equal(cpu_native.group_gemm(x[:rows], packed, refine), alone[:rows]), (dtype, rows)


def test_quant_linear_and_tied_embedding_on_the_native_kernel():
    """bf16 activations take the native kernel up to native_max_rows and dequantize + GEMM above;
    the int8 head's table serves the embedding lookup."""
    torch.manual_seed(5)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    layer = QuantLinear(quantize_rtn(weight, 8), bias, torch.bfloat16, DequantScratch(),
                        QuantPolicy(kernel_max_rows=4, native_max_rows=4))
    assert layer.native is not None and "native" in layer.extra_repr()
    served = layer.dequantize().double()
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 64).bfloat16()
        want = _quantized_activations(x) @ served.t() if rows <= 4 else x.double() @ served.t()
        got = layer(x).double() - bias.bfloat16().double()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), rows
    assert torch.equal(layer.integer_codes(), quantize_rtn(weight, 8).codes.to(torch.int32))
    ids = torch.tensor([[3, 0], [95, 3]])
    assert torch.equal(QuantEmbedding(layer)(ids), served.float().bfloat16()[ids])
    fp32_layer = QuantLinear(quantize_rtn(weight, 4), None, torch.float32, DequantScratch(), QuantPolicy())
    assert fp32_layer.native is None  # fp32 activations stay unrounded, on torch's kernels


def test_the_op_compiles_in_a_full_graph():
    packed, _, weight = _weight((48, 64), 4, seed=1)

    def step(x):
        return torch.relu(cpu_native.group_gemm(x * 2, packed)) + 1

    x = torch.randn(3, 64)
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    assert torch.allclose(compiled(x), step(x), rtol=1e-6, atol=1e-6)


# ---- the decode step's paged attention and KV store -------------------------------------------------
def _pool(num_pages: int, block_size: int, head_dim: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(num_pages, block_size, head_dim, generator=generator).to(dtype) for _ in range(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (16, 2, 128), (8, 1, 16), (6, 2, 48), (2, 1, 256)])
def test_paged_decode_attention_equals_the_torch_version(dtype, heads):
    from depthserve.kernels import paged

    num_q, num_kv, dim = heads
    block_size, batch, blocks = 8, 4, 6
    k_pages, v_pages = _pool(40, block_size, dim, dtype, seed=dim)
    generator = torch.Generator().manual_seed(num_q)
    table = torch.randint(0, 40, (batch, num_kv, blocks), generator=generator, dtype=torch.int32)
    lengths = torch.tensor([1, 17, blocks * block_size, 0])  # one block, mid-block, every block, a padding row
    wide = torch.randn(batch, num_q, dim + 16, generator=generator).to(dtype)
    q = wide[..., :dim]  # not contiguous: a view, as the qkv split gives
    got = cpu_native.paged_decode_attention(q, k_pages, v_pages, table.transpose(1, 2).contiguous().transpose(1, 2),
                                            lengths, 0.125)
    want = paged.paged_decode_attention(q, k_pages, v_pages, table, lengths.clamp(min=1), 0.125)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output rounded once, the torch path rounds P too
    assert got.dtype == dtype
    assert (got[:3].float() - want[:3].float()).abs().max() <= tol * want.float().abs().max()
    assert torch.equal(got[3], torch.zeros_like(got[3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (16, 2, 128), (6, 2, 48)])
def test_paged_prefill_attention_equals_the_torch_version(dtype, heads):
    """Prompt chunks packed as one varlen batch, each over its own cache: a first chunk, one token over a
    cached prefix, a chunk whose keys span two of the kernel's key blocks (256), the longest chunk it takes."""
    from depthserve.kernels import paged

    num_q, num_kv, dim = heads
    block_size = 8
    chunks = [(0, 5), (37, 1), (300, 33), (5, cpu_native.NATIVE_PREFILL_MAX_QUERIES)]  # (cached context, queries)
    blocks = max(-(-(context + n) // block_size) for context, n in chunks)
    k_pages, v_pages = _pool(len(chunks) * num_kv * blocks, block_size, dim, dtype, seed=dim)
    generator = torch.Generator().manual_seed(num_q)
    tables = torch.randperm(len(chunks) * num_kv * blocks, generator=generator).view(len(chunks), blocks, num_kv)
    starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0).int()
    lengths = torch.tensor([context + n for context, n in chunks], dtype=torch.int32)
    wide = torch.randn(int(starts[-1]), num_q, dim + 16, generator=generator).to(dtype)
    q = wide[..., :dim]  # not contiguous: a view, as the qkv split gives
    got = torch.ops.depthserve_cpu.paged_prefill_attention_varlen(q, k_pages, v_pages, tables.transpose(1, 2),
                                                                   starts, lengths, 0.125)
    want = paged.paged_prefill_attention_varlen(q, k_pages, v_pages, tables.transpose(1, 2), starts, lengths, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output rounded once, the torch path rounds P too
    assert got.dtype == dtype
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def test_prefill_attention_takes_the_native_kernel_for_short_chunks_only(monkeypatch):
    from depthserve.kernels import paged

    calls = []
    monkeypatch.setattr(paged, "paged_prefill_attention_varlen", lambda *args: calls.append(args) or "torch")
    k_pages, v_pages = _pool(64, 8, 64, torch.float32, seed=1)
    tables = torch.arange(64).view(1, 8, 8).transpose(1, 2)  # [1 sequence, 8 KV heads, 8 blocks]
    for queries, native in [(cpu_native.NATIVE_PREFILL_MAX_QUERIES, True), (cpu_native.NATIVE_PREFILL_MAX_QUERIES + 1, False)]:
        q = torch.randn(queries, 8, 64)
        out = cpu_native.paged_prefill_attention_varlen(q, k_pages, v_pages, tables, torch.tensor([0, queries]),
                                                        torch.tensor([queries]), 0.125)
        assert isinstance(out, torch.Tensor) is native
    out = cpu_native.paged_prefill_attention_varlen(torch.randn(4, 8, 64), k_pages, v_pages, tables,
                                                    torch.tensor([0, 4]), torch.tensor([4]), 0.125, window=2)
    assert out == "torch" and len(calls) == 2  # a sliding window: the torch implementation


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16)])
def test_store_kv_equals_the_torch_version(dtypes):
    from depthserve.kernels import paged

    source_dtype, page_dtype = dtypes
    k_pages, v_pages = _pool(6, 4, 32, page_dtype, seed=2)
    generator = torch.Generator().manual_seed(3)
    k = torch.randn(3, 2, 48, generator=generator).to(source_dtype)[..., :32]
    v = torch.randn(3, 2, 32, generator=generator).to(source_dtype)
    slots = torch.tensor([[0, 5], [-1, 23], [9, -1]])
    expected_k, expected_v = k_pages.clone(), v_pages.clone()
    paged.store_kv(k, v, expected_k, expected_v, slots)
    cpu_native.store_kv(k, v, k_pages, v_pages, slots)
    assert torch.equal(k_pages, expected_k) and torch.equal(v_pages, expected_v)


def test_the_auto_backend_runs_the_native_decode_ops_on_cpu():
    from depthserve.kernels import Kernels, paged

    def cpu_implementation(op):  # under a by-device wrapper where triton imports
        return getattr(op, "__wrapped__", op)

    auto, reference = Kernels("auto"), Kernels("torch")
    assert cpu_implementation(auto.paged_decode_attention) is cpu_native.paged_decode_attention
    assert cpu_implementation(auto.store_kv) is cpu_native.store_kv
    assert cpu_implementation(auto.paged_prefill_attention_varlen) is cpu_native.paged_prefill_attention_varlen
    assert reference.paged_decode_attention is paged.paged_decode_attention
    assert reference.paged_prefill_attention_varlen is paged.paged_prefill_attention_varlen
    gpu_engine = Kernels("auto", native_cpu=False)  # an engine on CUDA: no native CPU kernel bound or built
    assert cpu_implementation(gpu_engine.paged_decode_attention) is paged.paged_decode_attention
    assert gpu_engine.greedy_pick is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 40, 16])
def test_rms_norm_equals_torch(dtype, width):
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(5, 3, width, generator=generator) * 3).to(dtype)
    weight = torch.randn(width, generator=generator).to(dtype)
    got = cpu_native.rms_norm(x, weight, 1e-5)
    want = F.rms_norm(x.double(), (width,), weight.double(), 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    # fp32: summation order; bf16: one rounding of the result (2^-8 relative)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert ((got.double() - want).abs() <= tol * want.abs() + 1e-6).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_refined_activations_reach_16_bit_precision(bits):
    """`refine` rounds each activation twice (the second time its rounding error, with a step 254x
    finer): within max|x_g| / 64516 of x, where one rounding is within max|x_g| / 254."""
    shape = (100, 96)
    packed, _, weight = _weight(shape, bits, seed=11)
    x = torch.randn(9, shape[1], generator=torch.Generator().manual_seed(4)) * 5
    weight_mass = weight.abs().view(shape[0], -1, 32).sum(dim=-1)  # [out, groups]
    peaks = x.double().view(9, -1, 32).abs().amax(dim=-1)  # [rows, groups]
    exact = x.double() @ weight.t()
    coarse = (cpu_native.group_gemm(x, packed).double() - exact).abs()
    fine = (cpu_native.group_gemm(x, packed, refine=True).double() - exact).abs()
    assert (fine <= peaks / 64516 @ weight_mass.t() + 1e-5 * exact.abs().max()).all()
    assert fine.max() < coarse.max() / 50


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40, 128])
def test_apply_rope_equals_the_torch_form(dtype, head_dim):
    from depthserve.layers import rotary

    cos, sin = rotary.rope_tables(head_dim, 64, 10000.0)
    positions = torch.tensor([0, 5, 63, 17])
    generator = torch.Generator().manual_seed(head_dim)
    wide = torch.randn(4, 5, head_dim + 8, generator=generator).to(dtype)
    x = wide[..., :head_dim]  # a view with a row stride, as the qkv split gives
    got = cpu_native.apply_rope(x, cos[positions], sin[positions])
    # the torch form in float64, which the native kernel approaches within one rounding to x's dtype
    x64 = x.double()
    half = head_dim // 2
    c, s = cos[positions].double()[:, None], sin[positions].double()[:, None]
    want = torch.cat((x64[..., :half] * c - x64[..., half:] * s, x64[..., half:] * c + x64[..., :half] * s), dim=-1)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert got.dtype == dtype and got.is_contiguous()
    assert ((got.double() - want).abs() <= tol * (x64.abs().amax(dim=-1, keepdim=True) * 2) + 1e-7).all()


@pytest.mark.parametrize("width", [49152, 1000, 17, 5])
def test_greedy_pick_is_torchs_argmax_and_log_normalizer(width):
    from depthserve.sampler import EXP_FLOOR

    generator = torch.Generator().manual_seed(width)
    padded = torch.randn(7, width + 3, generator=generator) * 8  # rows strided past their width
    logits = padded[:, :width]
    logits[1, :] = 3.0  # all tied: the first index
    logits[2, width // 2] = logits[2, -1] = 1e3  # a tie across lanes: the first of the two
    logits[3, : width // 2] = float("-inf")
    logits[4, :] -= 200.0  # spread past the exp floor
    token, peak, log_z = cpu_native.greedy_pick(logits, EXP_FLOOR)
    assert torch.equal(token, logits.argmax(dim=-1))
    assert torch.equal(peak, logits.amax(dim=-1))
    shifted = (logits.double() - peak.double()[:, None]).clamp(min=EXP_FLOOR)
    expected = shifted.exp().sum(dim=-1).log() + peak.double()
    assert torch.allclose(log_z.double(), expected, rtol=0, atol=2e-6 * max(1.0, float(expected.abs().max())))
    special = torch.zeros(3, width)
    special[0, width - 1] = float("nan")
    special[1, :] = float("-inf")
    special[2, 0] = float("inf")
    token, peak, _ = cpu_native.greedy_pick(special, EXP_FLOOR)
    assert torch.isnan(peak[0]) and peak[1] == float("-inf") and token[1] == 0 and peak[2] == float("inf")


@pytest.mark.parametrize("width, words", [(49152, 1536), (1000, 32), (1030, 32), (17, 1), (40, 2)])
def test_apply_token_bitmask_equals_the_torch_version(width, words):
    """Random words, words allowing everything or nothing, a subset of the logits' rows in any order,
    logits narrower or wider than the bitmask (their extra columns masked), rows strided past their width."""
    from depthserve.structured.bitmask import apply_token_bitmask_

    generator = torch.Generator().manual_seed(width)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=generator, dtype=torch.int64).to(torch.int32)
    bitmask[0, ::3] = -1
    bitmask[1, 1::2] = 0
    rows = [4, 0, 2]
    padded = torch.randn(6, width + 5, generator=generator)
    beyond = padded[:, width:].clone()
    expected = padded[:, :width].clone()
    apply_token_bitmask_(expected, bitmask, rows)
    logits = padded[:, :width]
    cpu_native.apply_token_bitmask(logits, bitmask, torch.tensor(rows), min(width, words * 32))
    assert torch.equal(logits, expected)
    assert torch.equal(padded[:, width:], beyond)  # nothing written past each row's width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 40, 16, 7])
def test_silu_and_mul_equals_torch_rounded_once(dtype, width):
    """SiLU(gate) * up of [gate | up] rows, in fp32 and rounded once to the dtype: within a few fp32 ulp
    of the float64 value (its e^x is a polynomial, not libm's), over the range SiLU bends in and its
    tails (saturating to 0 and to the identity), odd widths included."""
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(6, 2 * width, generator=generator) * 6).to(dtype)
    x[0, :width] = torch.linspace(-100, 100, width).to(dtype)  # the tails of the gate
    got = cpu_native.silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert got.shape == (6, width) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8  # fp32: the polynomial; bf16: one rounding
    assert ((got.double() - want).abs() <= tol * want.abs() + 1e-30).all()
    assert torch.isnan(cpu_native.silu_and_mul(torch.full((1, 4), float("nan"), dtype=dtype))).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 8, 20, 1000])
def test_windowed_decode_attention_reads_only_the_window(dtype, window):
    """A sliding-window layer's decode attention: the torch form's meaning, and no key before the
    window is read. Every table entry before the window points at a page of NaNs (a page given back
    and reused), which would turn the output NaN if the kernel touched it."""
    from depthserve.kernels import paged

    num_q, num_kv, dim, block_size, blocks = 6, 2, 64, 8, 6
    k_pages, v_pages = _pool(40, block_size, dim, dtype, seed=window)
    poisoned = 39
    k_pages[poisoned], v_pages[poisoned] = float("nan"), float("nan")
    generator = torch.Generator().manual_seed(window)
    table = torch.randint(0, poisoned, (3, num_kv, blocks), generator=generator, dtype=torch.int32)
    lengths = torch.tensor([1, 19, blocks * block_size])
    q = torch.randn(3, num_q, dim, generator=generator).to(dtype)
    want = paged.paged_decode_attention(q, k_pages, v_pages, table, lengths, 0.125, window)
    for row, length in enumerate(lengths.tolist()):
        table[row, :, : max(0, length - window) // block_size] = poisoned  # pages wholly before the window
    got = cpu_native.paged_window_decode_attention(q, k_pages, v_pages, table, lengths, 0.125, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert not torch.isnan(got).any()
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def test_the_auto_backend_takes_the_native_kernel_for_windowed_decode_only_on_cpu():
    from depthserve.kernels import Kernels, paged

    auto = Kernels("auto")
    assert getattr(auto.paged_window_decode_attention, "__wrapped__", auto.paged_window_decode_attention) is \
        cpu_native.paged_window_decode_attention
    assert Kernels("torch").paged_window_decode_attention is paged.paged_window_decode_attention
    gpu_engine = Kernels("auto", native_cpu=False)
    assert gpu_engine.paged_window_decode_attention is paged.paged_window_decode_attention


# ---- nGPT (csrc/ngpt.cpp) against layers/ngpt.py's torch forms in float64 -----------------------------
NGPT_WIDTHS = [2560, 40, 16]


def _ngpt_tolerance(dtype: torch.dtype) -> float:
    return 1e-6 if dtype == torch.float32 else 2 ** -8  # fp32: summation order and e^x; bf16: one rounding


def _close_rounded_once(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> bool:
    """Within one rounding of the dtype of values of magnitude `scale` (per row) of the float64 value."""
    return bool(((got.double() - want).abs() <= _ngpt_tolerance(dtype) * scale + 1e-7).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", NGPT_WIDTHS)
def test_ngpt_normalisation_and_interpolation_equal_the_torch_forms(dtype, width):
    from depthserve.layers import ngpt

    generator = torch.Generator().manual_seed(width)
    wide = (torch.randn(2, 3, width + 8, generator=generator) * 4).to(dtype)
    x = wide[..., :width]  # rows with a stride: the op copies them
    y = (torch.randn(2, 3, width, generator=generator) * 2).to(dtype)
    rate = torch.rand(width, generator=generator).to(dtype)
    eps = 1e-6
    got = cpu_native.l2_normalize(x, eps)
    assert got.shape == x.shape and got.dtype == dtype
    assert _close_rounded_once(got, ngpt._l2_normalize_torch(x.double(), eps), dtype, torch.ones(()))
    h = cpu_native.l2_normalize(y, eps)
    for normalize in (False, True):
        got = cpu_native.ngpt_interpolate(h, x, rate, eps, normalize)
        want = ngpt._interpolate_torch(h.double(), x.double(), rate.double(), eps, normalize)
        assert got.shape == h.shape and got.dtype == dtype
        assert _close_rounded_once(got, want, dtype, want.abs().amax(dim=-1, keepdim=True))
    assert torch.isnan(cpu_native.l2_normalize(torch.full((1, width), float("nan"), dtype=dtype), eps)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", NGPT_WIDTHS)
def test_ngpt_gates_equal_the_torch_forms(dtype, width):
    """Attention's sigmoid gate and the MLP's scaled SwiGLU, each normalised, over the range the
    sigmoid bends in and its saturated tails."""
    from depthserve.layers import ngpt

    generator = torch.Generator().manual_seed(width + 1)
    x, gate, up = ((torch.randn(5, width, generator=generator) * 6).to(dtype) for _ in range(3))
    gate[0] = torch.linspace(-100, 100, width).to(dtype)
    scale, up_scale = (torch.rand(width, generator=generator).to(dtype) * 2 for _ in range(2))
    eps = 1e-6
    got = cpu_native.gated_l2_normalize(x, gate, scale, eps)
    want = ngpt._gated_torch(x.double(), gate.double(), scale.double(), eps)
    assert got.shape == x.shape and _close_rounded_once(got, want, dtype, torch.ones(()))
    got = cpu_native.swiglu_l2_normalize(gate, up, scale, up_scale, eps)
    want = ngpt._swiglu_torch(gate.double(), up.double(), scale.double(), up_scale.double(), eps)
    assert got.shape == x.shape and _close_rounded_once(got, want, dtype, torch.ones(()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [256, 48])
@pytest.mark.parametrize("scaled", [True, False])
def test_unit_rope_equals_the_torch_form(dtype, head_dim, scaled):
    from depthserve.layers import ngpt, rotary

    heads, positions = 3, torch.tensor([0, 5, 63, 17])
    cos, sin = rotary.rope_tables(head_dim, 64, 10000.0)
    generator = torch.Generator().manual_seed(head_dim)
    wide = (torch.randn(4, heads, head_dim + 16, generator=generator) * 3).to(dtype)
    x = wide[..., :head_dim]  # a view with a row stride, as a projection's split gives
    scale = torch.rand(heads * head_dim, generator=generator).to(dtype) * 4 if scaled else None
    got = cpu_native.unit_rope(x, cos[positions], sin[positions], scale, 1e-6)
    normed = ngpt._l2_normalize_torch(x.double(), 1e-6)
    half = head_dim // 2
    c, s = cos[positions].double()[:, None], sin[positions].double()[:, None]
    want = torch.cat((normed[..., :half] * c - normed[..., half:] * s, normed[..., half:] * c + normed[..., :half] * s),
                     dim=-1)
    if scale is not None:
        want = want * scale.double().view(heads, head_dim)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == x.shape
    assert _close_rounded_once(got, want, dtype, want.abs().amax(dim=-1, keepdim=True))


# ---- dense bf16 weights (csrc/bf16_gemm.cpp) -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(960, 576), (7, 64), (33, 96), (4, 32)])
def test_bf16_gemm_is_the_fp32_sum_of_the_bf16_weights(dtype, shape):
    """Every output the float64 product of x and the bf16 weight within fp32 summation order (fp32 x),
    or that plus one rounding of the result to bf16 (2^-8 relative); whatever the number of rows
    (the kernel's row tiles are 4 and 3, 2, 1), and a row's bits are the same in any batch."""
    generator = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(shape, generator=generator).bfloat16()
    for rows in (1, 2, 3, 4, 5, 7, 9, 66):
        x = torch.randn(rows, shape[1], generator=generator).to(dtype)
        got = cpu_native.bf16_gemm(x, weight)
        assert got.dtype == dtype and got.shape == (rows, shape[0])
        want = x.double() @ weight.double().t()
        bound = (1e-5 if dtype == torch.float32 else 8e-3) * float(want.abs().max())
        assert float((got.double() - want).abs().max()) <= bound, rows
        assert torch.equal(cpu_native.bf16_gemm(x[rows // 2: rows // 2 + 1], weight), got[rows // 2: rows // 2 + 1])


def test_bf16_gemm_refuses_what_it_cannot_read():
    x = torch.randn(2, 48).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_native.bf16_gemm(x, torch.randn(16, 48).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        cpu_native.bf16_gemm(x[:, :32], torch.randn(16, 32).float())


def test_bf16_linear_layers_take_the_native_kernel_up_to_the_cpus_row_count(monkeypatch):
    """A bf16 model's linear layers become NativeBf16Linear on the same tensors (fp32 ones keep their
    own CPU form). Up to the layer's row count the kernel runs (decode-sized calls where torch's bf16
    GEMM is native, every call where it is emulated), more rows and compiled calls F.linear, each
    within one bf16 rounding of F.linear's result."""
    from torch import nn

    from depthserve.layers import linear as linear_module
    from depthserve.layers.linear import (EVERY_ROW_COUNT, NATIVE_BF16_MAX_ROWS, CpuLinear, NativeBf16Linear,
                                          native_bf16_max_rows, optimize_linears_for_cpu)

    model = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 8)).bfloat16().requires_grad_(False)  # 40: no whole step
    weight = model[0].weight
    optimize_linears_for_cpu(model)
    assert isinstance(model[0], NativeBf16Linear) and model[0].weight is weight
    assert model[0].max_native_rows == native_bf16_max_rows() == (
        NATIVE_BF16_MAX_ROWS if cpu_native.cpu_has_native_bf16_gemm() else EVERY_ROW_COUNT)
    assert type(model[1]) is nn.Linear
    assert isinstance(optimize_linears_for_cpu(nn.Sequential(nn.Linear(64, 40)))[0], CpuLinear)
    kernel = cpu_native.bf16_gemm
    for max_rows, kernel_calls in ((NATIVE_BF16_MAX_ROWS, [1, 4]), (EVERY_ROW_COUNT, [1, 4, 5, 16, 70])):
        layer, calls = NativeBf16Linear(nn.Linear(64, 40).bfloat16().requires_grad_(False), max_rows), []
        monkeypatch.setattr(linear_module.cpu_native, "bf16_gemm", lambda x, w: calls.append(len(x)) or kernel(x, w))
        for rows in (1, 4, 5, 16, 70):
            x = torch.randn(rows, 64).bfloat16()
            want = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
            got = layer(x).float()
            assert float((got - want).abs().max()) <= 8e-3 * float(want.abs().max())
        assert calls == kernel_calls
        compiled = torch.compile(layer, fullgraph=True)
        torch.testing.assert_close(compiled(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert calls == kernel_calls
