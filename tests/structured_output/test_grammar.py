"""Structured outputs on the host: llguidance's checks at SamplingParams construction, and
matchers over the embedded SmolLM2-135M-Instruct tokenizer driven by random logits (a
stand-in model: whatever it prefers, the mask must keep the output inside the grammar)."""
import json
import re

import jsonschema
import numpy as np
import pytest

from jaxllm.models.gguf import find_default_model, load_gguf_tokenizer
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams
from jaxllm.structured_output import (GrammarCompiler, apply_bitmask_numpy, bitmask_words, fill_bitmasks,
                                      check_structured_outputs, grammar_text)

PADDED_VOCAB = 49152 + 77  # the model's logits wider than SmolLM2's 49152 tokens, not a multiple of 32
MAX_TOKENS = 200

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "floor": {"type": "integer",
                                                                                      "minimum": 0, "maximum": 9}},
            "required": ["zip", "floor"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
DATE_REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(find_default_model())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, PADDED_VOCAB, (tokenizer.eos_token_id,))


def allowed_ids(row: np.ndarray) -> np.ndarray:
    """The token ids a bitmask row [W] int32 allows."""
    bits = (row[:, None] >> np.arange(32, dtype=np.int32)) & 1
    return np.flatnonzero(bits.reshape(-1))


def generate(compiler, params, seed, preferred_ids=()):
    """Greedy tokens of random logits [1, PADDED_VOCAB] under the grammar, up to EOS or
    MAX_TOKENS; `preferred_ids` get +3 (about the max of 49k normal logits)."""
    rng = np.random.default_rng(seed)
    matcher = compiler.matcher(params)
    bitmask = np.zeros((1, bitmask_words(PADDED_VOCAB)), np.int32)
    tokens = []
    while len(tokens) < MAX_TOKENS and (not tokens or tokens[-1] != compiler.eos_token_id):
        matcher.fill_bitmask(bitmask[0])
        logits = rng.standard_normal((1, PADDED_VOCAB), dtype=np.float32)
        logits[0, list(preferred_ids)] += 3.0
        token = int(np.argmax(apply_bitmask_numpy(logits, bitmask)[0]))
        assert matcher.accept_token(token)
        tokens.append(token)
    assert matcher.num_accepted == len(tokens)
    return tokens


def text_before_eos(tokenizer, compiler, tokens):
    assert tokens[-1] == compiler.eos_token_id, f"no EOS in {MAX_TOKENS} tokens: {tokenizer.decode(tokens)!r}"
    return tokenizer.decode(tokens[:-1])


# check_structured_outputs


@pytest.mark.parametrize("kwargs", [dict(json=PERSON_SCHEMA), dict(json=json.dumps(PERSON_SCHEMA)),
                                    dict(regex=DATE_REGEX), dict(choice=CHOICES), dict(json_object=True),
                                    dict(grammar='start: "x" NUMBER\nNUMBER: /[0-9]+/')])
def test_valid_constraints_pass(kwargs):
    check_structured_outputs(StructuredOutputsParams(**kwargs))


@pytest.mark.parametrize("kind, value, message", [
    ("regex", "(", "unclosed group"),
    ("json", {"type": "no-such-type"}, "no-such-type"),
    ("json", "{not json", ""),
    ("json", {"default": object()}, "not JSON serializable"),
    ("grammar", "start: undefined_rule", "undefined_rule"),
])
def test_bad_constraint_raises_naming_the_kind(kind, value, message):
    with pytest.raises(ValueError, match=rf"(?s)^structured_outputs\.{kind}: .*{message}"):
        StructuredOutputsParams(**{kind: value})


def test_sampling_params_with_a_bad_regex_raises_at_construction():
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="("))


@pytest.mark.parametrize("kind, value", [("regex", r"[^\s\S]"), ("regex", r"ab[^\s\S]c"),
                                         ("grammar", 'start: x\nx: x "a"')])
def test_a_constraint_no_output_can_match_is_refused(kind, value):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind}: no output can match it"):
        SamplingParams(structured_outputs=StructuredOutputsParams(**{kind: value}))


@pytest.mark.parametrize("kwargs", [dict(regex=""), dict(regex="a{0}"), dict(grammar='start: ""'),
                                    dict(grammar="start: <|eot_id|>")])  # the model's tokenizer has it, perhaps
def test_a_constraint_only_the_empty_output_or_a_special_token_matches_is_not_refused(kwargs):
    check_structured_outputs(StructuredOutputsParams(**kwargs))


