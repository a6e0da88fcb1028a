"""One request of a multi-turn rollout as a state machine, in plain Python (no torch, no engine).

    start: create the tools, start the interaction ------------------▶ GENERATING | DONE(error)
    GENERATING --a sampled turn--▶ parse it (verl's turn limits first: assistant turns, and
    user turns = tool rounds + interaction replies):
        calls                                   ─▶ TOOLS     | DONE(max_turns | length)
        no call, an interaction (a turn cut by max_turn_tokens: only with interact_on_cut)
                                                ─▶ INTERACTING | DONE(max_turns | length)
        no call                                 ─▶ DONE(stop; length if the turn was cut)
    TOOLS --run the calls (timeouts)--▶ observation ids ─▶ GENERATING
                                      | DONE(budget | invalid_calls | timeout)
    INTERACTING --reply(messages)--▶ user ids ─▶ GENERATING | DONE(interaction_done | budget)

A driver (flowrl/agent/driver.py, one asyncio task per request) feeds `on_turn` the ids an
engine sampled for this request and appends what `advance` returns to the conversation it
sends next; the episode keeps the response:
sampled ids verbatim (mask 1), observation deltas (mask 0; chat.py), their log-probs (0.0 off
the sampled tokens). A turn cut by `max_turn_tokens` that still made calls (or that the
interaction answers) gets an eos the policy did not sample (mask 0), so the ids stay the chat
template's.

Anything that raises inside a request ends that request with reason "error" (the exception is
kept in `info`), or "infra" when what it ran on failed (`flowrl.errors.is_infra`: its engine
aborted it or is unreachable, a tool's service is down); such a request and one that ran out of
time ("timeout") train on nothing (mask all 0), and an "infra" one is also left out of its
group's statistics (flowrl/runtime/executor.py). No request's failure escapes to the step.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import attrs

from flowrl.agent.chat import truncate_chars
from flowrl.agent.tools.timeouts import run_call
from flowrl.errors import described, is_infra

GENERATING, TOOLS, INTERACTING, DONE = "generating", "tools", "interacting", "done"
REASONS = (
    "stop",
    "length",
    "max_turns",
    "budget",
    "invalid_calls",
    "timeout",
    "error",
    "infra",
    "interaction_done",
)
FAILED = ("error", "timeout", "infra")  # requests that contribute zero loss
INFRA = "infra"  # what the request ran on failed: left out of its group (executor.py)


@attrs.frozen
class Limits:
    max_new_tokens: int = 256  # the whole response: sampled and observation tokens
    max_turn_tokens: int = 256  # one assistant turn
    max_assistant_turns: int = 4  # every assistant turn counts (verl's)
    max_user_turns: int = 0  # tool rounds and interaction replies (verl's); 0 = no limit
    max_parallel_calls: int = 1  # calls run per turn (verl's); the rest are dropped, counted
    max_tool_response_length: int = 256  # characters of one tool output (verl's)
    tool_response_truncate_side: str = "middle"  # verl's: "left" keeps the head, "right" the tail
    max_obs_tokens: int = 256  # tokens of one tool output, after the character cut
    tool_timeout_s: float = 10.0  # one call
    request_timeout_s: float = 120.0  # a request's time in tools and interactions, summed
    max_invalid_calls: int = 3  # invalid calls in a row that end the request (0 = no limit)
    obs_role: str = "tool"  # the role of tool output messages
    interact_on_cut: bool = False  # the interaction answers a turn cut by max_turn_tokens


class Episode:
    """One request's conversation. Args: prompt_ids, the chat (chat.ChatTokens), a parser
    (text -> [ToolCall]), the request's tool session (tools.Session), Limits; optionally the
    prompt messages, an interaction (`start(request_id, **kwargs)`, `reply(request_id,
    messages, **kwargs) -> (done, text, reward)`, `finish(request_id)`: verl.VerlInteraction
    or rows.FunctionInteraction) with its kwargs, and a clock."""

    def __init__(
        self,
        prompt_ids,
        chat,
        parser,
        session,
        limits: Limits,
        messages=(),
        interaction=None,
        interaction_kwargs=None,
        clock=time.monotonic,
    ):
        self.prompt_ids, self.chat = list(prompt_ids), chat
        self.parser, self.session = parser, session
        self.limits, self.interaction = limits, interaction
        self.interaction_kwargs = dict(interaction_kwargs or {})
        self.messages, self.prompt_messages = list(messages), len(messages)
        self.clock, self.spent = clock, 0.0  # seconds spent in tools and interactions
        self.state, self.reason, self.error = GENERATING, None, None
        # the first exception of the request's own code: what ended it in "error", or an
        # interaction's finish that raised (flowrl.testing.scripted_request raises it)
        self.exception: BaseException | None = None
        self.ids, self.mask, self.logprobs = [], [], []
        self.turn_texts: list[str] = []
        self.request_id = uuid.uuid4().hex
        self.user_turns, self.interaction_turns, self.invalid_streak = 0, 0, 0
        self.dropped_calls = 0  # calls past max_parallel_calls in their turn, not run
        self.release_errors: list[str] = []
        self.calls: list[dict] = []  # {name, status, seconds} per call
        self.tool_rewards: list[float] = []  # step rewards tools returned
        self.turn_scores: list[float] = []  # interaction rewards
        self.reward_scores: dict = {}  # end-of-request tool rewards {tool: reward}
        self.seed: int | None = None  # the request's sampling seed (run_requests sets it)
        self.env_outcome: dict = {}  # an environment's terminated / truncated at the end
        self._pending_calls, self._unfed = [], []

    @property
    def done(self) -> bool:
        return self.state == DONE

    def turn_limit(self) -> int:
        """The most tokens the next assistant turn may sample."""
        return min(self.limits.max_turn_tokens, self.limits.max_new_tokens - len(self.ids))

    # -- transitions -----------------------------------------------------------------------
    def fail_at_start(self, error: Exception) -> None:
        """End the request before it starts (a row whose interaction cannot be chosen); its
        tools are not created."""
        self.session.tools = []
        self._fail(error)

    def fail(self, error: Exception) -> None:
        """End the request with reason "error" (e.g. its rollout backend aborted a turn)."""
        self._fail(error)

    async def start(self) -> None:
        """Create the request's tools (class instances, verl `create`) and start its
        interaction (verl `start_interaction`)."""
        if self.done:
            return
        try:
            await self.session.start()
            if self.interaction is not None:
                args = {"request_id": self.request_id, **self.interaction_kwargs}
                if getattr(self.interaction, "takes_seed", False):  # an environment's reset
                    args["seed"] = self.seed
                opening = await run_call(
                    "interaction", self.interaction.start, args, self._timeout()
                )
                if isinstance(opening, str) and opening:  # an environment's first observation
                    self._observe([{"role": "user", "content": opening}])
        except Exception as e:
            self._fail(e)

    def on_turn(self, ids, logprobs=None) -> None:
        """Record one sampled assistant turn and decide what follows."""
        try:
            self._on_turn(list(ids), list(logprobs) if logprobs is not None else [0.0] * len(ids))
        except Exception as e:
            self._fail(e)

    async def advance(self) -> list[int]:
        """Run the pending calls or the interaction: the ids to append before the next turn
        (an added eos, then the observation delta), or [] when the request ended."""
        start = self.clock()
        try:
            if self.state == TOOLS:
                messages = await self._run_calls()
            elif self.state == INTERACTING:
                messages = await self._interact()
            else:
                return []
            self.spent += self.clock() - start
            if messages is None:  # the calls or the reply ended the request
                return []
            if self._time_left() <= 0:
                return self._end("timeout") or []
            return self._observe(messages)
        except Exception as e:
            self._fail(e)
            return []

    async def finish(self) -> None:
        """End-of-request tool rewards and release of every tool created (also after a
        failure), and the interaction's finalize; call once, after the request is done."""
        if self.state != DONE:
            self._end("error")
            self.error = "the rollout stopped before the request ended"
        self.reward_scores, self.release_errors = await self.session.close()
        if self.interaction is not None:
            outcome = getattr(self.interaction, "outcome", None)
            if callable(outcome):  # an environment: how it ended, before it is closed
                self.env_outcome = outcome(self.request_id)
            try:
                args = {"request_id": self.request_id}
                await run_call("interaction", self.interaction.finish, args, self._timeout())
            except Exception as e:
                self.exception = self.exception or e
                self.release_errors.append(f"interaction: finish: {type(e).__name__}: {e}")

    # -- inside the transitions ------------------------------------------------------------
    def _on_turn(self, ids: list[int], logprobs: list[float]) -> None:
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        ended = bool(ids) and ids[-1] == self.chat.eos
        text = self.chat.decode(ids)
        self.turn_texts.append(text)
        self.messages.append({"role": "assistant", "content": text})
        calls = self.parser(text)
        # a turn cut by max_turn_tokens is answered when it made calls; the interaction
        # answers it only with interact_on_cut (verl ends a cut turn's request: docs)
        answered = self.interaction is not None and (ended or self.limits.interact_on_cut)
        if not (calls or answered):
            return self._end("stop" if ended else "length")
        # a call or the user would follow: verl's turn limits end the request first
        limits = self.limits
        if len(self.turn_texts) >= limits.max_assistant_turns or (
            limits.max_user_turns and self.user_turns >= limits.max_user_turns
        ):
            return self._end("max_turns")
        if len(self.ids) >= limits.max_new_tokens:  # verl: the budget ends it, nothing runs
            return self._end("length")
        if not ended:  # cut by max_turn_tokens: close the turn as the template would
            self._append([self.chat.eos], trained=False)
            self._unfed = [self.chat.eos]
        self._pending_calls, self.state = calls, TOOLS if calls else INTERACTING
        return None

    async def _run_calls(self) -> list[dict] | None:
        limits, calls = self.limits, self._pending_calls
        allowed = calls[: limits.max_parallel_calls]
        self.dropped_calls += len(calls) - len(allowed)  # verl drops them too, unanswered
        timeout = min(limits.tool_timeout_s, self._time_left())
        results = list(await asyncio.gather(*(self.session.call(c, timeout) for c in allowed)))
        for result in results:
            call = {"name": result.name, "status": result.status, "seconds": result.seconds}
            self.calls.append({**call, "error": result.error} if result.error else call)
            if result.reward is not None:
                self.tool_rewards.append(result.reward)
            self.invalid_streak = self.invalid_streak + 1 if result.status == "invalid" else 0
        if limits.max_invalid_calls and self.invalid_streak >= limits.max_invalid_calls:
            return self._end("invalid_calls")
        out = []
        for result in results:  # characters first (verl's), so a huge output is never tokenized
            text = truncate_chars(
                result.text, limits.max_tool_response_length, limits.tool_response_truncate_side
            )
            text, _ = self.chat.truncate(text, limits.max_obs_tokens)
            out.append({"role": limits.obs_role, "content": text})
        return out

    async def _interact(self) -> list[dict] | None:
        self.interaction_turns += 1
        args = {"request_id": self.request_id, "messages": list(self.messages)}
        args.update(self.interaction_kwargs)
        done, text, reward = await run_call(
            "interaction", self.interaction.reply, args, self._timeout()
        )
        if reward is not None:
            self.turn_scores.append(float(reward))
        message = [{"role": "user", "content": str(text)}]
        if done:  # verl appends the closing message too, then ends
            self._observe(message)
            return self._end("interaction_done")
        return message

    def _observe(self, messages: list[dict]) -> list[int]:
        ids = self.chat.delta(messages)
        if len(self.ids) + len(ids) >= self.limits.max_new_tokens:  # no room for a turn after
            return self._end("budget") or []
        self._append(ids, trained=False)
        self.messages += messages
        self.user_turns += 1  # verl counts tool rounds and interaction replies alike
        unfed, self._unfed = self._unfed, []
        self.state = GENERATING
        return unfed + ids

    def _append(self, ids: list[int], trained: bool) -> None:
        self.ids += ids
        self.mask += [int(trained)] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def _end(self, reason: str) -> None:
        self.state, self.reason = DONE, reason

    def _fail(self, error: Exception) -> None:
        self.exception = error
        self.error = described(error)  # "Type: message (file:line)", the user's line first
        self._end(INFRA if is_infra(error) else "error")

    def _timeout(self) -> float:
        return max(min(self.limits.tool_timeout_s, self._time_left()), 1e-3)

    def _time_left(self) -> float:
        """What is left of the request's time for tools. Only tool and interaction time
        counts: decoding waits for the engine, shared with other requests, and the token
        limits bound it already."""
        return self.limits.request_timeout_s - self.spent

    # -- the result --------------------------------------------------------------------------
    def trained_mask(self) -> list[int]:
        """1 on sampled tokens; all 0 for a request that failed (it contributes no loss)."""
        return [0] * len(self.mask) if self.reason in FAILED else list(self.mask)

    def solution(self, mode: str = "assistant") -> str:
        """What the reward sees: the model's own turns ("assistant"), or the decoded whole
        response with tool output ("full", as verl)."""
        if mode == "full":
            return self.chat.decode(self.ids)
        return "\n".join(self.turn_texts)

    def info(self) -> dict:
        """The request's record, under verl's names where verl has one."""
        statuses = [c["status"] for c in self.calls]
        return {
            "termination": self.reason,
            "error": self.error,
            "release_errors": list(self.release_errors),
            "assistant_turns": len(self.turn_texts),
            "user_turns": self.user_turns,  # tool rounds and interaction replies, as verl
            "interaction_turns": self.interaction_turns,
            "num_turns": len(self.turn_texts) + self.user_turns + 1,  # verl counts the prompt
            "calls": list(self.calls),
            "tool_calls": len(self.calls),
            "dropped_calls": self.dropped_calls,
            "invalid_calls": statuses.count("invalid"),
            "tool_errors": statuses.count("error"),
            "tool_timeouts": statuses.count("timeout"),
            "tool_rewards": list(self.tool_rewards),
            "turn_scores": list(self.turn_scores),
            "turn_rewards": list(self.turn_scores),  # an environment's per-turn rewards
            **self.env_outcome,
            "rollout_reward_scores": dict(self.reward_scores),
            "policy_tokens": sum(self.mask),
            "tool_tokens": len(self.mask) - sum(self.mask),
            "messages": self.messages[self.prompt_messages :],
            "trained_spans": self.spans(),
        }

    def spans(self) -> list[list]:
        """The response as [text, trained] runs (special tokens shown), for samples.jsonl."""
        out, mask, start = [], self.trained_mask(), 0
        for k in range(1, len(mask) + 1):
            if k == len(mask) or mask[k] != mask[start]:
                out.append([self.chat.show(self.ids[start:k]), mask[start]])
                start = k
        return out
