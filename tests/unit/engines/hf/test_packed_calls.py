"""Packed model calls (flowrl/engines/hf/packed.py): decoding rows and a request back from its
tools in one call, on the tiny random Llama. A packed call computes what the two separate
calls compute, and what the model computes on the whole conversation without a cache; in the
engine a returning request joins the decoding row's call, and the rollout is the one the
engine makes without packing."""

import asyncio
import copy
import threading

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama import modeling_llama

from flowrl.backends import HFOptions
from flowrl.engines import HFRollout
from flowrl.engines.hf.packed import PackedCall, can_pack, packing
from flowrl.engines.rollout import Request, Sampling
from flowrl.engines.threads import run_sync
from flowrl.models.tiny import tiny_model, tiny_qwen2, tiny_tokenizer

A_PROMPT, B_PROMPT = [5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3).eval()


def primed(model):
    """An engine whose cache holds A's prompt in slot 0 and B's in slot 1."""
    engine = HFRollout(model, tiny_tokenizer())
    engine.runner.reserve(3, 32)
    with torch.inference_mode():
        engine.runner.prefill([A_PROMPT, B_PROMPT], [0, 0], 0)
    return engine


qwen2 = tiny_qwen2  # biased q/k/v projections, 4 heads sharing 2 KV heads


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_packed_call_computes_what_two_calls_and_the_whole_conversation_compute(family):
    model = tiny_model(seed=3).eval() if family == "llama" else qwen2()
    packed, apart = primed(model), primed(model)
    assert packed.runner.packs
    with torch.inference_mode():
        # A decodes its next token (20) while B feeds three new ids after its prompt
        logits = packed.runner.packed([[20], [30, 31, 32]], [5, 7], 0)
        a = apart.runner.decode([20], [5], 0)
        b = apart.runner.prefill([[30, 31, 32]], [7], 1)
        whole_a = model(input_ids=torch.tensor([A_PROMPT + [20]])).logits[0, -1]
        whole_b = model(input_ids=torch.tensor([B_PROMPT + [30, 31, 32]])).logits[0, -1]
    assert logits.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(logits, torch.cat([a, b]))
    torch.testing.assert_close(logits, torch.stack([whole_a, whole_b]))
    for mine, theirs in zip(packed.runner.cache.layers, apart.runner.cache.layers, strict=True):
        torch.testing.assert_close(mine.key_buffer[:2, :, :10], theirs.key_buffer[:2, :, :10])
        torch.testing.assert_close(mine.value_buffer[:2, :, :10], theirs.value_buffer[:2, :, :10])
    # the packed attention is selected for the packed call only
    assert model.config._attn_implementation == "sdpa"


def test_only_models_whose_attention_layers_call_the_registered_functions_with_sdpa_pack():
    assert can_pack(tiny_model())
    eager = tiny_model()
    eager.config._attn_implementation = "eager"
    assert not can_pack(eager)
    assert not can_pack(torch.nn.Linear(2, 2))


def test_several_decoding_rows_and_returning_rows_of_every_length_in_one_call(model):
    """Decoding rows at different columns (their mask differs row by row), then returning
    rows of 3, 1 and 2 ids: each row's logits are the model's own on its whole sequence."""
    engine = HFRollout(model, tiny_tokenizer())
    engine.runner.reserve(6, 32)
    prompts = [[5, 6], [7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18], [19], [20, 21]]
    chunks = [[30], [31], [32], [40, 41, 42], [43], [44, 45]]
    with torch.inference_mode():
        engine.runner.prefill(prompts, [0] * 6, 0)
        logits = engine.runner.packed(chunks, [len(p) for p in prompts], 0)
        whole = [
            model(input_ids=torch.tensor([p + c])).logits[0, -1]
            for p, c in zip(prompts, chunks, strict=True)
        ]
    torch.testing.assert_close(logits, torch.stack(whole))


def test_a_model_that_claims_the_attention_functions_but_bypasses_them_is_computed_apart(
    model, monkeypatch
):
    """Its packed call is computed again a group at a time, with a warning, and the engine
    packs no more."""
    engine, apart = primed(model), primed(model)
    monkeypatch.setattr(
        modeling_llama.ALL_ATTENTION_FUNCTIONS,
        "get_interface",
        lambda name, default: sdpa_attention_forward,
    )
    with torch.inference_mode(), pytest.warns(UserWarning, match="0 of 2 did"):
        logits = engine.runner.packed([[20], [30, 31, 32]], [5, 7], 0)
    assert not engine.runner.packs
    with torch.inference_mode():
        a = apart.runner.decode([20], [5], 0)
        b = apart.runner.prefill([[30, 31, 32]], [7], 1)
    torch.testing.assert_close(logits, torch.cat([a, b]))
    for mine, theirs in zip(engine.runner.cache.layers, apart.runner.cache.layers, strict=True):
        torch.testing.assert_close(mine.key_buffer[:2, :, :10], theirs.key_buffer[:2, :, :10])