def test_grammar_is_built_once_per_constraint_text():
    first = grammar_text(StructuredOutputsParams(json=dict(PERSON_SCHEMA)))
    assert grammar_text(StructuredOutputsParams(json=dict(PERSON_SCHEMA))) is first


# Generation under the mask


@pytest.mark.parametrize("seed", range(20))
def test_json_schema_output_validates(tokenizer, compiler, seed):
    # Compact and closed: random logits would otherwise pick whitespace and new keys forever.
    params = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True,
                                     disable_additional_properties=True)
    text = text_before_eos(tokenizer, compiler, generate(compiler, params, seed))
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_regex_output_full_matches(tokenizer, compiler):
    for seed in range(5):
        text = text_before_eos(tokenizer, compiler, generate(compiler, StructuredOutputsParams(regex=DATE_REGEX), seed))
        assert re.fullmatch(DATE_REGEX, text), text


def test_choice_output_is_one_of_the_choices(tokenizer, compiler):
    for seed in range(5):
        text = text_before_eos(tokenizer, compiler, generate(compiler, StructuredOutputsParams(choice=CHOICES), seed))
        assert text in CHOICES


@pytest.mark.parametrize("grammar, pattern", [
    ('start: "x=" NUMBER "," NUMBER\nNUMBER: /[0-9]{1,3}/', r"x=[0-9]{1,3},[0-9]{1,3}"),  # Lark
    ('root ::= "v" [0-9] [a-f]', r"v[0-9][a-f]"),  # GBNF, as vLLM's xgrammar backend takes
])
def test_grammar_output_matches_it(tokenizer, compiler, grammar, pattern):
    for seed in range(3):
        text = text_before_eos(tokenizer, compiler, generate(compiler, StructuredOutputsParams(grammar=grammar), seed))
        assert re.fullmatch(pattern, text), text


def test_json_object_output_is_an_object(tokenizer, compiler):
    # A stand-in that likes to close what it opens: uniform logits would write one endless string.
    closers = tokenizer.convert_tokens_to_ids(['"', "}"])
    params = StructuredOutputsParams(json_object=True)
    for seed in range(5):
        tokens = generate(compiler, params, seed, preferred_ids=closers)
        assert isinstance(json.loads(text_before_eos(tokenizer, compiler, tokens)), dict)


# The mask itself


def test_padding_ids_past_the_tokenizer_are_never_allowed(tokenizer, compiler):
    row = np.zeros(bitmask_words(PADDED_VOCAB), np.int32)
    anything = compiler.matcher(StructuredOutputsParams(grammar="start: /(?s:.*)/"))
    anything.fill_bitmask(row)
    allowed = allowed_ids(row)
    assert len(allowed) > 40_000 and allowed.max() < len(tokenizer)
    for params in (StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex=r"\w+ \d+")):
        row[:] = -1
        compiler.matcher(params).fill_bitmask(row)
        assert allowed_ids(row).max() < len(tokenizer)


def test_one_choice_allows_only_its_first_token(tokenizer, compiler):
    text = "structured outputs"
    row = np.zeros((1, bitmask_words(PADDED_VOCAB)), np.int32)
    compiler.matcher(StructuredOutputsParams(choice=[text])).fill_bitmask(row[0])
    # A forced text: llguidance allows its canonical tokenization only, not "s", "str", ...
    first = tokenizer.encode(text)[0]
    assert allowed_ids(row[0]).tolist() == [first]
    masked = apply_bitmask_numpy(np.zeros((1, PADDED_VOCAB), np.float32), row)
    assert np.flatnonzero(np.isfinite(masked[0])).tolist() == [first]


def test_apply_bitmask_numpy_equals_llguidances_own(tokenizer):
    from llguidance.numpy import apply_token_bitmask_inplace
    rng = np.random.default_rng(0)
    for num_rows, vocab_size in [(1, 32), (3, 100), (4, PADDED_VOCAB)]:
        logits = rng.standard_normal((num_rows, vocab_size), dtype=np.float32)
        bitmask = rng.integers(-2**31, 2**31, (num_rows, bitmask_words(vocab_size)), dtype=np.int32)
        expected = logits.copy()
        apply_token_bitmask_inplace(expected, bitmask)
        np.testing.assert_array_equal(apply_bitmask_numpy(logits, bitmask), expected)


