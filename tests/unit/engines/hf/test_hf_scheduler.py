"""The continuous-batching engine (flowrl/engines/hf/scheduler.py) under the agent driver, on the
tiny random model: every request its own task, turns extended in its held cache slot, giving
the same log-probs as re-running the whole conversation without a cache; the train engine's
log-probs of the multi-turn rows equal the sampler's; a rollout is a function of its seeds.
Then the scheduler's batching itself, driven step by step with a scripted model: who is in
each model call, what a returning request prefills, lockstep."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from flowrl.agent.chat import ChatTokens
from flowrl.agent.driver import run_requests
from flowrl.agent.episode import Episode, Limits
from flowrl.agent.parsers import user_parser
from flowrl.agent.tools.toolbox import FunctionTool, Toolbox
from flowrl.backends import HFOptions
from flowrl.engines import HFRollout, TrainEngine
from flowrl.engines.rollout import Request, Sampling
from flowrl.engines.threads import run_sync
from flowrl.protocol import DataProto
from flowrl.testing import tiny_model, tiny_tokenizer

QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hi."]
SYSTEM = {"role": "system", "content": "You are a terse assistant who uses tools. " * 2}


def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: anything.
    """
    return f"echo:{text}"


def calls_unless_done(text: str):
    """Every turn calls echo, unless it contains an "a" (then the request ends): requests
    end at different turns, so rows leave the cache mid-rollout."""
    return [] if "a" in text else [("echo", {"text": text[:4]})]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(params=["eager", "static"])
def runner(request):
    """The engine's model runner: the eager one (the CPU path) and the CUDA runner's calls,
    run eagerly (engines/hf/static.py): every engine test below holds for both."""
    return request.param


