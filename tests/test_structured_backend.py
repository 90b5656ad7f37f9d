"""The grammar backend (depthserve.structured) on SmolLM2's real tokenizer, without a model: random
logits masked by the constraint's bitmask, argmax, accept. Whatever the logits, a finished output
must satisfy the constraint."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch

from depthserve.errors import InvalidRequestError
from depthserve.structured import bitmask as bitmask_module
from depthserve.structured.compile_cache import CacheKey, CompileCache
from depthserve.structured import (
    BitmaskFillWorker,
    GrammarLimits,
    ChoiceConstraint,
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileTimeoutError,
    GrammarConstraint,
    GrammarMatcher,
    GrammarTooComplexError,
    InvalidChoiceError,
    InvalidGrammarError,
    InvalidJsonSchemaError,
    InvalidRegexError,
    InvalidToolError,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    ToolCallConstraint,
    ToolSpec,
    UnsatisfiableConstraintError,
    UnsupportedJsonSchemaError,
    apply_token_bitmask_,
    create_grammar_backend,
    unpack_token_bitmask,
)

MAX_STEPS = 400


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The masked logits here are one row: on a shared 2-core machine, torch's intra-op threads
    only contend (100x slower under load), and this file must stay within its time budget."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def backend(smollm_tokenizer):
    # <|im_end|> (the chat EOS) and <|endoftext|>, as the engine collects them from config and tokenizer
    return create_grammar_backend(smollm_tokenizer, eos_token_ids=[2, 0])


def drive(backend, matcher: GrammarMatcher, seed: int, prefix: list[int] = ()) -> tuple[list[int], bool]:
    """Greedy decoding of random logits under the constraint: (tokens before EOS, finished)."""
    for token in prefix:
        assert matcher.accept_token(token), matcher.error
    generator = torch.Generator().manual_seed(seed)
    bitmask = backend.allocate_bitmask(1)
    tokens = list(prefix)
    for _ in range(MAX_STEPS):
        backend.fill_bitmask([matcher], bitmask)
        logits = torch.randn(1, backend.tokenizer.vocab_size, generator=generator)
        apply_token_bitmask_(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token), matcher.error
        if token in backend.tokenizer.eos_token_ids:
            assert matcher.is_finished()
            return tokens, True
        tokens.append(token)
        if matcher.is_finished():
            return tokens, True
    return tokens, False


def allowed_tokens(backend, matcher: GrammarMatcher) -> set[int]:
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    return set(torch.nonzero(unpack_token_bitmask(bitmask, backend.tokenizer.vocab_size)[0]).flatten().tolist())


SHORT = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "flat object": {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                       "admin": {"type": "boolean"}},
                    "required": ["name", "age", "admin"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "kind": {"const": "fixed"},
                                                 "level": {"enum": [1, 2.5, None, True]}},
              "required": ["color", "kind", "level"], "additionalProperties": False},
    "bounded array": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    "bounded numbers": {"type": "object", "properties": {"x": {"type": "number", "minimum": -5.5, "maximum": 1000},
                                                           "n": {"type": "integer", "minimum": 10, "maximum": 20}},
                        "required": ["x", "n"], "additionalProperties": False},
    "nested with $ref": {"type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                                                   "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                                                                "required": ["x", "y"], "additionalProperties": False}},
                         "properties": {"start": {"$ref": "#/$defs/point"}, "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 3},
                                        "label": SHORT},
                         "required": ["start", "path"], "additionalProperties": False},
    "anyOf and pattern": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{3}$"},
                                                             "note": {"anyOf": [SHORT, {"type": "null"}]}},
                          "required": ["id", "note"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(backend, smollm_tokenizer, name):
    schema = SCHEMAS[name]
    compiled = backend.compile(JsonSchemaConstraint(schema))
    for seed in range(5):
        tokens, finished = drive(backend, compiled.new_matcher(), seed)
        assert finished, f"{name} seed {seed}: unfinished after {MAX_STEPS} tokens: {smollm_tokenizer.decode(tokens)!r}"
        text = smollm_tokenizer.decode(tokens)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_forces_an_object(backend, smollm_tokenizer):
    matcher = backend.compile(JsonObjectConstraint()).new_matcher()
    first = allowed_tokens(backend, matcher)
    assert first and all(smollm_tokenizer.decode([token]).startswith("{") for token in first)
    for token in smollm_tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}'):
        assert matcher.accept_token(token), matcher.error
    assert matcher.eos_allowed() and matcher.is_finished()
    assert not backend.compile(JsonObjectConstraint()).new_matcher().accept_token(smollm_tokenizer.encode("[")[0])


def test_regex_outputs_match(backend, smollm_tokenizer):
    pattern = r"[A-Z][a-z]{1,6} [0-9]{2,4}(\.[0-9])?"
    compiled = backend.compile(RegexConstraint(pattern))
    for seed in range(5):
        tokens, finished = drive(backend, compiled.new_matcher(), seed)
        assert finished
        assert re.fullmatch(pattern, smollm_tokenizer.decode(tokens))


def test_choice_outputs_are_one_of_the_choices(backend, smollm_tokenizer):
    choices = ("red", "green", 'say "hi" \\ there', "café", "")
    compiled = backend.compile(ChoiceConstraint(choices))
    seen = set()
    for seed in range(12):
        tokens, finished = drive(backend, compiled.new_matcher(), seed)
        assert finished
        seen.add(smollm_tokenizer.decode(tokens))
    assert seen <= set(choices) and len(seen) > 1


def test_lark_and_gbnf_grammars(backend, smollm_tokenizer):
    lark = 'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[0-9]/'
    gbnf = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] "+" expr'
    for grammar in (lark, gbnf):
        compiled = backend.compile(GrammarConstraint(grammar))
        for seed in range(3):
            tokens, finished = drive(backend, compiled.new_matcher(), seed)
            assert finished
            assert re.fullmatch(r"\([0-9](\+[0-9])*\)", smollm_tokenizer.decode(tokens))


WEATHER = ToolSpec("get_weather", {"type": "object", "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                                   "properties": {"city": SHORT, "unit": {"$ref": "#/$defs/unit"},
                                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                   "required": ["city", "unit"], "additionalProperties": False})
SEARCH = ToolSpec("search", {"type": "object", "properties": {"query": SHORT, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                             "required": ["query"], "additionalProperties": False})
CLOCK = ToolSpec("now")
TOOLS = {tool.name: tool for tool in (WEATHER, SEARCH, CLOCK)}
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)  # as vLLM's hermes parser reads calls


def parsed_calls(text: str) -> list[dict]:
    calls = [json.loads(body.strip()) for body in HERMES_CALL.findall(text)]
    for call in calls:
        tool = TOOLS[call["name"]]
        jsonschema.validate(call["arguments"], dict(tool.parameters or {"type": "object", "additionalProperties": False}))
    return calls


def test_required_tool_calls_parse_and_validate(backend, smollm_tokenizer):
    compiled = backend.compile(ToolCallConstraint((WEATHER, SEARCH, CLOCK)))
    names = set()
    for seed in range(6):
        tokens, finished = drive(backend, compiled.new_matcher(), seed)
        assert finished
        text = smollm_tokenizer.decode(tokens)
        calls = parsed_calls(text)
        assert calls and HERMES_CALL.sub("", text).strip() == ""
        names |= {call["name"] for call in calls}
    assert len(names) > 1


def test_named_tool_single_call(backend, smollm_tokenizer):
    compiled = backend.compile(ToolCallConstraint((WEATHER,), parallel_calls=False))
    for seed in range(3):
        tokens, finished = drive(backend, compiled.new_matcher(), seed)
        assert finished
        text = smollm_tokenizer.decode(tokens)
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        (call,) = parsed_calls(text)
        assert call["name"] == "get_weather"


def test_auto_tool_choice_enforces_a_call_once_opened(backend, smollm_tokenizer):
    compiled = backend.compile(ToolCallConstraint((WEATHER, SEARCH), require_call=False, parallel_calls=False))
    plain = compiled.new_matcher()
    assert all(plain.accept_token(token) for token in smollm_tokenizer.encode("No tool needed: it is sunny."))
    assert plain.eos_allowed()
    prefix = smollm_tokenizer.encode("Let me look that up. <tool_call>\n")
    tokens, finished = drive(backend, compiled.new_matcher(), seed=0, prefix=prefix)
    assert finished
    text = smollm_tokenizer.decode(tokens)
    (call,) = parsed_calls(text)
    assert text.startswith("Let me look that up. ") and call["name"] in {"get_weather", "search"}
    opened = compiled.new_matcher()
    assert all(opened.accept_token(token) for token in prefix)
    assert opened.validate_tokens(smollm_tokenizer.encode("hello")) == 0


@pytest.mark.parametrize("constraint, error, reason", [
    (JsonSchemaConstraint({"type": "foo"}), InvalidJsonSchemaError, "foo"),
    (JsonSchemaConstraint({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), InvalidJsonSchemaError, "missing"),
    (JsonSchemaConstraint({"type": "string", "pattern": "(("}), InvalidJsonSchemaError, "unclosed group"),
    (JsonSchemaConstraint("an object"), InvalidJsonSchemaError, "object or a boolean"),
    (JsonSchemaConstraint({"not": {"type": "string"}}), UnsupportedJsonSchemaError, "not"),
    (JsonSchemaConstraint({"type": "string", "format": "no-such-format"}), UnsupportedJsonSchemaError, "no-such-format"),
    (RegexConstraint("(("), InvalidRegexError, "unclosed group"),
    (RegexConstraint("(?=a)b"), InvalidRegexError, "look-around"),
    (GrammarConstraint('start: "a" undefined_rule'), InvalidGrammarError, "undefined_rule"),
    (GrammarConstraint(""), InvalidGrammarError, "non-empty"),
    (ChoiceConstraint(()), InvalidChoiceError, "non-empty"),
    (ChoiceConstraint(("a", 1)), InvalidChoiceError, "string"),
    (ToolCallConstraint((ToolSpec("no spaces allowed"),)), InvalidToolError, "must match"),
    (ToolCallConstraint((ToolSpec("f", {"type": "string"}),)), InvalidToolError, "object"),
    (ToolCallConstraint((ToolSpec("f", {"type": "object", "properties": {"a": {"type": "nope"}}}),)), InvalidToolError, "nope"),
    (ToolCallConstraint((ToolSpec("f"), ToolSpec("f"))), InvalidToolError, "unique"),
    (ToolCallConstraint(()), InvalidToolError, "no tools"),
])
def test_bad_constraints_raise_typed_400s(backend, constraint, error, reason):
    with pytest.raises(error) as caught:
        backend.compile(constraint)
    assert reason in caught.value.reason
    assert isinstance(caught.value, InvalidRequestError) and caught.value.status == 400
    located = caught.value.located("response_format.json_schema.schema")
    assert type(located) is type(caught.value) and str(located).startswith("response_format.json_schema.schema: ")


LARGE_SCHEMA = {"type": "object", "properties": {f"email{i}": {"type": "string", "pattern": f"^[a-z]{{1,{40 + i}}}@[a-z]{{1,30}}\\.(com|org)$"}
                                                 for i in range(200)}}


def test_compile_bounds_raise_typed_errors(backend, monkeypatch):
    limits = backend.limits
    monkeypatch.setattr(backend, "limits", dataclasses.replace(limits, max_grammar_symbols=100))
    with pytest.raises(GrammarTooComplexError, match="too big"):
        backend.compile(JsonSchemaConstraint(LARGE_SCHEMA))
    monkeypatch.setattr(backend, "limits", dataclasses.replace(limits, initial_lexer_fuel=1000))
    with pytest.raises(GrammarTooComplexError, match="too big"):
        backend.compile(JsonSchemaConstraint(LARGE_SCHEMA))
    monkeypatch.setattr(backend, "limits", dataclasses.replace(limits, max_constraint_chars=50))
    with pytest.raises(GrammarTooComplexError, match="characters long"):
        backend.compile(JsonSchemaConstraint(SCHEMAS["flat object"]))
    monkeypatch.setattr(backend, "limits", dataclasses.replace(limits, compile_timeout_s=0.001))
    with pytest.raises(GrammarCompileTimeoutError, match="longer than"):
        backend.compile(JsonSchemaConstraint(LARGE_SCHEMA))


def test_rollback_restores_the_mask(backend, smollm_tokenizer):
    matcher = backend.compile(JsonSchemaConstraint(SCHEMAS["nested with $ref"])).new_matcher()
    tokens = smollm_tokenizer.encode('{"start": {"x": 1, "y": 2}, "path": [')
    masks = []
    for token in tokens:
        masks.append(allowed_tokens(backend, matcher))
        assert matcher.accept_token(token)
    k = 4
    assert matcher.validate_tokens(smollm_tokenizer.encode('"x"')) == 0  # path items are objects
    matcher.rollback(k)
    assert allowed_tokens(backend, matcher) == masks[-k]
    assert matcher.validate_tokens(tokens[-k:]) == k
    fork = matcher.fork()
    for token in tokens[-k:]:
        assert matcher.accept_token(token)
    assert allowed_tokens(backend, fork) == masks[-k]  # the fork kept its own state
    assert not matcher.accept_token(smollm_tokenizer.encode("}")[0])  # "[" must be closed by "]" first
    assert matcher.error


def test_finished_constraint_allows_only_eos(backend, smollm_tokenizer):
    matcher = backend.compile(RegexConstraint("ab")).new_matcher()
    assert not matcher.eos_allowed()
    assert not (allowed_tokens(backend, matcher) & set(backend.tokenizer.eos_token_ids))
    for token in smollm_tokenizer.encode("ab"):
        assert matcher.accept_token(token)
    assert matcher.is_finished() and matcher.eos_allowed() and matcher.error is None
    assert allowed_tokens(backend, matcher) == set(backend.tokenizer.eos_token_ids)


def test_apply_masks_padded_vocab_and_leaves_other_rows_untouched(backend, smollm_tokenizer):
    vocab = backend.tokenizer.vocab_size
    compiled = backend.compile(RegexConstraint("[0-9]+"))
    matchers = [compiled.new_matcher(), compiled.new_matcher()]
    assert matchers[1].accept_token(smollm_tokenizer.encode("7")[0])
    bitmask = backend.allocate_bitmask(len(matchers))
    backend.fill_bitmask(matchers, bitmask)
    logits = torch.randn(4, vocab + 64)  # a model vocabulary padded past the tokenizer's
    original = logits.clone()
    apply_token_bitmask_(logits, bitmask, rows=[3, 1])
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    for row, matcher in ((3, matchers[0]), (1, matchers[1])):
        allowed = sorted(allowed_tokens(backend, matcher))
        assert torch.isinf(logits[row, vocab:]).all()
        assert torch.equal(logits[row, allowed], original[row, allowed])
        assert int(torch.isfinite(logits[row]).sum()) == len(allowed)
    assert set(backend.tokenizer.eos_token_ids) <= set(allowed_tokens(backend, matchers[1]))
    assert not set(backend.tokenizer.eos_token_ids) & set(allowed_tokens(backend, matchers[0]))


def test_bitmask_layout_and_vocab_bound(monkeypatch):
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    allowed = [0, 31, 32, 63, 64, 70]
    for token in allowed:
        word, bit = divmod(token, 32)
        bitmask[0, word] |= torch.tensor(1 << bit).to(torch.int32) if bit < 31 else torch.tensor(-(2**31), dtype=torch.int32)
    logits = torch.zeros(1, 100, dtype=torch.bfloat16)
    apply_token_bitmask_(logits, bitmask, vocab_size=65)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 32, 63, 64]
    fallback = torch.zeros(1, 100)
    monkeypatch.setattr(bitmask_module.sys, "byteorder", "big")  # the path that does not read bytes
    apply_token_bitmask_(fallback, bitmask, vocab_size=65)
    assert torch.isfinite(fallback[0]).nonzero().flatten().tolist() == [0, 31, 32, 63, 64]
    untouched = torch.zeros(2, 8)
    apply_token_bitmask_(untouched, torch.zeros(0, 1, dtype=torch.int32), rows=[])
    assert torch.equal(untouched, torch.zeros(2, 8))


def test_background_fill_matches_direct_fill(backend):
    assert isinstance(backend, GrammarBackend)
    compiled = backend.compile(JsonSchemaConstraint(SCHEMAS["enums"]))
    matchers = [compiled.new_matcher() for _ in range(3)]
    assert isinstance(compiled, CompiledGrammar) and isinstance(matchers[0], GrammarMatcher)
    worker = BitmaskFillWorker(backend)
    try:
        background = backend.allocate_bitmask(3)
        worker.submit(matchers, background).result(timeout=30)
    finally:
        worker.close()
    direct = backend.allocate_bitmask(3)
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(direct, row)
    assert torch.equal(background, direct)


# ---- constraints that fail safe (issue 51) ----------------------------------------------------------
ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
           "$ref": "#/$defs/n"}
HOSTILE = {
    "schema without a finite instance": (JsonSchemaConstraint(ENDLESS), GrammarTooComplexError, "too many items"),
    "the same as a required tool": (ToolCallConstraint((ToolSpec("f", ENDLESS),)), GrammarTooComplexError,
                                    "too many items"),
    "regex of a million states": (RegexConstraint("a{1000}{1001}"), GrammarTooComplexError, ""),
    "40,000 choices": (ChoiceConstraint(tuple(f"c{i}" for i in range(40_000))), GrammarTooComplexError,
                       "40000 choices"),
    "grammar of 20,000 alternatives": (GrammarConstraint("start: " + " | ".join(f'"alt{i}"' for i in range(20_000))),
                                       GrammarTooComplexError, "items"),
    "grammar of no sentence": (GrammarConstraint(r"start: /[^\s\S]/"), UnsatisfiableConstraintError, "no output"),
    "schema that is only itself": (JsonSchemaConstraint({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
                                   UnsatisfiableConstraintError, "no output"),
    "regex of a lone backslash": (RegexConstraint("\\"), InvalidRegexError, "lone backslash"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_constraints_get_the_same_typed_400_every_time(backend, name, monkeypatch):
    """Each compiled without error before, and failed (or wrote "") only once running; now the first
    compile refuses it, and a repeat is refused with the same error from the failure record."""
    constraint, error, reason = HOSTILE[name]
    with pytest.raises(error) as first:
        backend.compile(constraint)
    assert reason in first.value.reason.lower() and first.value.status == 400
    monkeypatch.setattr(backend, "_build", lambda *args: pytest.fail("a failed constraint was compiled again"))
    with pytest.raises(error) as again:
        backend.compile(constraint)
    assert type(again.value) is type(first.value) and again.value.reason == first.value.reason


def test_a_grammar_whose_lexer_failed_while_running_is_refused_from_then_on(backend, smollm_tokenizer, monkeypatch):
    """A lexer bound exceeded mid-output fails the lexer every copy of the grammar shares: that
    output's matcher rejects even EOS (never a "complete" output), and the next compile refuses it."""
    monkeypatch.setattr(backend, "limits", dataclasses.replace(backend.limits, max_lexer_states=100))
    constraint = RegexConstraint("[a-z]{0,300}")
    matcher = backend.compile(constraint).new_matcher()
    long_word = smollm_tokenizer.encode("ectable")
    for _ in range(40):
        allowed_tokens(backend, matcher)
        if matcher.error:
            break
        assert matcher.accept_token(long_word[0])
    assert matcher.error and "too many states" in matcher.error
    assert not matcher.accept_token(backend.tokenizer.eos_token_ids[0])
    with pytest.raises(GrammarTooComplexError, match="too many states"):
        backend.compile(constraint)


