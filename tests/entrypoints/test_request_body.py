"""Reading a request body (jaxllm/entrypoints/openai/request_body.py) without a server: both
JSON parsers read what json.loads reads, and the value checks name the path of what they refuse."""
import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.entrypoints.openai import request_body
from jaxllm.entrypoints.openai.errors import APIError
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxllm.entrypoints.openai.request_body import RequestLimits, parse_json, parse_request

LIMITS = RequestLimits(max_body_bytes=1 << 20, max_seqs=8, max_model_len=64)
NESTED_70_DEEP = functools.reduce(lambda value, _: [value], range(70), 0)
NESTED_900_DEEP = functools.reduce(lambda value, _: [value], range(900), 0)  # a repr of it would recurse too deep
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
                    max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_both_parsers_read_what_json_loads_reads(value):
    body = json.dumps(value).encode()
    assert parse_json(body) == json.loads(body)
    limit = request_body._C_PARSER_MAX_VALUES
    try:
        request_body._C_PARSER_MAX_VALUES = -1  # every body through the pure-Python scanner
        assert parse_json(body) == json.loads(body)
    finally:
        request_body._C_PARSER_MAX_VALUES = limit


def error_of(body: dict | bytes, model=CompletionRequest) -> APIError:
    with pytest.raises(APIError) as e:
        parse_request(body if isinstance(body, bytes) else json.dumps(body).encode(), model, LIMITS)
    return e.value


@pytest.mark.parametrize("body, where, param", [
    ({"prompt": "x", "stop_token_ids": [1, 2**64]}, "stop_token_ids[1] is 18446744073709551616", "stop_token_ids"),
    ({"prompt": "x", "top_k": -2**63 - 1}, "top_k is -9223372036854775809", "top_k"),
    ({"prompt": ["a", "b\ud800"]}, "prompt[1] is not valid text", "prompt"),
    ({"prompt": "x", "logit_bias": {"5": float("inf")}}, "logit_bias.5 is inf", "logit_bias"),
    ({"prompt": "x", "structured_outputs": {"json": {"enum": ["\udfff"]}}}, "structured_outputs.json.enum[0]",
     "structured_outputs"),
    ({"prompt": [[1, 2], [3, True]]}, "prompt[1][1] is true, not a token id", "prompt"),
    ({"prompt": [[1], NESTED_900_DEEP]}, "prompt[1][0] is a list, not a token id", "prompt"),
    ({"prompt": [[1]] * 9}, "prompt holds 9 prompts", "prompt"),
    ({"prompt": list(range(65))}, "prompt has 65 tokens, more than max_model_len (64)", "prompt"),
    ({"prompt": "x", "chat_template_kwargs": {"a": NESTED_70_DEEP}}, "nested more than 64", "chat_template_kwargs"),
    ({"prompt": "x", "stop": ["a"] * 70_000}, "stop[65535] is one value too many", "stop"),
])
def test_a_value_the_request_may_not_hold_is_named_by_its_path(body, where, param):
    error = error_of(body)
    assert error.status == 400 and where in error.message and error.param == param, error.message


def test_a_body_that_is_not_utf8_json_or_an_object_is_a_400():
    assert "not UTF-8" in error_of(b'{"prompt": "\xff"}').message
    assert "not valid JSON" in error_of(b'{"prompt": ').message
    assert "JSON object" in error_of(b"[1, 2]").message
    assert "4300 digits" in error_of(b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}").message
    assert "nested too deeply" in error_of(b"[" * 100_000 + b"]" * 100_000).message


def test_types_are_strict_and_logit_bias_keys_are_decimal_token_ids():
    assert error_of({"prompt": "x", "n": True}).param == "n"
    assert error_of({"prompt": "x", "max_tokens": 2.0}).param == "max_tokens"
    for key in (" 5", "1_0", "\u0665", "-1", "9" * 20):
        assert error_of({"prompt": "x", "logit_bias": {key: 1.0}}).param == "logit_bias", key
    request = parse_request(b'{"messages": [], "logit_bias": {"007": -1}}', ChatCompletionRequest, LIMITS)
    assert request.logit_bias == {7: -1.0}
