"""Running a user's agent program once per episode against the endpoint (docs/agents.md).

A program is either
- a Python function by reference, "file.py:name", sync or async:
      def solve(base_url: str, api_key: str, row: dict) -> float | str | dict
  (a sync one runs on a thread of its own), or
- a command run as a child process (the black-box case), with OPENAI_BASE_URL and
  OPENAI_API_KEY set and the row as JSON on its stdin and in FLOWRL_ROW; its result is the last
  line it prints.

A result is a reward (a finite number), an answer (a string, for the graph's reward node), or
a JSON object / dict with "reward" or "answer". Each episode gets its own key, closed when the
episode ends (a later call with it is refused, 401). Failures are the episode's, never the
step's: "error" (it raised, or the command exited non-zero), "timeout" (past the time limit: a
command is killed with its process group; a sync function's thread cannot be stopped, only its
key closed), "never_called" (it returned without calling the endpoint), "bad_return" (a result
of none of the shapes above). Each is kept with its first error, file:line included.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import shlex
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import attrs

from flowrl.errors import described

KINDS = ("ok", "error", "timeout", "never_called", "bad_return")


@attrs.define
class Outcome:
    """One episode's end: its result (a reward or an answer), how it ended (KINDS), its first
    error, its recorded calls and its seconds."""

    reward: float | None = None
    answer: str | None = None
    kind: str = "ok"
    error: str = ""
    calls: list = attrs.field(factory=list)
    seconds: float = 0.0


def load_program(ref: str, base_dir: str = "."):
    """The function of a "file.py:name" reference, resolved against `base_dir`."""
    from flowrl.agent.tools import load_object

    function = load_object(ref, base_dir, what="agent program")
    if not callable(function):
        raise TypeError(f'agent program "{ref}" is not callable')
    return function


def read_result(value, outcome: Outcome, where: str) -> None:
    """Put a program's result into `outcome`: a reward, an answer, or a bad_return naming
    what came back and the fix."""
    if isinstance(value, dict):
        if "reward" in value:
            value = value["reward"]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                return _bad(outcome, where, f'"reward" is {value!r}, not a number')
        elif "answer" in value:
            value = value["answer"]
            if not isinstance(value, str):
                return _bad(outcome, where, f'"answer" is {type(value).__name__}, not a string')
        else:
            return _bad(outcome, where, f'a dict without "reward" or "answer": {sorted(value)}')
    if isinstance(value, bool):
        value = float(value)
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            return _bad(outcome, where, f"the reward {value} is not finite")
        outcome.reward = float(value)
    elif isinstance(value, str):
        outcome.answer = value
    else:
        return _bad(outcome, where, f"{type(value).__name__} ({value!r:.80})")


def _bad(outcome: Outcome, where: str, what: str) -> None:
    outcome.kind = "bad_return"
    outcome.error = f"{where} returned {what}: return a reward (a number) or an answer (a string)"


async def run_function(function, base_url: str, key: str, row: dict, timeout_s: float, pool=None):
    """The value of `function(base_url, key, row)`, within `timeout_s` (TimeoutError); a sync
    function runs on a thread of `pool` (a ThreadPoolExecutor; None: the loop's default)."""
    if inspect.iscoroutinefunction(function):
        return await asyncio.wait_for(function(base_url, key, row), timeout_s)
    loop = asyncio.get_running_loop()
    call = loop.run_in_executor(pool, function, base_url, key, row)
    return await asyncio.wait_for(call, timeout_s)


async def run_command(command: str, base_url: str, key: str, row: dict, timeout_s: float, cwd: str):
    """The parsed last line the command prints; a RuntimeError with its stderr's tail when it
    exits non-zero; asyncio.TimeoutError (the process group killed) past `timeout_s`."""
    text = json.dumps(row)
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key, "FLOWRL_ROW": text}
    child = await asyncio.create_subprocess_exec(
        *shlex.split(command),
        cwd=cwd,
        env=env,
        start_new_session=True,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(child.communicate(text.encode()), timeout_s)
    except TimeoutError:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await child.wait()
        raise
    if child.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"`{command}` exited with code {child.returncode}: " + " | ".join(tail))
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1].strip()
    try:
        return json.loads(last)
    except json.JSONDecodeError:
        return last


async def run_episodes(
    rows: list[dict],
    program,
    endpoint,
    keys,
    base_url: str,
    *,
    concurrency: int,
    timeout_s: float,
    cwd: str = ".",
    tag: str = "",
) -> list[Outcome]:
    """One episode per row, at most `concurrency` at once, each under `timeout_s`.

    Args:
        program: a function (see the module) or a command string.
        endpoint, keys: the served endpoint (its recorder keeps the calls) and its keys.
        tag: prefixes the episode ids (the step), so a late call of an old episode is never
            recorded under a new one.
    """
    gate = asyncio.Semaphore(concurrency)
    # a thread for each running sync episode (the loop's default pool has cpu_count + 4, and an
    # episode waiting for a thread would spend its time limit there); never joined: a thread
    # past its time limit cannot be stopped, and must not hold the step
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="flowrl-program")
    where = program if isinstance(program, str) else getattr(program, "__qualname__", "program")

    async def one(k: int, row: dict) -> Outcome:
        async with gate:
            episode = f"{tag}{k}"
            key = keys.open(episode)
            outcome, start = Outcome(), time.perf_counter()
            try:
                if isinstance(program, str):
                    value = await run_command(program, base_url, key, row, timeout_s, cwd)
                else:
                    value = await run_function(program, base_url, key, row, timeout_s, pool)
                read_result(value, outcome, where)
            except TimeoutError:
                outcome.kind, outcome.error = "timeout", f"{where} ran past {timeout_s} s"
            except Exception as e:  # the program's own failure: the episode's, kept
                outcome.kind, outcome.error = "error", described(e)
            finally:
                keys.close(key)  # a later call is refused; one still sampling is dropped
                endpoint.cancel(episode)
            outcome.calls = endpoint.recorder.take(episode)
            outcome.seconds = time.perf_counter() - start
            if outcome.kind == "ok" and not outcome.calls:
                outcome.kind = "never_called"
                outcome.error = f"{where} returned without calling the endpoint"
            return outcome

    try:
        return list(await asyncio.gather(*(one(k, row) for k, row in enumerate(rows))))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
