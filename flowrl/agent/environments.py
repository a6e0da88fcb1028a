"""A Gymnasium environment with text observations and actions, run as an agent node's
interaction (`env = "file.py:Cls"` on `uses = "agent"`; docs/agents.md "Environments").

Per request, a fresh instance of the class (`Cls()`, or `Cls(**env_kwargs)`):

    start   obs, info = env.reset(seed=<the request's seed>, options=<the row's
            interaction_kwargs, or None>)          obs: the first user message, before turn 1
    reply   obs, reward, terminated, truncated, info = env.step(<the model's last turn>)
            obs: the next user message; reward: this turn's, kept in rollout_info's
            `turn_rewards`; terminated or truncated ends the request, the two kept apart
            (rollout_info's `env_terminated`, `env_truncated`)
    finish  env.close()

The class is Gymnasium's API (`gymnasium.Env`, or any class with its `reset` and `step`):
Gymnasium itself is not imported here. What the environment returns is checked where it comes
back: an observation that is neither text nor a dict of fields (read as "name: value"
lines), a reward that is no finite number, `terminated` or `truncated` that are not booleans,
or a `step` that does not return five values fail the request with the environment's
file:line and what it returned.

No torch.
"""

from __future__ import annotations

import inspect
import math
import numbers

from flowrl import contracts
from flowrl.agent.tools import ToolError


def is_environment(cls) -> bool:
    """A Gymnasium-shaped class: `reset` and `step`, and not a verl interaction."""
    return (
        inspect.isclass(cls)
        and callable(getattr(cls, "reset", None))
        and callable(getattr(cls, "step", None))
        and not callable(getattr(cls, "generate_response", None))
    )


class EnvironmentInteraction:
    """An environment class as flowrl's interaction: one instance per request."""

    takes_seed = True  # the episode passes its request's seed to `start`

    def __init__(self, cls, env_kwargs: dict | None = None, label: str = ""):
        if not is_environment(cls):
            raise ToolError(
                f'env "{label or cls!r}": a class with Gymnasium\'s reset(seed=, options=) and '
                "step(action) -> (observation, reward, terminated, truncated, info)"
            )
        self.cls, self.env_kwargs = cls, dict(env_kwargs or {})
        self.name = getattr(cls, "__name__", "env")
        self.place = contracts.place(cls)
        self.envs: dict[str, object] = {}
        self.ended: dict[str, tuple[bool, bool]] = {}

    def refuses(self, kwargs: dict) -> list[str]:
        return []  # the row's interaction_kwargs go to reset as `options`

    async def start(self, request_id: str, seed: int | None = None, **kwargs) -> str:
        env = self.cls(**self.env_kwargs)
        self.envs[request_id] = env
        out = env.reset(seed=seed, options=kwargs or None)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise self._bad("reset", "(observation, info)", out)
        return self._text("reset", out[0])

    async def reply(self, request_id: str, messages: list, **kwargs):
        action = next(
            (m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"),
            "",
        )
        out = self.envs[request_id].step(action)
        if not (isinstance(out, tuple) and len(out) == 5):
            raise self._bad("step", "(observation, reward, terminated, truncated, info)", out)
        observation, reward, terminated, truncated, _ = out
        text = self._text("step", observation)
        if not _finite(reward):
            raise self._bad("step", "a finite number as its reward", reward)
        for name, flag in (("terminated", terminated), ("truncated", truncated)):
            if not isinstance(flag, bool) and type(flag).__name__ != "bool_":  # numpy's too
                raise self._bad("step", f"a bool as `{name}`", flag)
        self.ended[request_id] = (bool(terminated), bool(truncated))
        return bool(terminated or truncated), text, float(reward)

    def outcome(self, request_id: str) -> dict:
        """What the environment said of the request's end (for rollout_info)."""
        terminated, truncated = self.ended.get(request_id, (False, False))
        return {"env_terminated": terminated, "env_truncated": truncated}

    async def finish(self, request_id: str) -> None:
        env = self.envs.pop(request_id, None)
        self.ended.pop(request_id, None)
        close = getattr(env, "close", None)
        if callable(close):
            close()

    def _text(self, method: str, observation) -> str:
        """The observation the model reads: a str as it is; a dict (a `spaces.Dict` of text
        and numbers) as "name: value" lines, as an OpenEnv observation of several fields."""
        if isinstance(observation, dict) and all(isinstance(k, str) for k in observation):
            from flowrl.agent.openenv_envs import observation_text

            return observation_text(observation, list(observation))
        if not isinstance(observation, str):
            raise self._bad(
                method, "text (a str, or a dict of fields) as its observation", observation
            )
        return observation

    def _bad(self, method: str, wanted: str, got) -> TypeError:
        return TypeError(
            f"env {self.name}.{method} ({self.place}) returned {_show(got)}; it must return "
            f"{wanted}: an environment of text observations and actions"
        )


def _finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _show(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
