"""What the incremental = recompute tests of every depth architecture share: an engine on a tiny
checkpoint with a KV budget counted in pages, and the comparison of the engine's logprobs with
the float64 reference's."""

from __future__ import annotations

import pytest
import torch

from depthserve import LLM, DepthParams
from depthserve.engine.model_runner import ModelRunner
from depthserve.lab.make_tiny import synthetic_streams

BLOCK_SIZE = 8
TINY_HEAD_DIM = 16  # depthserve.lab.make_tiny.TINY


# A tiny engine's KV budget unless a test sets one: 64 MiB, room for hundreds of the tests' longest
# sequences. Not the engine's CPU default (1 GiB, committed at start-up): with it every engine a test
# module kept cost a GiB, and the suite grew past 20 GB resident.
TINY_DEFAULT_PAGES = 1 << 16


def tiny_llm(path, pages: int | None = None, max_model_len: int = 256, device: str = "cpu", **kwargs) -> LLM:
    """An fp32 engine (CPU unless asked) with block size 8 and a KV budget of `pages` pages
    (TINY_DEFAULT_PAGES when not given)."""
    page_bytes = ModelRunner.page_bytes(BLOCK_SIZE, TINY_HEAD_DIM, torch.float32)
    gib = (TINY_DEFAULT_PAGES if pages is None else pages) * page_bytes / (1 << 30)
    return LLM(str(path), device=device, dtype="float32", load_progress=False, max_model_len=max_model_len,
               block_size=BLOCK_SIZE, kv_cache_memory_gib=gib, **kwargs)


def stream_prompts(lengths: list[int], seed: int, stride: int = 7, vocab_size: int = 49152) -> list[list[int]]:
    """Prompts of the given lengths cut from one synthetic token stream, each starting `stride`
    tokens after the one before (so neighbours overlap but share no prefix)."""
    stream = synthetic_streams(vocab_size, 1, 400, seed=seed)[0].tolist()
    return [stream[i * stride : i * stride + n] for i, n in enumerate(lengths)]


def costliest_pages(path, depths: list[DepthParams], max_model_len: int, step_tokens: int = 16) -> int:
    """The pages the costliest of `depths` needs for a sequence of max_model_len tokens, plus those a
    step of `step_tokens` sets aside for its depth cache (Dreamer's; none for the others), measured
    on a probe engine of the checkpoint."""
    probe = tiny_llm(path, max_model_len=max_model_len)
    bm, model = probe.engine.block_manager, probe.engine.model
    costliest = max(bm.pages_for(cache_layout(model, d), max_model_len) for d in depths)
    page_bytes = ModelRunner.page_bytes(BLOCK_SIZE, model.head_dim, torch.float32)
    return costliest + -(-model.step_cache_bytes_bound(step_tokens) // page_bytes)


def cache_layout(model, depth: DepthParams):
    """The cache layout a request with these depth settings gets from `model` (its plan's)."""
    return model.plan(depth.normalized(model.depth_knobs())).layout


def depth_params(knobs: dict | None) -> DepthParams:
    """DepthParams from a knob dict; None is the model's defaults."""
    return DepthParams.from_dict(knobs) if knobs is not None else DepthParams()


def _record(stats: dict, err: float, tol: float, what: str) -> None:
    stats["max_err"] = max(stats.get("max_err", 0.0), err)
    assert err < tol, f"{what} differs by {err:.2e}"


def check_logprobs(logprobs: torch.Tensor, prompt_len: int, completion, stats: dict, *, tol: float,
                   near_tie: float, greedy: bool = True, prompt_logprobs=None) -> None:
    """Compare one completion with the reference.

    `logprobs` are the reference's log-softmax rows over prompt + completion tokens but the last
    (so they cover every prompt position too). Every reported logprob (chosen token and
    alternatives) must be within `tol`; a greedy token that is not the reference's argmax is
    accepted only at a near-tie (top logprob minus the token's below `near_tie`). Prompt
    logprobs, if given, are checked against the same rows."""
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = logprobs[prompt_len - 1 + i]
        for alt, lp in entry.items():
            _record(stats, abs(float(row[alt]) - lp.logprob), tol, f"token {i}: logprob of {alt}")
        if greedy and int(row.argmax()) != token:
            assert float(row.max() - row[token]) < near_tie, f"greedy token {i} is not the reference argmax"
    stats["tokens"] = stats.get("tokens", 0) + len(completion.token_ids)
    for position, entry in enumerate(prompt_logprobs or []):
        if entry is None:
            continue  # position 0 has no prefix
        for alt, lp in entry.items():
            _record(stats, abs(float(logprobs[position - 1, alt]) - lp.logprob), tol,
                    f"prompt position {position}: logprob of {alt}")
        stats["prompt_positions"] = stats.get("prompt_positions", 0) + 1


def kernel_test_device() -> str:
    """Where the Triton kernel tests run their engines: CUDA when present (native kernels), else the
    CPU (kernels under the Triton interpreter, TRITON_INTERPRET=1 set by conftest)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def generate_on_both_backends(model: str, prompts, params, depths=None, **llm_kwargs) -> tuple[list, list, LLM]:
    """The same requests through an fp32 engine on the torch kernels and one on the Triton kernels
    (kernel_test_device): (torch outputs, Triton outputs, the Triton engine). Eager unless asked
    otherwise: on CUDA the default compiles and captures every graph bucket of every depth level
    (minutes per engine on the H100), which the kernels under test do not need; the CUDA-graph
    tests (tests/test_cuda.py) cover the compiled steps."""
    outputs = []
    llm_kwargs = {"enforce_eager": True, **llm_kwargs}
    for backend in ("torch", "triton"):
        llm = LLM(model, device=kernel_test_device(), dtype="float32", load_progress=False, kernel_backend=backend,
                  **llm_kwargs)
        outputs.append(llm.generate(prompts, params, depths))
    return outputs[0], outputs[1], llm


def assert_same_generations(expected, got, tol: float = 1e-4) -> None:
    """Equal tokens, and every logprob the expected run reports within `tol` in the other."""
    for e, g in zip(expected, got, strict=True):
        assert g.token_ids == e.token_ids
        for e_step, g_step in zip(e.logprobs, g.logprobs, strict=True):
            for token, lp in e_step.items():
                assert abs(g_step[token].logprob - lp.logprob) < tol, (token, lp.logprob, g_step[token].logprob)


def assert_runs_like_the_fixed_knob(ranged, fixed, level: int) -> None:
    """Outputs of a range run at `level` against the fixed knob at that level: the same tokens,
    every token reported at the level, logprobs (chosen and alternatives) within 1e-6."""
    for a, b in zip(ranged, fixed, strict=True):
        assert a.token_ids == b.token_ids
        assert a.depth.per_token == [level] * a.depth.tokens
        assert a.outputs[0].token_depths == [level] * len(a.token_ids)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert {t: v.logprob for t, v in x.items()} == pytest.approx({t: v.logprob for t, v in y.items()},
                                                                        abs=1e-6)