def test_choices_are_matched_literally(backend, smollm_tokenizer):
    """A choice list is one regex lexeme: every regex metacharacter, the slash that would end it,
    control characters and non-ASCII text in a choice stand for themselves."""
    choices = ("a.b", "a+b*?", "(x|y)", "[^z]{2}", "$^#&-~", "path/to\\file", "tab\there\nnext", "naïve ✓", "")
    compiled = backend.compile(ChoiceConstraint(choices))
    eos = backend.tokenizer.eos_token_ids[0]
    for choice in choices:
        tokens = smollm_tokenizer.encode(choice) + [eos]
        assert compiled.new_matcher().validate_tokens(tokens) == len(tokens), choice
    for near_miss in ("aXb", "x|y", "zz", "path/to/file", "tab"):
        tokens = smollm_tokenizer.encode(near_miss) + [eos]
        assert compiled.new_matcher().validate_tokens(tokens) < len(tokens), near_miss


def test_the_compile_cache_is_bounded_by_bytes_and_keeps_only_errors_of_failures():
    cache: CompileCache[str] = CompileCache(max_bytes=100, max_failures=2)
    keys = [CacheKey.of(f"start: {i}", GrammarLimits()) for i in range(5)]
    for key in keys[:3]:
        cache.keep(key, "compiled", 40)
    assert len(cache) == 2 and cache.nbytes == 80 and cache.compiled(keys[0]) is None
    assert cache.keep(keys[3], "too big to keep", 101) == 0 and cache.compiled(keys[3]) is None
    cache.remember_failure(keys[2], InvalidRegexError("bad"))
    assert cache.compiled(keys[2]) is None and cache.nbytes == 40
    assert isinstance(cache.failure(keys[2]), InvalidRegexError) and cache.failure(keys[2]).reason == "bad"
    for key in keys[3:]:
        cache.remember_failure(key, InvalidRegexError("bad"))
    assert cache.failure(keys[2]) is None  # the oldest failure forgotten beyond max_failures


def test_the_backend_keeps_compiled_grammars_within_its_byte_budget(smollm_tokenizer):
    """Lists of 3,000 choices (past the 2,000 Earley items a row that Lark alternatives would need)."""
    backend = create_grammar_backend(smollm_tokenizer, eos_token_ids=[2, 0], cache_bytes=4 * 2**20)
    try:
        for i in range(12):
            choices = tuple(f"list {i} item {j}" for j in range(3000))
            compiled = backend.compile(ChoiceConstraint(choices))
            assert backend.cache.nbytes <= 4 * 2**20
        tokens, finished = drive(backend, compiled.new_matcher(), seed=0)
        assert finished and smollm_tokenizer.decode(tokens) in choices
        assert 0 < len(backend.cache) < 12
    finally:
        backend.close()
