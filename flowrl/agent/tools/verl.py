"""verl's tools and tool config YAML, run as they are.

- `VerlTool` adapts a `BaseTool`-shaped class (verl/tools/base_tool.py): `__init__(config,
  tool_schema)`, async `create(instance_id, **kw) -> (id, ToolResponse)`, `execute(id,
  parameters, **kw) -> (ToolResponse, step_reward, metrics)`, `calc_reward(id)`,
  `release(id)`. flowrl follows verl's SGLang rollout lifecycle: `create` once per request
  (with the row's `tools_kwargs[name].create_kwargs`), every call of the request on that
  instance, then `calc_reward` and `release` once when it ends. verl's agent loop instead
  creates and releases around each call, so a tool's state never survives between two calls;
  the once-per-request lifecycle keeps state (verl's own Gsm8kTool scores the last answer,
  which needs it) and is what the legacy path, where these tools were written, did.
- `load_tool_config` reads verl's tool YAML (`tools: [{class_name, config, tool_schema}]`,
  examples/sglang_multiturn/config/tool_config/*.yaml) the way `initialize_tools_from_config`
  does: `config` reaches the tool; `tool_schema` may be left out when the class has its own.

verl's interactions, which share the YAML reader, are flowrl/agent/verl.py. No torch, no verl
needed.
"""

from __future__ import annotations

import inspect
import uuid
from pathlib import Path

from flowrl.agent.tools import BUILTIN_TOOLS, ToolError, load_object


class Schema(dict):
    """A schema dict that also reads as attributes: verl's pydantic `OpenAIFunctionToolSchema`
    is read as `tool_schema.function.name` and dumped with `model_dump(...)`."""

    def __getattr__(self, key):
        try:
            value = self[key]
        except KeyError as e:
            raise AttributeError(key) from e
        return Schema(value) if isinstance(value, dict) else value

    def model_dump(self, **kwargs) -> dict:
        return dict(self)


def is_verl_tool(cls) -> bool:
    return all(callable(getattr(cls, m, None)) for m in ("create", "execute", "release"))


def reference(class_name: str, folder: Path) -> str:
    """verl's dotted "pkg.module.Class" as a flowrl reference: "pkg/module.py:Class" when
    that file sits in the YAML's folder, else "pkg.module:Class" (importable); a flowrl
    reference with a colon, or a built-in tool's name ("sandbox_fusion"), passes through."""
    if ":" in class_name or class_name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS.get(class_name, class_name)
    module, _, name = class_name.rpartition(".")
    file = (folder / (module.replace(".", "/") + ".py")).resolve()
    return f"{file}:{name}" if file.is_file() else f"{module}:{name}"


class VerlTool:
    """One verl tool instance shared by the requests of a rank; one `create`d id each."""

    verl = True  # a failed call gives a 0.0 step reward, as verl's agent loop

    def __init__(self, cls, config: dict | None = None, schema: dict | None = None):
        schema = schema or getattr(cls, "tool_schema", None)
        if isinstance(schema, dict):
            schema = Schema(schema)
        try:
            self.tool = cls(config=dict(config or {}), tool_schema=schema)
        except Exception as e:
            hint = (  # a schema it was not given may be what it lacked
                ""
                if schema is not None
                else " (a verl tool takes its schema from the tool YAML's tool_schema or its "
                "class attribute tool_schema)"
            )
            raise ToolError(
                f"{cls.__qualname__}(config=..., tool_schema=...) raised {type(e).__name__}: "
                f"{e}{hint}"
            ) from e
        schema = getattr(self.tool, "tool_schema", None) or schema
        if schema is None:
            raise ToolError(f"{cls.__qualname__}: no tool_schema (give one in the tool YAML)")
        dumped = (
            dict(schema)
            if isinstance(schema, dict)
            else schema.model_dump(exclude_unset=True, exclude_none=True)
        )
        if "function" not in dumped:
            raise ToolError(f'{cls.__qualname__}: its tool_schema has no "function"')
        self.schemas = [dumped]
        self.names = [dumped["function"]["name"]]
        parameters = dumped["function"].get("parameters") or {}
        self.parameters = list(parameters.get("properties") or {})
        self.required = list(parameters.get("required") or [])

    def keys(self) -> list[str]:
        """The names a row's tools_kwargs may give this tool's create_kwargs under."""
        return list(self.names)

    def create_kwargs_needed(self) -> list[str]:
        """`create`'s keyword arguments without a default: what rows must supply."""
        signature = inspect.signature(self.tool.create)
        return [
            p.name
            for p in list(signature.parameters.values())[1:]
            if p.default is p.empty and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]

    async def open(self, tools_kwargs: dict):
        entry = tools_kwargs.get(self.names[0]) or {}
        create_kwargs = dict(entry.get("create_kwargs") or {})
        kwargs = dict(create_kwargs)
        parameters = inspect.signature(self.tool.create).parameters
        takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
        if (takes_any or "create_kwargs" in parameters) and "create_kwargs" not in kwargs:
            kwargs["create_kwargs"] = create_kwargs  # how verl's agent loop passes them
        created = await self.tool.create(str(uuid.uuid4()), **kwargs)
        instance_id = created[0] if isinstance(created, tuple) else created
        return instance_id, entry.get("execute_kwargs") or {}

    def handles(self, state) -> dict:
        instance_id, execute_kwargs = state

        async def execute(**arguments):
            return await self.tool.execute(instance_id, arguments, **execute_kwargs)

        execute.__signature__ = inspect.Signature(
            [
                inspect.Parameter(
                    p,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=inspect.Parameter.empty if p in self.required else None,
                )
                for p in self.parameters
            ]
        )
        return {self.names[0]: execute}

    async def close(self, state) -> dict:
        """calc_reward, then release, which runs whatever calc_reward did."""
        try:
            reward = await self.tool.calc_reward(state[0])
        finally:
            await self.tool.release(state[0])
        return {self.names[0]: reward_value(reward)}


def reward_value(reward):
    """A float, or a list of floats (verl's sandbox tool returns one per submission)."""
    if isinstance(reward, list | tuple):
        return [float(r) for r in reward]
    return float(reward or 0.0)


def read_yaml(path: Path, key: str) -> list:
    import yaml

    if not path.is_file():
        raise ToolError(f"{path}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ToolError(f"{path}: not valid YAML ({e})") from e
    items = (data or {}).get(key) if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ToolError(f"{path}: expected a top-level `{key}:` list, as verl's configs have")
    for k, item in enumerate(items):
        if not isinstance(item, dict) or not item.get("class_name"):
            raise ToolError(f"{path}: {key}[{k}] needs a class_name")
    return items


def load_tool_config(path: str | Path, base_dir: str | Path = ".") -> list[VerlTool]:
    """The tools of a verl tool YAML; `class_name` is verl's "pkg.module.Class" (importable
    from the graph's folder) or flowrl's "file.py:Class"."""
    path = Path(path) if Path(path).is_absolute() else Path(base_dir) / path
    tools = []
    for k, item in enumerate(read_yaml(path, "tools")):
        config = dict(item.get("config") or {})
        kind = config.get("type", "native")
        if kind != "native":
            raise ToolError(f'{path}: tools[{k}] has config.type "{kind}"; only native is run')
        cls = load_object(reference(item["class_name"], path.parent), path.parent)
        if not is_verl_tool(cls):
            raise ToolError(f"{path}: tools[{k}] {item['class_name']} is not a verl BaseTool")
        tools.append(VerlTool(cls, config, item.get("tool_schema")))
    return tools
