"""Typed errors of structured outputs: a constraint that cannot be compiled, and why.

Every class is an `InvalidRequestError` (HTTP 400, OpenAI `invalid_request_error`), so the server
answers them like any other bad request. Each carries the `reason` (llguidance's own message, where
it gave one) and, once the caller knows it, the request `field` it came from: the backend compiles a
constraint without knowing whether it arrived as `response_format`, `tools` or `structured_outputs`,
so the server re-raises with `error.located("response_format.json_schema.schema")`.
"""

from __future__ import annotations

from typing import TypeVar

from depthserve.errors import InvalidRequestError

_E = TypeVar("_E", bound="StructuredOutputError")

# llguidance's messages quote the grammar and the parser state; a 400 body needs only the reason.
MAX_REASON_CHARS = 2000


class StructuredOutputError(InvalidRequestError):
    """A structured-output constraint (schema, regex, choice, grammar, tools) is unusable."""

    def __init__(self, reason: str, field: str | None = None):
        self.reason = reason.strip()[:MAX_REASON_CHARS]
        self.field = field
        super().__init__(f"{field}: {self.reason}" if field else self.reason)

    @property
    def param(self) -> str | None:
        """The field, as an OpenAI error body's `param`."""
        return self.field

    def located(self: _E, field: str) -> _E:
        """The same error, naming the request field the constraint came from."""
        return type(self)(self.reason, field)


class InvalidJsonSchemaError(StructuredOutputError):
    """The JSON schema is malformed: not an object, an unknown type, a dangling `$ref`, a bad pattern."""


class UnsupportedJsonSchemaError(InvalidJsonSchemaError):
    """The JSON schema uses a keyword or format the grammar engine cannot enforce (e.g. `not`)."""


class InvalidRegexError(StructuredOutputError):
    """The regular expression does not compile (or uses look-around, which cannot be enforced)."""


class InvalidChoiceError(StructuredOutputError):
    """The choice list is empty or holds something other than strings."""


class InvalidGrammarError(StructuredOutputError):
    """The Lark (or GBNF) grammar does not compile."""


class InvalidToolError(StructuredOutputError):
    """A tool's name is not a function name, or its `parameters` are not a usable JSON schema."""


class UnsatisfiableConstraintError(StructuredOutputError):
    """No output satisfies the constraint: a grammar whose language is empty, a schema whose only
    definition is itself. Found by the first-token check of compiling."""


class GrammarTooComplexError(StructuredOutputError):
    """The constraint exceeds a size bound (text length, choices, grammar symbols, lexer fuel, parser
    items), when compiled or at its first token."""


class GrammarCompileTimeoutError(GrammarTooComplexError):
    """Compiling the constraint took longer than the backend's time bound."""
