"""Type checks of a user-facing dataclass (EngineArgs, SamplingParams), read from its annotations.

Python does not check annotations, and a wrong type that passes the range checks fails
much later (a float max_num_seqs inside batch packing, after the weights load), so the
boundaries check every field: bool is not an int here, a float field takes an int, a
list[X] field checks every item.
"""
import dataclasses
import types
import typing

_NAMES = {int: "an int", float: "a number", str: "a str", bool: "a bool", types.NoneType: "None"}


def check_field_types(obj) -> None:
    """Raises TypeError naming the first field of the dataclass `obj` whose value does not
    match the field's annotation, e.g. "max_num_seqs must be an int, got 2.5"."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if not _matches(value, field.type):
            raise TypeError(f"{field.name} must be {_describe(field.type)}, got {value!r}")


def _matches(value, annotation) -> bool:
    if isinstance(annotation, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if typing.get_origin(annotation) is dict:
        key, item = typing.get_args(annotation)
        return isinstance(value, dict) and all(_matches(k, key) and _matches(v, item) for k, v in value.items())
    if annotation is typing.Any:
        return True
    if annotation in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if annotation is float else annotation)


def _describe(annotation) -> str:
    """`int | None` -> "an int or None"; `list[str]` -> "a list of str"."""
    if isinstance(annotation, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        kinds = typing.get_args(item) if isinstance(item, types.UnionType) else (item,)
        return f"a list of {' or '.join(k.__name__ for k in kinds)}"
    if typing.get_origin(annotation) is dict:
        key, item = typing.get_args(annotation)
        return f"a dict of {key.__name__} to {item.__name__ if isinstance(item, type) else 'anything'}"
    return _NAMES.get(annotation) or f"a {annotation.__name__}"
