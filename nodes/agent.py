"""Multi-turn rollout with tools: `generate` plus a tool loop, per request a state machine.

reads: prompts, prompt_mask, raw_prompt, extra_info -> writes: responses, response_mask,
response_attention, response_text, rollout_logprobs, rollout_info

Each (prompt, sample) is a request (flowrl/agent/episode.py): the policy samples a turn; calls
in it are parsed, run (concurrently, each under a timeout) and their output appended as tokens
the policy did not sample; until a turn makes no call or a limit ends it. All requests advance
turn by turn on the engine's KV cache (flowrl/engines/wave_rollout.py). `response_mask` is 1
on sampled tokens only; `response_attention` on tool output too. `rollout_info` carries each
request's turns, calls, tool rewards and why it ended (verl's names), for reward.rule with
`rollout_info = true`. Replaces [nodes.generate] in a graph; docs/multi-turn.md.
"""

from __future__ import annotations

import concurrent.futures
import time

import attrs

from flowrl.front.validators import MAX_TOKENS, Rule, checked, count, one_of, positive
from flowrl.nodespec import PHASES, CheckContext, Finding, NodeSpec, RolloutParams


def _names() -> Rule:
    return Rule("a list of distinct tool names or references", lambda v: len(set(v)) == len(v))


@attrs.frozen
class Params(RolloutParams):
    max_new_tokens: int = checked(256, count(1, MAX_TOKENS))  # whole response, sampled + tool
    tools: tuple[str, ...] = checked((), _names())  # built-in names or "file.py:name"
    parser: str = "hermes"  # "hermes", "tag" (<name>argument</name>) or "file.py:parse"
    max_turn_tokens: int = checked(0, count(0, MAX_TOKENS))  # one turn; 0 = max_new_tokens
    max_assistant_turns: int = checked(4, count(1, 10_000))  # assistant turns per request
    max_calls_per_turn: int = checked(1, count(1, 10_000))  # more get an error
    max_obs_tokens: int = checked(256, count(1, MAX_TOKENS))  # one output, else cut
    tool_timeout_s: float = checked(10.0, positive())  # one call
    request_timeout_s: float = checked(120.0, positive())  # one request's time in tools, summed
    max_invalid_calls: int = checked(3, count(0, 10_000))  # in a row; 0 = no limit
    obs_role: str = checked("tool", one_of(("tool", "user")))  # role of tool output
    solution: str = checked(
        "assistant", one_of(("assistant", "full"))
    )  # response_text; full = verl
    interaction: str = ""  # "file.py:reply", reply(messages, **kwargs) -> (done, text, reward)
    max_user_turns: int = checked(0, count(0, 10_000))  # interaction replies per request
    script_first_turn: bool = False  # first turn = a call of each tool (--tiny sets it)


def limits(p: Params):
    from flowrl.agent.episode import Limits

    return Limits(
        max_new_tokens=p.max_new_tokens,
        max_turn_tokens=p.max_turn_tokens or p.max_new_tokens,
        **{f: getattr(p, f) for f in ("max_assistant_turns", "max_calls_per_turn")},
        **{f: getattr(p, f) for f in ("max_obs_tokens", "tool_timeout_s", "request_timeout_s")},
        **{f: getattr(p, f) for f in ("max_invalid_calls", "max_user_turns", "obs_role")},
    )


def check(p: Params, context: CheckContext) -> list[Finding]:
    """Every limit, the tools, parser and interaction, and the chat template's appending."""
    from flowrl.agent.checks import agent_findings

    return agent_findings(p, context)


def scripted_turn(setup, p: Params) -> list[int]:
    """The ids of a first turn that calls each tool once (flowrl/agent/script.py), ending
    the turn; [] for a parser of the user's own."""
    from flowrl.agent.script import first_turn_text

    text = first_turn_text(setup.toolbox.schemas, p.parser)
    if not text:
        return []
    return setup.chat.tokenizer(text, add_special_tokens=False)["input_ids"] + [setup.chat.eos]


class AgentWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        from flowrl.agent.driver import run_sync, run_waves
        from flowrl.agent.rows import agent_metrics, agent_setup, assemble, episodes_for
        from flowrl.engines.wave_rollout import WaveRollout
        from flowrl.nodes.generate import generation_metrics, step_generator

        p, start = self.params, time.perf_counter()
        setup = agent_setup(p, batch.meta.get("base_dir", "."), self.engine.tokenizer)
        pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="flowrl-tool")
        wave = WaveRollout(
            self.engine,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            do_sample=p.do_sample,
            generator=step_generator(batch.meta, self.engine.device),
            first_turn=scripted_turn(setup, p) if p.script_first_turn else (),
        )
        try:
            episodes = episodes_for(batch, setup, limits(p), p.n, pool)
            wave.start(batch["prompts"], batch["prompt_mask"], p.n, p.max_new_tokens)
            stats = run_sync(run_waves(episodes, wave))
        finally:
            wave.close()
            pool.shutdown(wait=False, cancel_futures=True)  # a hung sync tool keeps its thread
        out = assemble(episodes, self.engine.pad, p.solution)
        metrics = generation_metrics(out["response_mask"], time.perf_counter() - start)
        # decode and tool phases go to the run's trace, on this rank's track
        return out, {**metrics, **agent_metrics(episodes, stats), PHASES: stats.phases}


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask", "raw_prompt", "extra_info"),
    writes=(
        "responses",
        "response_mask",
        "response_attention",
        "response_text",
        "rollout_logprobs",
        "rollout_info",
    ),
    params=Params,
    worker=AgentWorker,
    mode="rollout",
    head="lm",
    rows="repeat",
    multi_turn=True,
    check=check,
)
