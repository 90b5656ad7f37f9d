"""The grammar backend implemented with llguidance (JSON schema, regex, Lark/GBNF grammars).

llguidance compiles a constraint into an Earley parser over a lazily built lexer DFA and computes a
token mask by walking the tokenizer's trie: tens of microseconds per token, with the GIL released.
Its tokenizer side (`LLTokenizer`) is built once per model from the engine's own Hugging Face
tokenizer, costing about two seconds for a 49k vocabulary.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from depthserve.structured import errors
from depthserve.structured.backend import GrammarLimits, TokenizerInfo
from depthserve.structured.bitmask import allocate_token_bitmask, bitmask_words, unpack_token_bitmask
from depthserve.structured.compile_cache import CacheKey, CompileCache
from depthserve.structured.native_heap import heap_bytes_in_use, release_free_heap
from depthserve.structured.constraints import (
    TOOL_NAME_PATTERN,
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    ToolCallConstraint,
    ToolSpec,
)

# llguidance reports an exceeded compile or step bound with one of these phrases ("too many
# expressions constructed": lexer fuel; "Too many items", "Current row has N items; max is M": parser).
_OVER_BOUND = re.compile(r"too big|too complex|too many|limit for this|fuel|max is \d", re.IGNORECASE)
# ... and a grammar that can write nothing at all (its parser stops before the first byte) thus.
_NO_OUTPUT = re.compile(r"^\s*NoExtension")
# Rust regex metacharacters, and the slash that ends a Lark regex literal.
_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$#&-~/")
# ... and a schema feature it cannot enforce with one of these.
_UNSUPPORTED_SCHEMA = re.compile(r"unimplemented|unknown format|not supported|unsupported", re.IGNORECASE)


# ---- tokenizer ---------------------------------------------------------------------------------
def build_llguidance_tokenizer(
    hf_tokenizer: Any, eos_token_ids: Sequence[int] | None = None
) -> tuple[llguidance.LLTokenizer, TokenizerInfo]:
    """llguidance's view of a Hugging Face tokenizer (a `transformers` fast tokenizer or a
    `tokenizers.Tokenizer`), and the facts it was built with. `eos_token_ids` default: the
    tokenizer's EOS token; the engine passes its own set (the model config's EOS ids as well)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", hf_tokenizer)
    if not hasattr(backend, "to_str"):
        raise TypeError(f"a Hugging Face fast tokenizer is needed, not {type(hf_tokenizer).__name__}")
    spec = json.loads(backend.to_str())
    # Padding and truncation are encode-time settings; llguidance's tokenizer must not apply them.
    spec["padding"] = None
    spec["truncation"] = None
    if eos_token_ids is None:
        eos = getattr(hf_tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer names no EOS token; pass eos_token_ids")
        eos_token_ids = [eos]
    eos_ids = tuple(sorted(set(int(token) for token in eos_token_ids)))
    if not eos_ids:
        raise ValueError("at least one EOS token id is needed")
    special = tuple(sorted(token["id"] for token in spec.get("added_tokens", []) if token.get("special")))
    if spec.get("decoder") is not None:
        lltokenizer = llguidance.LLTokenizer(json.dumps(spec), eos_token=list(eos_ids))
    else:  # llguidance reads token bytes from a byte-level or byte-fallback decoder; here there is none
        lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTexts(backend, eos_ids, special)),
                                             eos_token=list(eos_ids))
    return lltokenizer, TokenizerInfo(lltokenizer.vocab_size, eos_ids, special)


class _TokenTexts:
    """A tokenizer without a decoder (the demo models' word-level ones) as llguidance's
    TokenizerWrapper reads it: each token's bytes are its own text, so a constraint sees the tokens
    concatenated without the separators such a tokenizer puts between them when it decodes."""

    def __init__(self, backend: Any, eos_ids: tuple[int, ...], special: tuple[int, ...]):
        size = backend.get_vocab_size(with_added_tokens=True)
        self.tokens = [(backend.id_to_token(i) or "").encode("utf-8") for i in range(size)]
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = None
        self.special_token_ids = list(special)
        self._backend = backend

    def __call__(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids


# ---- constraint -> llguidance grammar text -----------------------------------------------------
def _json_options(flexible_whitespace: bool) -> dict[str, Any]:
    # lenient=False: a keyword llguidance cannot enforce is an error, never silently ignored.
    if flexible_whitespace:
        return {"whitespace_flexible": True, "lenient": False}
    # Small models given free whitespace can emit it forever; the separators are json.dumps's.
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}


