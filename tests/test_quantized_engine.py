"""The engine with weight-only quantized linears (issue 34, loading/quantization.py) against the
float64 reference of the quantized weights, for all six architectures.

The oracle: a "fake-quantized" copy of each tiny checkpoint, every tensor the quantized engine
serves from codes replaced by its round-to-nearest dequantization, `quantize_rtn(w, bits)
.dequantize()` of the checkpoint's own (fp32) tensor. int4 (per group of 32 inputs) and int8 (per
output row) are both independent per output row, so rounding q, k and v apart equals rounding the
packed qkv; a tied head / embedding is int8. The architecture's own reference on that copy is what
the quantized engine must equal: with fp32 activations within the fp32 engine's 1e-4, with bf16
activations within the bound BF16 states. Mixed batches: prompts of different lengths and
different depth settings per request, chunked prefill, and completions of different lengths, so
that both paths of QuantLinear run (the weight-only kernel at few rows, dequantize + GEMM above).

And the codes themselves: the engine serves the RTN codes of the checkpoint's own tensors in
either activation dtype; on the real SmolLM2 GGUF, its own Q4_1 codes (and its tied Q8_0 table as
int8 rows) give the same greedy tokens as today's dequantized fp32 path.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from depthserve import LLM, SamplingParams, reference
from depthserve.layers.quantized import (QuantEmbedding, QuantLinear, QuantPolicy,
                                         quantize_rtn)
from depthserve.loading.weights import parameter_name
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import BLOCK_SIZE, check_logprobs, depth_params, stream_prompts


@dataclass(frozen=True)
class Tolerance:
    logprob: float  # every reported logprob, engine vs reference
    near_tie: float  # a greedy token other than the reference's argmax must be this close to it
    routing_margin: float  # routing choices (ITT, Dreamer) must agree where the reference's margin exceeds it


FP32 = Tolerance(logprob=1e-4, near_tie=1e-4, routing_margin=1e-4)  # the dense fp32 engine's own bounds
# bf16 activations and KV cache carry 8 mantissa bits (a relative rounding of 2^-9 per value), and
# the tiny models' logits are peaked (std ~4): on these batches the dense bf16 engine is 0.14-0.34
# off the float64 reference in logprob, the quantized bf16 engine 0.11-0.53 off the reference of the
# codes it serves (measured with codes rounded from the very weights it loads; the largest: the tied
# llama, int4). 1.25 is 2.4x the largest. Dreamer's expert choices flip in bf16 at router margins up
# to 0.14, the dense bf16 engine's too.
BF16 = Tolerance(logprob=1.25, near_tie=1.25, routing_margin=0.4)

LENGTHS = [3, 17, 33, 51]
MAX_TOKENS = [8, 3, 6, 5]
MAX_MODEL_LEN = 64


@dataclass(frozen=True)
class Case:
    arch: str
    options: dict
    depths: list[dict | None]
    tied: bool = False  # the head is the embedding table (served as one int8 table)


CASES = {
    "llama": Case("llama", {}, [None] * len(LENGTHS)),
    "llama-tied": Case("llama", {}, [None] * len(LENGTHS), tied=True),
    "sgt": Case("sgt", dict(num_kv_heads=2), [{"loops": {1: 0, 2: 3}}, {"loops": 1}, None, {"loops": 3}]),
    "itt": Case("itt", dict(num_kv_heads=2),
                [{"selection_ratios": [0.3, 0.7]}, {"selection_ratios": [1.0, 0.0]}, None,
                 {"selection_ratios": [0.7, 0.3], "thinking_steps": 1}]),
    "dreamer": Case("dreamer", dict(num_kv_heads=2, attn_experts=2), [{"depth": 1}, {"depth": 3}, None, {"depth": 2}]),
    "put": Case("put", {}, [{"loops": 1}, {"loops": 2}, None, {"loops": 1}]),
    "saobp": Case("saobp", dict(lam=1.0), [None] * len(LENGTHS)),
}
# The tied table is int8 whatever the mode: int4 covers it (an int4 body, an int8 head, as SmolLM2).
ENGINE_CASES = [(name, bits) for name in CASES for bits in (4, 8) if not (CASES[name].tied and bits == 8)]


# ---- checkpoints -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    paths = {name: make_tiny(case.arch, root / name, seed=5, tokenizer=smollm_tokenizer, **case.options)
             for name, case in CASES.items() if not case.tied}
    paths["llama-tied"] = tied_copy(paths["llama"], root / "llama-tied")
    return paths


def tied_copy(path: Path, out: Path) -> Path:
    """The checkpoint with its head as the embedding table too (the head's scale keeps the logits
    as peaked as the untied model's)."""
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(out / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights.pop("lm_head.weight")
    save_file(weights, out / "model.safetensors")
    return out


def checkpoint_parameter(name: str, model: torch.nn.Module, tied: bool) -> tuple[str, int | None]:
    """(parameter, shard) a checkpoint tensor loads into; a tied embedding is the head's table."""
    target, shard = parameter_name(name, model.checkpoint_prefix, model.packed_modules)
    return ("lm_head.weight" if tied and target == "embed_tokens.weight" else target), shard


def wanted_bits(parameter: str, bits: int, tied: bool) -> int:
    return 8 if tied and parameter == "lm_head.weight" else bits


def fake_quantized_copy(path: Path, model: torch.nn.Module, quantized: list[str], bits: int, tied: bool,
                        out: Path) -> tuple[Path, set[str]]:
    """The checkpoint with every tensor of a quantized parameter replaced by its RTN dequantization;
    returns the copy and the parameters it covers."""
    shutil.copytree(path, out)
    weights = load_file(out / "model.safetensors")
    covered = set()
    for name, tensor in weights.items():
        target, _ = checkpoint_parameter(name, model, tied)
        if target in quantized:
            weights[name] = quantize_rtn(tensor.float(), wanted_bits(target, bits, tied)).dequantize().to(tensor.dtype)
            covered.add(target)
    save_file(weights, out / "model.safetensors")
    return out, covered


@pytest.fixture(scope="module")
def fake_quantized(checkpoints, tmp_path_factory):
    """(case, bits, the quantized engine) -> (the fake-quantized copy, the parameters it covers),
    built once per case and width."""
    built = {}

    def get(name: str, bits: int, llm: LLM) -> tuple[Path, set[str]]:
        if (name, bits) not in built:
            out = tmp_path_factory.mktemp("fake") / f"{name}-int{bits}"
            built[name, bits] = fake_quantized_copy(checkpoints[name], llm.engine.model,
                                                    llm.engine.quantization.quantized, bits, CASES[name].tied, out)
        return built[name, bits]

    return get


# ---- the engine ------------------------------------------------------------------------------------
def quantized_llm(path: Path, bits: int, dtype: str) -> LLM:
    return LLM(str(path), device="cpu", dtype=dtype, quantization=f"int{bits}", load_progress=False,
               max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, kv_cache_memory_gib=0.02,
               max_num_batched_tokens=16, enable_prefix_caching=False)


def mixed_batch(case: Case) -> tuple[list[list[int]], list[SamplingParams], list]:
    prompts = stream_prompts(LENGTHS, seed=41)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1 if i == 2 else None) for i, n in enumerate(MAX_TOKENS)]
    return prompts, params, [depth_params(d) for d in case.depths]


