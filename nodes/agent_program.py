"""Rollout by an agent program of the user's own, through an OpenAI-compatible endpoint.

reads: prompts, prompt_mask, raw_prompt, extra_info -> writes: responses, response_mask,
response_attention, response_text, rollout_logprobs, rollout_info (+ scores with
`returns = "reward"`)

The worker serves the rollout engine on 127.0.0.1 (flowrl/serve/) and runs the program once
per (row, sample): a function "file.py:name" (sync or async) given the endpoint's base URL,
its episode's key and the row ({"prompt": messages, "extra_info": ..., "index", "sample"}), or
a `command` run as a child process with OPENAI_BASE_URL / OPENAI_API_KEY set (the row on its
stdin), or `env = "verifiers:..."`: a verifiers environment's episode for the row's task
(flowrl/serve/verifiers_envs.py; its rubric's reward, with `returns = "reward"`). A call
that sets no temperature / top_p / top_k gets the node's; with `do_sample = false`
(validation) every call is greedy; `max_new_tokens` caps each call. Every call is
recorded (prompt ids, completion ids, log-probs, policy version); the episode's row is its
calls from the row's prompt on: each completion trained (mask 1), what the program added
between calls attended to (mask 0). A call that rewrites the history starts a new segment:
with `max_segments = k` each episode has k rows, its first k segments (then empty rows) with
`episode_share` 1/k so grpo and rloo take group statistics over episodes; segments past k,
or whose prompt rewrote the row's own messages, are counted (`segments_dropped`), not
trained. A program that fails (raises, hangs past
`episode_timeout_s`, never calls, returns nothing usable, starts from another prompt) trains
on nothing, counted by kind with its first error shown. docs/agents.md.
"""

from __future__ import annotations

import time
from pathlib import Path

import attrs

from flowrl.nodes.agent import SPEC as AGENT
from flowrl.nodespec import NodeSpec, RolloutParams
from flowrl.params import checked, count, one_of, positive


@attrs.frozen
class Params(RolloutParams):
    program: str = ""  # "file.py:function" (sync or async): (base_url, api_key, row) -> result
    command: str = ""  # or a command line run per episode (OPENAI_BASE_URL, OPENAI_API_KEY)
    env: str = ""  # or "verifiers:file.py" / "verifiers:<id>": a verifiers environment's episodes
    returns: str = checked("answer", one_of(("answer", "reward")))  # reward: writes scores
    max_concurrent: int = checked(8, count(1, 4096))  # episodes running at once
    episode_timeout_s: float = checked(120.0, positive())  # one episode, wall time
    parser: str = "hermes"  # the endpoint's tool-call parser: "hermes", "tag", "file.py:fn"
    max_segments: int = checked(1, count(1, 16))  # rows per episode: one per history rewrite


def check(p: Params, context) -> list:
    from flowrl.hooks import Finding

    if sum(map(bool, (p.program, p.command, p.env))) != 1:
        fix = 'program = "agent.py:solve", command = "python agent.py" or env = "verifiers:..."'
        return [Finding("give exactly one of program, command and env", fix)]
    if p.env:
        return _env_findings(p, context)
    file, _, name = p.program.rpartition(":")
    if p.program and not (file.endswith(".py") and name):
        return [
            Finding(
                f'program = "{p.program}" is not "file.py:function"', 'e.g. "my_agent.py:solve"'
            )
        ]
    if p.program and not (Path(context.base_dir) / file).is_file():
        where = Path(context.base_dir) / file
        return [
            Finding(
                f'program = "{p.program}": no file {where}',
                "give the path relative to the graph's folder",
            )
        ]
    return []


def _env_findings(p: Params, context) -> list:
    from flowrl.hooks import Finding

    ref = p.env.removeprefix("verifiers:")
    if not p.env.startswith("verifiers:") or not ref:
        fix = 'env = "verifiers:my_env.py" (a file next to the graph) or "verifiers:<env id>"'
        return [Finding(f'env = "{p.env}" is not a verifiers environment', fix)]
    out = []
    if ref.endswith(".py") and not (Path(context.base_dir) / ref).is_file():
        where = Path(context.base_dir) / ref
        out.append(Finding(f'env = "{p.env}": no file {where}', "give it relative to the graph"))
    if p.returns != "reward":
        what = "a verifiers environment's rubric scores its episodes"
        out.append(Finding(what, 'returns = "reward"'))
    return out


class ProgramWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params, self.server, self.step = engine, params, None, 0

    def _serve(self):
        from flowrl.serve.app import Keys
        from flowrl.serve.endpoint import Endpoint
        from flowrl.serve.record import Recorder
        from flowrl.serve.server import Server

        endpoint = Endpoint(
            self.engine,
            model_name="policy",
            parser=self.params.parser,
            max_tokens=self.params.max_new_tokens,
            recorder=Recorder(),
        )
        return Server(endpoint, Keys(required=True)).start()

    def _program(self, base_dir: str):
        """The function run per episode: the program's, or a verifiers environment's episode
        (flowrl/serve/verifiers_envs.py), loaded once."""
        from flowrl.serve.programs import load_program

        if not self.params.env:
            return load_program(self.params.program, base_dir)
        if getattr(self, "verifiers", None) is None:
            from flowrl.serve.verifiers_envs import VerifiersProgram

            self.verifiers = VerifiersProgram(self.params.env, base_dir)
        return self.verifiers.episode

    def __call__(self, batch):
        from flowrl.engines.rollout import Sampling
        from flowrl.nodes.generate import generation_metrics, step_seed
        from flowrl.serve.program_rows import (
            program_metrics,
            program_rows,
            refused,
            rows_for,
            segment_metrics,
        )
        from flowrl.serve.programs import run_episodes

        p, start = self.params, time.perf_counter()
        base_dir = batch.meta.get("base_dir", ".")
        if self.server is None:
            self.server = self._serve()
        endpoint = self.server.endpoint
        endpoint.set_version(int(batch.meta.get("step", 0)))
        endpoint.seed = step_seed(batch.meta)
        # the node's sampling for calls that give none; do_sample = false (validation): greedy
        endpoint.sampling = Sampling(p.temperature, p.top_p, p.top_k, p.do_sample)
        program = p.command or self._program(base_dir)
        rows, prompts = rows_for(batch, p.n)
        self.step, refused_before = self.step + 1, refused(endpoint)
        outcomes = self.engine.run(
            run_episodes(
                rows,
                program,
                endpoint,
                self.server.keys,
                self.server.base_url,
                concurrency=p.max_concurrent,
                timeout_s=p.episode_timeout_s,
                cwd=base_dir,
                tag=f"{self.step}:",
            )
        )
        out = program_rows(
            outcomes, prompts, self.engine.tokenizer, self.engine.pad, p.returns, p.max_segments
        )
        metrics = generation_metrics(out["response_mask"], time.perf_counter() - start)
        refused_now = refused(endpoint) - refused_before
        return out, {**metrics, **program_metrics(outcomes, refused_now), **segment_metrics(out)}


SPEC = NodeSpec(
    reads=AGENT.reads,  # what the agent node reads and writes: it takes the agent node's place
    writes=AGENT.writes,
    optional_writes={
        "scores": lambda p: p.returns == "reward",
        "episode_share": lambda p: p.max_segments > 1,
    },
    params=Params,
    worker=ProgramWorker,
    mode="rollout",
    head="lm",
    rows="repeat",
    multi_turn=True,
    check=check,
)
