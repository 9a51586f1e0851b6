"""StructuredOutputsParams -> an llguidance grammar (its JSON text), checked without a tokenizer.

SamplingParams calls `check_structured_outputs` on every construction, so the grammar of
each distinct constraint is built and validated once (about 0.3-5 ms) and then cached;
the engine's matchers start from the same cached text.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from jaxllm.sampling_params import StructuredOutputsParams

# Distinct constraints kept; a grammar text is a few KB, so this bounds the cache to a few MB.
_CACHED_GRAMMARS = 1024


def constraint_kind(params: StructuredOutputsParams) -> str:
    """The field that holds the constraint: json, regex, choice, grammar or json_object."""
    for kind in ("json", "regex", "choice", "grammar"):
        if getattr(params, kind) is not None:
            return kind
    return "json_object"


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raises ValueError("structured_outputs.<kind>: <llguidance's message>") on a bad JSON
    schema, regex, choice or Lark grammar, and on one that no output can match."""
    grammar_text(params)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params`, validated (cached by the constraint's text)."""
    kind = constraint_kind(params)
    if kind == "json" and isinstance(params.json, str):
        source = params.json
    elif kind == "json":
        # Keyed by its text in the user's key order: property order is output order.
        try:
            source = json.dumps(params.json)
        except (TypeError, ValueError) as e:  # a value JSON cannot hold, a circular reference
            raise ValueError(f"structured_outputs.json: {e}") from None
    elif kind == "json_object":
        source = '{"type": "object"}'
    elif kind == "choice":
        source = json.dumps(params.choice)
    else:
        source = getattr(params, kind)
    json_options = (params.disable_any_whitespace, params.disable_additional_properties,
                    params.whitespace_pattern) if kind in ("json", "json_object") else None
    return _grammar(kind, source, json_options)


@lru_cache(maxsize=_CACHED_GRAMMARS)
def _grammar(kind: str, source: str, json_options: tuple | None) -> str:
    try:
        if kind in ("json", "json_object"):
            grammar = _json_grammar(source, *json_options)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        elif kind == "choice":
            # Each choice as a Lark string literal; json.dumps escapes quotes and backslashes.
            alternatives = " | ".join(json.dumps(choice) for choice in json.loads(source))
            grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        else:
            # llguidance's Lark, or a GBNF grammar (what vLLM's xgrammar backend takes) converted to it.
            grammar = llguidance.grammar_from("grammar", source)
    except ValueError as e:  # not JSON, a GBNF that does not convert
        raise ValueError(f"structured_outputs.{kind}: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"structured_outputs.{kind}: {messages[0].strip()}")
    if _matches_nothing(grammar):
        raise ValueError(f"structured_outputs.{kind}: no output can match it (not even an empty one): "
                         f"{source[:200]!r}")
    return grammar


class _ByteVocabulary:
    """A vocabulary of the 256 bytes and an EOS (id 256): what llguidance needs to run a
    grammar without the model's tokenizer."""
    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([b]) for b in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@lru_cache(maxsize=1)
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


def _matches_nothing(grammar: str) -> bool:
    r"""Whether no string fits the grammar, as llguidance tells at its first step: over a
    vocabulary of single bytes, a grammar that neither accepts the empty string nor lets
    any byte start a match stops with "NoExtension". (validate_grammar does not tell: a
    regex of an empty class such as [^\s\S] validates, then ends every output at once.) A
    language that only dies later (Lark's `start: "a" x` with x unproductive) is not seen."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    matcher.compute_bitmask()
    return matcher.is_error() and matcher.get_error().startswith("NoExtension")


def _json_grammar(schema_text: str, disable_any_whitespace: bool, disable_additional_properties: bool,
                  whitespace_pattern: str | None) -> str:
    options = {}
    if disable_any_whitespace:
        options["whitespace_flexible"] = False
    if whitespace_pattern is not None:
        options["whitespace_pattern"] = whitespace_pattern
    schema = json.loads(schema_text)
    if disable_additional_properties:
        schema = _close_objects(schema)
    # As overrides: the request's options win over a schema's own "x-guidance" options.
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options or None)


# Keywords whose value is a subschema, a list of them, or a name -> subschema map.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _close_objects(schema):
    """A copy of `schema` where every object schema that does not say otherwise gets
    "additionalProperties": false (llguidance, as JSON Schema, allows extra keys by default).
    Only subschemas are walked: an enum's or a const's value is data and stays as it is."""
    if not isinstance(schema, dict):
        return schema  # true / false
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if key in schema:
            closed[key] = _close_objects(schema[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            closed[key] = [_close_objects(item) for item in schema[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: _close_objects(item) for name, item in schema[key].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed
