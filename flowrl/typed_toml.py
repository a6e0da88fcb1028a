"""A TOML table -> an instance of an attrs class, with every problem of the table collected.

Each key is checked against the class's fields (unknown keys get a did-you-mean), each value
against the field's type (TOML has no implicit conversions: `n = "4"` is an error, `lr = 1`
becomes 1.0), then the class is built so its validators run. Problems go to a `Collector`,
named by table and key, with the default as the fix. No torch or ray here.
"""

import types
import typing
from typing import Any

import attrs
import toml

from flowrl.errors import Collector, did_you_mean, one_of


def build_attrs(cls, table: dict, where: str, errors: Collector, overridden=frozenset()):
    """An instance of attrs class `cls` from a TOML table, or None after reporting problems."""
    attrs.resolve_types(cls)
    fields = attrs.fields_dict(cls)
    kwargs, ok = {}, True
    for key, value in table.items():
        origin = " (from the command line)" if f"{where}.{key}" in overridden else ""
        if key not in fields:
            errors.add(
                f"[{where}]",
                f'unknown key "{key}"{origin}{did_you_mean(key, fields)}',
                f"keys here: {one_of(fields) or 'none'}",
            )
            ok = False
            continue
        converted, good = convert(value, fields[key].type)
        if not good:
            errors.add(
                f"[{where}]",
                f'"{key}" = {value!r}{origin} should be {type_name(fields[key].type)}',
                f"default: {key} = {toml_value(fields[key].default)}",
            )
            ok = False
            continue
        kwargs[key] = converted
    if not ok:
        return None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        errors.add(f"[{where}]", str(e), "see docs/graph-file.md for the allowed values")
        return None


def convert(value, tp) -> tuple[Any, bool]:
    """(value converted to tp, True) or (None, False) when the TOML value has the wrong type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is not type(None):
                converted, good = convert(value, arg)
                if good:
                    return converted, True
        return None, False
    if origin is typing.Literal:
        return value, value in args
    if tp is bool:
        return value, isinstance(value, bool)
    if tp is int:
        return value, isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        good = isinstance(value, int | float) and not isinstance(value, bool)
        return (float(value) if good else None), good
    if tp is str:
        return value, isinstance(value, str)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list):
            return None, False
        item_type = args[0] if args else Any
        items = [convert(v, item_type) if item_type is not Any else (v, True) for v in value]
        if not all(good for _, good in items):
            return None, False
        seq = [v for v, _ in items]
        return (tuple(seq) if (origin or tp) is tuple else seq), True
    if origin is dict or tp is dict:
        return value, isinstance(value, dict)
    return value, True  # Any or an unchecked type


def type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, "a list" if typing.get_origin(tp) in (list, tuple) else str(tp))


def toml_value(value) -> str:
    if isinstance(value, attrs.Factory):
        value = value.factory()
    if value is None:
        return "(unset)"
    return toml.dumps({"v": value}).strip()[4:]
