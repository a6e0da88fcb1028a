"""The CUDA runner's parts on the CPU (flowrl/engines/hf/static.py, sampling.py): everything
but the graph capture. The counter-based streams (known answers, uniformity, independence of
the batch), the static cache's bookkeeping (a layout from a budget, the ladder, requests that
wait for room, a regrown cache), decode blocks (padding rows and finished rows write to the
scratch column only), and the runner with graphs off giving the eager runner's greedy tokens.
The engine tests of test_hf_scheduler.py also run on this runner."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl.backends import HFOptions
from flowrl.engines import HFRollout, make_rollout
from flowrl.engines.batch import generate_batch
from flowrl.engines.hf.sampling import (
    sample_scan,
    sample_tokens,
    stream_uniforms,
    threefry2x32,
)
from flowrl.engines.hf.static import (
    LADDER,
    LOGIT_BYTES,
    CacheFull,
    StaticRunner,
    bucket,
    cache_layout,
    column_bytes,
)
from flowrl.engines.rollout import Request, Sampling
from flowrl.engines.threads import run_sync
from flowrl.errors import FlowrlError, GraphErrors
from flowrl.front import dsl
from flowrl.testing import tiny_model, tiny_qwen2, tiny_tokenizer

GREEDY = Sampling(do_sample=False)
STATIC = HFOptions(runner="static", memory_fraction=0.01)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3).eval()


def prompts_and_mask(rows: int, width: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 100, (rows, width), generator=g)
    mask = torch.ones_like(prompts)
    for k in range(rows):
        mask[k, : k % 3] = 0  # ragged prompts, left-padded
    return prompts, mask


def together(engine, requests):
    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return run_sync(run())


# -- counter-based streams ----------------------------------------------------------------------


def test_threefry_gives_random123s_known_answers():
    cases = [  # (counter, key, output) from Random123's kat_vectors (threefry2x32_20)
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 2, (0x1CB996FC, 0xBB002BE7)),
        ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xC4923A9C, 0x483DF7A0)),
    ]
    for counter, key, expected in cases:
        words = threefry2x32(tuple(map(torch.tensor, key)), tuple(map(torch.tensor, counter)))
        assert tuple(int(w) for w in words) == expected


def test_stream_uniforms_are_uniform_and_depend_on_key_and_counter_only():
    keys = torch.arange(400) * 7919 + 12345  # (400,) streams
    counters = torch.arange(250)[:, None]  # (250, 1): 100,000 draws in all
    u = stream_uniforms(keys, counters)
    assert u.shape == (250, 400) and u.dtype == torch.float32
    assert 0 <= float(u.min()) and float(u.max()) < 1
    # chi-square over 50 equal bins: 49 degrees of freedom, 0.1% critical value 85.35
    counts = torch.bincount((u * 50).long().flatten(), minlength=50).double()
    expected = u.numel() / 50
    assert float(((counts - expected) ** 2 / expected).sum()) < 85.35
    # one stream's draws, alone, in another batch, or padded: the same numbers
    alone = stream_uniforms(keys[7:8], counters)
    padded = stream_uniforms(torch.cat([keys[7:8], torch.zeros(5, dtype=torch.long)]), counters)
    assert torch.equal(alone[:, 0], u[:, 7]) and torch.equal(padded[:, 0], u[:, 7])
    assert not torch.equal(u[:, 0], u[:, 1])  # neighbouring keys: unrelated streams


def test_tokens_drawn_from_stream_uniforms_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(20000, 4)
    u = stream_uniforms(torch.full((20000,), 99), torch.arange(20000))
    tokens = sample_tokens(logits, 1.5, 0, 1.0, True, None, uniform=u, sync_free=True)
    probs = (logits[0] / 1.5).softmax(-1)
    counts = torch.bincount(tokens, minlength=4).double()
    expected = probs.double() * 20000
    # 3 degrees of freedom, 0.1% critical value 16.27
    assert float(((counts - expected) ** 2 / expected).sum()) < 16.27


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 0, 0.9), (0.8, 50, 1.0), (1.0, 200, 0.8), (0.6, 0, 0.3)],
)
def test_one_scan_draws_what_the_host_sampler_draws(temperature, top_k, top_p):
    """sample_scan (the device's one-scan sampler) against sample_tokens' host path at the
    same uniforms: the same token but where a uniform falls within float rounding of a
    boundary, and the same log-prob of the drawn token."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(512, 4096, generator=g) * 3  # peaked and flat rows alike
    u = stream_uniforms(torch.arange(512), torch.full((512,), 5, dtype=torch.long))
    host = sample_tokens(logits, temperature, top_k, top_p, True, None, True, u)
    scan = sample_scan(logits, temperature, top_k, top_p, u)
    same = host[0] == scan[0]
    assert int(same.sum()) >= 510, int(same.sum())
    torch.testing.assert_close(host[1][same], scan[1][same], atol=2e-5, rtol=0)
    # and its log-prob is the drawn token's under the distribution it came from
    recount = sample_tokens(logits, temperature, top_k, top_p, True, None, True, u)[1]
    torch.testing.assert_close(recount[same], scan[1][same], atol=2e-5, rtol=0)


def test_one_scan_keeps_the_nucleus_and_top_k_candidates_only():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 300, generator=g)
    for trial in range(20):
        u = stream_uniforms(torch.arange(64), torch.full((64,), trial, dtype=torch.long))
        token, _ = sample_scan(logits, 1.0, 0, 0.5, u)
        probs, ranked = logits.softmax(-1).sort(-1, descending=True)
        inside = (probs.cumsum(-1) - probs) < 0.5
        for row in range(64):
            assert token[row] in ranked[row][inside[row]]
        token, _ = sample_scan(logits, 1.0, 5, 1.0, u)
        assert all(token[r] in logits[r].topk(5).indices for r in range(64))
    # top_p that no token reaches alone still keeps the most likely one
    token, logprob = sample_scan(logits, 1.0, 0, 1e-6, u)
    assert torch.equal(token, logits.argmax(-1))
    torch.testing.assert_close(logprob, torch.zeros(64), atol=1e-6, rtol=0)


