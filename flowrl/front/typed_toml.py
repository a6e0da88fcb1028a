"""A TOML table -> an instance of an attrs class, with every problem of the table collected.

Each key is checked against the class's fields (unknown keys get a did-you-mean), each value
against the field's type (TOML has no implicit conversions: `n = "4"` is an error, `lr = 1`
becomes 1.0), against finiteness (nan and inf are refused in every float field) and against
the field's own validator (flowrl/params.py states the rule); then the class is built, so
checks across fields run too. Every problem goes to a `Collector`, named by table and key, with
the rule and the default as the fix. `read_toml` reads the file itself with the standard
library's parser, turning every way a file can be unreadable into a problem with a line and
column. No torch or ray here.
"""

import json
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from flowrl.compat import REMOVED_IN
from flowrl.errors import Collector, did_you_mean, one_of
from flowrl.front import overrides
from flowrl.params import describe, finite, fix_for


def read_toml(path: Path, errors: Collector) -> dict:
    """The tables of a TOML file ({} after reporting why it cannot be read). A UTF-8 byte-order
    mark is accepted."""
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.toml"))
        errors.add("file", "is a directory, not a graph file", _pick(found))
        return {}
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        errors.add("file", "no such file", "check the path")
        return {}
    except OSError as e:
        errors.add("file", f"cannot be read: {e.strerror or e}", "check the path and permissions")
        return {}
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        errors.add(
            f"line {line}, column {column}",
            f"not UTF-8 text: byte 0x{data[e.start]:02x} cannot be decoded",
            "save the file as UTF-8 (TOML files are UTF-8)",
        )
        return {}
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        where, message, fix = _toml_problem(str(e), text)
        errors.add(where, f"not valid TOML: {message}", fix)
        return {}


def _pick(found: list[str]) -> str:
    if found:
        return "give one of its graph files: " + ", ".join(found[:5])
    return "give the path of a .toml graph file"


def _toml_problem(error: str, text: str) -> tuple[str, str, str]:
    """(where, message, fix) from tomllib's message, which ends "(at line L, column C)"."""
    match = re.search(r"\s*\(at line (\d+), column (\d+)\)$", error)
    message = error[: match.start()] if match else error.replace(" (at end of document)", "")
    where = f"line {match.group(1)}, column {match.group(2)}" if match else "end of file"
    declared = re.fullmatch(r"Cannot declare \((.*)\) twice", message)
    if declared:  # tomllib names the table as a Python tuple
        name = ".".join(part.strip(" '\"") for part in declared.group(1).split(",") if part.strip())
        message = f"table [{name}] is declared twice"
        fix = f"merge the two [{name}] tables into one"
    elif message == "Cannot overwrite a value":
        message = "this line defines again a table or key already defined above"
        fix = "define each key and table once; [x] (a table) and [[x]] (a list of tables) differ"
    elif message == "Unclosed array":  # within the line: two elements without a comma
        message = "unclosed array"
        fix = 'separate the elements with commas and close the array with "]"'
    else:
        message = message[:1].lower() + message[1:]
        fix = "fix the syntax on that line"
    lines = text.splitlines()
    error_line = int(match.group(1)) if match else len(lines) + 1
    source = lines[error_line - 1] if error_line <= len(lines) else ""
    # inside an array, a [table] line reads as a nested array and a key as a bad value
    new_entry = re.match(r"\s*(\[|[\w.\"'-]+\s*=)", source)
    opened = None
    if new_entry or (message == "unclosed array" and not match):
        opened = _open_array(lines[: error_line - 1])
    if opened:  # tomllib notices it at the next line that is not an element: name the opener
        line, key = opened
        noticed = f"line {error_line}" if match else "the end of the file"
        where = f"line {line}"
        message = f"the array {key} = [ opened on this line is not closed (seen at {noticed})"
        fix = f'close it with "]" after its last element: {lines[line - 1].strip()}'
    elif match and source.strip():
        message += f": {source.strip()}"
    return where, message, fix


def _open_array(lines: list[str]) -> tuple[int, str] | None:
    """(line, dotted key) of the array still open at the end of `lines`, if one is: brackets
    are counted outside strings and comments; a header line ([table]) outside a value sets the
    table its keys belong to."""
    table, depth, opener, quote = "", 0, None, ""
    for number, text in enumerate(lines, start=1):
        stripped = text.strip()
        if depth == 0 and not quote and re.fullmatch(r"\[\[?[^\[\]=]+\]\]?(\s*#.*)?", stripped):
            table = stripped.split("#")[0].strip("[] ")
            continue
        key = re.match(r"\s*([\w.\"'-]+)\s*=", text) if depth == 0 and not quote else None
        start = key.end() if key else 0
        i = start
        while i < len(text):
            char = text[i]
            if quote:
                if char == "\\" and quote == '"':
                    i += 1
                elif char == quote:
                    quote = ""
            elif char in "\"'":
                quote = char
            elif char == "#":
                break
            elif char == "[":
                depth += 1
                if depth == 1:
                    opener = (number, ".".join(p for p in (table, key and key.group(1)) if p))
            elif char == "]":
                depth = max(depth - 1, 0)
            i += 1
        quote = ""  # a single-line string ends with its line
    return opener if depth > 0 else None


