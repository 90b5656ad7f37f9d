"""Structured outputs: constraining generation to a JSON schema, regex, choice, grammar or tool call.

`constraints` says what a request asks for; `backend` is the interface the engine uses (compile once,
fill a bitmask per step, accept tokens, roll back); `llguidance_backend` implements it; `bitmask`
applies a step's masks to the logits; `errors` are the 400s a bad constraint raises.
"""

from depthserve.structured.backend import (
    BitmaskFillWorker,
    CompiledGrammar,
    GrammarBackend,
    GrammarLimits,
    GrammarMatcher,
    TokenizerInfo,
)
from depthserve.structured.factory import create_grammar_backend
from depthserve.structured.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_,
    bitmask_words,
    unpack_token_bitmask,
)
from depthserve.structured.constraints import (
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    ToolCallConstraint,
    ToolSpec,
)
from depthserve.structured.errors import (
    GrammarCompileTimeoutError,
    GrammarTooComplexError,
    InvalidChoiceError,
    InvalidGrammarError,
    InvalidJsonSchemaError,
    InvalidRegexError,
    InvalidToolError,
    StructuredOutputError,
    UnsupportedJsonSchemaError,
)

__all__ = [
    "BitmaskFillWorker", "CompiledGrammar", "GrammarBackend", "GrammarLimits", "GrammarMatcher", "TokenizerInfo",
    "create_grammar_backend", "allocate_token_bitmask", "apply_token_bitmask_", "bitmask_words",
    "unpack_token_bitmask", "ChoiceConstraint", "Constraint", "GrammarConstraint", "JsonObjectConstraint",
    "JsonSchemaConstraint", "RegexConstraint", "ToolCallConstraint", "ToolSpec", "GrammarCompileTimeoutError",
    "GrammarTooComplexError", "InvalidChoiceError", "InvalidGrammarError", "InvalidJsonSchemaError",
    "InvalidRegexError", "InvalidToolError", "StructuredOutputError", "UnsupportedJsonSchemaError",
]