def test_nucleus_without_read_back_keeps_the_same_candidates():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)) * 0.5
    u = stream_uniforms(torch.arange(8), torch.zeros(8, dtype=torch.long))
    host = sample_tokens(logits, 1.0, 0, 0.7, True, None, True, u)
    device = sample_tokens(logits, 1.0, 0, 0.7, True, None, True, u, sync_free=True)
    assert torch.equal(host[0], device[0])
    torch.testing.assert_close(host[1], device[1])


# -- the static cache's bookkeeping --------------------------------------------------------------


def test_a_call_pads_its_rows_to_the_ladder_within_the_caches_slots():
    assert [bucket(n, 512) for n in (1, 3, 5, 17, 100, 256, 257)] == [1, 4, 8, 24, 128, 256, 320]
    assert bucket(100, most=110) == 110  # never past the cache's slots
    assert bucket(600, most=600) == 600 and LADDER[-1] < 600  # past the ladder: as it is


def test_the_cache_layout_follows_the_budget(model):
    per_column = column_bytes(model, torch.float32)
    assert per_column == 2 * 2 * 1 * 16 * 4  # k and v, 2 layers, 1 KV head of 16, fp32
    # 100 columns plus the scratch one round up to 256; 10 slots of them fit
    assert cache_layout(10 * 256 * per_column, per_column, 101, 512) == (10, 256)
    assert cache_layout(10 * 256 * per_column, per_column, 101, 4) == (4, 256)
    assert cache_layout(256 * per_column - 1, per_column, 101, 512) == (0, 256)
    logits = 512 * 103 * LOGIT_BYTES  # kept out of the cache's budget
    runner = StaticRunner(model, "cpu", budget=logits + 3 * 256 * per_column, graphs=False)
    assert runner.capacity(100) == 3 and runner.capacity(300) == 1  # 512 columns: 1 slot
    runner.reserve(2, 100)
    assert (runner.cache.slots, runner.cache.columns, runner.scratch) == (3, 256, 255)
    with pytest.raises(CacheFull, match="memory_fraction"):
        runner.reserve(4, 100)


