"""An agent node's part in a tiny run (`flowrl run --tiny`; nodes/agent.py's `tiny` hook): the
params that make its tools and its interactions run on the random policy, and what the run's
summary lists of them.

- Tools: the random policy never writes a call, so the first turn is scripted to call each
  tool once (flowrl/agent/first_turn.py); the budget fits that turn (the tiny tokenizer spends a
  token per character), the tools' answers and a sampled turn after them.
- Interactions: the random policy almost never samples the end-of-turn token, and a turn cut
  by `max_turn_tokens` ends its request without the interaction (verl's rule). So the tiny
  run sets `interact_on_cut` (the cut turn is closed, the interaction answers it) and sizes
  the turns, the turn limits and the budget for `REPLIES` replies after the tool round. An
  interaction that ends the request on its first reply gets one: the summary counts them.

No torch.
"""

from __future__ import annotations

from flowrl.hooks import TinyNode

REPLIES = 2  # interaction replies a tiny run makes room for
TURN_TOKENS = 8  # a sampled turn, where no scripted turn sets the size
# room for one reply: the tiny tokenizer spends a token per character, so a reply of about
# 450 characters with its chat-template delta (~25 tokens) fits
REPLY_TOKENS = 512
OBS_TEMPLATE_TOKENS = 32  # a tool answer's chat-template delta, besides max_obs_tokens


def tiny_node(p, base_dir: str) -> TinyNode:
    """The agent node's TinyNode for its params `p` (nodes/agent.py Params). A tool or an
    interaction that does not load is `flowrl check`'s to report: it is left out here."""
    tools, text, calls = _scripted(p, base_dir)
    params, turn, answers = {}, TURN_TOKENS, 0
    if text:
        turn = len(text) + 1  # + the turn's eos
        answers = calls * (p.max_obs_tokens + OBS_TEMPLATE_TOKENS)
        params = {
            "script_first_turn": True,
            "max_turn_tokens": turn,
            "max_new_tokens": 2 * turn + answers,
            "max_parallel_calls": max(p.max_parallel_calls, calls),
        }
    interactions = _interactions(p, base_dir)
    if p.env:  # an environment: its reset observation opens the response, then replies
        interactions = {p.env.rpartition(":")[2] or "env": p.env}
        answers += REPLY_TOKENS
    if interactions:
        params |= room_for_replies(p, turn, answers, tool_rounds=1 if text else 0)
    return TinyNode(params, tools=tools, scripted=p.script_first_turn, interactions=interactions)


def room_for_replies(p, turn: int, answers: int, tool_rounds: int) -> dict:
    """Turn limits and a budget (`turn` tokens a turn, `answers` for the tools' answers) for
    the scripted tool round (if any), then `REPLIES` interaction replies, each after a
    sampled turn, and the sampled turn after the last: verl checks the turn limits after each
    assistant turn, before the interaction answers."""
    turns = tool_rounds + REPLIES + 1
    out = {
        "interact_on_cut": True,
        "max_turn_tokens": turn,
        "max_assistant_turns": turns,
        "max_new_tokens": turns * turn + answers + REPLIES * REPLY_TOKENS,
    }
    if p.max_user_turns:  # 0 is no limit
        out["max_user_turns"] = tool_rounds + REPLIES
    return out


def _scripted(p, base_dir: str) -> tuple[tuple[str, ...], str, int]:
    """(tool names, the scripted first turn's text or "", its calls)."""
    from flowrl.agent.first_turn import first_turn_text
    from flowrl.agent.tools.toolbox import Toolbox

    if not (p.tools or p.tool_config):
        return (), "", 0
    try:
        toolbox = Toolbox(p.tools, base_dir, p.tool_config)
    except Exception:
        return (), "", 0
    text = first_turn_text(toolbox.schemas, p.parser)  # "" for a parser of the user's own
    return tuple(toolbox.names), text, len(toolbox.schemas)


def _interactions(p, base_dir: str) -> dict[str, str]:
    from flowrl.agent.interactions import interaction_sources

    try:
        return interaction_sources(p.interaction, p.interaction_config, base_dir)
    except Exception:
        return {}
