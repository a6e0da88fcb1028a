"""An agent node's interactions (the user's side of a conversation), resolved from its params:

- `interaction = "file.py:reply"`: flowrl's function `reply(messages, **interaction_kwargs) ->
  (done, text, reward)`, sync or async, for every row (`FunctionInteraction`);
- `interaction = "file.py:Cls"`: a verl `BaseInteraction`-shaped class, instantiated as verl's
  registry does, for every row;
- `interaction_config = "interaction.yaml"`: verl's interaction YAML; each row picks one by
  `extra_info.interaction_kwargs.name`, as verl's agent loop does.

No torch: `flowrl check` instantiates them here.
"""

from __future__ import annotations

import inspect

from flowrl.agent.objects import ToolError, load_object
from flowrl.agent.session import maybe_await
from flowrl.agent.verl import (
    binding_problem,
    default_name,
    is_verl_interaction,
    load_interaction_config,
    make_interaction,
)


class FunctionInteraction:
    """flowrl's interaction function `reply(messages, **kwargs) -> (done, text, reward)`
    (sync or async) with verl's interaction lifecycle."""

    def __init__(self, function):
        self.function = function

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


def load_interactions(reference: str, config: str, base_dir: str) -> dict:
    """{name: interaction}: a verl interaction YAML's by name, or "" -> the one `interaction`
    names (a function, or a verl BaseInteraction class with verl's default name)."""
    if config:
        return load_interaction_config(config, base_dir)
    if not reference:
        return {}
    target = load_object(reference, base_dir, "interaction")
    if inspect.isclass(target):
        if not is_verl_interaction(target):
            raise ToolError(f'interaction "{reference}": a class needs generate_response')
        return {"": make_interaction(target, default_name(target.__name__))}
    return {"": FunctionInteraction(target)}


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
