"""Structured outputs: constraining generation to a JSON schema, regex, choice, grammar or tool call.

`constraints` says what a request asks for; `backend` is the interface the engine uses (compile once,
fill a bitmask per step, accept tokens, roll back); `llguidance_backend` implements it; `bitmask`
applies a step's masks to the logits; `errors` are the 400s a bad constraint raises; `params` is
`SamplingParams.structured_outputs`. The modules that need torch load on first use, so that
sampling parameters stay importable without it.
"""

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
from depthserve.structured.params import StructuredOutputsParams, as_constraint
from depthserve.structured.errors import (
    GrammarCompileTimeoutError,
    GrammarTooComplexError,
    InvalidChoiceError,
    InvalidGrammarError,
    InvalidJsonSchemaError,
    InvalidRegexError,
    InvalidToolError,
    StructuredOutputError,
    UnsatisfiableConstraintError,
    UnsupportedJsonSchemaError,
)

__all__ = [
    "BitmaskFillWorker", "CompiledGrammar", "GrammarBackend", "GrammarLimits", "GrammarMatcher", "TokenizerInfo",
    "create_grammar_backend", "allocate_token_bitmask", "apply_token_bitmask_", "bitmask_words",
    "unpack_token_bitmask", "ChoiceConstraint", "Constraint", "GrammarConstraint", "JsonObjectConstraint",
    "JsonSchemaConstraint", "RegexConstraint", "ToolCallConstraint", "ToolSpec", "GrammarCompileTimeoutError",
    "GrammarTooComplexError", "InvalidChoiceError", "InvalidGrammarError", "InvalidJsonSchemaError",
    "InvalidRegexError", "InvalidToolError", "StructuredOutputError", "UnsatisfiableConstraintError",
    "UnsupportedJsonSchemaError",
    "StructuredOutputsParams", "as_constraint",
]

_LAZY = {
    "BitmaskFillWorker": "backend", "CompiledGrammar": "backend", "GrammarBackend": "backend",
    "GrammarLimits": "backend", "GrammarMatcher": "backend", "TokenizerInfo": "backend",
    "create_grammar_backend": "factory", "allocate_token_bitmask": "bitmask", "apply_token_bitmask_": "bitmask",
    "bitmask_words": "bitmask", "unpack_token_bitmask": "bitmask",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"depthserve.structured.{_LAZY[name]}"), name)
    raise AttributeError(name)
