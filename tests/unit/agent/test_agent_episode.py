"""The per-request state machine driven by a scripted backend (fixed ids per request and
turn): every transition and limit, with the character-level tokenizer (one id per char)."""

import asyncio
import concurrent.futures
import json
import time

import pytest

from flowrl.agent.chat import ChatTokens
from flowrl.agent.driver import run_requests
from flowrl.agent.episode import Episode, Limits
from flowrl.agent.interactions import FunctionInteraction
from flowrl.agent.parsers import make_parser
from flowrl.agent.tools.toolbox import FunctionTool, Toolbox
from flowrl.engines.threads import run_sync
from flowrl.testing import ScriptedTurns, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
CHAT = ChatTokens(TOKENIZER)
EOS = TOKENIZER.eos_token_id


def calc(expression: str) -> str:
    """Multiply two numbers.

    Args:
        expression: "a*b".
    """
    a, b = expression.split("*")
    return str(int(a) * int(b))


async def slow_first(x: str) -> str:
    """Echo after a delay that shrinks with x, so later calls finish first.

    Args:
        x: a number of hundredths of a second to wait.
    """
    await asyncio.sleep(int(x) / 100)
    return f"echo {x}"


def explode(x: str) -> str:
    """Raise.

    Args:
        x: ignored.
    """
    raise ZeroDivisionError("division by zero")


def hang(x: str) -> str:
    """Block the thread for two seconds.

    Args:
        x: ignored.
    """
    time.sleep(2)
    return "late"


async def hang_async(x: str) -> str:
    """Sleep for five seconds.

    Args:
        x: ignored.
    """
    await asyncio.sleep(5)
    return "late"


def scored(answer: str) -> tuple[str, float]:
    """Check an answer and return a step reward.

    Args:
        answer: the answer.
    """
    return f"got {answer}", 0.5


TOOLS = [calc, slow_first, explode, hang, hang_async, scored]


class Box(Toolbox):
    """A toolbox over the functions above (Toolbox takes references; tests pass objects)."""

    def __init__(self, functions=TOOLS):
        self.tools = [FunctionTool(f) for f in functions]
        self.schemas = [s for t in self.tools for s in t.schemas]
        self.names = [n for t in self.tools for n in t.names]


def ids(text: str, eos: bool = True) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"] + ([EOS] if eos else [])


