"""Structured outputs through the engine (offline API) on the real SmolLM2 and on depth models: every
output that finishes with "stop" satisfies its constraint; constrained requests leave the
unconstrained ones of their batch token-identical to running alone (chunked prefill, preemption);
bad constraints fail before admission and a constraint that cannot finish ends with "length"."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest

from depthserve import LLM, DepthParams, SamplingParams
from depthserve.demo.task import problems
from depthserve.structured import (
    GrammarTooComplexError,
    InvalidGrammarError,
    InvalidJsonSchemaError,
    InvalidRegexError,
    JsonSchemaConstraint,
    StructuredOutputError,
    StructuredOutputsParams,
    UnsatisfiableConstraintError,
)
from tests.batch_workload import PARAMS, compare, prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from json_schemas import as_generated_json, draw_instance, draw_schemas  # noqa: E402

pytestmark = pytest.mark.slow  # part of make test, left out of make test-fast

SCHEMAS_IN_SUITE = 24  # a few hundred: bench/structured_outputs.py


@pytest.fixture(scope="module")
def llm(smollm_llm):
    return smollm_llm  # conftest.py: shared, and checked to be left idle and holding no page after each test


def _chat(llm, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


# ---- JSON schemas drawn by hypothesis (bench/json_schemas.py) -------------------------------
def test_outputs_of_generated_json_schemas_validate(llm):
    schemas = draw_schemas(SCHEMAS_IN_SUITE, seed=0)
    # The constraint admits what the schema admits: an instance hypothesis-jsonschema draws, written
    # as the grammar writes JSON, is accepted token by token and may end there.
    for i, schema in enumerate(schemas):
        instance = draw_instance(schema, seed=i)
        matcher = llm.engine.structured.compile(JsonSchemaConstraint(schema)).new_matcher()
        for token in llm.tokenizer.encode(as_generated_json(instance, schema), add_special_tokens=False):
            assert matcher.accept_token(token), (schema, instance, matcher.error)
        assert matcher.eos_allowed(), (schema, instance)
    prompts = [_chat(llm, f"Reply with a JSON object that matches this schema: {json.dumps(s)}") for s in schemas]
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=s))
              for s in schemas]
    outputs = llm.generate(prompts, params)
    finished = [(schema, out) for schema, out in zip(schemas, outputs) if out.finish_reason == "stop"]
    for schema, out in finished:
        jsonschema.validate(json.loads(out.text), schema)
    assert len(finished) >= 0.75 * len(schemas), [out.finish_reason for out in outputs]


def test_regex_choice_grammar_and_json_object(llm):
    prompt = _chat(llm, "Give me a date, a colour and a small JSON object.")
    cases = [
        (StructuredOutputsParams(regex=r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"),
         lambda text: re.fullmatch(r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)", text)),
        (StructuredOutputsParams(choice=["red", "green", "blue"]), lambda text: text in {"red", "green", "blue"}),
        (StructuredOutputsParams(grammar='start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'),
         lambda text: re.fullmatch(r"x=[0-9]{1,3};", text)),
        (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    ]
    for structured, check in cases:
        stopped = 0
        for params in (SamplingParams(temperature=0, max_tokens=64, structured_outputs=structured),
                       SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=64, logprobs=3,
                                      structured_outputs=structured)):
            out = llm.generate([prompt], params)[0]
            for choice in out.outputs:
                if choice.finish_reason == "stop":  # else cut off by max_tokens (free JSON strings can run on)
                    stopped += 1
                    assert check(choice.text), (structured, choice.text)
                if params.logprobs:  # logprobs of the masked distribution: every listed token could be drawn
                    assert all(lp.logprob > float("-inf") for step in choice.logprobs for lp in step.values())
        assert stopped >= 2, structured


def test_seeded_constrained_sampling_repeats(llm):
    prompt = _chat(llm, "Pick a colour.")
    params = SamplingParams(temperature=1.2, seed=3, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue", "cyan"]))
    first, second = (llm.generate([prompt], params)[0] for _ in range(2))
    assert first.token_ids == second.token_ids


def test_constraint_that_cannot_finish_ends_with_length(llm):
    out = llm.generate([_chat(llm, "Say a.")], SamplingParams(
        temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="a{40}")))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and set(out.text) <= {"a"}


@pytest.mark.parametrize("structured, error", [
    (StructuredOutputsParams(regex="(unclosed"), InvalidRegexError),
    (StructuredOutputsParams(json={"type": "no-such-type"}), InvalidJsonSchemaError),
    (StructuredOutputsParams(json="{not json"), InvalidJsonSchemaError),
    (StructuredOutputsParams(grammar="start: undefined_rule"), InvalidGrammarError),
    (StructuredOutputsParams(regex="a", choice=["a"]), StructuredOutputError),
    (StructuredOutputsParams(), StructuredOutputError),
    (StructuredOutputsParams(json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
     UnsatisfiableConstraintError),
    (StructuredOutputsParams(grammar=r"start: /[^\s\S]/"), UnsatisfiableConstraintError),
    (StructuredOutputsParams(regex="\\"), InvalidRegexError),
    (StructuredOutputsParams(json={"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                                   "required": ["next"]}}, "$ref": "#/$defs/n"}), GrammarTooComplexError),
])
def test_bad_constraints_fail_before_admission(llm, structured, error):
    with pytest.raises(error):
        llm.generate([_chat(llm, "Hi")], SamplingParams(max_tokens=4, structured_outputs=structured))
    assert not llm.engine.has_unfinished_requests()


def test_a_constraint_that_fails_mid_output_fails_its_request_and_is_refused_after(llm, monkeypatch):
    """A lexer bound exceeded after the first tokens (its state count, shared by every copy of the
    grammar): the output ends with "error", never "stop" as if complete, and frees its pages; the
    same constraint is then refused before admission."""
    backend = llm.engine.structured.backend
    monkeypatch.setattr(backend, "limits", dataclasses.replace(backend.limits, max_lexer_states=100))
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(regex="[a-z]{300}"))
    prompt = _chat(llm, "Write lowercase letters.")
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "error" and 0 < len(out.token_ids) < 80
    assert llm.engine.block_manager.num_used_pages == 0
    with pytest.raises(GrammarTooComplexError, match="too many states"):
        llm.generate([prompt], params)


def test_unconstrained_requests_unchanged_beside_constrained_ones(alone_outputs, smollm_tokenizer):
    """The batch-invariance workload, with a constrained request beside every unconstrained one,
    under chunked prefill and a cache small enough to preempt."""
    mixed = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", load_progress=False,
                max_num_batched_tokens=96, max_model_len=512, kv_cache_memory_gib=0.03, enable_prefix_caching=False)
    constrained = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    workload = prompts(smollm_tokenizer)
    outputs = mixed.generate([p for prompt in workload for p in (prompt, prompt[:9])],
                             [params for _ in workload for params in (PARAMS, constrained)])
    assert mixed.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for all 32"
    compare(alone_outputs, outputs[0::2])
    for out in outputs[1::2]:
        assert out.finish_reason == "length" or isinstance(json.loads(out.text)["n"], int)
    assert mixed.engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("model, depths, engine_args", [
    ("demo-itt", [{"thinking_steps": 1}, {"thinking_steps": 4}], {}),
    ("demo-dreamer", [{"depth": {"min": 2, "max": 6}}, {"depth": {"min": 1, "max": 4}}],
     {"depth_policy": "confidence", "confidence_threshold": 0.9999}),
])
def test_constrained_requests_on_depth_models(model, depths, engine_args):
    llm = LLM(model, device="cpu", dtype="float32", load_progress=False, **engine_args)
    held_out = problems(11, 6, "held_out", 4)
    answer = StructuredOutputsParams(regex=r"[0-9]")
    params = [SamplingParams(temperature=0, max_tokens=4, structured_outputs=answer if i % 2 else None)
              for i in range(len(held_out))]
    depth = [DepthParams.from_dict(depths[i % len(depths)]) for i in range(len(held_out))]
    outputs = llm.generate([p.prompt for p in held_out], params, depth)
    for i, out in enumerate(outputs):
        if i % 2:
            # A word-level tokenizer decodes each token after a space; the constraint is on the tokens.
            assert out.finish_reason == "stop" and re.fullmatch(r"[0-9]", out.text.strip()), out.text
    assert llm.engine.block_manager.num_used_pages == 0


def test_the_confidence_exit_reads_the_masked_distribution():
    """A token the demo Dreamer is sure of exits early; masked to every other digit, the same token
    has no confident choice left and runs to its range's maximum."""
    llm = LLM("demo-dreamer", device="cpu", dtype="float32", load_progress=False, depth_policy="confidence",
              confidence_threshold=0.9999)
    held_out = problems(12, 16, "held_out", 2)
    depth = DepthParams.from_dict({"depth": {"min": 1, "max": 6}})
    free = llm.generate([p.prompt for p in held_out], SamplingParams(temperature=0, max_tokens=1), depth)
    early = [(p, out) for p, out in zip(held_out, free) if out.outputs[0].token_depths[0] < 6]
    assert early, "no answer exited early without a constraint"
    others = [SamplingParams(temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(
        choice=[d for d in "0123456789" if d != out.text.strip()])) for _, out in early]
    masked = llm.generate([p.prompt for p, _ in early], others, depth)
    assert all(out.outputs[0].token_depths == [6] for out in masked), [o.outputs[0].token_depths for o in masked]
