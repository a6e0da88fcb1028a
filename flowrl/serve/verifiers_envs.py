"""`verifiers` environments (0.4's `verifiers.v1`) as a rollout source: their tasks as a data
source, their episodes as an agent program (docs/agents.md "Environments (verifiers)").

    [data] source = "verifiers:my_game.py"      the environment's tasks as prompt rows
    [nodes.generate] uses = "agent_program"
                     env = "verifiers:my_game.py"

The reference after "verifiers:" is a module verifiers can load: a file next to the graph
("my_game.py": its folder goes on sys.path, its name is the taskset id), or the id of an
installed environment ("guess-game", "owner/guess-game@1.0"). Its `__all__` exports one
`Taskset` (the tasks, their rubric) and may export one `Env` (the multi-turn protocol).

An episode is `env.run_episode(task, ctx)`: the environment runs its protocol, each seat's
program (flowrl's in-process chat harness, `flowrl.serve.verifiers_harness`, in place of the
environment's own) calls verifiers' interception endpoint, which forwards every call to
flowrl's endpoint with the episode's key (so every call is recorded as the program node
records any program's), and the rubric scores the trace: the episode's reward is the
trace's. Rows: a task's row is its system prompt and prompt as the harness sends them, with
`extra_info.task` its index; the program node checks the first call starts from it.

No torch; verifiers is imported when the tasks are read or the first episode starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
from pathlib import Path

PREFIX = "verifiers:"
HARNESS_ID = "flowrl-verifiers-chat"  # verifiers imports it as the module flowrl_verifiers_chat


def taskset_id(reference: str, base_dir: str = ".") -> str:
    """The taskset id verifiers imports for "verifiers:<file.py or id>": a file's folder is
    put on sys.path and its stem is the id."""
    ref = reference.removeprefix(PREFIX)
    if ref.endswith(".py"):
        path = Path(ref) if Path(ref).is_absolute() else Path(base_dir) / ref
        if not path.is_file():
            raise FileNotFoundError(
                f'verifiers environment "{ref}": no file {path} (give it relative to the graph)'
            )
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        return path.stem
    return ref


_ENVS: dict[tuple[str, str], object] = {}


def load_env(reference: str, base_dir: str = "."):
    """The environment of `reference`, each seat's harness flowrl's in-process chat and its
    runtime a local one (an environment's default runtime is a remote sandbox), the rest of
    the environment's configuration as its author set it. One per reference and folder."""
    key = (reference, str(Path(base_dir).resolve()))
    if key in _ENVS:
        return _ENVS[key]
    import verifiers.v1 as vf
    from verifiers.v1.runtimes.subprocess import SubprocessConfig

    from flowrl.serve import verifiers_harness

    # verifiers imports a harness by a top-level module name (a dotted one is looked up
    # inside its own harnesses package): flowrl's is registered under one
    sys.modules.setdefault(HARNESS_ID.replace("-", "_"), verifiers_harness)
    config = vf.resolve_env_config({"taskset": {"id": taskset_id(reference, base_dir)}})
    seats = {
        name: value.model_copy(
            update={"harness": vf.HarnessConfig(id=HARNESS_ID), "runtime": SubprocessConfig()}
        )
        for name, value in config
        if isinstance(value, vf.AgentConfig)
    }
    if len(seats) != 1:
        raise ValueError(
            f'verifiers environment "{reference}" has {len(seats)} agent seats '
            f"({', '.join(seats) or 'none'}): flowrl trains an environment of one agent"
        )
    env = vf.load_environment(config.model_copy(update=seats))
    _ENVS[key] = env
    return env


def tasks(env) -> list:
    """The environment's tasks, in the taskset's order (their `idx`)."""
    if not hasattr(env, "_flowrl_tasks"):
        env._flowrl_tasks = list(env.taskset)
    return env._flowrl_tasks


def task_rows(reference: str, base_dir: str = ".") -> list[dict]:
    """The environment's tasks as data rows: the prompt as the harness sends it (the task's
    system prompt, then its prompt), `extra_info.task` the task's index."""
    from verifiers.v1.dialects.chat import message_to_wire

    env = load_env(reference, base_dir)
    rows = []
    for index, task in enumerate(tasks(env)):
        data = task.data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [message_to_wire(m) for m in data.prompt or ()]
        rows.append(
            {
                "data_source": f"{PREFIX}{reference.removeprefix(PREFIX)}",
                "prompt": messages,
                "extra_info": {"task": index},
                # the task's identity: tasks of one prompt are not one row repeated
                "reward_model": {"style": "environment", "ground_truth": f"task {index}"},
            }
        )
    return rows


class VerifiersProgram:
    """An agent program that runs the environment's episode for a row's task (`episode`, the
    program node's function). verifiers' serving resources (its interception endpoint) are
    held while any episode of this event loop runs: entered by the first, left by the last."""

    def __init__(self, reference: str, base_dir: str = "."):
        self.reference = reference
        self.env = load_env(reference, base_dir)
        self.running, self.lock, self.loop, self.serving = 0, None, None, None

    async def episode(self, base_url: str, api_key: str, row: dict) -> dict:
        import verifiers.v1 as vf

        index = (row.get("extra_info") or {}).get("task")
        all_tasks = tasks(self.env)
        if not isinstance(index, int) or not 0 <= index < len(all_tasks):
            raise ValueError(
                f"the row's extra_info.task is {index!r}, not a task of {self.reference} "
                f'(0..{len(all_tasks) - 1}): use data.source = "{PREFIX}'
                f'{self.reference.removeprefix(PREFIX)}"'
            )
        # verifiers reads the key from an environment variable: one per episode
        variable = f"FLOWRL_EPISODE_KEY_{secrets.token_hex(8)}"
        os.environ[variable] = api_key
        try:
            context = vf.ModelContext(
                model="policy",
                client=vf.EvalClientConfig(base_url=base_url, api_key_var=variable),
            )
            async with self._served():
                episode = await self.env.run_episode(all_tasks[index], context)
        finally:
            os.environ.pop(variable, None)
        errors = [str(e) for e in episode.errors] + [
            str(e) for trace in episode.traces for e in trace.errors
        ]
        if not episode.ok or not episode.traces:
            raise RuntimeError(f"the verifiers episode failed: {'; '.join(errors)[:500]}")
        (trace,) = episode.traces
        return {"reward": float(trace.reward)}

    @contextlib.asynccontextmanager
    async def _served(self):
        loop = asyncio.get_running_loop()
        if self.loop is not loop:  # a new step's loop (the last one's episodes all ended)
            self.loop, self.lock, self.running = loop, asyncio.Lock(), 0
        async with self.lock:
            if self.running == 0:
                self.serving = self.env.serving()
                await self.serving.__aenter__()
            self.running += 1
        try:
            yield
        finally:
            async with self.lock:
                self.running -= 1
                if self.running == 0:
                    serving, self.serving = self.serving, None
                    await serving.__aexit__(None, None, None)