def hermes(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


PROMPT = [{"role": "user", "content": "What is 12*34?"}]


@pytest.fixture
def pool():
    executor = concurrent.futures.ThreadPoolExecutor(4)
    yield executor
    executor.shutdown(wait=False)


def run(script, pool, parser="hermes", box=None, interaction=None, clock=None, **limits):
    """Run one episode per scripted request: (episodes, backend, stats)."""
    box = box or Box()
    limits = Limits(**{"max_new_tokens": 1000, "max_turn_tokens": 300, **limits})
    episodes = []
    for _ in script:
        episode = Episode(
            CHAT.encode(PROMPT, generation_prompt=True),
            CHAT,
            make_parser(parser, box.names),
            box.open({}),
            limits,
            messages=PROMPT,
            interaction=FunctionInteraction(interaction) if interaction else None,
            **({"clock": clock} if clock else {}),
        )
        episodes.append(episode)
    backend = ScriptedTurns(script)
    stats = run_sync(run_requests(episodes, backend))
    return episodes, backend, stats


def tool_delta(*texts: str) -> list[int]:
    return CHAT.delta([{"role": "tool", "content": t} for t in texts])


def test_one_call_then_an_answer(pool):
    turn1, turn2 = ids("<calc>12*34</calc>"), ids("408")
    (episode,), backend, stats = run({0: [turn1, turn2]}, pool, parser="tag")
    observation = tool_delta("408")
    assert episode.reason == "stop" and stats.turns == 2
    assert episode.ids == turn1 + observation + turn2
    assert episode.mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert episode.logprobs == [-0.5] * len(turn1) + [0.0] * len(observation) + [-0.5] * 4
    assert backend.appended[0] == [[], observation]  # the engine appends the observation
    assert episode.info()["calls"][0]["status"] == "ok"
    assert episode.solution() == "<calc>12*34</calc>\n408"
    # verl's count: 2 assistant turns + 1 tool round + 1 for the prompt
    assert "408" in episode.solution("full") and episode.info()["num_turns"] == 4
    show = TOKENIZER.decode  # with special tokens: what samples.jsonl shows
    assert episode.info()["trained_spans"] == [
        [show(turn1), 1],
        [show(observation), 0],
        [show(turn2), 1],
    ]


def test_several_calls_keep_call_order_when_they_finish_out_of_order(pool):
    turn = ids(hermes("slow_first", x="20") + hermes("slow_first", x="0"))
    (episode,), _, _ = run({0: [turn, ids("done")]}, pool, max_parallel_calls=2)
    # the second call finished first; the observation still lists the first call first
    observation = tool_delta("echo 20", "echo 0")
    assert episode.reason == "stop"
    assert episode.ids[len(turn) : len(turn) + len(observation)] == observation
    assert [c["status"] for c in episode.calls] == ["ok", "ok"]


def test_calls_over_the_per_turn_limit_are_dropped_and_counted_as_verl_does(pool):
    calls = [hermes("calc", expression=f"{k}*3") for k in range(1, 5)]
    (episode,), _, _ = run({0: [ids("".join(calls)), ids("3")]}, pool, max_parallel_calls=1)
    # four calls in one turn: the first runs, three are dropped unanswered; the request goes on
    assert episode.reason == "stop" and [c["status"] for c in episode.calls] == ["ok"]
    assert episode.info()["dropped_calls"] == 3 and episode.info()["invalid_calls"] == 0
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["3"]


@pytest.mark.parametrize(
    ("turn", "status", "says"),
    [
        ("<tool_call>{not json}</tool_call>", "invalid", "not valid JSON"),
        ('<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}', "invalid", "not closed"),
        (hermes("nope", x="1"), "invalid", 'unknown tool "nope"'),
        (hermes("calc", expr="2*3"), "invalid", "bad arguments"),
        (hermes("calc", expression=23), "invalid", 'argument "expression" must be of type string'),
        (hermes("explode", x="1"), "error", "ZeroDivisionError: division by zero"),
    ],
)
def test_a_bad_call_becomes_an_error_message_and_is_counted(pool, turn, status, says):
    (episode,), _, _ = run({0: [ids(turn), ids("ok")]}, pool)
    assert episode.reason == "stop"  # the request goes on after the error message
    assert [c["status"] for c in episode.calls] == [status]
    tool_message = episode.messages[-2]
    assert tool_message["role"] == "tool" and says in tool_message["content"]
    assert tool_message["content"].startswith("error: ")
    counts = episode.info()
    assert counts["invalid_calls"] + counts["tool_errors"] == 1


@pytest.mark.parametrize("name", ["hang", "hang_async"])
def test_a_tool_past_its_timeout_is_answered_in_well_under_a_second(pool, name):
    start = time.perf_counter()
    (episode,), _, _ = run({0: [ids(hermes(name, x="1")), ids("ok")]}, pool, tool_timeout_s=0.1)
    assert time.perf_counter() - start < 10  # the tool hangs far longer: the timeout held
    assert episode.calls[0]["status"] == "timeout" and episode.info()["tool_timeouts"] == 1
    assert "TimeoutError: " + name + " took longer than 0.1 s" in episode.messages[-2]["content"]


def test_max_turns_ends_without_running_the_last_calls(pool):
    call = ids("<calc>2*3</calc>")
    (episode,), backend, _ = run({0: [call, call, call]}, pool, "tag", max_assistant_turns=2)
    assert episode.reason == "max_turns" and len(episode.calls) == 1
    assert episode.ids == call + tool_delta("6") + call  # the second turn's call never ran
    assert backend.count[0] == 2


def test_an_observation_past_the_budget_ends_the_request(pool):
    call = ids("<calc>2*3</calc>")
    budget = len(call) + len(tool_delta("6"))  # the observation fits, but no turn after it
    (episode,), backend, _ = run({0: [call, ids("6")]}, pool, "tag", max_new_tokens=budget)
    assert episode.reason == "budget" and episode.ids == call and backend.count[0] == 1
    assert len(episode.calls) == 1  # the tool ran; its answer did not fit


def test_turns_never_sample_past_the_budget(pool):
    call = ids("<calc>2*3</calc>")
    budget = len(call) + len(tool_delta("6")) + 3
    (episode,), backend, _ = run({0: [call, ids("123456")]}, pool, "tag", max_new_tokens=budget)
    assert backend.limits[0] == [min(300, budget), 3] and len(episode.ids) == budget
    assert episode.reason == "length"  # cut by the budget, no eos sampled


def test_consecutive_invalid_calls_end_the_request(pool):
    bad = ids(hermes("nope"))
    good = ids(hermes("calc", expression="2*3"))
    script = {0: [bad, good, bad, bad, bad], 1: [bad, bad, bad]}
    (reset, ended), _, _ = run(script, pool, max_invalid_calls=2, max_assistant_turns=9)
    # a valid call resets the streak: bad, good, bad, bad -> ends at the 2nd bad in a row
    assert reset.reason == "invalid_calls" and len(reset.calls) == 4
    assert ended.reason == "invalid_calls" and len(ended.calls) == 2
    assert ended.info()["invalid_calls"] == 2


def test_a_turn_cut_by_its_token_limit_gets_an_eos_it_did_not_sample(pool):
    call = ids("<calc>2*3</calc>", eos=False) + ids(" and more")  # cut at the call's end
    cut = len(ids("<calc>2*3</calc>", eos=False))
    (episode,), backend, _ = run({0: [call, ids("6")]}, pool, "tag", max_turn_tokens=cut)
    assert episode.ids[: cut + 1] == call[:cut] + [EOS]
    assert episode.mask[: cut + 1] == [1] * cut + [0]  # the added eos is not trained
    assert backend.appended[0][1] == [EOS] + tool_delta("6")  # the engine feeds it too
    assert episode.reason == "stop"


def test_a_turn_cut_without_a_call_ends_by_length(pool):
    (episode,), _, _ = run({0: [ids("a long answer")]}, pool, max_turn_tokens=5)
    assert episode.reason == "length" and episode.ids == ids("a long")[:5]


def test_one_failing_request_does_not_fail_the_others(pool):
    box = Box()

    def broken_parser(text):
        raise RuntimeError("parser bug")

    good = Episode([1], CHAT, make_parser("tag", box.names), box.open({}), Limits())
    bad = Episode([1], CHAT, broken_parser, box.open({}), Limits())
    script = {0: [ids("<calc>2*3</calc>"), ids("6")], 1: [ids("hi")]}
    run_sync(run_requests([good, bad], ScriptedTurns(script)))
    assert good.reason == "stop" and bad.reason == "error"
    assert "RuntimeError: parser bug" in bad.info()["error"]
    assert bad.trained_mask() == [0] * len(bad.ids) and sum(good.trained_mask()) > 0


def test_the_request_timeout_ends_it_and_it_trains_on_nothing(pool):
    now = [0.0]

    def clock():
        now[0] += 1.0  # every look at the clock is a second later
        return now[0]

    # each round of calls "takes" a second on this clock: the 3rd round passes 2.5 s
    call = ids("<calc>2*3</calc>")
    script = {0: [call, call, call, call]}
    (episode,), backend, _ = run(
        script, pool, "tag", clock=clock, request_timeout_s=2.5, max_assistant_turns=9
    )
    assert episode.reason == "timeout" and sum(episode.trained_mask()) == 0
    assert len(episode.calls) == 3 and backend.count[0] == 3
    assert episode.spent == 3.0


def test_an_interaction_answers_as_the_user_until_it_is_done(pool):
    seen = []

    def reply(messages, **kwargs):
        seen.append(messages[-1]["content"])
        return (len(seen) == 2), "Try again.", float(len(seen))

    script = {0: [ids("12"), ids("408")]}
    (episode,), backend, _ = run(script, pool, interaction=reply, max_user_turns=3)
    assert episode.reason == "interaction_done" and seen == ["12", "408"]
    assert episode.info()["turn_scores"] == [1.0, 2.0]
    user = CHAT.delta([{"role": "user", "content": "Try again."}])
    assert backend.appended[0][1] == user
    # the closing reply is appended too (verl's agent loop), after the last turn, untrained
    assert episode.ids[-len(user) :] == user and episode.mask.count(0) == 2 * len(user)
    assert episode.info()["num_turns"] == 2 + 2 + 1 and episode.interaction_turns == 2


def test_an_interaction_out_of_turns_ends_by_max_turns(pool):
    def reply(messages, **kwargs):
        return False, "Again.", 0.0

    script = {0: [ids("1"), ids("2"), ids("3")]}
    (episode,), backend, _ = run(script, pool, interaction=reply, max_user_turns=2)
    assert episode.reason == "max_turns" and episode.user_turns == 2 and backend.count[0] == 3
    # max_user_turns also bounds tool rounds, as verl's: the 2nd call ends the request
    call = ids("<calc>2*3</calc>")
    (tools,), backend, _ = run({0: [call, call, call]}, pool, "tag", max_user_turns=1)
    assert tools.reason == "max_turns" and len(tools.calls) == 1 and backend.count[0] == 2


def test_an_async_interaction_and_the_end_reason_it_gives_are_kept(pool):
    async def reply(messages, **kwargs):
        return True, "", 3.0

    now = [0.0]

    def clock():  # the reply "takes" ten seconds, past the request's time
        now[0] += 10.0
        return now[0]

    script = {0: [ids("408")]}
    (episode,), _, _ = run(
        script, pool, interaction=reply, max_user_turns=1, clock=clock, request_timeout_s=5
    )
    assert episode.reason == "interaction_done" and episode.turn_scores == [3.0]


def test_a_turn_cut_by_max_turn_tokens_ends_without_the_interaction_as_verl(pool):
    """verl ends the request of a turn its token limit cut (its SGLang rollout on the
    "length" finish reason; its agent loop's only limit is the response budget, checked before
    the interaction): the user is not asked."""
    asked = []

    def reply(messages, **kwargs):
        asked.append(messages[-1]["content"])
        return False, "Go on.", 0.0

    script = {0: [ids("12345678"), ids("9")]}  # 9 ids (8 and the eos), cut at 4
    (episode,), backend, _ = run(script, pool, interaction=reply, max_turn_tokens=4)
    assert episode.reason == "length" and asked == [] and backend.count[0] == 1
    assert episode.mask == [1, 1, 1, 1] and episode.interaction_turns == 0


def test_interact_on_cut_closes_the_cut_turn_and_asks_the_interaction(pool):
    asked = []

    def reply(messages, **kwargs):
        asked.append(messages[-1]["content"])
        return len(asked) == 2, "Go on.", 0.0

    script = {0: [ids("12345678"), ids("abcdefgh")]}
    (episode,), backend, _ = run(
        script, pool, interaction=reply, max_turn_tokens=4, interact_on_cut=True
    )
    assert episode.reason == "interaction_done" and asked == ["1234", "abcd"]
    user = CHAT.delta([{"role": "user", "content": "Go on."}])
    # the cut turn gets an eos the policy did not sample (mask 0), fed before the reply
    assert backend.appended[0][1] == [EOS] + user
    assert episode.ids == ids("1234", eos=False) + [EOS] + user + ids("abcd") + user
    assert episode.mask == [1] * 4 + [0] * (1 + len(user)) + [1] * 4 + [0] * (1 + len(user))


def test_a_turn_that_fills_the_budget_ends_before_the_interaction(pool):
    """verl checks the response budget first: a turn that reaches it ends the request, and
    neither calls nor the interaction run after it."""
    asked = []

    def reply(messages, **kwargs):
        asked.append(messages[-1]["content"])
        return False, "Go on.", 0.0

    (episode,), _, _ = run({0: [ids("123")]}, pool, interaction=reply, max_new_tokens=4)
    assert episode.reason == "length" and asked == [] and episode.mask == [1] * 4


def test_tool_step_rewards_are_recorded(pool):
    script = {0: [ids(hermes("scored", answer="7")), ids("7")]}
    (episode,), _, _ = run(script, pool)
    assert episode.info()["tool_rewards"] == [0.5]
    assert episode.messages[-2]["content"] == "got 7"


class Counter:
    """A per-request class tool: state survives between calls; reward and close once."""

    closed = []

    def __init__(self, start: int = 0):
        self.total = start

    def add(self, n: int) -> str:
        """Add n to the running total.

        Args:
            n: the number to add.
        """
        self.total += n
        return str(self.total)

    def reward(self) -> float:
        return float(self.total)

    def close(self) -> None:
        Counter.closed.append(self.total)


def test_a_class_tool_keeps_state_per_request_and_is_rewarded_once(pool):
    from flowrl.agent.tools.toolbox import ClassTool

    box = Box([])
    box.tools, box.names = [ClassTool(Counter)], ["add"]
    Counter.closed.clear()
    episodes = [
        Episode(
            [1], CHAT, make_parser("hermes", ["add"]), box.open({"tools_kwargs": kwargs}), Limits()
        )
        for kwargs in ({"Counter": {"create_kwargs": {"start": 10}}}, {})
    ]
    turn = ids(hermes("add", n=5))
    script = {0: [turn, turn, ids("done")], 1: [turn, ids("done")]}
    run_sync(run_requests(episodes, ScriptedTurns(script)))
    assert [m["content"] for m in episodes[0].messages if m["role"] == "tool"] == ["15", "20"]
    assert episodes[0].info()["rollout_reward_scores"] == {"Counter": 20.0}
    assert episodes[1].info()["rollout_reward_scores"] == {"Counter": 5.0}
    assert sorted(Counter.closed) == [5, 20]  # each instance closed once


def test_a_tool_whose_creation_fails_ends_only_its_request(pool):
    from flowrl.agent.tools.toolbox import ClassTool

    box = Box([])
    box.tools, box.names = [ClassTool(Counter)], ["add"]
    bad = Episode(
        [1],
        CHAT,
        make_parser("hermes", ["add"]),
        box.open({"tools_kwargs": {"Counter": {"create_kwargs": {"wrong": 1}}}}),
        Limits(),
    )
    good = Episode([1], CHAT, make_parser("hermes", ["add"]), box.open({}), Limits())
    backend = ScriptedTurns({0: [], 1: [ids("hi")]})
    run_sync(run_requests([bad, good], backend))
    assert bad.reason == "error" and "TypeError" in bad.error and bad.ids == []
    assert good.reason == "stop" and backend.count == {0: 0, 1: 1}