def build_attrs(cls, table: dict, where: str, errors: Collector, overridden: Mapping | None = None):
    """An instance of attrs class `cls` from a TOML table, or None after reporting problems.

    Args:
        cls: an attrs class; its init arguments are the table's keys.
        table: the parsed TOML table.
        where: the table's dotted name, e.g. "models.policy".
        errors: collects one problem per bad key.
        overridden: dotted key -> the command-line override that set it, so its problems
            quote the override.
    """
    overridden = overridden or {}
    attrs.resolve_types(cls)
    fields = {(f.alias or f.name): f for f in attrs.fields(cls) if f.init}
    table = _renamed(cls, table, where, errors, overridden)
    kwargs, ok = {}, True
    for key, value in table.items():
        said = overrides.said(overridden, f"{where}.{key}")
        origin = " (from the command line)" if said else ""
        if key not in fields:
            errors.add(
                f"[{where}]",
                f'{said}unknown key "{key}"{origin}{did_you_mean(key, fields)}',
                f"keys here: {one_of(fields) or 'none'}",
            )
            ok = False
            continue
        converted, problem = check_value(value, fields[key])
        if problem:
            fix = fix_for(fields[key].validator, value) if "not allowed" in problem else ""
            fix = fix or f"default: {key} = {toml_value(fields[key].default)}"
            shown = repr(value) if isinstance(value, str) else toml_value(value)
            errors.add(f"[{where}]", f'{said}"{key}" = {shown}{origin} {problem}', fix)
            ok = False
            continue
        kwargs[key] = converted
    if not ok:
        return None
    try:
        return cls(**kwargs)
    except Exception as e:  # a check across fields, in __attrs_post_init__ (maybe a user's)
        message = _message(e) if isinstance(e, ValueError | TypeError) else f"{e!r}"
        errors.add(f"[{where}]", message, "see docs/graph-file.md for the allowed values")
        return None


def _renamed(cls, table: dict, where: str, errors: Collector, overridden: Mapping) -> dict:
    """The table with the old names of keys (the class's `RENAMED`: old -> new) replaced by
    the new ones, each noted as a warning. Both names in the file is an error; the new name
    set by an override (the command line, a tiny run) wins over the old one in the file."""
    renamed = getattr(cls, "RENAMED", {})
    if not any(key in renamed for key in table):
        return table
    out = {}
    for key, value in table.items():
        new = renamed.get(key)
        if new is None:
            out[key] = value
            continue
        errors.rename(f"[{where}]", key, new, REMOVED_IN)
        if new not in table:
            out[new] = value
        elif not overrides.said(overridden, f"{where}.{new}") or overrides.said(
            overridden, f"{where}.{key}"
        ):
            errors.add(f"[{where}]", f'"{key}" and "{new}" are both given', f"keep {new} only")
    return out


def check_value(value, field: attrs.Attribute) -> tuple[Any, str]:
    """(value converted to the field's type, "") or (None, what is wrong with it)."""
    converted, good = convert(value, field.type)
    if not good:
        return None, f"should be {type_name(field.type)}"
    if not finite(converted):
        return None, "is not a finite number: nan and inf are not allowed"
    if field.validator is not None:
        try:
            field.validator(None, field, converted)
        except Exception as e:  # a validator may raise anything; the user gets its message
            rule = describe(field.validator)
            return (
                None,
                f"is not allowed: must be {rule}" if rule else f"is not allowed: {_message(e)}",
            )
    return converted, ""


def _message(error: Exception) -> str:
    """The text of a validator's error; attrs' own validators put extra values in args."""
    return str(error.args[0]) if error.args else type(error).__name__


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
    """A TOML type in words: "an integer", 'one of "a", "b"', "a list of numbers"..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(toml_value(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args if a is not type(None))
    if origin in (list, tuple) or tp in (list, tuple):
        return f"a list of {PLURALS[args[0]]}" if args and args[0] in PLURALS else "a list"
    if origin is dict or tp is dict:
        return "a table"
    return NAMES.get(tp, getattr(tp, "__name__", str(tp)))


NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
PLURALS = {bool: "true or false values", int: "integers", float: "numbers", str: "strings"}


def toml_value(value) -> str:
    """A default as it would be written in TOML; "(unset)" for None."""
    if isinstance(value, attrs.Factory):
        value = value.factory()
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if hasattr(value, "isoformat"):  # TOML dates and times
        return value.isoformat()
    return repr(value)
