"""Multi-turn rollout with tools: `generate` plus a tool loop, per request a state machine.

reads: prompts, prompt_mask, raw_prompt, extra_info -> writes: responses, response_mask,
response_attention, response_text, rollout_logprobs, rollout_info

Each (prompt, sample) is a request (flowrl/agent/episode.py): the policy samples a turn; calls
in it are parsed, run (concurrently, each under a timeout) and their output appended as tokens
the policy did not sample; until a turn makes no call or a limit ends it. Every request is its
own asyncio task over the rollout contract (flowrl/agent/driver.py): no waves, so a request
decodes while others run their tools, and the engine keeps each request's KV between turns.
`response_mask` is 1 on sampled tokens only; `response_attention` on tool output too.
`rollout_info` carries each request's turns, calls, tool rewards and why it ended (verl's
names and counts), for
reward.rule with `rollout_info = true`. Tools are functions, classes, or verl's tool YAML
(`tool_config`); interactions a function, a verl class or verl's YAML; the prompt carries the
tools' schemas (the data loader templates it with `tools=`, as the SPEC's `prompt` hook asks).
Replaces [nodes.generate] in a graph; docs/multi-turn.md.
"""

from __future__ import annotations

import time

import attrs

from flowrl.hooks import CheckContext, Finding, TinyNode
from flowrl.nodespec import NodeSpec, RolloutParams
from flowrl.params import MAX_TOKENS, Rule, checked, count, one_of, positive


def _names() -> Rule:
    return Rule("a list of distinct tool names or references", lambda v: len(set(v)) == len(v))


@attrs.frozen
class Params(RolloutParams):
    RENAMED = {"max_calls_per_turn": "max_parallel_calls"}  # old graph keys (CHANGELOG.md)

    max_new_tokens: int = checked(256, count(1, MAX_TOKENS))  # whole response, sampled + tool
    tools: tuple[str, ...] = checked((), _names())  # built-in names or "file.py:name"
    tool_config: str = ""  # a verl tool YAML (tools: [{class_name, config, tool_schema}])
    sandbox: str = checked("auto", one_of(("auto", "required")))  # the python tool's confinement
    parser: str = "hermes"  # "hermes", "tag" (<name>argument</name>) or "file.py:parse"
    chat_template: str = ""  # a template file replacing the tokenizer's (tools in the prompt)
    system_prompt: str = ""  # put before the row's system message; {tools} = the schemas
    max_turn_tokens: int = checked(0, count(0, MAX_TOKENS))  # one turn; 0 = max_new_tokens
    max_assistant_turns: int = checked(4, count(1, 10_000))  # every assistant turn (verl's)
    max_user_turns: int = checked(0, count(0, 10_000))  # tool rounds + replies; 0 = no limit
    max_parallel_calls: int = checked(1, count(1, 10_000))  # per turn; the rest are dropped
    max_tool_response_length: int = checked(256, count(1, 10**9))  # characters (verl's)
    tool_response_truncate_side: str = checked("middle", one_of(("left", "middle", "right")))
    max_obs_tokens: int = checked(256, count(1, MAX_TOKENS))  # tokens of one output, else cut
    tool_timeout_s: float = checked(10.0, positive())  # one call
    request_timeout_s: float = checked(120.0, positive())  # one request's time in tools, summed
    max_invalid_calls: int = checked(3, count(0, 10_000))  # in a row; 0 = no limit
    obs_role: str = checked("tool", one_of(("tool", "user")))  # role of tool output
    solution: str = checked(
        "assistant", one_of(("assistant", "full"))
    )  # response_text; full = verl
    interaction: str = ""  # "file.py:reply" (a function) or "file.py:Cls" (verl interaction)
    interaction_config: str = ""  # a verl interaction YAML; rows pick by interaction_kwargs.name
    interact_on_cut: bool = False  # the interaction answers a turn cut by max_turn_tokens
    env: str = ""  # "file.py:Cls": an environment of text, Gymnasium's API or OpenEnv's
    script_first_turn: bool = False  # first turn = a call of each tool (--tiny sets it)


def limits(p: Params):
    from flowrl.agent.episode import Limits

    return Limits(
        max_new_tokens=p.max_new_tokens,
        max_turn_tokens=p.max_turn_tokens or p.max_new_tokens,
        **{f: getattr(p, f) for f in ("max_assistant_turns", "max_user_turns")},
        **{f: getattr(p, f) for f in ("max_parallel_calls", "max_tool_response_length")},
        **{f: getattr(p, f) for f in ("tool_response_truncate_side", "max_obs_tokens")},
        **{f: getattr(p, f) for f in ("tool_timeout_s", "request_timeout_s")},
        **{f: getattr(p, f) for f in ("max_invalid_calls", "obs_role", "interact_on_cut")},
    )


def check(p: Params, context: CheckContext) -> list[Finding]:
    """Every limit, the tools, parser and interaction, and the chat template's appending."""
    from flowrl.agent.checks import agent_findings

    return agent_findings(p, context)


def prompt(p: Params, base_dir: str, tokenizer):
    """The renderer the data loader templates every prompt with: the row's messages with the
    schemas of the tools it may use (flowrl/agent/prompt.py)."""
    from flowrl.agent.prompt import agent_prompt

    return agent_prompt(p, base_dir, tokenizer)


def scripted_turn(setup, p: Params) -> list[int]:
    """The ids of a first turn that calls each tool once (flowrl/agent/first_turn.py), ending
    the turn; [] for a parser of the user's own."""
    from flowrl.agent.first_turn import first_turn_text

    text = first_turn_text(setup.toolbox.schemas, p.parser)
    if not text:
        return []
    return setup.chat.tokenizer(text, add_special_tokens=False)["input_ids"] + [setup.chat.eos]


def tiny(p: Params, base_dir: str) -> TinyNode:
    """A tiny run's first turn calls each tool once, and its turns and budget leave room for
    two interaction replies (interact_on_cut: the random policy's turns are cut), so the
    tools and the interactions run, which a random policy's never would
    (flowrl/agent/tiny_setup.py)."""
    from flowrl.agent.tiny_setup import tiny_node

    return tiny_node(p, base_dir)


class AgentWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        from flowrl.agent.driver import run_requests
        from flowrl.agent.rows import agent_metrics, agent_setup, assemble, episodes_for
        from flowrl.engines.rollout import Sampling, request_seed
        from flowrl.nodes.generate import generation_metrics, step_seed

        p, start = self.params, time.perf_counter()
        setup = agent_setup(p, batch.meta.get("base_dir", "."), self.engine.tokenizer)
        episodes = episodes_for(batch, setup, limits(p), p.n)
        base = step_seed(batch.meta)
        seeds = [request_seed(base, k) for k in range(len(episodes))]
        stats = self.engine.run(
            run_requests(
                episodes,
                self.engine,
                Sampling(p.temperature, p.top_p, p.top_k, p.do_sample),
                seeds=seeds,
                first_turn=scripted_turn(setup, p) if p.script_first_turn else (),
                lockstep=self.engine.lockstep,
            ),
        )
        out = assemble(episodes, self.engine.pad, p.solution)
        metrics = generation_metrics(out["response_mask"], time.perf_counter() - start)
        # decode and tool phases go to the run's trace, on this rank's track
        return out, {**metrics, **agent_metrics(episodes, stats)}, stats.phases


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
    tiny=tiny,
    prompt=prompt,
)