def rollout(
    model, n=2, seed=0, do_sample=True, max_turn_tokens=6, first_turn=(), lockstep=False,
    runner="eager",
):  # fmt: skip
    """Episodes run by the request driver on the engine; (episodes, prompts, prompt_mask)."""
    tokenizer = tiny_tokenizer()
    chat = ChatTokens(tokenizer)
    box = Toolbox([])
    box.tools, box.names = [FunctionTool(echo)], ["echo"]
    prompt_ids = [chat.encode([SYSTEM, {"role": "user", "content": q}], True) for q in QUESTIONS]
    width = max(len(p) for p in prompt_ids)
    prompts = torch.full((len(prompt_ids), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(prompts)
    for i, ids in enumerate(prompt_ids):
        prompts[i, width - len(ids) :], mask[i, width - len(ids) :] = torch.tensor(ids), 1
    limits = Limits(
        max_new_tokens=200,
        max_turn_tokens=max_turn_tokens,
        max_assistant_turns=3,
        max_obs_tokens=20,
    )
    episodes = [
        Episode(ids, chat, user_parser(calls_unless_done), box.open({}), limits)
        for ids in prompt_ids
        for _ in range(n)
    ]
    options = HFOptions(lockstep=lockstep, runner=runner, memory_fraction=0.01)
    engine = HFRollout(model, tokenizer, options=options)
    sampling = Sampling(do_sample=do_sample)
    seeds = [seed * 1000 + k for k in range(len(episodes))]
    stats = run_sync(
        run_requests(episodes, engine, sampling, seeds, first_turn=first_turn, lockstep=lockstep)
    )
    engine.idle()
    assert not engine.scheduler.batch.slots  # every request released: the engine freed its slots
    assert engine.runner.cache is None or runner == "static"  # a static cache stays allocated
    assert stats.turns > len(episodes)  # requests came back for further turns
    return episodes, prompts, mask


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """The reference: the whole sequence through the model at once, no cache: (len, v)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def check_against_full_forward(model, episodes, greedy: bool) -> None:
    for episode in episodes:
        ids = episode.prompt_ids + episode.ids
        logits = full_logits(model, ids)
        p = len(episode.prompt_ids)
        for j, trained in enumerate(episode.mask):
            if not trained:
                continue
            expected = torch.log_softmax(logits[p + j - 1], -1)[ids[p + j]]
            assert abs(float(expected) - episode.logprobs[j]) < 1e-4
            if greedy:  # each token is the argmax given everything before it
                assert int(logits[p + j - 1].argmax()) == ids[p + j]


def test_cache_extension_equals_rerunning_the_conversation(model, runner):
    """Every sampled token's log-prob, from the cache extended turn by turn, equals the
    one from running the whole conversation (tool output included) through the model."""
    # a seed whose rows leave at different turns (the static runner draws from other streams)
    episodes, _, _ = rollout(model, n=2, seed={"eager": 2, "static": 0}[runner], runner=runner)
    reasons = [e.reason for e in episodes]
    assert "max_turns" in reasons and len(set(reasons)) > 1  # rows left at different turns
    assert all(e.mask.count(0) > 0 for e in episodes if e.reason == "max_turns")
    check_against_full_forward(model, episodes, greedy=False)


def test_cache_extension_equals_rerunning_the_conversation_greedy(model, runner):
    episodes, _, _ = rollout(model, n=1, do_sample=False, runner=runner)
    assert all(e.reason == "max_turns" for e in episodes)
    check_against_full_forward(model, episodes, greedy=True)


def test_train_engine_logprobs_equal_the_samplers_at_trained_positions(model, runner):
    episodes, prompts, prompt_mask = rollout(model, n=2, seed=1, runner=runner)
    rows = len(episodes)
    t = max(len(e.ids) for e in episodes)
    responses = torch.zeros(rows, t, dtype=torch.long)
    response_mask, attention = torch.zeros_like(responses), torch.zeros_like(responses)
    sampled = torch.zeros(rows, t)
    for k, e in enumerate(episodes):
        responses[k, : len(e.ids)] = torch.tensor(e.ids)
        response_mask[k, : len(e.ids)] = torch.tensor(e.mask)
        attention[k, : len(e.ids)] = 1
        sampled[k, : len(e.ids)] = torch.tensor(e.logprobs)
    assert int((attention - response_mask).sum()) > 0  # tool output inside the rows
    batch = DataProto.from_dict(
        {
            "prompts": prompts.repeat_interleave(2, 0),
            "prompt_mask": prompt_mask.repeat_interleave(2, 0),
            "responses": responses,
            "response_mask": response_mask,
            "response_attention": attention,
        }
    )
    engine = TrainEngine(model, tiny_tokenizer(), trainable=False)
    logprobs = engine.forward(batch, grad=False)["logprobs"]
    trained = response_mask.bool()
    assert (logprobs[trained] - sampled[trained]).abs().max() < 1e-5
    # the check bites: attending with the trained mask only (tool output unseen) disagrees
    batch["response_attention"] = response_mask
    blind = engine.forward(batch, grad=False)["logprobs"]
    assert (blind[trained] - sampled[trained]).abs().max() > 1e-3


def test_a_lockstep_rollout_is_a_function_of_its_seeds(model, runner):
    first = [(e.ids, e.mask) for e in rollout(model, seed=5, lockstep=True, runner=runner)[0]]
    again = [(e.ids, e.mask) for e in rollout(model, seed=5, lockstep=True, runner=runner)[0]]
    other = [(e.ids, e.mask) for e in rollout(model, seed=6, lockstep=True, runner=runner)[0]]
    assert first == again and first != other


def test_a_requests_tokens_do_not_depend_on_the_requests_beside_it(model, runner):
    """Each request samples from its own stream, seeded by (seed, turn): alone or in a batch
    with five others, it samples the same tokens (log-probs equal up to float noise)."""
    tokenizer = tiny_tokenizer()
    prompts = [tokenizer(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    requests = [Request(prompts[k % 3], 12, seed=k, turn=1) for k in range(6)]

    async def together(engine, batch):
        return await asyncio.gather(*(engine.generate(r) for r in batch))

    engine = HFRollout(model, tokenizer, options=HFOptions(runner=runner, memory_fraction=0.01))
    batched = run_sync(together(engine, requests))
    for request, result in zip(requests, batched, strict=True):
        (alone,) = run_sync(together(engine, [request]))
        assert alone.ids == result.ids and alone.finish_reason == result.finish_reason
        torch.testing.assert_close(alone.logprobs, result.logprobs, atol=1e-5, rtol=0)
    other_turn = run_sync(together(engine, [Request(prompts[0], 12, seed=0, turn=2)]))[0]
    assert other_turn.ids != batched[0].ids  # the turn is part of the stream's seed


def test_a_forced_first_turn_is_taken_verbatim_with_the_policys_log_probs(model, runner):
    """The agent's script_first_turn: every request's first turn is the given ids (here
    "ping" and the eos, a call of echo), each with the model's own log-prob of it; the turns
    after it are sampled as usual."""
    tokenizer = tiny_tokenizer()
    forced = tokenizer("ping", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    episodes, _, _ = rollout(model, n=2, seed=0, first_turn=forced, runner=runner)
    for episode in episodes:
        assert episode.ids[: len(forced)] == forced
        assert episode.info()["calls"][0]["name"] == "echo"
    assert len({tuple(e.ids) for e in episodes}) > 1  # sampled after the first turn
    check_against_full_forward(model, episodes, greedy=False)


# -- the scheduler's batching, step by step, with a scripted model -------------------------


class CountingLM(torch.nn.Module):
    """A model whose next token after id x is x + 1 (never the eos, 2), for any cache; it
    records every call: (slots lo..hi as the number of rows, query width, positions)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=1, _attn_implementation="sdpa")
        self.unused = torch.nn.Parameter(torch.zeros(1))
        self.calls = []
        self.before_call = None  # a hook run in the engine's thread before each call

    def forward(self, input_ids, position_ids, logits_to_keep, **kwargs):
        if self.before_call is not None:
            self.before_call(len(self.calls))
        self.calls.append((len(input_ids), input_ids.shape[1], position_ids[:, 0].tolist()))
        nxt = (input_ids + 1) % 100  # (a, w)
        logits = torch.nn.functional.one_hot(nxt, 100).float() * 10
        keep = logits[:, -1:] if isinstance(logits_to_keep, int) else logits[:, logits_to_keep]
        return SimpleNamespace(logits=keep)


class FakeTokenizer:
    eos_token_id, pad_token_id = 2, 0


def greedy(ids, limit, name):
    return Request(ids, limit, Sampling(do_sample=False), request_id=name, keep=True)


def test_a_request_back_from_its_tools_prefills_only_its_new_tokens_while_another_decodes():
    """A ends its first turn and waits for its tool; B goes on decoding alone meanwhile. When
    A comes back, only its new ids are fed (its last sampled token and the tool's 3), at the
    positions after its cached ones, and it joins B's decoding: one call for both. Events,
    not sleeps, order the two sides: A's tool answers during B's model call 5, which waits
    until A's next request has reached the engine."""
    model = CountingLM()
    engine = HFRollout(model, FakeTokenizer())
    back, hand_over = threading.Event(), engine.scheduler._hand_over
    engine.scheduler._hand_over = lambda loop: (hand_over(loop), back.set())
    state = {}

    def gate(k):  # runs in the engine's thread before model call k
        if k == 0:  # the first requests are in: from now on `back` means A's second
            back.clear()
        if k == 5:  # B's 4th call alone: A's tool answers now, and the call waits for A
            state["loop"].call_soon_threadsafe(state["tool"].set)
            assert back.wait(10)

    async def run():
        state["loop"], state["tool"] = asyncio.get_running_loop(), asyncio.Event()

        async def a():
            first = await engine.generate(greedy([10, 11, 12], 2, "a"))
            await state["tool"].wait()
            # the tool's output (3 ids) follows the turn; the whole conversation is sent
            second = await engine.generate(greedy([10, 11, 12, 13, 14, 50, 51, 52], 2, "a"))
            return first, second

        async def b():
            return await engine.generate(greedy([20, 21], 9, "b"))

        (first, second), result_b = await asyncio.gather(a(), b())
        engine.release("a"), engine.release("b")
        return first, second, result_b

    model.before_call = gate
    first, second, result_b = run_sync(run())
    assert first.ids == [13, 14] and first.finish_reason == "length"
    assert second.ids == [53, 54] and result_b.ids == list(range(22, 31))
    assert model.calls == [
        (2, 3, [0, 0]),  # both prompts prefilled, right-padded to 3 columns
        (2, 1, [3, 2]),  # both decode; A has sampled 13, 14 and leaves for its tool
        (1, 1, [3]), (1, 1, [4]), (1, 1, [5]), (1, 1, [6]),  # B alone
        (1, 4, [4]),  # A back: 14 (sampled, never fed) and the tool's 3 ids, at 4..7
        (2, 1, [7, 8]),  # A joined B's decoding: one call for both
        (1, 1, [8]), (1, 1, [9]),  # A done; B finishes its 9 tokens
    ]  # fmt: skip
    engine.idle()
    assert engine.runner.cache is None


def test_lockstep_runs_no_step_while_a_held_request_is_away():
    model = CountingLM()
    engine = HFRollout(model, FakeTokenizer(), options=HFOptions(lockstep=True))

    async def run():
        async def a():
            await engine.generate(greedy([10, 11, 12], 1, "a"))
            await asyncio.sleep(0)  # its "tool"
            second = await engine.generate(greedy([10, 11, 12, 13, 40], 1, "a"))
            engine.release("a")  # held and never back would stop the lockstep engine
            return second

        async def b():
            return await engine.generate(greedy([20, 21, 22], 5, "b"))

        results = await asyncio.gather(a(), b())
        engine.release("b")
        return results

    second, result_b = run_sync(run())
    assert second.ids == [41] and result_b.ids == [23, 24, 25, 26, 27]
    # prefill both; A samples its one token and leaves, B's token is fed; then nothing runs
    # until A is back: its prefill (13 and 40) comes before B's next decode call
    assert model.calls[:4] == [(2, 3, [0, 0]), (1, 1, [3]), (1, 2, [3]), (1, 1, [4])]


def test_releasing_a_running_request_ends_it_with_abort_and_frees_its_slot():
    model = CountingLM()
    engine = HFRollout(model, FakeTokenizer())
    model.before_call = lambda k: engine.release("a") if k == 3 else None

    async def run():
        return await asyncio.gather(
            engine.generate(greedy([10, 11], 20, "a")), engine.generate(greedy([30], 5, "b"))
        )

    a, b = run_sync(run())
    assert a.finish_reason == "abort" and a.ids == [12, 13, 14]  # sampled before the release
    assert b.finish_reason == "length" and b.ids == [31, 32, 33, 34, 35]
    engine.release("b")
    engine.idle()
    assert engine.runner.cache is None and not engine.scheduler.batch.held


# -- a synchronous caller lends its thread to the loop (HFRollout.run) ----------------------


def test_run_makes_the_model_calls_on_the_callers_thread_and_returns_the_results():
    model = CountingLM()
    engine = HFRollout(model, FakeTokenizer())
    threads = set()
    model.before_call = lambda k: threads.add(threading.current_thread())

    async def run():
        results = await asyncio.gather(
            engine.generate(greedy([10, 11], 3, "a")), engine.generate(greedy([30], 2, "b"))
        )
        engine.release("a"), engine.release("b")
        return results

    a, b = engine.run(run())
    assert threads == {threading.current_thread()}
    assert a.ids == [12, 13, 14] and b.ids == [31, 32]
    assert engine.runner.cache is None and engine.scheduler.thread is None  # the loop has exited


def test_run_raises_the_coroutines_error_and_drops_what_it_left_held():
    model = CountingLM()
    engine = HFRollout(model, FakeTokenizer())

    async def run():
        await engine.generate(greedy([10, 11], 2, "a"))  # kept, never released
        raise ValueError("the caller's own error")

    with pytest.raises(ValueError, match="the caller's own error"):
        engine.run(run())
    assert engine.runner.cache is None and not engine.scheduler.batch.held
    # the engine serves the next caller as a fresh one
    assert engine.run(engine.generate(greedy([40], 2, "c"))).ids == [41, 42]


def test_a_lockstep_run_whose_caller_ends_with_a_request_away_does_not_wait_for_it():
    """A lockstep engine runs no step while a held request is away; once the caller has
    ended, nobody can come back for A, so the loop goes on: B (cancelled with the caller's
    loop) leaves with "abort" and the loop exits instead of waiting for A forever."""
    model = CountingLM()
    engine = HFRollout(model, FakeTokenizer(), options=HFOptions(lockstep=True))

    async def run():
        async def b():
            return await engine.generate(Request([30], 6, Sampling(do_sample=False)))

        task = asyncio.ensure_future(b())
        await engine.generate(greedy([10, 11], 1, "a"))  # A stays away, unreleased
        return task  # B still decoding when the caller ends

    caller = threading.Thread(target=engine.run, args=(run(),), daemon=True)
    caller.start()
    caller.join(30)
    assert not caller.is_alive()
    assert engine.runner.cache is None and engine.scheduler.thread is None


def test_run_while_another_caller_holds_the_loop_joins_it():
    """A second synchronous caller (another thread) while the first one's requests run: its
    request is batched by the running loop, on the first caller's thread. An event orders the
    two: model call 1 waits until the second caller's request has reached the engine."""
    model = CountingLM()
    engine = HFRollout(model, FakeTokenizer())
    arrived, hand_over = threading.Event(), engine.scheduler._hand_over
    engine.scheduler._hand_over = lambda loop: (hand_over(loop), arrived.set())
    threads, out = set(), {}

    def second_caller():
        out["b"] = engine.run(engine.generate(Request([30], 2, Sampling(do_sample=False))))

    def gate(k):  # in the loop's thread, before model call k
        threads.add(threading.current_thread())
        if k == 1:  # the first caller's loop is running: the second caller starts now
            arrived.clear()
            out["thread"] = threading.Thread(target=second_caller)
            out["thread"].start()
            assert arrived.wait(10)

    model.before_call = gate
    a = engine.run(engine.generate(Request([10], 8, Sampling(do_sample=False))))
    out["thread"].join(10)
    assert a.ids == list(range(11, 19)) and out["b"].ids == [31, 32]
    assert threads == {threading.current_thread()}  # every call on the first caller's thread
    assert model.calls[:4] == [
        (1, 1, [0]), (1, 1, [1]),  # a's prompt, a's first decode (the second caller starts)
        (1, 1, [0]),  # b's prompt prefilled in the running loop
        (2, 1, [2, 1]),  # a and b decode in one call
    ]  # fmt: skip


# -- a new prompt copies the prefix another request's slot holds ------------------------------

PREFIX = list(range(10, 30))  # 20 ids: the system prompt of both requests


def staggered(model, tokenizer):
    """A arrives alone; B, sharing A's first 20 ids, arrives during A's prefill call, so the
    two are admitted one after the other. -> (A's result, B's, the engine)."""
    engine = HFRollout(model, tokenizer)
    arrived, hand_over, state = threading.Event(), engine.scheduler._hand_over, {}
    engine.scheduler._hand_over = lambda loop: (hand_over(loop), arrived.set())

    def gate(k):  # in the engine's thread before model call k
        if k == 0:
            arrived.clear()
            state["loop"].call_soon_threadsafe(state["go"].set)
            assert arrived.wait(10)

    async def run():
        state["loop"], state["go"] = asyncio.get_running_loop(), asyncio.Event()

        async def b():
            await state["go"].wait()
            return await engine.generate(greedy(PREFIX + [50, 51], 3, "b"))

        return await asyncio.gather(engine.generate(greedy(PREFIX + [40], 3, "a")), b())

    return gate, run, engine


def test_a_prompt_arriving_later_copies_the_prefix_a_running_request_holds():
    model = CountingLM()
    gate, run, engine = staggered(model, FakeTokenizer())
    model.before_call = gate
    a, b = run_sync(run())
    assert a.ids == [41, 42, 43] and b.ids == [52, 53, 54]
    # A is prefilled and decodes once; B's first 20 ids are then copied from A's slot, so its
    # prefill feeds only 50, 51, at columns 20 and 21; then both decode together
    assert model.calls[:4] == [(1, 21, [0]), (1, 1, [21]), (1, 2, [20]), (2, 1, [22, 22])]
    assert engine.scheduler.batch.counts["copied_prefix_tokens"] == 20
    engine.release("a"), engine.release("b")


def test_a_copied_prefix_gives_the_tokens_and_log_probs_of_a_prompt_prefilled_alone(model):
    tokenizer = tiny_tokenizer()
    gate, run, engine = staggered(model, tokenizer)
    hook = model.register_forward_pre_hook(lambda m, args, kw: gate(calls.pop()), with_kwargs=True)
    calls = list(range(50, -1, -1))  # pop() gives each model call its number: 0, 1, 2, ...
    try:
        a, b = run_sync(run())
    finally:
        hook.remove()
    engine.release("a"), engine.release("b")
    assert engine.scheduler.batch.counts["copied_prefix_tokens"] == 20
    alone = HFRollout(model, tokenizer)
    only_b = run_sync(alone.generate(greedy(PREFIX + [50, 51], 3, "b")))
    assert b.ids == only_b.ids
    torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(only_b.logprobs))
    alone.release("b")
