"""Parity with Hugging Face transformers on the same dequantized SmolLM2 weights (fp32, CPU)."""

from __future__ import annotations

import json

import pytest

from depthserve import SamplingParams
from tests.conftest import shared_data_file
from tests.hf_oracle import hf_greedy, hf_prompt_logprobs

pytestmark = pytest.mark.slow  # part of make test, left out of make test-fast

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three uses of a paperclip.",
    "How do I boil an egg?",
    "What is 17 times 23?",
    "Give me a short motivational quote.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.fixture(scope="module")
def llm(smollm_llm):
    return smollm_llm  # SmolLM2 in fp32 (tests/conftest.py)


def test_greedy_chat_continuations_match_transformers(llm):
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        expected = hf_greedy(prompt, 32)
        assert out.token_ids == expected, (
            f"prompt {llm.tokenizer.decode(prompt)!r}\nengine: {out.text!r}\n"
            f"hf:     {llm.tokenizer.decode(expected)!r}"
        )


def test_prompt_logprobs_match_transformers_on_c4(llm):
    path = shared_data_file("c4_sample.jsonl")
    docs = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()][:8]
    prompts = [llm.tokenizer.encode(doc, add_special_tokens=False)[:256] for doc in docs]
    scores = llm.score(prompts)
    worst = 0.0
    for ids, got in zip(prompts, scores):
        assert got[0] is None and len(got) == len(ids)
        expected = hf_prompt_logprobs(ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(got[1:], expected)))
    print(f"max |engine - transformers| prompt logprob over {len(prompts)} documents: {worst:.2e}")
    assert worst < 1e-3
