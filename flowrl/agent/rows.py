"""Between a batch and its requests: what the agent node needs besides the state machine.

- `AgentSetup`: an agent node's tools, parser, chat and interaction, resolved once;
- `episodes_for`: one Episode per (row, sample), with the row's verl fields;
- `assemble`: the episodes as right-padded response tensors and per-row columns;
- `agent_metrics`: turns, tokens, calls, interaction replies, errors and why requests ended.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from flowrl.agent.chat import ChatTokens
from flowrl.agent.episode import REASONS, Episode, Limits
from flowrl.agent.interactions import load_interactions, pick_interaction
from flowrl.agent.parsers import make_parser
from flowrl.agent.prompt import read_template
from flowrl.agent.tools.timeouts import stuck_threads
from flowrl.agent.tools.toolbox import Toolbox


@attrs.frozen
class AgentSetup:
    toolbox: Toolbox
    parser: object
    chat: ChatTokens
    interactions: dict  # name -> interaction; "" = the one every row gets


_SETUPS: dict = {}  # (params' references, base_dir, tokenizer id) -> AgentSetup


def agent_setup(params, base_dir: str, tokenizer) -> AgentSetup:
    """The resolved tools, parser, chat and interactions of an agent node's params (cached:
    built once per worker process, not every step)."""
    refs = (tuple(params.tools), params.tool_config, params.parser, params.chat_template)
    key = (*refs, params.interaction, params.interaction_config, params.sandbox)
    key = (*key, base_dir, id(tokenizer))
    if key not in _SETUPS:
        toolbox = Toolbox(params.tools, base_dir, params.tool_config, params.sandbox)
        _SETUPS[key] = AgentSetup(
            toolbox,
            make_parser(params.parser, toolbox.names, base_dir),
            ChatTokens(tokenizer, read_template(params.chat_template, base_dir)),
            load_interactions(params.interaction, params.interaction_config, base_dir, params.env),
        )
    return _SETUPS[key]


def _no_calls(text: str) -> list:
    return []


def episodes_for(batch, setup: AgentSetup, limits: Limits, n: int) -> list[Episode]:
    """One Episode per row and sample (interleaved: row 0's n samples first). A row's
    `extra_info` gives verl's `tools_kwargs` and `interaction_kwargs`; `agent_name =
    "single_turn_agent"` runs it without tools."""
    prompts, mask = batch["prompts"], batch["prompt_mask"]
    infos = batch["extra_info"] if "extra_info" in batch else [None] * len(prompts)
    messages = batch["raw_prompt"] if "raw_prompt" in batch else [()] * len(prompts)
    out = []
    for i in range(len(prompts)):
        ids = prompts[i][mask[i].bool()].tolist()
        extra = infos[i] if isinstance(infos[i], dict) else {}
        single = extra.get("agent_name") == "single_turn_agent"
        kwargs = dict(extra.get("interaction_kwargs") or {})
        for _ in range(n):
            problem, interaction = None, None
            try:
                interaction = None if single else pick_interaction(setup.interactions, kwargs)
            except ValueError as e:
                problem = e
            episode = Episode(
                ids,
                setup.chat,
                _no_calls if single else setup.parser,
                setup.toolbox.open(extra, limits.tool_timeout_s),
                limits,
                messages=list(messages[i] or ()),
                interaction=interaction,
                interaction_kwargs=kwargs,
            )
            if problem is not None:  # ends in "error" at start, shown with its row
                episode.fail_at_start(problem)
            out.append(episode)
    return out


def response_tensors(rows: list[tuple[list, list, list]], pad: int) -> dict:
    """{responses, response_mask, response_attention, rollout_logprobs}: (r, t) right-padded
    (t the longest response) from each row's (ids, trained mask, log-probs)."""
    r, t = len(rows), max((len(ids) for ids, _, _ in rows), default=0)
    responses = torch.full((r, t), pad, dtype=torch.long)
    trained = torch.zeros((r, t), dtype=torch.long)
    attention = torch.zeros((r, t), dtype=torch.long)
    logprobs = torch.zeros((r, t), dtype=torch.float32)
    for k, (ids, mask, lps) in enumerate(rows):
        responses[k, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        trained[k, : len(ids)] = torch.tensor(mask, dtype=torch.long)
        attention[k, : len(ids)] = 1
        logprobs[k, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
    return {
        "responses": responses,
        "response_mask": trained,
        "response_attention": attention,
        "rollout_logprobs": logprobs,
    }


def assemble(episodes: list[Episode], pad: int, solution: str) -> dict:
    """{responses, response_mask, response_attention, rollout_logprobs}: (r, t), right-padded
    (t the longest response); response_text and rollout_info: (r,) objects."""
    rows = [(e.ids, e.trained_mask(), e.logprobs) for e in episodes]
    texts, infos = np.empty(len(episodes), dtype=object), np.empty(len(episodes), dtype=object)
    for k, episode in enumerate(episodes):
        texts[k], infos[k] = episode.solution(solution), episode.info()
    return {**response_tensors(rows, pad), "response_text": texts, "rollout_info": infos}


def agent_metrics(episodes: list[Episode], stats) -> dict:
    """Per-rank metrics of one rollout (the runtime prefixes the node id and averages ranks):
    means per request unless named otherwise; termination/<reason> is a share of requests."""
    infos = [e.info() for e in episodes]
    count = max(len(infos), 1)
    seconds = [c["seconds"] for i in infos for c in i["calls"]]

    def mean(key):
        return sum(i[key] for i in infos) / count

    out = {
        "num_turns_mean": mean("assistant_turns"),
        "num_turns_max": float(max((i["assistant_turns"] for i in infos), default=0)),
        "policy_tokens": mean("policy_tokens"),
        "tool_tokens": mean("tool_tokens"),
        "calls_per_request": mean("tool_calls"),
        "dropped_calls": mean("dropped_calls"),
        "call_rate": sum(i["tool_calls"] > 0 for i in infos) / count,
        "invalid_calls": mean("invalid_calls"),
        "tool_errors": mean("tool_errors"),
        "tool_timeouts": mean("tool_timeouts"),
        # requests with a trained token: 0 means the step learned nothing from its rollouts
        "requests_trained": sum(any(e.trained_mask()) for e in episodes) / count,
        "release_errors": sum(bool(i["release_errors"]) for i in infos) / count,
        "stuck_tool_threads": float(stuck_threads()),
        "tool_seconds_mean": sum(seconds) / len(seconds) if seconds else 0.0,
        "tool_seconds_max": max(seconds, default=0.0),
        # wall time with some request decoding / in tools, and with both at once
        "decode_s": stats.seconds("decode"),
        "tools_s": stats.seconds("tools"),
        "overlap_s": stats.overlap_s,
        "turns": float(stats.turns),
        "gen_tokens_per_s": sum(i["policy_tokens"] for i in infos)
        / max(stats.seconds("decode"), 1e-9),
    }
    for reason in REASONS:
        out[f"termination/{reason}"] = sum(i["termination"] == reason for i in infos) / count
    if any("env_terminated" in i for i in infos):  # an environment's own ends (a game won...)
        for flag in ("env_terminated", "env_truncated"):
            out[flag] = sum(bool(i.get(flag)) for i in infos) / count
    calls = [c for i in infos for c in i["calls"] if c["name"]]
    for name in sorted({c["name"] for c in calls}):  # per tool: calls and answered calls
        out[f"calls/{name}"] = sum(c["name"] == name for c in calls) / count
        ok = [c for c in calls if c["name"] == name and c["status"] == "ok"]
        out[f"calls/{name}/ok"] = len(ok) / count
    return out | interaction_metrics(episodes)


def interaction_metrics(episodes: list[Episode]) -> dict:
    """interactions/<name>: the replies of each interaction per request that has it (rows
    of a verl YAML pick theirs by name)."""
    by_name: dict = {}
    for e in episodes:
        if e.interaction is not None:
            by_name.setdefault(getattr(e.interaction, "name", "interaction"), []).append(e)
    return {
        f"interactions/{name}": sum(e.interaction_turns for e in mine) / len(mine)
        for name, mine in sorted(by_name.items())
    }
