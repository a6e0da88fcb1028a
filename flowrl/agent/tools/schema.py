"""A tool's OpenAI function schema from its type hints and Google-style docstring, without
transformers (so `flowrl check` stays torch-free and fast for agent graphs).

The output is the one transformers' `get_json_schema` gives (the chat templates that render
`tools=` were written against it; tests/unit/agent/tools/test_agent_schema.py compares the two):

    {"type": "function", "function": {"name", "description", "parameters": {"type": "object",
     "properties": {arg: {"type", "description"[, "enum", "items", "nullable"]}},
     "required": [args without defaults]}[, "return": {...}]}}
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing

from flowrl.agent.tools import ToolError

SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
CONTAINERS = {list: "array", tuple: "array", dict: "object"}
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.S)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.S)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.S)
# one argument: "name (type): text" up to the next "name:" at the same indentation or less
_ARG = re.compile(
    r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*"
    r"(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)",
    re.S,
)


def function_schema(function) -> dict:
    """The OpenAI function schema of a typed function or method with a Google docstring.

    Raises:
        ToolError: an argument without a type hint or a description, or a hint with no JSON
            form (a custom class).
    """
    name = getattr(function, "__name__", "operation")
    doc = inspect.getdoc(function)
    if not doc:
        raise _error(function, f"{name} has no docstring")
    description, described, returns = _docstring(doc.strip())
    parameters = _parameters(function, name)
    returned = parameters["properties"].pop("return", None)
    if returned is not None and returns is not None:
        returned["description"] = returns
    for arg, schema in parameters["properties"].items():
        if arg not in described:
            raise _error(function, f"the docstring of {name} does not describe '{arg}'")
        text = described[arg]
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", text, flags=re.I)
        if choices:
            values = json.loads(choices[1])
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in values]
            text = text[: choices.start()].strip()
        schema["description"] = text
    out = {"name": name, "description": description, "parameters": parameters}
    if returned is not None:
        out["return"] = returned
    return {"type": "function", "function": out}


def _docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    """(summary, argument -> description, returns) of a Google-style docstring."""
    description, args, returns = _DESCRIPTION.search(doc), _ARGS.search(doc), _RETURNS.search(doc)
    described = {}
    if args:
        block = "\n".join(line for line in args[1].split("\n") if line.strip())
        described = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG.findall(block)}
    return (
        description[1].strip() if description else None,
        described,
        returns[1].strip() if returns else None,
    )


def _parameters(function, name: str) -> dict:
    hints = typing.get_type_hints(function)
    signature = inspect.signature(function)
    first = next(iter(signature.parameters), None)
    receiver = first in ("self", "cls") and (
        signature.parameters[first].annotation is inspect.Parameter.empty
    )
    required = []
    for arg, parameter in signature.parameters.items():
        if receiver and arg == first:
            continue
        if parameter.annotation is inspect.Parameter.empty:
            raise _error(function, f"argument {arg} of {name} has no type hint")
        if parameter.default is inspect.Parameter.empty:
            required.append(arg)
    properties = {}
    for arg, hint in hints.items():
        if receiver and arg == first:
            continue
        if arg == "return":  # the model never writes it: an odd return hint is left out
            try:
                properties[arg] = type_schema(hint)
            except TypeError:
                pass
        else:
            try:
                properties[arg] = type_schema(hint)
            except TypeError as e:
                raise _error(function, f"argument {arg} of {name}: {e}") from None
    out = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    return out


def type_schema(hint) -> dict:
    """The JSON schema of a type hint: scalars, Any, Enum, Literal, Optional / unions, and
    list / tuple / dict of those. Raises TypeError for anything else."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum([member.value for member in hint])
    if origin is None:
        if hint is typing.Any:
            return {}
        if hint in SCALARS:
            return {"type": SCALARS[hint]}
        if hint in CONTAINERS:
            return {"type": CONTAINERS[hint]}
        raise TypeError(f"{hint!r} has no JSON form (use int, float, str, bool, list, dict ...)")
    if origin is typing.Union or origin is types.UnionType:
        inner = [type_schema(t) for t in args if t is not type(None)]
        if len(inner) == 1:
            out = inner[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in inner):
            names = sorted({s["type"] for s in inner})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": inner}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal and args:
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": type_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise TypeError(f"{hint}: use list[...] for a sequence of one type")
        return {"type": "array", "prefixItems": [type_schema(t) for t in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = type_schema(args[1])
        return out
    raise TypeError(f"{hint!r} has no JSON form")


def _enum(values: list) -> dict:
    if not values or any(type(v) not in SCALARS for v in values):
        raise TypeError(f"enum values {values!r} must be JSON scalars")
    names = list(dict.fromkeys(SCALARS[type(v)] for v in values))
    return {"type": names[0] if len(names) == 1 else names, "enum": values}


def _error(function, problem: str) -> ToolError:
    return ToolError(
        f"{getattr(function, '__qualname__', function)}: {problem} (a tool needs a type hint "
        "on every argument and a Google-style docstring describing each under Args:)"
    )
