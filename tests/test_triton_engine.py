"""The engine on the Triton kernel backend against the torch backend: the same greedy tokens and
logprobs for a mixed batch with chunked prefill and prefix hits. On CUDA it runs a Llama of
SmolLM2's shapes (random weights) natively; on CPU (the Triton interpreter, ~100x slower) a tiny
Llama of the same family."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from transformers import AutoConfig  # noqa: E402

from depthserve import LLM, SamplingParams  # noqa: E402
from depthserve.lab.make_tiny import make_tiny  # noqa: E402
from depthserve.lab.make_tiny import synthetic_streams  # noqa: E402
from tests.depth_helpers import assert_same_generations, generate_on_both_backends, kernel_test_device  # noqa: E402
from tests.flash_helpers import stand_in_flash  # noqa: E402

pytestmark = pytest.mark.slow  # part of make test, left out of make test-fast


SHARED = "The history of the city of Rome is long, and the"
PROMPTS = [SHARED + " Colosseum", "Hi", SHARED + " Tiber river"]


def _generate(model: str, backend: str) -> list:
    """PROMPTS[0], then the others together (the last one hits the first's cached blocks), with a small
    token budget: prompts are prefilled in chunks over earlier chunks' cache, and the first step
    holds only a chunk that starts its sequence."""
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True)
    llm = LLM(model, dtype="float32", device=kernel_test_device(), max_num_batched_tokens=16,
              kv_cache_memory_gib=0.05, max_model_len=128, block_size=8, load_progress=False, kernel_backend=backend)
    outputs = llm.generate(PROMPTS[:1], params) + llm.generate(PROMPTS[1:], params)
    assert llm.engine.block_manager.prefix_hits > 0
    assert llm.engine.block_manager.num_free_pages == llm.engine.block_manager.num_pages
    return outputs


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm_tokenizer) -> str:
    like = "smollm2-135m-instruct" if kernel_test_device() == "cuda" else None
    return str(make_tiny("llama", tmp_path_factory.mktemp("llama"), seed=6, like=like, tokenizer=smollm_tokenizer))


@pytest.fixture(scope="module")
def torch_outputs(tiny_llama) -> list:
    return _generate(tiny_llama, "torch")


def test_triton_path_matches_torch_path(tiny_llama, torch_outputs):
    assert_same_generations(torch_outputs, _generate(tiny_llama, "triton"))


def test_steps_of_fresh_chunks_take_flash_and_others_the_triton_kernel(tiny_llama, torch_outputs, monkeypatch):
    """With flash varlen attention taken wherever it is offered (stood in by its documented semantics):
    steps whose every prompt chunk starts its sequence attend over their own keys through it, the
    others (later chunks, prefix hits, decodes) through the Triton kernels, and the tokens and
    logprobs are the torch backend's: a step that handed flash chunks over cached keys would have
    left those keys out."""
    calls = stand_in_flash(monkeypatch)
    assert_same_generations(torch_outputs, _generate(tiny_llama, "triton"))
    layers = AutoConfig.from_pretrained(tiny_llama).num_hidden_layers
    assert calls and len(calls) % layers == 0 and {chunks for chunks, _ in calls} <= {1, 2}
    assert {left for _, left in calls} == {-1}


def test_sliding_window_layers_take_flash_with_their_window(tmp_path, smollm_tokenizer, monkeypatch):
    """Dory with sliding windows of 8 keys, prompts longer than that, flash stood in as above: a
    sliding layer's fresh chunks go to flash with its window (7 keys before a query's own), the
    full layers' without one, and the tokens and logprobs are the torch backend's."""
    calls = stand_in_flash(monkeypatch)
    path = make_tiny("dory", tmp_path / "dory", seed=2, tokenizer=smollm_tokenizer, loops=1, sliding_window=8)
    stream = synthetic_streams(49152, 1, 64, seed=4)[0].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True)
    expected, got, llm = generate_on_both_backends(str(path), [stream[:13], stream[20:23], stream[30:50]], params,
                                                   max_model_len=64, block_size=8, max_num_batched_tokens=12)
    assert_same_generations(expected, got)
    assert {left for _, left in calls} == {-1, 7}
    assert llm.engine.block_manager.num_used_pages == 0
