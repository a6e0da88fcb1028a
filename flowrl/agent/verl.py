"""verl's interactions, run as they are.

`VerlInteraction` adapts a `BaseInteraction`-shaped class (verl/interactions/base.py);
`load_interaction_config` reads verl's interaction YAML (`interaction: [{name, class_name,
config}]`), injecting `config["name"]` as verl's registry does. verl's tools and tool YAML
are flowrl/agent/tools/verl.py.

No torch, no verl needed.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from flowrl.agent.tools import ToolError, load_object
from flowrl.agent.tools.session import maybe_await
from flowrl.agent.tools.verl import read_yaml, reference
from flowrl.errors import located


def is_verl_interaction(cls) -> bool:
    return callable(getattr(cls, "generate_response", None))


class VerlInteraction:
    """A verl interaction as flowrl's interaction: `start(request_id, **kwargs)`,
    `reply(request_id, messages, **kwargs) -> (done, text, reward)`, `finish(request_id)`."""

    def __init__(self, instance, name: str):
        self.instance, self.name = instance, name

    async def start(self, request_id: str, **kwargs) -> None:
        method = self.instance.start_interaction
        if problem := binding_problem(method, (request_id,), kwargs):  # where, not a bare
            raise TypeError(  # TypeError from inside flowrl
                f"{located(method)}{problem}: give it **kwargs (verl passes the row's "
                "interaction_kwargs to it)"
            )
        await maybe_await(method(request_id, **kwargs))

    async def reply(self, request_id: str, messages: list, **kwargs):
        out = await maybe_await(self.instance.generate_response(request_id, messages, **kwargs))
        done, text, reward = out[:3]  # verl's 4th item (metrics) is not used
        return done, text, reward

    def refuses(self, kwargs: dict) -> list[str]:
        """Why a row's interaction_kwargs cannot be passed to this interaction's methods."""
        out = []
        start = self.instance.start_interaction
        for method, args in ((start, ("id",)), (self.instance.generate_response, ("id", []))):
            problem = binding_problem(method, args, kwargs)
            if problem:
                out.append(f"{method.__name__}{problem}")
        return out

    async def finish(self, request_id: str) -> None:
        finalize = getattr(self.instance, "finalize_interaction", None)
        if finalize is None:
            return
        parameters = inspect.signature(finalize).parameters
        await maybe_await(finalize(request_id) if parameters else finalize())


def binding_problem(function, args: tuple, kwargs: dict) -> str:
    """ "" when `function(*args, **kwargs)` binds, else ": <why>"."""
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError as e:
        return f": {e}"
    except ValueError:  # no signature (a builtin): nothing to check
        pass
    return ""


def make_interaction(cls, name: str, config: dict | None = None) -> VerlInteraction:
    """Instantiate a verl interaction class as verl's registry does: `cls(config=config)`
    with `config["name"]` set."""
    config = {**(config or {}), "name": name}
    try:
        instance = cls(config=config)
    except Exception as e:
        raise ToolError(
            f"interaction {cls.__qualname__}(config={{...}}) raised {type(e).__name__}: {e} "
            "(a verl interaction's __init__ takes one argument, config, a dict)"
        ) from e
    return VerlInteraction(instance, name)


def default_name(class_name: str) -> str:
    """verl's default interaction name: the class name without "Interaction", lower case."""
    simple = class_name.rpartition(".")[2].rpartition(":")[2]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def interaction_entries(path: str | Path, base_dir: str | Path = ".") -> dict:
    """{name: item} of a verl interaction YAML, named as verl's registry names them (the
    entry's `name`, else the class name's default); nothing is imported."""
    path = Path(path) if Path(path).is_absolute() else Path(base_dir) / path
    out = {}
    for item in read_yaml(path, "interaction"):
        name = item.get("name") or default_name(item["class_name"])
        if name in out:
            raise ToolError(f"{path}: interaction name {name!r} is used twice")
        out[name] = item
    return out


def load_interaction_config(path: str | Path, base_dir: str | Path = ".") -> dict:
    """{name: VerlInteraction} of a verl interaction YAML."""
    path = Path(path) if Path(path).is_absolute() else Path(base_dir) / path
    out = {}
    for name, item in interaction_entries(path).items():
        cls = load_object(reference(item["class_name"], path.parent), path.parent, "interaction")
        if not is_verl_interaction(cls):
            raise ToolError(f"{path}: {item['class_name']} has no generate_response")
        out[name] = make_interaction(cls, name, item.get("config"))
    return out
