"""A request body, from its bytes to a validated request model, checked at the door.

Everything a later step could choke on is refused here, as a 4xx naming the field: a body
too large (413) or not JSON (415, 400), text that is not UTF-8 (a lone surrogate such as
"\\ud800" fails in the tokenizer, in llguidance and in the response's own encoding), an
integer outside 64 bits (the engine core's msgpack cannot carry it), NaN and infinities,
nesting deeper than _MAX_DEPTH, and more values than pydantic can validate quickly.

`parse_request` runs in a worker thread: what it costs grows with the body, and the event
loop must stay free (a 10 MB body of JSON numbers takes about a second to parse).
"""
import contextlib
import dataclasses
import gc
import json
import json.scanner
import math
import re
import threading

from pydantic import BaseModel, ValidationError

from jaxllm.entrypoints.openai.errors import APIError

_INT64 = 2**63
_MAX_DEPTH = 64
# Values outside the bulk token-id fields (prompt, tokens). pydantic takes up to ~3 us per value
# (a chat message), holding the interpreter: 65536 keep a request's validation near 100 ms.
_MAX_VALUES = 65536
# Below this many values (an upper bound: commas, brackets and braces) the C parser is used; it
# holds the interpreter for the whole document (10 ms on a 2-core test machine). Above, the
# standard library's pure-Python scanner, every value a step the event loop's thread can cut into.
_C_PARSER_MAX_VALUES = 100_000
_FREE_PER_STEP = 4096
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list",
               dict: "an object", type(None): "null"}


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may carry (`jaxllm serve`'s --max-request-body-bytes and
    --max-seqs-per-request, and the model's max_model_len)."""
    max_body_bytes: int
    max_seqs: int
    max_model_len: int


async def read_body(request, max_bytes: int) -> bytes:
    """The body, refused (413) as soon as it is known to pass max_bytes: from its
    Content-Length before any of it is read, else as its chunks arrive."""
    content_type = request.headers.get("content-type", "application/json")
    media_type = content_type.split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got {content_type!r}")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {max_bytes} bytes (jaxllm serve "
                    "--max-request-body-bytes)")


def parse_request(body: bytes, model: type[BaseModel], limits: RequestLimits) -> BaseModel:
    """The body as `model`, or an APIError (400) naming what is wrong."""
    with _collector_paused():
        data = parse_json(body)
        try:
            return _validated(data, model, limits)
        except APIError as e:
            error = APIError(e.status, e.message, e.param, e.type, e.code)
        # Out of the except block, the error's traceback (whose frames hold the body) is gone.
        _free_gradually(data)
    raise error


def _validated(data, model: type[BaseModel], limits: RequestLimits) -> BaseModel:
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_json_type(data)}")
    check_values(data, limits, model.prompt_field)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def _free_gradually(value) -> None:
    """Frees a refused body a slice of a container at a time, each step a Python one the
    event loop's thread can run between: freed in one go, millions of small lists held the
    interpreter for a third of a second."""
    stack = [value]
    while stack:
        container = stack.pop()
        if type(container) is dict:
            container = list(container.values())  # the dict's keys and values, freed with it below
        elif type(container) is not list:
            continue
        while container:
            piece = container[-_FREE_PER_STEP:]
            del container[-_FREE_PER_STEP:]
            stack.extend(item for item in piece if type(item) is list or type(item) is dict)


def parse_json(body: bytes):
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 text: byte {e.start} ({body[e.start]:#04x}) {e.reason}")
    decoder = json.JSONDecoder()
    if body.count(b",") + body.count(b"[") + body.count(b"{") > _C_PARSER_MAX_VALUES:
        decoder.scan_once = json.scanner.py_make_scanner(decoder)
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})")
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except ValueError:  # int() refuses more than 4300 digits
        raise APIError(400, "the request body holds an integer of more than 4300 digits") from None


_paused_lock = threading.Lock()
_paused = 0


@contextlib.contextmanager
def _collector_paused():
    """The cyclic garbage collector off (in every thread) while a body is parsed and checked:
    a body of millions of small lists and objects (none in a cycle) set off collections over
    all of them, each holding the interpreter for ~100 ms."""
    global _paused
    with _paused_lock:
        _paused += 1
        gc.disable()
    try:
        yield
    finally:
        with _paused_lock:
            _paused -= 1
            if not _paused:
                gc.enable()