class PathCounter:
    """Calls of each path of QuantLinear (wraps the class's two matmuls), with the path switching
    above 4 rows so that the tiny batches here run both (the default switches above a decode batch)."""

    def __init__(self, monkeypatch):
        from depthserve.loading import quantization

        monkeypatch.setattr(quantization.QuantPolicy, "for_this_cpu",
                            classmethod(lambda cls: cls(kernel_max_rows=4, native_max_rows=4)))
        self.kernel_calls = self.gemm_calls = 0
        kernel, gemm = QuantLinear._kernel, QuantLinear._dequantized_for_gemm

        def counted_kernel(layer, rows):
            self.kernel_calls += 1
            return kernel(layer, rows)

        def counted_gemm(layer):
            self.gemm_calls += 1
            return gemm(layer)

        monkeypatch.setattr(QuantLinear, "_kernel", counted_kernel)
        monkeypatch.setattr(QuantLinear, "_dequantized_for_gemm", counted_gemm)


def assert_report(name: str, bits: int, llm: LLM, covered: set[str]) -> None:
    """Which parameters the engine serves from codes, and at which width."""
    case, model, report = CASES[name], llm.engine.model, llm.engine.quantization
    if case.arch == "dreamer":
        # Dreamer's block keeps its projections and experts as raw parameters (no nn.Linear): only
        # its head is served from codes.
        assert report.quantized == ["lm_head.weight"]
    else:
        assert "lm_head.weight" in report.quantized
        assert len(report.quantized) > 4 * model.config.num_layers  # qkv, o, gate_up, down per layer
    # SGT's loop attention is derived (after_load) from its layer's projections: it stays dense and
    # is refilled from the quantized layer (after_quantization), so it computes with what its source
    # serves. Every quantized parameter is a checkpoint tensor.
    loop_layers = [f"{n}.weight" for n, _ in model.named_modules() if ".loop_attn." in n and n.endswith("_proj")]
    assert report.dense == (loop_layers if case.arch == "sgt" else [])
    assert set(report.quantized) <= covered
    for parameter in report.quantized:
        layer = model.get_submodule(parameter.removesuffix(".weight"))
        assert isinstance(layer, QuantLinear) and layer.bits == wanted_bits(parameter, bits, case.tied), parameter
    if case.tied:
        assert isinstance(model.embed_tokens, QuantEmbedding)


