"""Tools an agent node may call, referenced from the graph file like scorers.

A reference is a built-in name ("calculator", "python", "answer_check", "sandbox_fusion": see
builtin.py and sandbox_service.py) or "file.py:name" (relative to the graph file) or
"package.module:name", naming one of:

- a function, sync or `async def`, with type hints and a Google-style docstring (its schema
  comes from them: flowrl/agent/tools/schema.py, the output of transformers' `get_json_schema`
  without importing transformers). It returns the text the model
  sees, or (text, step_reward).
- a class with per-request state: `__init__(self, **create_kwargs)` gets the row's
  `extra_info.tools_kwargs[<class or method name>].create_kwargs`; its public documented
  methods are the tools; optional `reward(self) -> float` is called once when the request
  ends and `close(self)` after it (verl's create / execute / calc_reward / release).
- a verl `BaseTool`-shaped class (async `create`, `execute`, `calc_reward`, `release`) with
  its OpenAI schema as the class attribute `tool_schema`, through `VerlTool` (verl.py); or
  the tools of a verl tool YAML (`tool_config`), with their `config`.

A `Toolbox` opens one `Session` per request (session.py), which runs the calls, each in a
daemon thread of its own under a timeout (runner.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path

from flowrl.agent.tools import BUILTIN_TOOLS, ToolError, load_object
from flowrl.agent.tools.schema import function_schema
from flowrl.agent.tools.session import Session, maybe_await
from flowrl.agent.tools.verl import VerlTool, is_verl_tool, load_tool_config

LIFECYCLE = ("reward", "close")  # class-tool methods that are not tools


class FunctionTool:
    """A stateless function: one tool, shared by every request."""

    verl = False  # a failed call gives no step reward

    def __init__(self, function):
        self.function = function
        self.schemas = [function_schema(function)]
        self.names = [self.schemas[0]["function"]["name"]]

    def keys(self) -> list[str]:
        return list(self.names)

    def create_kwargs_needed(self) -> list[str]:
        return []

    async def open(self, tools_kwargs: dict):
        return None

    def handles(self, state) -> dict:
        return {self.names[0]: self.function}

    async def close(self, state) -> dict:
        return {}


class ClassTool:
    """A class whose instance holds one request's state; its public methods are tools."""

    verl = False  # a failed call gives no step reward

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

    def keys(self) -> list[str]:
        """The names a row's tools_kwargs may give this tool's create_kwargs under."""
        return [self.cls.__name__, *self.names]

    def create_kwargs_needed(self) -> list[str]:
        """`__init__`'s arguments without a default: what rows must supply."""
        parameters = list(inspect.signature(self.cls.__init__).parameters.values())[1:]
        return [
            p.name
            for p in parameters
            if p.default is p.empty and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]

    async def open(self, tools_kwargs: dict):
        entry = next((tools_kwargs[k] for k in self.keys() if k in tools_kwargs), {}) or {}
        return self.cls(**(entry.get("create_kwargs") or {}))

    def handles(self, instance) -> dict:
        return {name: getattr(instance, name) for name in self.names}

    async def close(self, instance) -> dict:
        """reward, then close, which runs whatever reward did."""
        out = {}
        try:
            if hasattr(instance, "reward"):
                out[self.cls.__name__] = float(await maybe_await(instance.reward()))
        finally:
            if hasattr(instance, "close"):
                await maybe_await(instance.close())
        return out


def make_tool(ref: str, base_dir: str | Path = ".", sandbox: str = "auto"):
    """The tool a reference names (see the module docstring); the built-in `python` runs
    its code under the agent node's `sandbox` setting (flowrl/agent/tools/sandbox.py)."""
    if ref == "python":
        from flowrl.agent.tools.builtin import python_tool

        return FunctionTool(python_tool(sandbox))
    target = load_object(BUILTIN_TOOLS.get(ref, ref), base_dir)
    if inspect.isclass(target):
        return VerlTool(target) if is_verl_tool(target) else ClassTool(target)
    if callable(target):
        return FunctionTool(target)
    raise ToolError(f'tool "{ref}" is neither a function nor a class')


class Toolbox:
    """The tools of an agent node; `open` gives one request its Session."""

    def __init__(self, refs, base_dir: str | Path = ".", tool_config: str = "", sandbox="auto"):
        self.tools = [make_tool(ref, base_dir, sandbox) for ref in refs]
        if tool_config:
            self.tools += load_tool_config(tool_config, base_dir)
        self.schemas = [s for tool in self.tools for s in tool.schemas]
        self.names = [n for tool in self.tools for n in tool.names]
        twice = sorted({n for n in self.names if self.names.count(n) > 1})
        if twice:
            raise ToolError(f"tools named twice: {', '.join(twice)}")

    def select(self, extra: dict | None) -> list:
        """The tools a row may use, as verl's SGLang rollout chose them: none for
        `agent_name = "single_turn_agent"`; those its `tools_kwargs` name when it names any
        of them; else all."""
        extra = extra if isinstance(extra, dict) else {}
        if extra.get("agent_name") == "single_turn_agent":
            return []
        named = set(extra.get("tools_kwargs") or {})
        chosen = [tool for tool in self.tools if named & set(tool.keys())]
        return chosen or list(self.tools)

    def open(self, extra: dict | None, timeout: float = 60.0) -> Session:
        """The Session of one request, over the tools the row may use."""
        extra = extra if isinstance(extra, dict) else {}
        return Session(self.select(extra), extra.get("tools_kwargs") or {}, timeout)
