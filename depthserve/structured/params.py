"""The structured-output option of `SamplingParams`, in vLLM's shape: exactly one of `json`,
`regex`, `choice`, `grammar` or `json_object`, turned into a `Constraint` (no torch here: sampling
parameters are read by torch-free modules)."""

from __future__ import annotations

import json as json_module
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from depthserve.structured import errors
from depthserve.structured.constraints import (
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)

FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's `StructuredOutputsParams`; set one field):

    - `json`: a JSON schema (a dict, a boolean, or its JSON text);
    - `regex`: a regular expression the whole output matches;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a Lark grammar (llguidance's dialect) or a GBNF grammar;
    - `json_object`: True for any JSON object.
    """

    json: Mapping[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> Constraint:
        given = [name for name in FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise errors.StructuredOutputError(
                f"set exactly one of {', '.join(FIELDS)}; got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            return JsonSchemaConstraint(_schema(self.json))
        if self.regex is not None:
            return RegexConstraint(self.regex)
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence):
                raise errors.InvalidChoiceError("choice must be a list of strings")
            return ChoiceConstraint(tuple(self.choice))
        if self.grammar is not None:
            return GrammarConstraint(self.grammar)
        return JsonObjectConstraint()


def _schema(value: Mapping[str, Any] | bool | str) -> Mapping[str, Any] | bool:
    if isinstance(value, str):
        try:
            value = json_module.loads(value)
        except ValueError as exc:
            raise errors.InvalidJsonSchemaError(f"the schema is not JSON: {exc}") from exc
    if not isinstance(value, (Mapping, bool)):
        raise errors.InvalidJsonSchemaError(f"a JSON schema is an object or a boolean, not {type(value).__name__}")
    return value


def as_constraint(value: StructuredOutputsParams | Constraint | None) -> Constraint | None:
    """A `SamplingParams.structured_outputs` value as the constraint it asks for (None: none)."""
    if value is None or isinstance(value, Constraint.__args__):
        return value
    if isinstance(value, StructuredOutputsParams):
        return value.constraint()
    raise errors.StructuredOutputError(
        f"structured_outputs must be a StructuredOutputsParams or a constraint, not {type(value).__name__}")
