"""One request's tools: creating their state, running calls, collecting rewards.

`Session.call` turns every failure - a malformed call, an unknown tool, wrong arguments, an
exception, a timeout - into an error text the model gets as the tool's answer, with a status
the rollout counts. Every call runs in a daemon thread of its own (runner.py), so neither a
blocking async tool nor a hung one stalls the other requests or keeps the process alive.
"""

from __future__ import annotations

import functools
import inspect
import time
import typing

import attrs

from flowrl.agent.tools.timeouts import ToolStuck, run_call
from flowrl.errors import is_infra
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
class ToolCall:
    """One call as parsed: a tool name and its arguments, or the reason it is malformed.

    `arguments` is a dict of named arguments, or a string: the single argument of a tag call,
    given to the tool's one parameter."""

    name: str | None
    arguments: dict | str | None = None
    error: str | None = None  # set when the call could not be parsed


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
    raises, `close` collects end-of-request rewards ({tool: reward}) and releases every tool
    `start` created, also when creating a later one failed. Each of them runs in a thread of
    its own under a timeout (runner.py): `create_timeout` for start and close."""

    def __init__(self, tools: list, tools_kwargs: dict, create_timeout: float = 60.0):
        self.tools, self.tools_kwargs = list(tools), tools_kwargs
        self.create_timeout = create_timeout
        self.opened: list = []  # (tool, state) of the tools created so far
        self.functions = {}
        # verl's tools give every call a step reward, 0.0 when it failed (tool_agent_loop.py)
        self.failed_reward = 0.0 if tools and all(t.verl for t in tools) else None

    async def start(self) -> None:
        for tool in self.tools:
            args = {
                "tools_kwargs": self.tools_kwargs
            }  # its own key: a hung call is not a hung create
            state = await run_call(f"{tool.names[0]}:create", tool.open, args, self.create_timeout)
            self.opened.append((tool, state))
            self.functions.update(tool.handles(state))

    async def close(self) -> tuple[dict, list[str]]:
        """({tool: reward}, errors): every opened tool is closed, whatever another raised."""
        rewards, errors = {}, []
        opened, self.opened = self.opened, []
        for tool, state in opened:
            try:
                close = functools.partial(tool.close, state)
                name = f"{tool.names[0]}:release"
                rewards.update(await run_call(name, close, {}, self.create_timeout))
            except Exception as e:
                errors.append(f"{tool.names[0]}: release: {type(e).__name__}: {e}")
        return rewards, errors

    async def call(self, call: ToolCall, timeout: float) -> ToolResult:
        start = time.monotonic()
        name = call.name or ""
        if call.error:
            text = f"error: could not parse the tool call: {call.error}"
            return ToolResult(name, text, "invalid")
        failed = functools.partial(ToolResult, name, reward=self.failed_reward)
        function = self.functions.get(name)
        if function is None:
            known = ", ".join(self.functions) or "none"
            return failed(f'error: unknown tool "{name}"; the tools are: {known}', "invalid")
        arguments, problem = bind_arguments(function, call.arguments)
        if problem:
            return failed(f"error: {name}: {problem}", "invalid")
        try:
            out = await run_call(name, function, arguments, timeout)
        except ToolStuck as e:
            return failed(f"error: TimeoutError: {e}", "timeout")
        except TimeoutError:
            text = f"error: TimeoutError: {name} took longer than {timeout:g} s"
            return failed(text, "timeout", time.monotonic() - start)
        except Exception as e:
            if is_infra(e):  # a service the tool calls is down: not the model's doing
                raise
            return failed(f"error: {type(e).__name__}: {e}", "error", time.monotonic() - start)
        text, reward = tool_output(out)
        try:
            reward = None if reward is None else finite(reward, f"tool {name}")
        except BadValue as e:
            return failed(text, "bad_value", time.monotonic() - start, error=str(e))
        return ToolResult(name, text, "ok", time.monotonic() - start, reward)


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
