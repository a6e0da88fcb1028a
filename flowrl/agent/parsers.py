"""Tool-call parsers: the text of one assistant turn -> the calls it makes, in order.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what Qwen-family
  models emit (verl's and TRL's default). A block whose JSON does not parse, or that has no
  name, is a malformed call: the model is told so as the tool's answer (verl drops it).
- `tag`: `<name>argument</name>` for tools of one argument, e.g. `<calc>347*28</calc>`: 12
  tokens for SmolLM2's tokenizer where the hermes form takes 34.
- a user function `parse(text) -> [(name, arguments dict), ...]` from "file.py:function".

No torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from flowrl.agent.tools.session import ToolCall  # the parsed call, the session's input

HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block of text; an unclosed last block counts as malformed."""
    calls = []
    for match in HERMES.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall(None, error="the <tool_call> block is not closed"))
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=f"the call is not valid JSON ({e.msg})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall(None, error='the call needs a "name" string'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(call["name"], error='"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def tag_parser(names: list[str]) -> Callable[[str], list[ToolCall]]:
    """A parser of `<name>argument</name>` for the given tool names."""
    if not names:
        return lambda text: []
    pattern = re.compile(
        r"<(" + "|".join(re.escape(n) for n in names) + r")>(.*?)(</\1>|$)", re.DOTALL
    )

    def parse(text: str) -> list[ToolCall]:
        calls = []
        for match in pattern.finditer(text):
            name, argument, closed = match.group(1), match.group(2), bool(match.group(3))
            if closed:
                calls.append(ToolCall(name, argument.strip()))
            else:
                calls.append(ToolCall(name, error=f"<{name}> is not closed by </{name}>"))
        return calls

    return parse


def user_parser(function: Callable) -> Callable[[str], list[ToolCall]]:
    """Wrap `function(text) -> [(name, arguments), ...]` (or ToolCall objects)."""

    def parse(text: str) -> list[ToolCall]:
        calls = []
        for item in function(text) or []:
            if isinstance(item, ToolCall):
                calls.append(item)
            else:
                name, arguments = item
                calls.append(ToolCall(name, arguments))
        return calls

    return parse


def make_parser(ref: str, tool_names: list[str], base_dir=".") -> Callable[[str], list[ToolCall]]:
    """ "hermes", "tag" (over the tool names), or "file.py:function" (relative to base_dir)."""
    if ref == "hermes":
        return parse_hermes
    if ref == "tag":
        return tag_parser(tool_names)
    from flowrl.agent.tools import load_object

    return user_parser(load_object(ref, base_dir, what="parser"))