def _schema_text(schema: Any, error: type[errors.StructuredOutputError]) -> str:
    if not isinstance(schema, (Mapping, bool)):
        raise error(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise error(f"the schema is not JSON: {exc}") from exc


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_schema_grammar(schema: Any, options: dict[str, Any]) -> str:
    text = _schema_text(schema, errors.InvalidJsonSchemaError)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options)
    except ValueError as exc:
        raise errors.InvalidJsonSchemaError(str(exc)) from exc


def _regex_literal(text: str) -> str:
    """`text` as a Rust regex matching exactly it, safe inside a Lark `/.../` literal."""
    return "".join("\\" + char if char in _REGEX_SPECIAL
                   else f"\\x{{{ord(char):x}}}" if char < " " or char == "\x7f" else char for char in text)


def _choice_grammar(choices: Sequence[Any], limits: GrammarLimits) -> str:
    if isinstance(choices, str) or not choices:
        raise errors.InvalidChoiceError("the choice list must be a non-empty list of strings")
    if len(choices) > limits.max_choices:
        raise errors.GrammarTooComplexError(f"{len(choices)} choices; the limit is {limits.max_choices}")
    if not all(isinstance(choice, str) for choice in choices):
        raise errors.InvalidChoiceError("every choice must be a string")
    # One lexeme for the whole list: as Lark alternatives, each choice would be an Earley item of the
    # start row, and a list past llguidance's 2,000 items a row fails at its first token.
    return llguidance.LLMatcher.grammar_from_lark("start: /(" + "|".join(_regex_literal(c) for c in choices) + ")/")


def _regex_grammar(pattern: Any) -> str:
    if not isinstance(pattern, str):
        raise errors.InvalidRegexError("the regex must be a string")
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
        # llguidance's regex-to-Lark conversion drops it, which would leave a different regex
        raise errors.InvalidRegexError("the regex ends in a lone backslash, which escapes nothing")
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def _lark_grammar(text: Any) -> str:
    if not isinstance(text, str) or not text.strip():
        raise errors.InvalidGrammarError("the grammar must be a non-empty string")
    try:
        lark = any_to_lark(text)  # GBNF (llama.cpp's `::=` rules) converted; Lark passes through
    except Exception as exc:  # the converter raises bare Exceptions on malformed GBNF
        raise errors.InvalidGrammarError(f"the GBNF grammar does not convert: {exc}") from exc
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _tool_arguments_schema(tool: ToolSpec, options: dict[str, Any]) -> str:
    if not isinstance(tool.name, str) or not re.match(TOOL_NAME_PATTERN, tool.name):
        raise errors.InvalidToolError(f"tool name {tool.name!r} must match {TOOL_NAME_PATTERN}")
    if tool.parameters is None:  # OpenAI: omitted parameters mean a function without arguments
        parameters: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
    elif isinstance(tool.parameters, Mapping):
        parameters = dict(tool.parameters)
    else:
        raise errors.InvalidToolError(f"tool {tool.name!r}: parameters must be a JSON schema object")
    if parameters.get("type", "object") != "object":
        raise errors.InvalidToolError(f"tool {tool.name!r}: parameters must describe an object")
    # The schema stays the root of its own %json block, so its "#/$defs/..." references resolve.
    parameters["x-guidance"] = options
    return _schema_text(parameters, errors.InvalidToolError)


def _tool_call_grammar(constraint: ToolCallConstraint, options: dict[str, Any]) -> str:
    tools = tuple(constraint.tools)
    if not tools:
        raise errors.InvalidToolError("no tools to call")
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise errors.InvalidToolError(f"tool names must be unique: {names}")
    open_tag, close_tag = constraint.tags
    lines = ["%llguidance {}"]
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    lines.append(f"call: {calls}")
    for i, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
        lines.append(f"call_{i}: {_lark_literal(head)} args_{i} \"}}\"")
        lines.append(f"args_{i}: %json {_tool_arguments_schema(tool, options)}")
    body_end = _lark_literal("\n" + close_tag)
    more_calls = f' ({_lark_literal(chr(10))} block)*' if constraint.parallel_calls else ""
    lines.append(f"block: {_lark_literal(open_tag + chr(10))} call {body_end}")
    if constraint.require_call:
        lines.append(f"start: block{more_calls}")
    else:
        # Free text cannot contain the opening tag; the first block's tag ends the text lazily, so
        # once the model writes it the call that follows is enforced.
        lines.append(f"start: TEXT | first_block{more_calls}")
        lines.append(f"first_block: text_then_tag {_lark_literal(chr(10))} call {body_end}")
        lines.append(f"text_then_tag[lazy]: TEXT {_lark_literal(open_tag)}")
        lines.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(open_tag)}(?s:.*)/")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines))


