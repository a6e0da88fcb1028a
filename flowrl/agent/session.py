"""One request's tools: creating their state, running calls, collecting rewards.

`Session.call` turns every failure - a malformed call, an unknown tool, wrong arguments, an
exception, a timeout - into an error text the model gets as the tool's answer, with a status
the rollout counts. Async tools run on the event loop; blocking ones in the pool's threads.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
import typing

import attrs

from flowrl.agent.parsers import ToolCall
from flowrl.rewards import BadValue, finite

JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
}


@attrs.frozen
class ToolResult:
    name: str  # the tool called ("" for a call too malformed to name one)
    text: str  # what the model sees
    status: str  # "ok", "invalid" (bad call), "error" (the tool raised), "timeout",
    # "bad_value" (it ran, but its reward was no finite number: dropped, counted by reward.tools)
    seconds: float = 0.0
    reward: float | None = None  # a step reward the tool returned
    error: str = ""  # for "bad_value": what it returned (flowrl.rewards.finite's message)


class Session:
    """One request's tools: `start` creates per-request state, `call` runs one call and never
    raises, `close` collects end-of-request rewards ({tool: reward}) and releases."""

    def __init__(self, toolbox, tools_kwargs: dict, pool=None):
        self.toolbox, self.tools_kwargs, self.pool = toolbox, tools_kwargs, pool
        self.states, self.functions = None, {}

    async def start(self) -> None:
        self.states = [await tool.open(self.tools_kwargs) for tool in self.toolbox.tools]
        for tool, state in zip(self.toolbox.tools, self.states, strict=True):
            self.functions.update(tool.handles(state))

    async def close(self) -> dict:
        rewards = {}
        for tool, state in zip(self.toolbox.tools, self.states or [], strict=False):
            rewards.update(await tool.close(state))
        return rewards

    async def call(self, call: ToolCall, timeout: float) -> ToolResult:
        start = time.monotonic()
        name = call.name or ""
        if call.error:
            text = f"error: could not parse the tool call: {call.error}"
            return ToolResult(name, text, "invalid")
        function = self.functions.get(name)
        if function is None:
            known = ", ".join(self.functions) or "none"
            text = f'error: unknown tool "{name}"; the tools are: {known}'
            return ToolResult(name, text, "invalid")
        arguments, problem = bind_arguments(function, call.arguments)
        if problem:
            return ToolResult(name, f"error: {name}: {problem}", "invalid")
        try:
            out = await asyncio.wait_for(self._invoke(function, arguments), timeout)
        except TimeoutError:
            text = f"error: TimeoutError: {name} took longer than {timeout:g} s"
            return ToolResult(name, text, "timeout", time.monotonic() - start)
        except Exception as e:
            text = f"error: {type(e).__name__}: {e}"
            return ToolResult(name, text, "error", time.monotonic() - start)
        text, reward = tool_output(out)
        try:
            reward = None if reward is None else finite(reward, f"tool {name}")
        except BadValue as e:
            return ToolResult(name, text, "bad_value", time.monotonic() - start, error=str(e))
        return ToolResult(name, text, "ok", time.monotonic() - start, reward)

    async def _invoke(self, function, arguments: dict):
        if inspect.iscoroutinefunction(function):
            return await function(**arguments)
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self.pool, functools.partial(function, **arguments))
        return await maybe_await(out)


def bind_arguments(function, arguments) -> tuple[dict, str | None]:
    """(keyword arguments, None) for a call of `function`, or ({}, what is wrong). A string
    (a tag call's one argument) goes to the function's only required parameter."""
    signature = inspect.signature(function)
    params = [
        p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if isinstance(arguments, str):
        required = [p for p in params if p.default is p.empty] or params[:1]
        if len(required) != 1:
            return {}, f"takes {len(required)} arguments; the tag form passes one"
        arguments = {required[0].name: arguments}
    arguments = dict(arguments or {})
    try:
        signature.bind(**arguments)
    except TypeError as e:
        return {}, f"bad arguments: {e}"
    hints = _hints(function)
    for key, value in arguments.items():
        expected = _json_type(hints.get(key))
        if expected and not (
            isinstance(value, JSON_TYPES[expected])
            and not (isinstance(value, bool) and expected in ("integer", "number"))
        ):
            return {}, f'argument "{key}" must be of type {expected}, got {type(value).__name__}'
    return arguments, None


def tool_output(out) -> tuple[str, object]:
    """A tool's return value as (text, step reward): str, (text, reward[, metrics]), an
    object with `.text` (verl's ToolResponse), or anything else as its str."""
    reward = None
    if isinstance(out, tuple) and len(out) >= 2:
        out, reward = out[0], out[1]  # checked by the caller (flowrl.rewards.finite)
    if hasattr(out, "text") and not isinstance(out, str):
        out = out.text or ""
    return (out if isinstance(out, str) else str(out)), reward


def _hints(function) -> dict:
    try:
        return typing.get_type_hints(function)
    except Exception:
        return {}


def _json_type(hint) -> str | None:
    for name, types in (("boolean", bool), ("integer", int), ("number", float), ("string", str)):
        if hint is types:
            return name
    origin = getattr(hint, "__origin__", hint)
    if origin in (list, tuple):
        return "array"
    if origin is dict:
        return "object"
    return None


async def maybe_await(value):
    return await value if inspect.isawaitable(value) else value