class _BadValue(ValueError):
    """A value the request may not hold; `path` is filled in on the way out of the walk."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message, self.path = message, []


def check_values(data: dict, limits: RequestLimits, prompt_field: str = "prompt") -> None:
    """Every value of the request, as parsed from JSON: integers within 64 bits, finite
    floats, UTF-8 text (keys too), at most _MAX_DEPTH deep; the bulk token-id fields (the
    prompts, `prompt_field`, and tokens) within max_model_len (and a list of prompts within
    max_seqs), the rest at most _MAX_VALUES values."""
    budget = [_MAX_VALUES]
    for field, value in data.items():
        try:
            _check_text(field)
            if field == prompt_field:
                _check_prompt(value, limits)
            elif field == "tokens":
                _check_token_ids(value, limits.max_model_len)
            else:
                _check(value, 1, budget)
        except _BadValue as e:
            steps = [f"[{step}]" if isinstance(step, int) else f".{_shown(step)}" for step in reversed(e.path)]
            where = _shown(field) + "".join(steps if len(steps) <= 8 else steps[:4] + ["..."] + steps[-2:])
            raise APIError(400, f"{where} {e.message}", param=_shown(field)) from None


def _shown(key: str) -> str:
    """A key as an error message may hold it: escaped if it is not valid text."""
    return key if key.isascii() or not _SURROGATE.search(key) else ascii(key)


def _check(value, depth: int, budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise _BadValue(f"is one value too many: a request holds at most {_MAX_VALUES} JSON values outside "
                        "prompt and tokens")
    kind = type(value)
    if kind is str:
        _check_text(value)
    elif kind is int:
        _check_int(value)
    elif kind is float:
        if not math.isfinite(value):
            raise _BadValue(f"is {value}: numbers must be finite (JSON has no NaN or Infinity)")
    elif kind is list or kind is dict:
        if depth >= _MAX_DEPTH:
            raise _BadValue(f"is nested more than {_MAX_DEPTH} deep")
        for key, item in value.items() if kind is dict else enumerate(value):
            try:
                if kind is dict:
                    _check_text(key)
                _check(item, depth + 1, budget)
            except _BadValue as e:
                e.path.append(key)
                raise


def _check_text(text: str) -> None:
    if not text.isascii() and (match := _SURROGATE.search(text)):
        raise _BadValue(f"is not valid text: a lone surrogate {match.group()!r} at character {match.start()} "
                        "(UTF-8 cannot encode it)")


def _check_int(value: int) -> None:
    if not -_INT64 <= value < _INT64:
        raise _BadValue(f"is {_digits(value)}, which does not fit in 64 bits: integers must be in [-2**63, 2**63)")


def _digits(value: int) -> str:
    digits = str(value)
    return digits if len(digits) <= 24 else f"{digits[:12]}... ({len(digits)} digits)"


def _check_prompt(prompt, limits: RequestLimits) -> None:
    """A completion's prompt (an embedding's input): a string, a list of strings, a list of token
    ids or a list of token-id lists; at most max_seqs prompts, each list at most max_model_len
    ids. pydantic leaves it to this check (a list of millions of ids would hold the interpreter there)."""
    if isinstance(prompt, str):
        return _check_text(prompt)
    if not isinstance(prompt, list):
        raise _BadValue(f"must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                        f"got {_json_type(prompt)}")
    if prompt and type(prompt[0]) is int:
        return _check_token_ids(prompt, limits.max_model_len)
    if len(prompt) > limits.max_seqs:
        raise _BadValue(f"holds {len(prompt)} prompts, more than a request may start ({limits.max_seqs}: jaxllm serve "
                        "--max-seqs-per-request)")
    kinds = {type(p) for p in prompt}
    if not (kinds <= {str} or kinds <= {list}):
        raise _BadValue("must be a string, a list of strings, a list of token ids or a list of token-id lists, got a "
                        f"list of {' and '.join(sorted(_JSON_TYPES[k] for k in kinds))}")
    for i, p in enumerate(prompt):
        try:
            _check_text(p) if kinds == {str} else _check_token_ids(p, limits.max_model_len)
        except _BadValue as e:
            e.path.append(i)
            raise


def _check_token_ids(ids, max_model_len: int) -> None:
    if not isinstance(ids, list):
        raise _BadValue(f"must be a list of token ids, got {_json_type(ids)}")
    if len(ids) > max_model_len:
        raise _BadValue(f"has {len(ids)} tokens, more than max_model_len ({max_model_len})")
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t < _INT64:
            error = _BadValue(f"is {_json_type(t)}, not a token id" if type(t) is not int
                              else f"is {_digits(t)}: a token id outside the vocabulary")
            error.path.append(i)
            raise error


def _json_type(value) -> str:
    """What a parsed JSON value is, in JSON's words (never its repr: it may be nested 1000 deep)."""
    return _JSON_TYPES[type(value)] if type(value) is not bool else ("true" if value else "false")


def validation_error(error: ValidationError) -> APIError:
    """pydantic's errors as one 400 whose message and param name the bad fields. A value
    that fits none of a union's types gives one error per type: they become one line."""
    by_field: dict[str, list[dict]] = {}
    for e in error.errors():
        loc = [str(x) for x in e.get("loc", ())]
        by_field.setdefault(loc[0] if loc else "body", []).append({**e, "loc": loc})
    parts = []
    for field, errors in list(by_field.items())[:3]:
        e = errors[0]
        if e.get("type") == "extra_forbidden":
            parts.append(f"Unrecognized request argument supplied: {'.'.join(e['loc'])}")
        elif len({x["loc"][1] for x in errors if len(x["loc"]) > 1}) > 1:  # the branches of a union
            kinds = ", ".join(dict.fromkeys(x["loc"][1] for x in errors if len(x["loc"]) > 1))
            value = min(errors, key=lambda x: len(x["loc"])).get("input")
            parts.append(f"{field}: {value!r:.200} is none of the allowed types ({kinds})")
        else:
            message = str(e["ctx"]["error"]) if e.get("type") == "value_error" else e["msg"]
            parts.append(f"{'.'.join(e['loc']) or 'body'}: {message}")
    param = next(iter(by_field)) if by_field else None
    return APIError(400, "; ".join(parts) or "invalid request", param=None if param == "body" else param)
