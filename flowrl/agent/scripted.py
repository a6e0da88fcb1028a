"""One agent request driven by scripted policy turns, for tests: `scripted_request` and the
backend under it, `ScriptedTurns` (both exported by flowrl.testing and flowrl.api).

The request runs through the agent node's own machinery (its tools, parser, chat-template
deltas, limits and interaction) on the tiny tokenizer; only the policy is a script. An
interaction is whatever the node takes: a reply function or its "file.py:reply" reference, a
verl `BaseInteraction` class, an instance of one or its "file.py:Class" reference, or verl's
interaction YAML (`interaction_config`), from which `interaction_kwargs["name"]` picks one as
a row does. No torch.
"""

from __future__ import annotations

from pathlib import Path

from flowrl.models.tiny import tiny_tokenizer


def scripted_request(
    turns: list[str],
    tools=(),
    parser: str = "hermes",
    prompt: str = "Hi.",
    base_dir: str | Path = ".",
    tools_kwargs: dict | None = None,
    interaction=None,
    interaction_kwargs: dict | None = None,
    interaction_config: str | Path = "",
    tool_config: str | Path = "",
    raise_errors: bool = True,
    **limits,
):
    """One agent request run to its end with `turns` as the policy's turns. Returns the
    finished `flowrl.agent.episode.Episode`: `.info()` has its calls (`{name, status,
    seconds}`), `messages`, `tool_rewards`, `turn_scores`, `interaction_turns`,
    `rollout_reward_scores` and `termination`.

    Args:
        turns: the text of each assistant turn, in order (each ends with the eos).
        tools: tool references as in the graph ("calculator", "my_tools.py:convert").
        parser: "hermes", "tag" or "file.py:parse", as in the graph.
        prompt: the user message.
        base_dir: where relative references resolve (the graph's folder).
        tools_kwargs, interaction_kwargs: the row's `extra_info` entries of those names.
        interaction: who answers a turn without a call: a `reply(messages, **kwargs) ->
            (done, text, reward)` function, a verl `BaseInteraction` class or instance, or a
            "file.py:reply" / "file.py:Class" reference.
        interaction_config: verl's interaction YAML, as the node's param of that name.
        tool_config: verl's tool YAML, as the node's param of that name.
        raise_errors: a request that ends in "error" (an interaction, tool creation or parser
            that raised) or whose interaction's finish raised raises that exception here;
            False returns it, with the error in `info()["error"]`.
        **limits: `flowrl.agent.episode.Limits` fields (`max_assistant_turns`,
            `max_user_turns`, `interact_on_cut`, `tool_timeout_s`, ...).
    """
    from flowrl.agent.chat import ChatTokens
    from flowrl.agent.driver import run_requests
    from flowrl.agent.episode import Episode, Limits
    from flowrl.agent.parsers import make_parser
    from flowrl.agent.tools.toolbox import Toolbox
    from flowrl.engines.threads import run_sync

    tokenizer = tiny_tokenizer()
    chat, box = ChatTokens(tokenizer), Toolbox(list(tools), base_dir, str(tool_config))
    chosen = _interaction(interaction, interaction_config, interaction_kwargs or {}, base_dir)
    messages = [{"role": "user", "content": prompt}]
    script = [tokenizer(t, add_special_tokens=False)["input_ids"] + [chat.eos] for t in turns]
    # verl's turn limit is checked before the user's reply: one more turn lets the
    # interaction answer the last scripted turn
    limits.setdefault("max_assistant_turns", len(turns) + (1 if chosen else 0))
    episode = Episode(
        chat.encode(messages, generation_prompt=True),
        chat,
        make_parser(parser, box.names, base_dir),
        box.open({"tools_kwargs": tools_kwargs or {}}),
        Limits(**limits),
        messages=messages,
        interaction=chosen,
        interaction_kwargs=interaction_kwargs,
    )
    run_sync(run_requests([episode], ScriptedTurns({0: script})))
    if raise_errors and episode.exception is not None:
        done = f"{len(episode.turn_texts)} of {len(turns)} scripted turns"
        note = f"scripted_request: raised in the request after {done}; its messages: "
        episode.exception.add_note(note + repr(episode.messages[1:]))
        raise episode.exception
    return episode


def _interaction(interaction, config, kwargs: dict, base_dir):
    """The interaction the request gets: as the agent node resolves its params, or the object
    a test passes; from a YAML, the one `kwargs["name"]` picks."""
    from flowrl.agent.interactions import as_interaction, load_interactions, pick_interaction

    if interaction is not None and config:
        raise ValueError("give interaction or interaction_config, not both (as the agent node)")
    if config:
        return pick_interaction(load_interactions("", str(config), str(base_dir)), kwargs)
    if isinstance(interaction, str):
        return pick_interaction(load_interactions(interaction, "", str(base_dir)), kwargs)
    return None if interaction is None else as_interaction(interaction)


class ScriptedTurns:
    """A rollout backend (flowrl.engines.rollout.RolloutBackend's generate and release) that
    samples nothing: request i's k-th turn is `script[i][k]` (a list of ids), cut to the
    turn's limit, where i is the request's seed (run_requests gives request i the seed i by
    default). It records what was appended to each conversation before each turn
    (`appended[i]`), the limits asked for and the request ids released."""

    def __init__(self, script: dict, logprob: float = -0.5):
        self.script, self.logprob = script, logprob
        self.count = {i: 0 for i in script}
        self.appended = {i: [] for i in script}
        self.limits = {i: [] for i in script}
        self.seen = {i: 0 for i in script}  # conversation length after the last turn
        self.released: list[str] = []

    async def generate(self, request):
        from flowrl.engines.rollout import Result

        i, limit = request.seed, request.max_new_tokens
        if self.count[i] >= len(self.script[i]):
            raise IndexError(
                f"ScriptedTurns: request {i} asks for turn {self.count[i] + 1}, but its script "
                f"has {len(self.script[i])}: the last turn was answered (a tool, or an "
                "interaction that did not end the request) and the request went on. Add a "
                "turn, or lower max_assistant_turns (checked after each turn, as verl's)"
            )
        self.appended[i].append(list(request.ids[self.seen[i] :]) if self.count[i] else [])
        self.limits[i].append(limit)
        turn = list(self.script[i][self.count[i]])
        ids = turn[:limit]
        self.count[i] += 1
        self.seen[i] = len(request.ids) + len(ids)
        return Result(ids, [self.logprob] * len(ids), "stop" if len(turn) <= limit else "length")

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
