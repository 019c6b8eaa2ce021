"""``response_format``: structured outputs, compiled at the edge into a grammar.

``{"type": "json_object"}`` is any JSON object; ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`` is JSON that validates against
the schema. Either becomes an llguidance grammar (model/constraint.py) that the
route's last hop samples under, so even a small model's answer parses (or stops
at ``max_tokens`` with ``finish_reason: "length"``).

``strict: true`` compiles the schema as written, refusing a keyword the engine
does not implement; otherwise such keywords are ignored (the output still
follows every keyword the engine knows). A schema the engine refuses, or one
past the size bound, is a 400 naming ``response_format``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field

from meshnet.errors import FieldError
from meshnet.model.constraint import Constraint, check_grammar

if TYPE_CHECKING:  # a TypedDict of llguidance's stubs only, absent at run time
    from llguidance._lib import JsonCompileOptions

MAX_SCHEMA_CHARS = 64 * 1024  # a schema as JSON text
PARAM = "response_format"

# Compact JSON: a small model left free to add whitespace may add nothing else.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``, as OpenAI defines it."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(default=None, max_length=4096)
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = False


class ResponseFormat(BaseModel):
    """The request's ``response_format``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    def grammar(self) -> str | None:
        """llguidance's grammar for this format; None for free text.

        Raises ``FieldError`` (400, ``response_format``) for a schema too large or
        one that is not a JSON object."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return json_grammar({"type": "object"}, strict=False)
        if self.json_schema is None:
            raise FieldError(PARAM, "type json_schema needs a json_schema object")
        spec = self.json_schema
        return json_grammar(spec.json_schema or {"type": "object"}, bool(spec.strict))


def json_grammar(schema: dict[str, Any], strict: bool) -> str:
    """The grammar of JSON text valid under ``schema`` (unknown keywords refused when
    ``strict``, ignored otherwise)."""
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        limit = MAX_SCHEMA_CHARS
        raise FieldError(PARAM, f"the schema has {len(text)} characters, at most {limit}")
    options: JsonCompileOptions = {**_JSON_OPTIONS, "lenient": not strict}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)
    except ValueError as e:
        raise FieldError(PARAM, f"the schema is not usable: {e}") from None


def constraint_of(
    grammar: str, tokenizer: llguidance.LLTokenizer, start: int, param: str = PARAM
) -> Constraint:
    """``grammar`` over the ids sampled from position ``start``, checked to compile
    for this vocabulary (``FieldError`` naming ``param``, the field it came from, if not)."""
    why = check_grammar(grammar, tokenizer)
    if why:
        raise FieldError(param, f"the schema cannot be enforced: {why}")
    return Constraint(grammar, start, tokenizer)