def test_another_threads_forward_during_a_packed_call_runs_plain_sdpa(model):
    """The implementation is swapped on the shared config while a packed call runs: a forward
    of the same module on another thread meanwhile (started and joined inside the call)
    computes what it computes outside it."""
    engine = primed(model)
    x = torch.tensor([[3, 4, 5, 6]])
    with torch.inference_mode():
        expected = model(input_ids=x).logits
    seen = {}

    def other():
        with torch.inference_mode():
            seen["logits"] = model(input_ids=x).logits

    def during(module, args):
        if "implementation" not in seen:  # once, in the packed call's thread
            seen["implementation"] = model.config._attn_implementation
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()

    hook = model.model.layers[1].register_forward_pre_hook(during)
    try:
        with torch.inference_mode():
            engine.runner.packed([[20], [30, 31, 32]], [5, 7], 0)
    finally:
        hook.remove()
    assert seen["implementation"] == "flowrl_packed"
    torch.testing.assert_close(seen["logits"], expected)
    assert model.config._attn_implementation == "sdpa"


def test_overlapping_packed_calls_restore_the_implementation_when_the_last_ends(model):
    first, second = packing(model, PackedCall(None, [])), packing(model, PackedCall(None, []))
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first ends while the second still runs
    assert model.config._attn_implementation == "flowrl_packed"
    second.__exit__(None, None, None)
    assert model.config._attn_implementation == "sdpa"


def gated(engine, model, call: int):
    """Record the input shape of each model call; before call number `call` (from 0), set
    the event state["go"] on the caller's loop (the caller's coroutine puts both in `state`)
    and wait until the requests it lets go have reached the engine. -> (the shapes, state,
    the hook to remove)."""
    shapes, arrived, state = [], threading.Event(), {}
    hand_over = engine.scheduler._hand_over
    engine.scheduler._hand_over = lambda loop: (hand_over(loop), arrived.set())

    def gate(module, args, kwargs):  # in the engine's thread before each call
        k = len(shapes)
        shapes.append(tuple(kwargs["input_ids"].shape))
        if k == 0:  # the first requests are in: from now on `arrived` means the later ones
            arrived.clear()
        if k == call:
            state["loop"].call_soon_threadsafe(state["go"].set)
            assert arrived.wait(10)

    return shapes, state, model.register_forward_pre_hook(gate, with_kwargs=True)


def rollout(model, packs: bool, device="cpu"):
    """A ends its first turn and goes to its tool; B decodes alone meanwhile. A's tool
    answers during B's model call 4, which waits until A's next request has reached the
    engine: A's new ids then ride in B's next decode call. Returns (A's two results, B's,
    the input shape of every model call). On CUDA too the eager runner in the model's dtype:
    the module the hook sees is the one the engine calls, one forward per call."""
    options = HFOptions(runner="eager", dtype="float32")
    engine = HFRollout(model, tiny_tokenizer(), device, options=options)
    assert engine.view is None
    engine.runner.packs = packs
    shapes, state, hook = gated(engine, model, call=4)
    greedy = Sampling(do_sample=False)

    async def run():
        state["loop"], state["go"] = asyncio.get_running_loop(), asyncio.Event()

        async def a():
            first = await engine.generate(Request(A_PROMPT, 2, greedy, request_id="a", keep=True))
            await state["go"].wait()
            ids = A_PROMPT + first.ids + [40, 41, 42]  # the tool's answer follows the turn
            second = await engine.generate(Request(ids, 3, greedy, request_id="a", keep=True))
            return first, second

        async def b():
            return await engine.generate(Request(B_PROMPT, 12, greedy, request_id="b"))

        (first, second), result_b = await asyncio.gather(a(), b())
        engine.release("a")
        return first, second, result_b

    try:
        results = run_sync(run())
    finally:
        hook.remove()
    engine.idle()
    assert engine.runner.cache is None
    return results, shapes, engine.scheduler.batch.counts


def test_a_request_back_from_its_tools_joins_the_decoding_call_and_changes_no_token(model):
    (first, second, b), shapes, counts = rollout(model, packs=True)
    (first_, second_, b_), shapes_, counts_ = rollout(model, packs=False)
    assert [len(first.ids), len(second.ids), len(b.ids)] == [2, 3, 12]
    assert (first.ids, second.ids, b.ids) == (first_.ids, second_.ids, b_.ids)
    for mine, theirs in ((first, first_), (second, second_), (b, b_)):
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs))
    # A's return: its last sampled id (never fed) and the tool's 3, packed after B's token
    assert shapes[:6] == [(2, 7), (2, 1), (1, 1), (1, 1), (1, 1), (1, 5)]
    assert shapes[6] == (2, 1)  # then A and B decode together
    assert counts["packed_calls"] == 1 and counts_["packed_calls"] == 0
    # without packing, A's new ids are a prefill call of their own before B's decode call
    assert shapes_[:7] == [(2, 7), (2, 1), (1, 1), (1, 1), (1, 1), (1, 4), (2, 1)]
    assert len(shapes_) == len(shapes) + 1


