"""The CUDA runner's decode step on the CPU (flowrl/engines/hf/static.py), what a GPU run
relies on and a CPU can check:

- capturability: the step a CUDA graph captures (`StaticRunner._step`) and the block's
  sampling run no host-syncing op (`SyncGuard`: `.item()`, `nonzero`, boolean-mask indexing,
  ...), tiny Llama and Qwen2, greedy and sampled; the guard fails once such an op is put into
  the step;
- the compiled step (inductor) gives the eager step's greedy tokens and log-probs;
- a width's graph ladder captured in one pass, largest first, with gc and cache emptying off;
- the weight-pointer check covers buffers; an offload keeps the cache when there is room;
- attention the folded decode cannot compute (softcapping, sinks) is refused;
- a bf16 view keeps RoPE's frequencies in fp32; activation checkpointing only with gradients.
"""

import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flowrl.engines.hf.static as static
from flowrl.backends import HFOptions
from flowrl.engines import HFRollout
from flowrl.engines.batch import generate_batch
from flowrl.engines.hf.graphs import compiled_sampler
from flowrl.engines.hf.sampling import sample_scan, stream_uniforms
from flowrl.engines.hf.static import LADDER, DecodeCall, StaticRunner
from flowrl.errors import FlowrlError
from flowrl.testing import tiny_model, tiny_qwen2, tiny_tokenizer

STATIC = HFOptions(runner="static", memory_fraction=0.01, compile="off")

# ops that read a device tensor back to the host (a sync, which a CUDA graph cannot hold), or
# whose output size depends on the data (computed on the device, so read back first)
SYNCING = {
    "_local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "item",
    "is_nonzero",
    "equal",
    "nonzero",  # also torch.where(cond) with one argument, argwhere
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "bincount",
    "histc",
}


class SyncGuard(TorchDispatchMode):
    """Records every host-syncing aten op run under it: the ops of `SYNCING`, indexing with a
    boolean mask (it calls nonzero), repeat_interleave without `output_size`, and copies to
    the CPU. `ops` counts all the ops it saw (a guard that saw nothing proves nothing)."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = func.overloadpacket.__name__
        if name in SYNCING or self._syncs(name, args, kwargs):
            self.syncs.append(str(func))
        return func(*args, **kwargs)

    @staticmethod
    def _syncs(name: str, args, kwargs) -> bool:
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(i is not None and i.dtype == torch.bool for i in indices)
        if name == "repeat_interleave":
            return isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None
        if name in ("_to_copy", "to"):  # (under inference mode `to` comes undecomposed)
            return str(kwargs.get("device", "")) == "cpu"
        return False


@pytest.fixture
def guarded(monkeypatch):
    """StaticRunner._step and the block's sampling run under a SyncGuard each call; -> the
    guards' record: {"syncs": [...], "ops": n, "steps": calls of _step}."""
    record = {"syncs": [], "ops": 0, "steps": 0}
    step, sample = StaticRunner._step, static.sample_tokens

    def run(fn, *args, **kwargs):
        with SyncGuard() as guard:
            out = fn(*args, **kwargs)
        record["syncs"] += guard.syncs
        record["ops"] += guard.ops
        return out

    def guarded_step(self, b, width):
        record["steps"] += 1
        return run(step, self, b, width)

    monkeypatch.setattr(StaticRunner, "_step", guarded_step)
    monkeypatch.setattr(static, "sample_tokens", lambda *a, **k: run(sample, *a, **k))
    return record


def prompts_and_mask(rows: int = 5, width: int = 7):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 100, (rows, width), generator=g)
    mask = torch.ones_like(prompts)
    for k in range(rows):
        mask[k, : k % 3] = 0
    return prompts, mask


def model_of(family: str):
    return (tiny_model(seed=3) if family == "llama" else tiny_qwen2()).eval()


def decode(model, options=STATIC, **kwargs):
    engine = HFRollout(model, tiny_tokenizer(), options=options)
    prompts, mask = prompts_and_mask()
    out = generate_batch(engine, prompts, mask, n=2, max_new_tokens=20, logprobs=True, **kwargs)
    return engine, out


# -- capturability -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "sampling",
    [dict(do_sample=False), dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=40, seed=3)],
    ids=["greedy", "sampled"],
)
def test_the_captured_step_and_the_blocks_sampling_never_sync(guarded, family, sampling):
    decode(model_of(family), **sampling)
    assert guarded["steps"] > 10 and guarded["ops"] > 100 * guarded["steps"] / 10
    assert guarded["syncs"] == []


