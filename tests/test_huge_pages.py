"""CPU tensors on transparent huge pages (depthserve/layers/huge_pages.py): the same values as torch's
allocations, laid out as the module says, alive as long as a view is, and plain torch tensors where
huge pages are not offered; the native kernels' weights and the CPU KV pool use them."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from depthserve.kernels import cpu_native
from depthserve.layers import huge_pages
from depthserve.layers.quantized import QuantLinear, move_native_weights_to_huge_pages
from tests.test_quantized import _TiedToy

needs_huge_pages = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this system")


def _resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@needs_huge_pages
@pytest.mark.parametrize("populate", [True, False], ids=["kernel-populate", "written-zeros"])
def test_zeros_are_committed_at_once_by_the_kernel_or_by_writing_them(populate, monkeypatch):
    """64 MiB of zeros are resident as soon as they are made (the KV pool is committed at start-up),
    whether the kernel populates them (MADV_POPULATE_WRITE) or, where it refuses, they are written."""
    if not populate:
        monkeypatch.setattr(huge_pages, "MADV_POPULATE_WRITE", -1)  # an advice the kernel refuses
    before = _resident_bytes()
    pages = huge_pages.zeros((16, 1 << 20), torch.float32)
    assert _resident_bytes() - before >= 60 << 20
    assert not pages.any()


@needs_huge_pages
def test_zeros_are_zeros_on_a_huge_page_boundary():
    pages = huge_pages.zeros((5, 16, 64), torch.bfloat16)
    assert pages.shape == (5, 16, 64) and pages.dtype == torch.bfloat16 and pages.is_contiguous()
    assert pages.data_ptr() % huge_pages.HUGE_PAGE == 0 and pages.storage_offset() == 0
    assert not pages.any()
    pages[4, 15, 63] = 3.0  # writable to its last element
    assert pages.sum().item() == 3.0


@needs_huge_pages
def test_copies_share_one_arena_and_outlive_their_sources():
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randint(0, 255, (3, 7, 256), dtype=torch.uint8, generator=generator),
               torch.randn(3, 7, 16, generator=generator).half(), torch.randn(5, generator=generator).half(),
               torch.randn(2, 3, generator=generator)[:, 1:]]  # a strided view
    expected = [s.clone() for s in sources]
    copies = huge_pages.copy_to_huge_pages(sources)
    del sources
    gc.collect()
    for copy, want in zip(copies, expected, strict=True):
        assert copy.dtype == want.dtype and torch.equal(copy, want) and copy.is_contiguous()
        assert copy.storage_offset() == 0  # each its own storage, as torch's allocations (huge_pages._Arena)
        assert copy.data_ptr() % huge_pages.ALIGNMENT == 0
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    # one after another: each starts at the previous one's end, rounded up to a cache line
    for before, after in zip(copies, copies[1:]):
        end = before.data_ptr() + before.numel() * before.element_size()
        assert after.data_ptr() == -(-end // huge_pages.ALIGNMENT) * huge_pages.ALIGNMENT
    empty, after_empty = huge_pages.copy_to_huge_pages([torch.empty(0, 4), torch.ones(3)])
    assert empty.shape == (0, 4) and torch.equal(after_empty, torch.ones(3))
    survivor = copies[1].clone()
    del copies[0], copies[2:]  # the arena stays mapped while one copy lives
    gc.collect()
    assert torch.equal(copies[0], survivor)


def test_without_huge_pages_they_are_torch_tensors(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    assert torch.equal(huge_pages.zeros((2, 3), torch.float32), torch.zeros(2, 3))
    source = torch.arange(6.0)
    assert huge_pages.copy_to_huge_pages([source])[0] is source


@pytest.mark.skipif(not cpu_native.available(), reason=f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
def test_native_weights_move_whole_and_keep_their_fp16_scales():
    """The layers' products are unchanged after the move, the buffers are the kernel's own tensors
    (the scales as int16 views that a cast to the model's dtype leaves alone), and with huge pages
    the weights lie in one arena in module order."""
    from depthserve.loading.quantization import quantize_model

    torch.manual_seed(3)
    model = _TiedToy()
    quantize_model(model, "int4", {}, torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.native is not None]
    assert len(layers) >= 2
    x = torch.randn(3, layers[0].in_features).bfloat16()
    before = [layer(x) for layer in layers if layer.in_features == x.shape[1]]
    move_native_weights_to_huge_pages(model)
    model.to(dtype=torch.bfloat16)
    after = [layer(x) for layer in layers if layer.in_features == x.shape[1]]
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
    for layer in layers:
        assert layer.packed.data_ptr() == layer.native.codes.data_ptr()
        assert layer.scales.data_ptr() == layer.native.scale.data_ptr() and layer.native.scale.dtype == torch.float16
        assert layer.lows.data_ptr() == layer.native.low.data_ptr()
    if huge_pages.available():
        starts = [t.data_ptr() for layer in layers for t in (layer.native.codes, layer.native.scale, layer.native.low)]
        assert starts == sorted(starts) and starts[0] % huge_pages.HUGE_PAGE == 0


@needs_huge_pages
def test_the_cpu_engine_keeps_its_kv_pages_on_huge_pages(tmp_path, smollm_tokenizer):
    from depthserve import LLM, SamplingParams
    from depthserve.lab.make_tiny import make_tiny

    path = make_tiny("llama", tmp_path / "llama", seed=3, tokenizer=smollm_tokenizer)
    llm = LLM(str(path), device="cpu", load_progress=False, max_model_len=64)
    pool = llm.engine.runner.pool
    assert pool.k_pages.data_ptr() % huge_pages.HUGE_PAGE == 0 and pool.v_pages.data_ptr() % huge_pages.HUGE_PAGE == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