# ---- the reference ---------------------------------------------------------------------------------
def engine_decisions(arch: str, path: Path, tokens: list[int], depth, out, margin: float, stats: dict) -> dict | None:
    """The engine's routing choices to force on the reference (ITT's token selection, Dreamer's
    experts), checked equal to the reference's own wherever its margin exceeds `margin`."""
    if arch not in ("itt", "dreamer"):
        return None
    n = len(tokens)
    _, decisions = reference.forward(path, tokens, depth, return_decisions=True)
    force = {}
    for key, ref in decisions.items():
        if arch == "itt":
            recorded = out.depth.decisions[key][:n]
            assert (recorded >= 0).all(), f"{key}: a computed position has no recorded decision"
            mine = recorded == 1
            same = mine == ref["selected"]
        else:
            kind, d = key
            mine = out.depth.decisions[kind][:n, d]
            if kind == "ea":
                mine = np.sort(mine, axis=-1)
            same = (mine == ref["choice"]).reshape(n, -1).all(-1)
        stats["decisions"] += n
        stats["routing_differs"] += int((~same).sum())
        bad = np.flatnonzero(~same & (ref["margin"] > margin))
        assert not len(bad), f"{key}: decisions differ at {bad} with margins {ref['margin'][bad]}"
        force[key] = mine
    return force


def assert_equals_reference(arch: str, path: Path, prompts, depths, outputs, tolerance: Tolerance) -> dict:
    """Every reported logprob (generated and prompt) within tolerance of the reference run on the
    engine's tokens and routing choices; greedy tokens its argmax but for near-ties."""
    stats = {"tokens": 0, "max_err": 0.0, "decisions": 0, "routing_differs": 0}
    for prompt, depth, out in zip(prompts, depths, outputs, strict=True):
        tokens = prompt + out.token_ids[:-1]
        force = engine_decisions(arch, path, tokens, depth, out, tolerance.routing_margin, stats)
        logits = reference.forward(path, tokens, depth, **({} if force is None else {"force": force}))
        check_logprobs(torch.log_softmax(logits, dim=-1), len(prompt), out.outputs[0], stats, tol=tolerance.logprob,
                       near_tie=tolerance.near_tie, prompt_logprobs=out.prompt_logprobs)
    return stats


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("name", "bits"), ENGINE_CASES)
def test_quantized_engine_equals_the_reference_of_its_codes(name, bits, dtype, checkpoints, fake_quantized,
                                                            monkeypatch):
    case = CASES[name]
    counter = PathCounter(monkeypatch)
    llm = quantized_llm(checkpoints[name], bits, dtype)
    prompts, params, depths = mixed_batch(case)
    outputs = llm.generate(prompts, params, depths)
    assert llm.engine.block_manager.num_used_pages == 0
    assert counter.kernel_calls > 0 and counter.gemm_calls > 0, "both paths of QuantLinear ran"
    path, covered = fake_quantized(name, bits, llm)
    assert_report(name, bits, llm, covered)
    stats = assert_equals_reference(case.arch, path, prompts, depths, outputs, FP32 if dtype == "float32" else BF16)
    print(f"{name} int{bits} {dtype}: {stats}")
    assert stats["tokens"] == sum(MAX_TOKENS) and stats["prompt_positions"] == LENGTHS[2] - 1


# ---- the codes ---------------------------------------------------------------------------------------
def checkpoint_rtn_codes(path: Path, model: torch.nn.Module, quantized: list[str], bits: int,
                         tied: bool) -> dict[str, torch.Tensor]:
    """Each quantized parameter's RTN codes of the checkpoint's own tensors, shards stacked in order."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        target, shard = checkpoint_parameter(name, model, tied)
        if target not in quantized:
            continue
        codes = quantize_rtn(tensor.float(), wanted_bits(target, bits, tied)).codes.to(torch.int32)
        shards.setdefault(target, {})[shard or 0] = codes
    return {target: torch.cat([parts[i] for i in sorted(parts)]) for target, parts in shards.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_served_codes_are_the_rtn_codes_of_the_checkpoint(bits, dtype, checkpoints):
    """Whatever the activation dtype, the engine rounds the checkpoint's own weights (not a copy
    already rounded to that dtype): every code it serves is the checkpoint tensor's RTN code."""
    name = "llama-tied"
    llm = quantized_llm(checkpoints[name], bits, dtype)
    model, quantized = llm.engine.model, llm.engine.quantization.quantized
    expected = checkpoint_rtn_codes(checkpoints[name], model, quantized, bits, tied=True)
    assert set(expected) == set(quantized)
    differing = {}  # parameter -> the fraction of its codes that are not the checkpoint's RTN codes
    for parameter in quantized:
        served = model.get_submodule(parameter.removesuffix(".weight")).integer_codes()
        fraction = (served != expected[parameter]).float().mean().item()
        if fraction:
            differing[parameter] = f"{fraction:.2%}"
    assert not differing, differing