@pytest.mark.parametrize(
    "sync",
    [
        lambda x: x.sum().item(),
        lambda x: x.nonzero(),
        lambda x: x[x > 0],
        lambda x: torch.repeat_interleave(torch.ones(2, dtype=torch.long)),
        lambda x: x.to("cpu", copy=True),  # .cpu() of a CPU tensor dispatches nothing
    ],
    ids=["item", "nonzero", "bool-mask", "repeat_interleave", "to-cpu"],
)
def test_the_guard_fails_when_a_syncing_op_is_put_into_the_step(guarded, monkeypatch, sync):
    forward = StaticRunner._forward

    def syncing(self, ids, mask, positions):
        logits = forward(self, ids, mask, positions)
        sync(logits)
        return logits

    monkeypatch.setattr(StaticRunner, "_forward", syncing)
    decode(tiny_model(seed=3).eval(), do_sample=False)
    assert guarded["syncs"], "the guard missed a syncing op"


# -- the compiled step -------------------------------------------------------------------------
@pytest.mark.slow  # inductor compiles the step on the CPU: ~30-60 s on the 2-core machine
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_compiled_step_gives_the_eager_steps_tokens_and_logprobs(family):
    model = model_of(family)
    _, eager = decode(model, do_sample=False)
    options = HFOptions(runner="static", memory_fraction=0.01, compile="on")
    engine, compiled = decode(model, options, do_sample=False)
    assert engine.runner.compiled is not None and engine.runner.warnings == []
    assert torch.equal(eager["responses"], compiled["responses"])
    torch.testing.assert_close(eager["logprobs"], compiled["logprobs"], atol=1e-4, rtol=0)


def test_compile_is_on_by_default_for_cuda_graphs_only():
    model = tiny_model(seed=3).eval()
    runner = static.make_runner(model, "cpu", 0, HFOptions(runner="static"))
    assert runner.compiled is None  # "auto": only with graphs, which need CUDA
    on = static.make_runner(model, "cpu", 0, HFOptions(runner="static", compile="on"))
    assert on.compiled is not None
    with pytest.raises(ValueError, match="one of"):
        HFOptions(compile="yes")


def test_a_step_that_fails_to_compile_warns_and_runs_uncompiled(monkeypatch):
    model = tiny_model(seed=3).eval()
    _, eager = decode(model, do_sample=False)
    options = HFOptions(runner="static", memory_fraction=0.01, compile="on")

    def broken(forward):
        def step(*args):
            raise RuntimeError("inductor: no C compiler")

        return step

    monkeypatch.setattr(static, "compiled_step", broken)
    with pytest.warns(UserWarning, match="compiling it failed"):
        engine, out = decode(model, options, do_sample=False)
    assert engine.runner.compiled is None and "no C compiler" in engine.runner.warnings[0]
    assert torch.equal(eager["responses"], out["responses"])


# -- graphs: the ladder, the weights, an offload -----------------------------------------------
def runner_with_cache(slots: int = 64):
    runner = StaticRunner(tiny_model(seed=3).eval(), "cpu", budget=1 << 28, graphs=False)
    runner.reserve(slots, 100)
    runner.graphs = True  # what follows never reaches torch.cuda
    return runner


def test_a_widths_ladder_is_captured_in_one_pass_largest_first(monkeypatch):
    runner = runner_with_cache()
    collect, empty = gc.collect, torch.cuda.empty_cache
    runner.ids[:5, 0] = torch.arange(11, 16)
    runner.positions[:5, 0] = torch.arange(3, 8)
    seen = []

    def capture(b, width):  # the runner's positions are the scratch column meanwhile
        assert (runner.positions[:b] == runner.scratch).all()
        seen.append((b, width, gc.collect(), torch.cuda.empty_cache()))
        return f"graph {b}"

    monkeypatch.setattr(runner, "_capture", capture)
    assert runner._capture_ladder(24, 128) == "graph 24"
    assert [s[:2] for s in seen] == [(b, 128) for b in (24, 16, 8, 4, 2, 1)]
    assert all(s[2:] == (0, None) for s in seen)  # gc.collect and empty_cache were no-ops
    assert (gc.collect, torch.cuda.empty_cache) == (collect, empty)  # restored
    assert runner.ids[:5, 0].tolist() == list(range(11, 16))
    assert runner.positions[:5, 0].tolist() == list(range(3, 8))
    seen.clear()
    runner._capture_ladder(32, 128)  # the sizes captured already are not captured again
    assert [s[:2] for s in seen] == [(32, 128)]
    assert set(LADDER[:7]) == {b for b, _ in runner.captured}


def test_the_weight_check_covers_buffers():
    runner = runner_with_cache()
    runner._check_weights()
    runner.captured = {(1, 128): "graph"}
    rotary = runner.module.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq.clone()  # moved: an offload and a reload
    runner._check_weights()
    assert runner.captured == {}


def test_an_offload_keeps_the_cache_and_graphs_where_the_device_has_room(monkeypatch):
    runner = runner_with_cache()
    runner.captured = {(1, 128): "graph"}
    monkeypatch.setattr(runner, "keeps_cache", lambda: True)
    runner.free()
    assert runner.cache is not None and runner.captured == {(1, 128): "graph"}
    monkeypatch.setattr(runner, "keeps_cache", lambda: False)
    runner.free()
    assert runner.cache is None and runner.captured == {}
    assert not runner_with_cache().keeps_cache()  # the CPU: never kept


