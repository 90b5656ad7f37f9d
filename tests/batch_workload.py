"""The batch-invariance workload: 16 mixed-length greedy requests whose outputs, run alone, are the
reference for the same requests in batches (tests/test_batch_invariance.py, and beside constrained
requests in tests/test_structured_engine.py). fp32 matmuls may round differently for different batch
shapes, so a difference is accepted only at a step where the top-2 logit gap is below 1e-4 (a
genuine near-tie); each such case is printed."""

from __future__ import annotations

from depthserve import LLM, SamplingParams

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, "
    "presses operated in more than two hundred European cities, and the price of books fell "
    "sharply. Scholars argue about how much the new technology caused the Reformation, the "
    "scientific revolution and the rise of vernacular literature, but few doubt that it changed "
    "how ideas travelled. Before printing, a single manuscript could take a scribe months to copy; "
    "afterwards, a workshop could produce hundreds of identical pages in a day. Errors no longer "
    "multiplied with each copy, and readers in different cities could refer to the same page."
)
LENGTHS = [3, 7, 12, 20, 31, 45, 58, 64, 77, 90, 101, 118, 130, 149, 160, 185]
MAX_TOKENS = 24
NEAR_TIE = 1e-4


def prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT + " " + TEXT, add_special_tokens=False)
    assert len(ids) >= max(LENGTHS) + 4
    # Different offsets so the prompts do not share prefixes (prefix caching is tested elsewhere).
    return [ids[i % 5 : i % 5 + n] for i, n in enumerate(LENGTHS)]


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def run_alone(tokenizer) -> list:
    """Each request of the workload alone on an fp32 engine."""
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", load_progress=False,
              enable_prefix_caching=False)
    return [llm.generate([p], PARAMS)[0] for p in prompts(tokenizer)]


def compare(alone, batched) -> list[str]:
    near_ties = []
    for i, (a, b) in enumerate(zip(alone, batched)):
        if a.token_ids == b.token_ids:
            continue
        step = next(t for t, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        top = sorted((lp.logprob for lp in a.logprobs[step].values()), reverse=True)
        gap = top[0] - top[1]
        assert gap < NEAR_TIE, (
            f"request {i} diverged at step {step} with top-2 gap {gap:.2e} (not a near-tie): "
            f"{a.token_ids} vs {b.token_ids}"
        )
        near_ties.append(f"request {i}: step {step}, top-2 gap {gap:.2e}")
    print("near-tie divergences:", near_ties or "none")
    return near_ties