def test_the_static_runner_refuses_what_it_cannot_run(model):
    with pytest.raises(FlowrlError, match='"static"'):
        StaticRunner(model, "cpu", budget=1 << 30, graphs=True)  # graphs need CUDA
    eager = tiny_model()
    eager.config._attn_implementation = "eager"
    with pytest.raises(FlowrlError, match='runner = "eager"'):
        StaticRunner(eager, "cpu", budget=1 << 30, graphs=False)
    with pytest.raises(ValueError, match="one of"):
        HFOptions(runner="graphs")


# -- the runner in the engine ---------------------------------------------------------------------


qwen2 = tiny_qwen2  # 4 query heads over 2 KV heads (the decode attention folds them)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_runner_greedy_tokens_equal_the_eager_runners(model, family):
    model = model if family == "llama" else qwen2()
    prompts, mask = prompts_and_mask(5)
    eager = HFRollout(model, tiny_tokenizer())
    static = HFRollout(model, tiny_tokenizer(), options=STATIC)
    assert static.runner.device_sampling and not eager.runner.device_sampling
    kwargs = dict(max_new_tokens=37, do_sample=False, logprobs=True)
    a = generate_batch(eager, prompts, mask, **kwargs)
    b = generate_batch(static, prompts, mask, **kwargs)
    assert torch.equal(a["responses"], b["responses"])
    torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
    # 37 tokens: one sampled from the prefill's logits, then blocks of 16, 16 and 4 steps
    assert static.scheduler.batch.counts["decode_calls"] == 36


def test_rows_that_stop_inside_a_block_take_nothing_after_their_stop(model):
    """Rows stop at their own token limits and at the eos inside a block (the eos chosen as
    a token greedy decoding emits mid-block): the same results as the eager runner's."""
    prompts, mask = prompts_and_mask(4, seed=1)
    probe = generate_batch(
        HFRollout(model, tiny_tokenizer()), prompts, mask, max_new_tokens=30, do_sample=False
    )
    eos = int(probe["responses"][1, 20])  # row 1 stops at its 21st token, or before
    tokenizer = SimpleNamespace(eos_token_id=eos, pad_token_id=0)
    rows = [r[m.bool()].tolist() for r, m in zip(prompts, mask, strict=True)]
    requests = [
        Request(ids, limit, GREEDY) for ids, limit in zip(rows, [3, 30, 17, 25], strict=True)
    ]
    eager = together(HFRollout(model, tokenizer), requests)
    static = together(HFRollout(model, tokenizer, options=STATIC), requests)
    assert [r.ids for r in static] == [r.ids for r in eager]
    assert [r.finish_reason for r in static] == [r.finish_reason for r in eager]
    assert "stop" in [r.finish_reason for r in static] and len(static[0].ids) == 3


def test_padding_rows_leave_a_held_requests_columns_as_they_were(model):
    """A is held for its next turn while B, C and D decode: 3 rows pad to 4, the 4th being
    A's slot, whose scratch column takes the padding's keys. A's second turn then has the
    log-probs of the whole conversation run through the model at once."""
    engine = HFRollout(model, tiny_tokenizer(), options=STATIC)
    first = together(engine, [Request([5, 6, 7, 8], 2, GREEDY, request_id="a", keep=True)])[0]
    assert engine.scheduler.batch.held["a"].slot == 0
    others = [Request([10 + k, 11, 12], 20, GREEDY) for k in range(3)]
    calls = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        together(engine, others)
    finally:
        hook.remove()
    assert (4, 1) in calls and engine.scheduler.batch.held["a"].slot == 3  # padded into A's
    ids = [5, 6, 7, 8, *first.ids, 40, 41]
    second = together(engine, [Request(ids, 3, GREEDY, request_id="a", keep=True)])[0]
    engine.release("a")
    with torch.no_grad():
        whole = model(input_ids=torch.tensor([ids + second.ids])).logits[0].log_softmax(-1)
    expected = [float(whole[len(ids) + j - 1, t]) for j, t in enumerate(second.ids)]
    torch.testing.assert_close(torch.tensor(second.logprobs), torch.tensor(expected))