def test_finished_grammar_allows_only_eos(tokenizer, compiler):
    matcher = compiler.matcher(StructuredOutputsParams(choice=["positive"]))
    assert all(matcher.accept_token(t) for t in tokenizer.encode("positive"))
    assert matcher.is_terminated()
    row = np.zeros(bitmask_words(PADDED_VOCAB), np.int32)
    matcher.fill_bitmask(row)
    assert allowed_ids(row).tolist() == [compiler.eos_token_id]
    assert matcher.accept_token(compiler.eos_token_id)


def test_accept_token_rejects_a_token_the_mask_forbids(tokenizer, compiler):
    matcher = compiler.matcher(StructuredOutputsParams(regex=DATE_REGEX))
    row = np.zeros(bitmask_words(PADDED_VOCAB), np.int32)
    matcher.fill_bitmask(row)
    forbidden = tokenizer.convert_tokens_to_ids("hello")
    assert forbidden != tokenizer.unk_token_id
    assert forbidden not in allowed_ids(row)
    assert not matcher.accept_token(forbidden)
    assert matcher.num_accepted == 0 and matcher.is_error() and matcher.is_terminated()
    matcher.fill_bitmask(row)  # a rejection ends the request: EOS only
    assert allowed_ids(row).tolist() == [compiler.eos_token_id]


def test_disable_additional_properties_closes_objects(tokenizer, compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    comma = tokenizer.convert_tokens_to_ids(",")
    row = np.zeros(bitmask_words(PADDED_VOCAB), np.int32)
    for closed in (False, True):
        matcher = compiler.matcher(StructuredOutputsParams(json=schema, disable_additional_properties=closed,
                                                           disable_any_whitespace=True))
        assert all(matcher.accept_token(t) for t in tokenizer.encode('{"a":5'))
        matcher.fill_bitmask(row)
        assert (comma in allowed_ids(row)) != closed


def test_disable_any_whitespace_forbids_whitespace_between_tokens(tokenizer, compiler):
    newline, space = tokenizer.convert_tokens_to_ids(["Ċ", "Ġ"])  # byte-level BPE's "\n" and " "
    row = np.zeros(bitmask_words(PADDED_VOCAB), np.int32)
    for compact in (False, True):
        matcher = compiler.matcher(StructuredOutputsParams(json_object=True, disable_any_whitespace=compact))
        assert matcher.accept_token(tokenizer.convert_tokens_to_ids("{"))
        matcher.fill_bitmask(row)
        allowed = allowed_ids(row)
        assert (newline in allowed and space in allowed) != compact


def test_fill_bitmask_rejects_a_row_of_the_wrong_width(compiler):
    matcher = compiler.matcher(StructuredOutputsParams(choice=CHOICES))
    with pytest.raises(ValueError, match="row must be a contiguous"):
        matcher.fill_bitmask(np.zeros(bitmask_words(PADDED_VOCAB) - 1, np.int32))


def test_compiler_rejects_logits_narrower_than_the_tokenizer(tokenizer):
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarCompiler(tokenizer, len(tokenizer) - 1, (tokenizer.eos_token_id,))


def test_bitmask_words_is_ceil_of_vocab_over_32():
    assert [bitmask_words(v) for v in (1, 32, 33, 49152, 49229)] == [1, 1, 2, 1536, 1539]


def test_fill_bitmasks_in_threads_writes_what_each_matcher_writes_alone(compiler):
    kinds = [{"json_object": True}, {"regex": r"[0-9]{3}"}, {"choice": ["yes", "no"]}, {"json": {"type": "array"}}]
    matchers = [compiler.matcher(StructuredOutputsParams(**kind)) for kind in kinds]
    words = bitmask_words(compiler.vocab_size)
    alone = np.zeros((len(kinds), words), np.int32)
    for i, m in enumerate(matchers):
        m.fill_bitmask(alone[i])
    together = np.full((len(kinds) + 2, words), -1, np.int32)
    fill_bitmasks([(m, i + 1) for i, m in enumerate(matchers)], together)  # rows 1..4: rows 0 and 5 untouched
    np.testing.assert_array_equal(together[1:-1], alone)
    assert (together[[0, -1]] == -1).all()


def test_an_eos_the_tokenizer_lacks_gives_way_to_the_tokenizers_own(tokenizer):
    # EngineArgs.tokenizer may pair a model with another model's tokenizer, which lacks its EOS ids.
    compiler = GrammarCompiler(tokenizer, PADDED_VOCAB, (PADDED_VOCAB - 1,))
    assert compiler.eos_token_id == tokenizer.eos_token_id
    assert GrammarCompiler(tokenizer, PADDED_VOCAB, (PADDED_VOCAB - 1, 7)).eos_token_id == 7