PREFIX = list(range(10, 30))  # 20 ids: the system prompt every request below starts with


def newcomers(model, packs: bool):
    """A (kept by id) ends its first turn and is held away at its tools; B decodes alone.
    Before model call 3 (from 0) two samples of one new prompt C arrive: every slot is taken
    (A's held, B's decoding), so theirs are appended. Returns (B's result, the two samples',
    the input shape of every model call, the engine's counts)."""
    engine = HFRollout(model, tiny_tokenizer())
    engine.runner.packs = packs
    shapes, state, hook = gated(engine, model, call=3)
    greedy = Sampling(do_sample=False)

    async def run():
        state["loop"], state["go"] = asyncio.get_running_loop(), asyncio.Event()

        async def c(name):
            await state["go"].wait()
            return await engine.generate(Request(PREFIX + [50, 51], 4, greedy, request_id=name))

        a = Request(PREFIX + [40], 1, greedy, request_id="a", keep=True)
        b = Request(PREFIX + [41, 42], 10, greedy, request_id="b")
        out = await asyncio.gather(engine.generate(a), engine.generate(b), c("c1"), c("c2"))
        engine.release("a")
        return out[1:]

    try:
        results = run_sync(run())
    finally:
        hook.remove()
    engine.idle()
    return results, shapes, engine.scheduler.batch.counts


def test_new_prompts_arriving_while_another_decodes_ride_in_its_decode_call(model):
    (b, c1, c2), shapes, counts = newcomers(model, packs=True)
    (b_, c1_, c2_), shapes_, counts_ = newcomers(model, packs=False)
    # C's first 20 ids are copied from a slot that holds them; its last two ride in B's decode
    # call, fed once for both samples; then B and both samples decode together
    assert shapes[:6] == [(2, 22), (1, 1), (1, 1), (1, 1), (1, 3), (3, 1)]
    assert counts["packed_calls"] == 1 and counts["copied_prefix_tokens"] == 20
    # without packing, the two ids get a prefill call of their own before B's decode call
    assert shapes_[:6] == [(2, 22), (1, 1), (1, 1), (1, 1), (1, 2), (3, 1)]
    assert counts_["copied_prefix_tokens"] == 20
    alone = HFRollout(model, tiny_tokenizer())
    only = run_sync(alone.generate(Request(PREFIX + [50, 51], 4, Sampling(do_sample=False))))
    assert len(c1.ids) == 4 and c1.ids == c2.ids == c1_.ids == only.ids and b.ids == b_.ids
    for mine in (c1, c2, c1_):
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(only.logprobs))


# -- CUDA (skipped without a GPU) -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_packed_calls_compute_the_whole_conversations_and_the_cpus_rollout(model):
    gpu = copy.deepcopy(model).cuda()
    # the CUDA runner's packed call, in fp32 as the whole-conversation forwards it is held to
    engine = HFRollout(gpu, tiny_tokenizer(), "cuda", options=HFOptions(dtype="float32"))
    assert engine.view is None and type(engine.runner).__name__ == "StaticRunner"
    engine.runner.reserve(3, 32)
    prompts, chunks = [[5, 6], [7, 8, 9, 10], [11, 12, 13]], [[30], [40, 41, 42], [43]]
    with torch.inference_mode():
        engine.runner.prefill(prompts, [0, 0, 0], 0)
        logits = engine.runner.packed(chunks, [len(p) for p in prompts], 0)
        whole = [
            gpu(input_ids=torch.tensor([p + c], device="cuda")).logits[0, -1]
            for p, c in zip(prompts, chunks, strict=True)
        ]
    assert logits.device.type == "cuda"
    torch.testing.assert_close(logits, torch.stack(whole), atol=1e-4, rtol=1e-4)
    # a request back from its tools joins the decoding call on the GPU too, same tokens
    (first, second, b), shapes, counts = rollout(gpu, packs=True, device="cuda")
    (first_, second_, b_), shapes_, _ = rollout(model, packs=True)
    assert counts["packed_calls"] == 1 and shapes == shapes_
    assert (first.ids, second.ids, b.ids) == (first_.ids, second_.ids, b_.ids)
    for mine, theirs in ((first, first_), (second, second_), (b, b_)):
        torch.testing.assert_close(
            torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-4, rtol=1e-4
        )
