"""An OpenEnv environment with text actions and observations, run as an agent node's
interaction (`env = "file.py:Cls"` where Cls subclasses `openenv.core.env_server.Environment`;
docs/agents.md "Environments (OpenEnv)").

The class is served as OpenEnv serves it, by `openenv-core`'s own FastAPI app
(`create_fastapi_app`) under uvicorn on 127.0.0.1 (a free port, in a thread of the worker), and
each request talks to it through OpenEnv's client (`GenericEnvClient`, one WebSocket session per
request: OpenEnv's HTTP reset/step make a new environment per call):

    start   client.reset(seed=<the request's seed>, **<the row's interaction_kwargs>)
            the observation's text is the first user message, before turn 1
    reply   client.step(<the action with its text field set to the model's turn>)
            -> the observation's text (the next user message), its reward (this turn's,
            `turn_rewards`; None counts 0) and `done`, which ends the request
    finish  client.close()

OpenEnv has one `done` (no terminated / truncated split): it is kept as `env_terminated`,
and `env_truncated` is False. Text: the action model (the class's first type argument,
`Environment[Act, Obs, State]`) needs one required str field, every other field with a
default (the model's turn goes there), or else the graph is refused when it is loaded, with
the class's file:line; the observation model's text is its one str field, or all its fields
(but done, reward, metadata) as "name: value" lines. A class that does not declare
`SUPPORTS_CONCURRENT_SESSIONS = True` gets a server per concurrent request (OpenEnv refuses a
second session on one), reused by later requests.

No torch; openenv is imported when the first request starts (it imports gradio: seconds).
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
import threading
import typing

from flowrl import contracts
from flowrl.agent.tools import ToolError

ENVIRONMENT_BASES = ("openenv.core.env_server.interfaces", "openenv.core.env_server")
SERVER_START_S = 30.0


def is_openenv(cls) -> bool:
    """An OpenEnv environment class: a subclass of openenv-core's `Environment` (found by its
    module, so checking a graph need not import openenv)."""
    return isinstance(cls, type) and any(
        base.__name__ == "Environment" and base.__module__ in ENVIRONMENT_BASES
        for base in cls.__mro__[1:]
    )


def model_types(cls) -> tuple[type | None, type | None]:
    """(action model, observation model) from `Environment[Act, Obs, State]` in cls's bases."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if origin is not None and is_openenv_base(origin):
                args = typing.get_args(base)
                if len(args) >= 2 and all(isinstance(a, type) for a in args[:2]):
                    return args[0], args[1]
    return None, None


def is_openenv_base(origin) -> bool:
    return getattr(origin, "__name__", "") == "Environment" and origin.__module__ in (
        ENVIRONMENT_BASES
    )


OBSERVATION_SKIP = ("done", "reward", "metadata")


def action_field(model: type) -> str | None:
    """The field of the action model the model's turn goes into: its one str field, or of
    several its one required str field when every other field has a default; None if the text
    alone cannot make the action."""
    fields = {k: f for k, f in getattr(model, "model_fields", {}).items() if k != "metadata"}
    texts = [k for k, f in fields.items() if f.annotation is str]
    required = [k for k, f in fields.items() if f.is_required()]
    if len(texts) == 1 and set(required) <= set(texts):
        return texts[0]
    chosen = [k for k in texts if k in required]
    return chosen[0] if len(chosen) == 1 and len(required) == 1 else None


def observation_text(observation: dict, fields: list[str]) -> str:
    """What the model reads of an observation: its one str field as it is, else every field
    (in the model's order, the empty ones left out) as "name: value" lines."""
    if len(fields) == 1 and isinstance(observation.get(fields[0]), str):
        return observation[fields[0]]
    lines = []
    for name in fields:
        value = observation.get(name)
        if value is None or value == "" or value == [] or value == {}:
            continue
        if isinstance(value, str | numbers.Number):  # numpy's scalars too
            shown = str(value)
        else:
            shown = json.dumps(value, default=str)
        lines.append(f"{name}: {shown}")
    return "\n".join(lines)