# -- what the decode attention refuses ---------------------------------------------------------
def test_softcapping_and_sinks_are_refused():
    model = tiny_model(seed=3).eval()
    model.config.attn_logit_softcapping = 50.0
    with pytest.raises(FlowrlError, match="attn_logit_softcapping"):
        StaticRunner(model, "cpu", budget=1 << 28, graphs=False)
    q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 3, 4)
    layer = model.model.layers[0].self_attn
    for kwargs in ({"softcap": 30.0}, {"s_aux": torch.zeros(2)}):
        with pytest.raises(FlowrlError, match="softcapping or sinks"):
            DecodeCall().attend(layer, q, kv, kv, 0.5, None, **kwargs)
    out, _ = DecodeCall().attend(layer, q, kv, kv, 0.5, None, softcap=None, dropout=0.0)
    assert out.shape == (1, 1, 2, 4)


# -- the bf16 view, activation checkpointing -----------------------------------------------------
def test_a_bf16_view_keeps_ropes_frequencies_in_fp32():
    model = tiny_model(seed=3).eval()
    engine = HFRollout(model, tiny_tokenizer(), options=HFOptions(dtype="bfloat16"))
    view = engine.view
    assert next(view.parameters()).dtype == torch.bfloat16
    assert view.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(view.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    assert view.model.rotary_emb.inv_freq is not model.model.rotary_emb.inv_freq
    engine.sync_weights(model)  # refreshed in place, still fp32
    assert view.model.rotary_emb.inv_freq.dtype == torch.float32


def test_activation_checkpointing_runs_only_with_gradients(monkeypatch):
    from flowrl.engines.train import forward

    model = tiny_model(seed=3)
    forward.checkpoint_layers(forward.decoder_layers(model))
    calls = []
    real = forward.checkpoint
    monkeypatch.setattr(forward, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert calls == []  # a rollout's forward: the layers as they are
    logits = model(input_ids=ids).logits
    assert len(calls) == len(forward.decoder_layers(model))
    torch.testing.assert_close(logits, expected)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# -- overlap ---------------------------------------------------------------------------------------
def test_the_next_block_is_queued_before_the_first_is_read(monkeypatch):
    events = []
    launch, read = StaticRunner.launch_block, static.Launched.read

    def launching(self, *args, **kwargs):
        events.append("launch")
        return launch(self, *args, **kwargs)

    def reading(self):
        events.append("read")
        return read(self)

    monkeypatch.setattr(StaticRunner, "launch_block", launching)
    monkeypatch.setattr(static.Launched, "read", reading)
    model = tiny_model(seed=3).eval()
    _, eager = decode(model, HFOptions(runner="eager"), do_sample=False)
    _, overlapped = decode(model, do_sample=False)
    # 20 new tokens: one from the prefill, then 16 and 3 steps, the 3 queued behind the 16
    assert events == ["launch", "launch", "read", "read"]
    assert torch.equal(eager["responses"], overlapped["responses"])
    torch.testing.assert_close(eager["logprobs"], overlapped["logprobs"], atol=1e-5, rtol=0)


# -- the compiled sampler ----------------------------------------------------------------------
@pytest.mark.slow  # inductor compiles the sampler on the CPU
def test_the_compiled_sampler_draws_the_eager_scans_tokens():
    g = torch.Generator().manual_seed(5)
    sampler = compiled_sampler()
    for rows, (t, k, p) in ((24, (0.8, 0, 1.0)), (7, (1.0, 0, 0.9)), (24, (1.2, 30, 0.8))):
        logits = torch.randn(rows, 3000, generator=g) * 3
        u = stream_uniforms(torch.arange(rows), torch.full((rows,), 2, dtype=torch.long))
        token, logprob = sampler(logits, t, k, p, u)
        eager = sample_scan(logits, t, k, p, u)
        assert torch.equal(token, eager[0])
        torch.testing.assert_close(logprob, eager[1], atol=1e-5, rtol=0)


def test_a_sampler_that_fails_to_compile_warns_and_samples_uncompiled(monkeypatch):
    model = tiny_model(seed=3).eval()
    sampled = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=3)
    _, plain = decode(model, **sampled)

    def broken():
        def sampler(*args):
            raise RuntimeError("inductor: no C compiler")

        return sampler

    monkeypatch.setattr(static, "compiled_sampler", broken)
    monkeypatch.setattr(static, "compiled_step", lambda forward: None)  # the step stays eager
    options = HFOptions(runner="static", memory_fraction=0.01, compile="on")
    with pytest.warns(UserWarning, match="the block's sampling: compiling it failed"):
        engine, out = decode(model, options, **sampled)
    assert engine.runner.sampler is None and "no C compiler" in engine.runner.warnings[0]
    assert torch.equal(plain["responses"], out["responses"])
    torch.testing.assert_close(plain["logprobs"], out["logprobs"], atol=0, rtol=0)
