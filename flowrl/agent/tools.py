"""Tools an agent node may call, referenced from the graph file like scorers.

A reference is a built-in name ("calculator", "python", "answer_check") or "file.py:name"
(relative to the graph file) or "package.module:name", naming one of:

- a function, sync or `async def`, with type hints and a Google-style docstring (its schema
  comes from them: flowrl/agent/schema.py, the output of transformers' `get_json_schema`
  without importing transformers). It returns the text the model
  sees, or (text, step_reward).
- a class with per-request state: `__init__(self, **create_kwargs)` gets the row's
  `extra_info.tools_kwargs[<class or method name>].create_kwargs`; its public documented
  methods are the tools; optional `reward(self) -> float` is called once when the request
  ends and `close(self)` after it (verl's create / execute / calc_reward / release).
- a verl `BaseTool`-shaped class (async `create`, `execute`, `calc_reward`, `release`) with
  its OpenAI schema as the class attribute `tool_schema`, through `VerlTool`.

A `Toolbox` opens one `Session` per request (session.py), which runs the calls. Async tools
run on the event loop; blocking ones in a thread pool (a timed-out thread cannot be killed: it
runs on, unseen; the `python` tool uses a process).
"""

from __future__ import annotations

import inspect
import uuid
from pathlib import Path

from flowrl.agent.objects import ToolError, load_object
from flowrl.agent.schema import function_schema
from flowrl.agent.session import Session, maybe_await

BUILTIN_TOOLS = {
    "calculator": "flowrl.agent.builtin:calc",
    "python": "flowrl.agent.builtin:python",
    "answer_check": "flowrl.agent.builtin:AnswerCheck",
}
LIFECYCLE = ("reward", "close")  # class-tool methods that are not tools


class FunctionTool:
    """A stateless function: one tool, shared by every request."""

    def __init__(self, function):
        self.function = function
        self.schemas = [function_schema(function)]
        self.names = [self.schemas[0]["function"]["name"]]

    async def open(self, tools_kwargs: dict):
        return None

    def handles(self, state) -> dict:
        return {self.names[0]: self.function}

    async def close(self, state) -> dict:
        return {}


class ClassTool:
    """A class whose instance holds one request's state; its public methods are tools."""

    def __init__(self, cls):
        self.cls = cls
        methods = [
            name
            for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") and name not in LIFECYCLE
        ]
        if not methods:
            raise ToolError(f"{cls.__qualname__}: a tool class needs public documented methods")
        self.schemas = [function_schema(getattr(cls, m)) for m in methods]
        self.names = methods

    async def open(self, tools_kwargs: dict):
        keys = [self.cls.__name__, *self.names]
        entry = next((tools_kwargs[k] for k in keys if k in tools_kwargs), {}) or {}
        instance = self.cls(**(entry.get("create_kwargs") or {}))
        return instance

    def handles(self, instance) -> dict:
        return {name: getattr(instance, name) for name in self.names}

    async def close(self, instance) -> dict:
        out = {}
        if hasattr(instance, "reward"):
            out[self.cls.__name__] = float(await maybe_await(instance.reward()))
        if hasattr(instance, "close"):
            await maybe_await(instance.close())
        return out


class _Schema(dict):
    """A schema dict that also reads as attributes (verl's pydantic `OpenAIFunctionToolSchema`
    is read as `tool_schema.function.name`)."""

    def __getattr__(self, key):
        try:
            value = self[key]
        except KeyError as e:
            raise AttributeError(key) from e
        return _Schema(value) if isinstance(value, dict) else value

    def model_dump(self, **kwargs) -> dict:
        return dict(self)


class VerlTool:
    """A verl `BaseTool`-shaped class: one instance, one `create`d id per request."""

    def __init__(self, cls):
        schema = getattr(cls, "tool_schema", None)
        if not isinstance(schema, dict) or "function" not in schema:
            raise ToolError(
                f"{cls.__qualname__}: a verl-style tool needs its OpenAI schema as the class "
                'attribute tool_schema = {"type": "function", "function": {...}}'
            )
        self.tool = cls(config={}, tool_schema=_Schema(schema))
        self.schemas = [schema]
        self.names = [schema["function"]["name"]]
        self.parameters = list(schema["function"].get("parameters", {}).get("properties", {}))

    async def open(self, tools_kwargs: dict):
        entry = tools_kwargs.get(self.names[0]) or {}
        created = await self.tool.create(str(uuid.uuid4()), **(entry.get("create_kwargs") or {}))
        instance_id = created[0] if isinstance(created, tuple) else created
        return instance_id, entry.get("execute_kwargs") or {}

    def handles(self, state) -> dict:
        instance_id, execute_kwargs = state

        async def execute(**arguments):
            return await self.tool.execute(instance_id, arguments, **execute_kwargs)

        execute.__signature__ = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY) for p in self.parameters]
        )
        return {self.names[0]: execute}

    async def close(self, state) -> dict:
        reward = await self.tool.calc_reward(state[0])
        await self.tool.release(state[0])
        return {self.names[0]: float(reward or 0.0)}


def make_tool(ref: str, base_dir: str | Path = "."):
    """The tool a reference names (see the module docstring)."""
    target = load_object(BUILTIN_TOOLS.get(ref, ref), base_dir)
    if inspect.isclass(target):
        verl_shaped = all(hasattr(target, m) for m in ("create", "execute", "release"))
        return VerlTool(target) if verl_shaped else ClassTool(target)
    if callable(target):
        return FunctionTool(target)
    raise ToolError(f'tool "{ref}" is neither a function nor a class')


class Toolbox:
    """The tools of an agent node; `open` gives one request its Session."""

    def __init__(self, refs, base_dir: str | Path = "."):
        self.tools = [make_tool(ref, base_dir) for ref in refs]
        self.schemas = [s for tool in self.tools for s in tool.schemas]
        self.names = [n for tool in self.tools for n in tool.names]
        twice = sorted({n for n in self.names if self.names.count(n) > 1})
        if twice:
            raise ToolError(f"tools named twice: {', '.join(twice)}")

    def open(self, tools_kwargs: dict | None, pool=None) -> Session:
        return Session(self, tools_kwargs or {}, pool)
