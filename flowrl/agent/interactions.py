"""An agent node's interactions (the user's side of a conversation), resolved from its params:

- `interaction = "file.py:reply"`: flowrl's function `reply(messages, **interaction_kwargs) ->
  (done, text, reward)`, sync or async, for every row (`FunctionInteraction`);
- `interaction = "file.py:Cls"`: a verl `BaseInteraction`-shaped class, instantiated as verl's
  registry does, for every row;
- `interaction_config = "interaction.yaml"`: verl's interaction YAML; each row picks one by
  `extra_info.interaction_kwargs.name`, as verl's agent loop does.

`as_interaction` takes the object itself too (a function, a class, an instance):
`flowrl.testing.scripted_request` passes what a test hands it. Every interaction has a `name`
(verl's, or the function's), which metrics and the tiny run's summary show.

No torch: `flowrl check` instantiates them here.
"""

from __future__ import annotations

import inspect

from flowrl.agent.tools import ToolError, load_object
from flowrl.agent.tools.session import maybe_await
from flowrl.agent.verl import (
    VerlInteraction,
    binding_problem,
    default_name,
    interaction_entries,
    is_verl_interaction,
    load_interaction_config,
    make_interaction,
)


class FunctionInteraction:
    """flowrl's interaction function `reply(messages, **kwargs) -> (done, text, reward)`
    (sync or async) with verl's interaction lifecycle."""

    def __init__(self, function, name: str = ""):
        self.function = function
        self.name = name or getattr(function, "__name__", "reply")

    def refuses(self, kwargs: dict) -> list[str]:
        """Why a row's interaction_kwargs cannot be passed to the function."""
        problem = binding_problem(self.function, ([],), kwargs)
        return [f"{getattr(self.function, '__name__', 'reply')}{problem}"] if problem else []

    async def start(self, request_id: str, **kwargs) -> None:
        return None

    async def reply(self, request_id: str, messages: list, **kwargs):
        return await maybe_await(self.function(messages, **kwargs))

    async def finish(self, request_id: str) -> None:
        return None


def load_interactions(reference: str, config: str, base_dir: str, env: str = "") -> dict:
    """{name: interaction}: a verl interaction YAML's by name, or "" -> the one `interaction`
    names (a function, or a verl BaseInteraction class with verl's default name), or the
    environment `env` names (Gymnasium's API or an OpenEnv `Environment`: `environment`)."""
    if env:
        return {"": environment(load_object(env, base_dir, "env"), env)}
    if config:
        return load_interaction_config(config, base_dir)
    if not reference:
        return {}
    return {"": as_interaction(load_object(reference, base_dir, "interaction"), reference)}


def environment(cls, label: str):
    """The interaction of an environment class: an OpenEnv `Environment` (served on loopback,
    flowrl/agent/openenv_envs.py), else a Gymnasium-shaped one (flowrl/agent/environments.py)."""
    from flowrl.agent.environments import EnvironmentInteraction
    from flowrl.agent.openenv_envs import OpenEnvInteraction, is_openenv

    if is_openenv(cls):
        return OpenEnvInteraction(cls, label=label)
    return EnvironmentInteraction(cls, label=label)


def as_interaction(target, label: str = ""):
    """An interaction from what a reference names or a test passes: a verl `BaseInteraction`
    class (instantiated as verl's registry does, with verl's default name), an instance of
    one, a reply function, or an interaction already adapted."""
    label = label or getattr(target, "__qualname__", None) or repr(target)
    if isinstance(target, FunctionInteraction | VerlInteraction):
        return target
    from flowrl.agent.environments import EnvironmentInteraction, is_environment
    from flowrl.agent.openenv_envs import OpenEnvInteraction, is_openenv

    if isinstance(target, EnvironmentInteraction | OpenEnvInteraction):
        return target
    if is_openenv(target) or is_environment(target):  # an environment class of text
        return environment(target, label)
    if inspect.isclass(target):
        if not is_verl_interaction(target):
            raise ToolError(
                f'interaction "{label}": a class needs generate_response (verl\'s '
                "BaseInteraction), or give a function reply(messages, **kwargs)"
            )
        return make_interaction(target, default_name(target.__name__))
    if is_verl_interaction(target):  # an instance, already configured
        name = getattr(target, "name", "") or default_name(type(target).__name__)
        return VerlInteraction(target, str(name))
    if callable(target):
        return FunctionInteraction(target)
    raise ToolError(
        f'interaction "{label}" is a {type(target).__name__}: give a function reply(messages, '
        "**kwargs) -> (done, text, reward) or a verl BaseInteraction class"
    )


def interaction_sources(reference: str, config: str, base_dir: str) -> dict[str, str]:
    """{name: where it comes from} of the interactions `load_interactions` would give, under
    the names their requests' metrics use, without instantiating any: a YAML's entries
    ("interaction.yaml: pkg.module.Class"), or the one reference (its file imported)."""
    if config:
        entries = interaction_entries(config, base_dir)
        return {name: f"{config}: {item['class_name']}" for name, item in entries.items()}
    if not reference:
        return {}
    target = load_object(reference, base_dir, "interaction")
    name = getattr(target, "__name__", reference)
    return {default_name(name) if inspect.isclass(target) else name: reference}


def pick_interaction(interactions: dict, kwargs: dict):
    """A row's interaction: the only one, or the one its `interaction_kwargs.name` names
    (verl's rule; raises as verl does when it names none or an unknown one)."""
    if not interactions:
        return None
    if "" in interactions:
        return interactions[""]
    name = kwargs.get("name")
    if name is None:
        raise ValueError("'name' key is required in interaction_kwargs")
    if name not in interactions:
        raise ValueError(f"interaction {name!r} is not one of {sorted(interactions)}")
    return interactions[name]
