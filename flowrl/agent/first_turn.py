"""A scripted first turn: one well-formed call of each tool, in the parser's format.

A tiny run's random policy never writes a tool call, so its tools, their arguments and their
rewards would never run. With the agent node's `script_first_turn = true` (which `flowrl run
--tiny` sets), every request's first turn is these calls, decoded as forced tokens (the
policy's log-probs of them are real), and the turns after it are sampled.

Each argument gets a placeholder of its schema's type: the first choice of an enum, else
1 (integer), 1.0 (number), "1" (string), true, [] or {}. A tool that rejects the
placeholder answers with its error, which the run counts (`<node>/tool_errors`).
No torch.
"""

from __future__ import annotations

import json

PLACEHOLDERS = {"integer": 1, "number": 1.0, "string": "1", "boolean": True, "array": []}


def placeholder(schema: dict):
    """A value of a JSON-schema property: its first enum choice, else one of its type."""
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return PLACEHOLDERS.get(kind, {})


def arguments(schema: dict) -> dict:
    """Placeholder arguments for a tool's required parameters (all of them when none is
    marked required)."""
    parameters = schema["function"].get("parameters", {})
    properties = parameters.get("properties", {})
    names = parameters.get("required") or list(properties)
    return {name: placeholder(properties.get(name, {})) for name in names}


def first_turn_text(schemas: list[dict], parser: str) -> str:
    """The text of a turn that calls each tool once, or "" for a parser of the user's own,
    whose format flowrl does not know."""
    calls = []
    for schema in schemas:
        name, args = schema["function"]["name"], arguments(schema)
        if parser == "hermes":
            body = json.dumps({"name": name, "arguments": args})
            calls.append(f"<tool_call>\n{body}\n</tool_call>")
        elif parser == "tag":  # one argument, as text
            value = next(iter(args.values()), "")
            calls.append(f"<{name}>{value}</{name}>")
        else:
            return ""
    return "\n".join(calls)