def test_requests_past_the_caches_slots_wait_for_room(model):
    """A cache of 2 slots, 5 requests: they run two at a time (no call has more than 2
    rows) and give the eager runner's tokens; a budget that holds none refuses them."""
    options = HFOptions(runner="static", memory_fraction=0.01, max_slots=2)
    engine = HFRollout(model, tiny_tokenizer(), options=options)
    requests = [Request([20 + k, 21, 22, 23], 6 + k, GREEDY) for k in range(5)]
    rows = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        static = together(engine, requests)
    finally:
        hook.remove()
    assert max(rows) == 2 and engine.runner.cache.slots == 2
    eager = together(HFRollout(model, tiny_tokenizer()), requests)
    assert [r.ids for r in static] == [r.ids for r in eager]
    tight = HFRollout(
        model, tiny_tokenizer(), options=HFOptions(runner="static", memory_fraction=1e-9)
    )  # noqa: E501
    with pytest.raises(CacheFull, match="memory_fraction"):
        together(tight, requests[:1])


def test_a_longer_turn_regrows_the_cache_and_keeps_what_it_held(model):
    engine = HFRollout(model, tiny_tokenizer(), options=STATIC)
    first = together(engine, [Request([5, 6, 7], 4, GREEDY, request_id="a", keep=True)])[0]
    assert engine.runner.cache.columns == 256
    ids = [5, 6, 7, *first.ids, *([9] * 300)]  # the second turn needs 312 columns
    second = together(engine, [Request(ids, 4, GREEDY, request_id="a", keep=True)])[0]
    engine.release("a")
    assert engine.runner.regrows == 1 and engine.runner.cache.columns == 512
    alone = together(HFRollout(model, tiny_tokenizer()), [Request(ids, 4, GREEDY)])[0]
    assert second.ids == alone.ids


def test_sampled_rollouts_repeat_from_their_seeds(model):
    prompts, mask = prompts_and_mask(3)
    engine = HFRollout(model, tiny_tokenizer(), options=STATIC)
    kwargs = dict(n=2, max_new_tokens=24, logprobs=True)
    a = generate_batch(engine, prompts, mask, seed=1, **kwargs)
    b = generate_batch(engine, prompts, mask, seed=1, **kwargs)
    c = generate_batch(engine, prompts, mask, seed=2, **kwargs)
    assert torch.equal(a["responses"], b["responses"])
    assert not torch.equal(a["responses"], c["responses"])


def test_a_rollout_in_another_dtype_runs_a_view_refreshed_in_place(model):
    import copy

    policy = copy.deepcopy(model)
    options = HFOptions(runner="static", memory_fraction=0.01, dtype="bfloat16")
    engine = HFRollout(policy, tiny_tokenizer(), options=options)
    view = engine.view
    assert view is not None and next(view.parameters()).dtype == torch.bfloat16
    assert engine.runner.module is view
    addresses = [p.data_ptr() for p in view.parameters()]
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)  # a training step
    engine.sync_weights(policy)
    assert [p.data_ptr() for p in view.parameters()] == addresses  # in place
    for mine, theirs in zip(view.parameters(), policy.parameters(), strict=True):
        assert torch.equal(mine, theirs.to(torch.bfloat16))
    prompts, mask = prompts_and_mask(2)
    out = generate_batch(engine, prompts, mask, max_new_tokens=5, do_sample=False)
    assert out["responses"].shape == (2, 5)
    same = HFRollout(policy, tiny_tokenizer(), options=STATIC)  # float32: the module itself
    assert same.view is None and same.runner.module is policy


def test_the_runner_is_chosen_in_the_graph_file(model):
    graph = Path(__file__).resolve().parents[4] / "graphs" / "grpo.toml"
    spec = dsl.load(graph, ['models.policy.rollout_options.runner="static"'])
    assert spec.models["policy"].rollout_options == {"runner": "static"}
    with pytest.raises(GraphErrors) as info:
        dsl.load(graph, ['models.policy.rollout_options.runner="graphs"'])
    (problem,) = info.value.problems
    assert problem.where == "[models.policy.rollout_options]" and "cuda_graph" in problem.message
    engine = make_rollout("hf", model, tiny_tokenizer(), options=STATIC)
    assert isinstance(engine.runner, StaticRunner)
    assert type(make_rollout("hf", model, tiny_tokenizer()).runner).__name__ == "ModelRunner"