def constraint_grammar(constraint: Constraint, flexible_json_whitespace: bool = False,
                       limits: GrammarLimits = GrammarLimits()) -> str:
    """llguidance's grammar text for `constraint` (not yet compiled: `LLGuidanceBackend.compile`)."""
    options = _json_options(flexible_json_whitespace)
    if isinstance(constraint, JsonSchemaConstraint):
        return _json_schema_grammar(constraint.schema, options)
    if isinstance(constraint, JsonObjectConstraint):
        return _json_schema_grammar({"type": "object"}, options)
    if isinstance(constraint, RegexConstraint):
        return _regex_grammar(constraint.pattern)
    if isinstance(constraint, ChoiceConstraint):
        return _choice_grammar(constraint.choices, limits)
    if isinstance(constraint, GrammarConstraint):
        return _lark_grammar(constraint.grammar)
    if isinstance(constraint, ToolCallConstraint):
        return _tool_call_grammar(constraint, options)
    raise TypeError(f"not a constraint: {type(constraint).__name__}")


def _compile_error(constraint: Constraint, message: str) -> errors.StructuredOutputError:
    message = message.replace("<non-verbose/>", "").strip()  # llguidance's mark that details were left out
    if _NO_OUTPUT.match(message):
        return errors.UnsatisfiableConstraintError(f"no output satisfies the constraint ({message.split()[0]})")
    if _OVER_BOUND.search(message):
        return errors.GrammarTooComplexError(message)
    if isinstance(constraint, (JsonSchemaConstraint, JsonObjectConstraint)):
        unsupported = _UNSUPPORTED_SCHEMA.search(message)
        return (errors.UnsupportedJsonSchemaError if unsupported else errors.InvalidJsonSchemaError)(message)
    if isinstance(constraint, RegexConstraint):
        return errors.InvalidRegexError(message)
    if isinstance(constraint, ChoiceConstraint):
        return errors.InvalidChoiceError(message)
    if isinstance(constraint, ToolCallConstraint):
        return errors.InvalidToolError(message)
    return errors.InvalidGrammarError(message)


# ---- compiled grammar and matcher --------------------------------------------------------------
class LLGuidanceMatcher:
    """One sequence's constraint state (see `backend.GrammarMatcher`)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _check_bitmask(bitmask, row + 1)
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def accept_token(self, token_id: int) -> bool:
        # A matcher past a per-step bound lets only EOS through its mask; accepting it would end
        # the output as if complete.
        return not self._matcher.is_error() and self._matcher.consume_token(int(token_id))

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        return self._matcher.validate_tokens([int(token) for token in token_ids])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error() or 'too many'}")

    def is_finished(self) -> bool:
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def eos_allowed(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._matcher.deep_copy())


@dataclass(frozen=True)
class LLGuidanceGrammar:
    """A compiled constraint: a matcher at its start, copied for each sequence (compile once)."""

    constraint: Constraint
    grammar: str
    _template: llguidance.LLMatcher

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


def _check_bitmask(bitmask: torch.Tensor, rows: int, words: int | None = None) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
    if bitmask.dim() != 2 or bitmask.shape[0] < rows or (words is not None and bitmask.shape[1] != words):
        raise ValueError(f"bitmask of shape {tuple(bitmask.shape)} cannot hold {rows} rows of {words} words")


# ---- the backend ---------------------------------------------------------------------------------
def _first_steps_problem(template: llguidance.LLMatcher, tokenizer: TokenizerInfo) -> str | None:
    """What goes wrong for a fresh matcher at its first mask, its first token or the mask after it
    (None: nothing). llguidance builds its lexer and parser rows lazily, so a constraint that can
    write nothing, or whose first steps exceed a bound, compiles without error and fails only here;
    these faults are the constraint's, so they are found before admission."""
    matcher = template.deep_copy()
    bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
    row = bitmask[0]
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    if matcher.is_error():
        return matcher.get_error()
    allowed = unpack_token_bitmask(bitmask, tokenizer.vocab_size)[0]
    allowed[list(tokenizer.eos_token_ids)] = False
    tokens = torch.nonzero(allowed).flatten()
    if tokens.numel() == 0:  # only the end: fine where the empty output satisfies the constraint
        return None if matcher.is_accepting() else "NoExtension: no token can start the output"
    if not matcher.consume_token(int(tokens[0])) or matcher.is_error():
        return matcher.get_error() or f"its first allowed token {int(tokens[0])} is rejected"
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    return matcher.get_error() if matcher.is_error() else None


@dataclass(frozen=True)
class _Built:
    """A compile job's outcome: the template and its heap bytes, or llguidance's reason it failed."""

    template: llguidance.LLMatcher | None
    nbytes: int
    problem: str | None