# ---- the SmolLM2 GGUF ----------------------------------------------------------------------------------
SMOLLM_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a forest,",
    "Photosynthesis is the process by which plants",
]
GREEDY_TOKENS = 64
KERNEL_TOKENS = 8  # generated by the int4 engine itself: decode steps of 4 rows run the int4 kernel


def smollm2(quantization: str) -> LLM:
    return LLM("smollm2-135m-instruct", device="cpu", dtype="float32", quantization=quantization, load_progress=False,
               max_model_len=256, kv_cache_memory_gib=0.05)


def top_logprobs(entry) -> dict[int, float]:
    return {token: round(lp.logprob, 5) for token, lp in entry.items()}


def generation_differences(expected, got) -> list[str]:
    """Where greedy completions part (within the shorter), with both runs' top-2 logprobs there."""
    differences = []
    for prompt, (e, g) in enumerate(zip(expected, got, strict=True)):
        i = next((i for i, (a, b) in enumerate(zip(e.token_ids, g.token_ids)) if a != b), None)
        if i is not None:
            differences.append(f"prompt {prompt}, token {i}: dequantized {e.token_ids[i]} "
                               f"{top_logprobs(e.outputs[0].logprobs[i])}, int4 {g.token_ids[i]} "
                               f"{top_logprobs(g.outputs[0].logprobs[i])}")
    return differences


def teacher_forced_differences(expected, scored) -> list[str]:
    """The first completion token of each prompt that is not the scoring engine's argmax."""
    differences = []
    for prompt, (e, s) in enumerate(zip(expected, scored, strict=True)):
        start = len(e.prompt_token_ids)
        for i, token in enumerate(e.token_ids):
            entry = s.prompt_logprobs[start + i]
            if entry[token].rank != 1:
                differences.append(f"prompt {prompt}, token {i}: dequantized {token} "
                                   f"{top_logprobs(e.outputs[0].logprobs[i])}, int4 {top_logprobs(entry)}")
                break
    return differences


@pytest.mark.slow
def test_gguf_q4_1_codes_give_the_dequantized_greedy_tokens(smollm_llm):
    """fp32 activations: the file's Q4_1 codes (`quantization="gguf"`; its tied Q8_0 table served as
    the file has it, dequantized) against today's path, the same codes dequantized to fp32. Today's path generates 64 greedy tokens; the int4
    engine generates the first 8 itself (decode steps through the int4 kernel) and scores all 64
    teacher-forced (prefill: dequantize + GEMM), each of them its argmax: the same 64 greedy tokens
    as its own generation would give, up to the kernel's summation order (~1e-6), at a fraction of
    the time (the int4 kernel is several times slower than an fp32 GEMM with fp32 activations)."""
    assert smollm_llm.engine.quantization.mode == "none"  # the shared fp32 engine (tests/conftest.py): dequantized
    dequantized = smollm_llm.generate(SMOLLM_PROMPTS, SamplingParams(
        temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=2))
    llm = smollm2("gguf")
    model, report = llm.engine.model, llm.engine.quantization
    # Every linear of the file but the tied table is Q4_1, served as it is (q/k/v and gate/up
    # packed: 4 per layer); the Q8_0 table dense, as the file has it.
    assert len(report.quantized) == 4 * model.config.num_layers and report.dense == ["lm_head.weight"]
    assert report.weight_error is None  # nothing rounded again by RTN
    assert {model.get_submodule(p.removesuffix(".weight")).bits for p in report.quantized} == {4}
    assert type(model.lm_head) is not QuantLinear and type(model.embed_tokens) is not QuantEmbedding
    generated = llm.generate(SMOLLM_PROMPTS, SamplingParams(temperature=0.0, max_tokens=KERNEL_TOKENS,
                                                            ignore_eos=True, logprobs=2))
    differences = generation_differences(dequantized, generated)
    assert not differences, differences
    scored = llm.generate([e.prompt_token_ids + e.token_ids for e in dequantized],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    differences = teacher_forced_differences(dequantized, scored)
    assert not differences, differences
