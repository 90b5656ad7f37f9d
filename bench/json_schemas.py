"""JSON schemas drawn with hypothesis, and instances of them drawn with hypothesis-jsonschema: the
workload of bench/structured_outputs.py and of tests/test_structured_engine.py.

A schema is an object with 1-4 properties, each a bounded integer or number, an enum of strings, a
boolean, a short string, an array of those (bounded length) or a nested object of them, with
`required` and `additionalProperties: false`; now and then the nested object is moved under `$defs`
and referenced with `$ref`. Strings are short so that a small model can finish an output.
"""

from __future__ import annotations

import copy
import json
from decimal import Decimal
from typing import Any

import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

WORDS = ("name", "age", "city", "tags", "score", "id", "active", "color", "items", "size")


def _leaf() -> st.SearchStrategy[dict]:
    bounded = st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(lambda t: (t[0], t[0] + t[1]))
    return st.one_of(
        bounded.map(lambda b: {"type": "integer", "minimum": b[0], "maximum": b[1]}),
        bounded.map(lambda b: {"type": "number", "minimum": b[0], "maximum": b[1]}),
        st.lists(st.sampled_from(["red", "green", "blue", "small", "large", "yes", "no"]), min_size=1, max_size=4,
                 unique=True).map(lambda values: {"enum": values}),
        st.just({"type": "boolean"}),
        st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
    )


def _object(values: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    @st.composite
    def build(draw) -> dict:
        names = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=4, unique=True))
        properties = {name: draw(values) for name in names}
        required = [name for name in names if draw(st.booleans())] or names[:1]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return build()


def _array(items: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(items, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


@st.composite
def json_schemas(draw) -> dict:
    """One object schema (module docstring)."""
    schema = draw(_object(st.one_of(_leaf(), _array(_leaf()), _object(_leaf()))))
    nested = [name for name, sub in schema["properties"].items() if sub.get("type") == "object"]
    if nested and draw(st.booleans()):
        schema["$defs"] = {"Inner": schema["properties"][nested[0]]}
        schema["properties"][nested[0]] = {"$ref": "#/$defs/Inner"}
    return schema


def _examples(strategy: st.SearchStrategy, count: int, seed: int) -> list[Any]:
    """The first `count` distinct examples hypothesis generates from `strategy` with this seed (its
    first example is the simplest one; the later ones vary)."""
    seen: dict[str, Any] = {}

    @hypothesis.seed(seed)
    @settings(max_examples=10 * count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(value) -> None:
        if len(seen) < count:
            seen.setdefault(json.dumps(value, sort_keys=True), value)

    draw()
    return list(seen.values())


def draw_schemas(count: int, seed: int = 0) -> list[dict]:
    """`count` distinct schemas, the same for the same seed."""
    schemas = _examples(json_schemas(), count, seed)
    if len(schemas) < count:
        raise RuntimeError(f"hypothesis produced {len(schemas)} distinct schemas, not {count}")
    return schemas


def draw_instance(schema: dict, seed: int = 0) -> Any:
    """A value valid against `schema`, drawn by hypothesis-jsonschema: the last of its first few
    examples whose strings hold no character of Unicode planes 4-13, where no character is assigned
    and llguidance's JSON strings allow none (its first example, the simplest, always qualifies)."""
    examples = _examples(from_schema(copy.deepcopy(schema)), 4, seed)  # from_schema rewrites its argument
    return next(value for value in reversed(examples) if not _unassigned_planes(json.dumps(value, ensure_ascii=False)))


def _unassigned_planes(text: str) -> bool:
    return any(0x40000 <= ord(char) < 0xE0000 for char in text)


def as_generated_json(value: Any, schema: dict) -> str:
    """`value` written as the grammar has the model write JSON: an object's properties in the order
    the schema declares them (llguidance's order), json.dumps's separators, numbers without an
    exponent (llguidance's bounded numbers have none), characters past ASCII as themselves
    (llguidance takes a `\\u` escape only where JSON requires one, and DEL only escaped)."""
    return _write(_in_schema_order(value, schema, schema))


def _write(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_write(key)}: {_write(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_write(item) for item in value) + "]"
    if isinstance(value, float):
        return format(Decimal(repr(value)), "f")
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _in_schema_order(value: Any, schema: Any, root: dict) -> Any:
    if isinstance(schema, dict) and "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
    if isinstance(value, dict) and isinstance(schema, dict):
        declared = list(schema.get("properties", {}))
        keys = sorted(value, key=lambda k: declared.index(k) if k in declared else len(declared))
        return {k: _in_schema_order(value[k], schema.get("properties", {}).get(k), root) for k in keys}
    if isinstance(value, list) and isinstance(schema, dict):
        return [_in_schema_order(item, schema.get("items"), root) for item in value]
    return value