class LLGuidanceBackend:
    """A `GrammarBackend` for one model's tokenizer (build it once; it is thread-safe).

    Compiled grammars are cached within `cache_bytes` (their lexers are most of it: from a few kB to
    hundreds of MB for a hostile regex); the last `cached_failures` constraints that failed keep only
    their error, so a repeat is refused at once with the same 400."""

    def __init__(
        self,
        hf_tokenizer: Any,
        eos_token_ids: Sequence[int] | None = None,
        limits: GrammarLimits = GrammarLimits(),
        flexible_json_whitespace: bool = False,
        mask_threads: int = 1,
        cache_bytes: int = 256 * 2**20,
        cached_failures: int = 1024,
        compile_threads: int = 2,
    ):
        self._lltokenizer, self.tokenizer = build_llguidance_tokenizer(hf_tokenizer, eos_token_ids)
        self.limits = limits
        self.flexible_json_whitespace = flexible_json_whitespace
        self.words = bitmask_words(self.tokenizer.vocab_size)
        self._executor = llguidance.LLExecutor(num_threads=mask_threads)
        self._compile_pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="depthserve-grammar-compile")
        self.cache: CompileCache[llguidance.LLMatcher] = CompileCache(cache_bytes, cached_failures)

    def _parser_limits(self) -> llguidance.LLParserLimits:
        bounds = self.limits
        return llguidance.LLParserLimits(
            max_grammar_size=bounds.max_grammar_symbols, initial_lexer_fuel=bounds.initial_lexer_fuel,
            step_lexer_fuel=bounds.step_lexer_fuel, step_max_items=bounds.step_max_items,
            max_lexer_states=bounds.max_lexer_states,
            verbose_errors=False,  # a 400 body names the reason, not the parser's internal state
        )

    def compile(self, constraint: Constraint) -> LLGuidanceGrammar:
        grammar = constraint_grammar(constraint, self.flexible_json_whitespace, self.limits)
        if len(grammar) > self.limits.max_constraint_chars:
            raise errors.GrammarTooComplexError(
                f"the constraint is {len(grammar)} characters long; the limit is {self.limits.max_constraint_chars}")
        key = CacheKey.of(grammar, self.limits)
        failure = self.cache.failure(key)
        if failure is not None:
            raise failure
        template = self.cache.compiled(key)
        if template is not None:
            # A request that ran past a lexer bound leaves the shared lexer failed for every copy.
            problem = _first_steps_problem(template, self.tokenizer)
            if problem is not None:
                raise self._failed(key, _compile_error(constraint, problem))
            return LLGuidanceGrammar(constraint, grammar, template)
        built = self._compile_with_deadline(key, constraint, grammar)
        if built.problem is not None:
            raise self._failed(key, _compile_error(constraint, built.problem))
        if self.cache.keep(key, built.template, max(built.nbytes, len(grammar))):
            release_free_heap()
        return LLGuidanceGrammar(constraint, grammar, built.template)

    def _failed(self, key: CacheKey, error: errors.StructuredOutputError) -> errors.StructuredOutputError:
        self.cache.remember_failure(key, error)
        release_free_heap()  # the failed lexer's pages, back from the compile thread's arena
        return error

    def _build(self, grammar: str, abandoned: threading.Event) -> _Built:
        """The compile job: the matcher, then its first steps (both bounded by the parser limits)."""
        before = heap_bytes_in_use()
        template = llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0, limits=self._parser_limits())
        problem = template.get_error() if template.is_error() else _first_steps_problem(template, self.tokenizer)
        after = heap_bytes_in_use()
        if problem is not None or abandoned.is_set():
            del template
            release_free_heap()
            return _Built(None, 0, problem or "abandoned")
        # Other compile threads allocate meanwhile: an estimate, which the text length floors.
        return _Built(template, 0 if before is None or after is None else max(0, after - before), None)

    def _compile_with_deadline(self, key: CacheKey, constraint: Constraint, grammar: str) -> _Built:
        # llguidance builds with the GIL released; on a timeout the job runs on (its fuel bounds end
        # it) and frees what it built, but the caller is answered at once and a job still queued is
        # cancelled.
        abandoned = threading.Event()
        future: Future[_Built] = self._compile_pool.submit(self._build, grammar, abandoned)
        try:
            return future.result(timeout=self.limits.compile_timeout_s)
        except FutureTimeoutError:
            abandoned.set()
            future.cancel()
            raise self._failed(key, errors.GrammarCompileTimeoutError(
                f"compiling the constraint took longer than {self.limits.compile_timeout_s:g} s")) from None

    def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
        return allocate_token_bitmask(rows, self.tokenizer.vocab_size, pin_memory)

    def fill_bitmask(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor) -> None:
        if not matchers:
            return
        _check_bitmask(bitmask, len(matchers), self.words)
        rows = [(matcher._matcher, row) for row, matcher in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])

    def close(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