class OpenEnvInteraction:
    """An OpenEnv environment class as flowrl's interaction: one client session per request."""

    takes_seed = True  # the episode passes its request's seed to `start`

    def __init__(self, cls, label: str = ""):
        self.cls, self.name = cls, getattr(cls, "__name__", "env")
        self.place, label = contracts.place(cls), label or self.name
        action, observation = model_types(cls)
        fix = (
            f"declare the models: class {self.name}(Environment[MyAction, MyObservation, "
            "State]), MyAction with one required str field (the model's turn, its other fields "
            "with defaults), MyObservation with the fields the model reads"
        )
        if action is None:
            raise ToolError(f'env "{label}": {self.place}: no action and observation models; {fix}')
        self.action_field = action_field(action)
        if self.action_field is None:
            found = {k: f.annotation for k, f in action.model_fields.items() if k != "metadata"}
            shown = ", ".join(f"{k}: {getattr(t, '__name__', t)}" for k, t in found.items())
            raise ToolError(
                f'env "{label}": {self.place}: its action model {action.__name__} '
                f"({shown or 'no fields'}) cannot be made from the model's text: an environment "
                f"of text needs one required str field, every other with a default: {fix}"
            )
        skip = OBSERVATION_SKIP
        self.observation_fields = [k for k in observation.model_fields if k not in skip]
        if not self.observation_fields:
            raise ToolError(
                f'env "{label}": {self.place}: its observation model {observation.__name__} has '
                f"no field but done, reward and metadata: nothing for the model to read: {fix}"
            )
        self.action, self.observation = action, observation
        self.concurrent = bool(getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False))
        self.servers: list[LoopbackServer] = []  # started, not serving a request
        self.all_servers: list[LoopbackServer] = []
        self.sessions: dict[str, tuple] = {}  # request id -> (client, server)
        self.ended: dict[str, bool] = {}
        self.lock, self.starting = threading.Lock(), threading.Lock()

    def refuses(self, kwargs: dict) -> list[str]:
        return []  # the row's interaction_kwargs go to reset, which OpenEnv filters by name

    async def start(self, request_id: str, seed: int | None = None, **kwargs) -> str:
        from openenv.core import GenericEnvClient

        server = await asyncio.to_thread(self._server)
        # the sync client: its own loop in a thread, so a request's calls may come from any
        # event loop (the async client's socket belongs to the loop that opened it)
        client = GenericEnvClient(base_url=server.url).sync()
        self.sessions[request_id] = (client, server)
        await asyncio.to_thread(client.connect)
        result = await asyncio.to_thread(client.reset, seed=seed, **kwargs)
        return self._text("reset", result.observation)

    async def reply(self, request_id: str, messages: list, **kwargs):
        client, _ = self.sessions[request_id]
        action = next(
            (m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"),
            "",
        )
        result = await asyncio.to_thread(client.step, {self.action_field: action})
        text = self._text("step", result.observation)
        reward = 0.0 if result.reward is None else result.reward
        if not (isinstance(reward, numbers.Real) and math.isfinite(reward)):
            raise self._bad("step", "a finite number (or None) as its reward", reward)
        if not isinstance(result.done, bool):
            raise self._bad("step", "a bool as `done`", result.done)
        self.ended[request_id] = result.done
        return result.done, text, float(reward)

    def outcome(self, request_id: str) -> dict:
        return {"env_terminated": self.ended.get(request_id, False), "env_truncated": False}

    async def finish(self, request_id: str) -> None:
        client, server = self.sessions.pop(request_id, (None, None))
        self.ended.pop(request_id, None)
        try:
            if client is not None:
                await asyncio.to_thread(client.close)
        finally:
            if server is not None and not self.concurrent:
                with self.lock:
                    self.servers.append(server)

    def close(self) -> None:
        """Stop every server this interaction started."""
        with self.lock:
            servers, self.all_servers, self.servers = self.all_servers, [], []
        for server in servers:
            server.stop()

    def _server(self) -> LoopbackServer:
        """A server with room for one more session: the one server of a class that takes
        concurrent sessions, else a free one of the pool, or a new one."""
        if self.concurrent:
            with self.starting:  # one server, started by the first request
                if not self.all_servers:
                    self.all_servers.append(self._new_server(4096))
                return self.all_servers[0]
        with self.lock:
            if self.servers:
                return self.servers.pop()
        server = self._new_server(1)
        with self.lock:
            self.all_servers.append(server)
        return server

    def _new_server(self, capacity: int) -> LoopbackServer:
        from openenv.core.env_server import create_fastapi_app

        app = create_fastapi_app(self.cls, self.action, self.observation, capacity)
        return LoopbackServer(app).start()

    def _text(self, method: str, observation) -> str:
        if not isinstance(observation, dict):
            raise self._bad(method, "an observation of its model's fields", observation)
        return observation_text(observation, self.observation_fields)

    def _bad(self, method: str, wanted: str, got) -> TypeError:
        shown = repr(got)
        shown = f"{type(got).__name__} {shown[:80]}{'...' if len(shown) > 80 else ''}"
        return TypeError(
            f"env {self.name}.{method} ({self.place}) returned {shown}; it must return {wanted}"
        )


class LoopbackServer:
    """OpenEnv's app on 127.0.0.1 at a free port, on a thread of this process."""

    def __init__(self, app):
        from flowrl.serve.server import Threaded

        self.threaded = Threaded(quiet_disconnects(app), name="an OpenEnv server")
        self.url = self.threaded.url

    def start(self) -> LoopbackServer:
        self.threaded.start(SERVER_START_S)
        return self

    def stop(self) -> None:
        self.threaded.stop()


def quiet_disconnects(app):
    """The app, with a WebSocket closed by its client not logged as the app's error (OpenEnv's
    handler closes the socket again after the client did)."""
    from starlette.websockets import WebSocketDisconnect

    async def wrapped(scope, receive, send):
        try:
            await app(scope, receive, send)
        except WebSocketDisconnect:
            if scope["type"] != "websocket":
                raise

    return wrapped
