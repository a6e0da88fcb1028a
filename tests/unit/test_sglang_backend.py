"""The sglang rollout backend against a fake engine that records its calls: what it sends and
returns, the bucketed weight push, and the order of release, resume, weight update, flush and
generate around a compiled plan's steps. No SGLang here: the real engine runs only in
tests/gpu."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.engines import sglang_backend
from flowrl.engines.rollout import RolloutBackend, make_rollout, rollout_class
from flowrl.engines.sglang_backend import SGLangRollout, response_tensors, weight_buckets
from flowrl.testing import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


class FakeEngine:
    """Stands in for sglang.Engine: records every call as (method, details); `generate`
    returns the queued outputs if any, else a made-up response per request."""

    def __init__(self, **server_args):
        self.server_args, self.calls, self.queued, self.pushed = server_args, [], [], []

    def generate(self, input_ids, sampling_params, return_logprob=False):
        self.calls.append(("generate", len(input_ids)))
        self.requests, self.sampling = input_ids, sampling_params
        if self.queued:
            return self.queued.pop(0)
        outputs = []
        for i, ids in enumerate(input_ids):  # 1..max tokens below the vocabulary's end
            length = 1 + (sum(ids) + i) % sampling_params["max_new_tokens"]
            tokens = [10 + (sum(ids) + i + k) % 50 for k in range(length)]
            logprobs = [(-0.1 * (k + 1), token, None) for k, token in enumerate(tokens)]
            outputs.append({"output_ids": tokens, "meta_info": {"output_token_logprobs": logprobs}})
        return outputs

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", tuple(name for name, _ in named_tensors)))
        self.pushed.append(list(named_tensors))
        assert not flush_cache  # one flush after the last bucket

    def flush_cache(self):
        self.calls.append(("flush", None))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tuple(tags)))

    def shutdown(self):
        self.calls.append(("shutdown", None))


def reply(tokens, logprob) -> dict:
    """One request's output as SGLang gives it, every token with log-prob `logprob`."""
    return {
        "output_ids": tokens,
        "meta_info": {"output_token_logprobs": [(logprob, t, None) for t in tokens]},
    }


RESUME_ALL = [("resume", ("weights",)), "update", "flush", ("resume", ("kv_cache",))]


def kinds(calls) -> list:
    """The calls with consecutive weight updates folded into one "update" (a push)."""
    out = []
    for kind, details in calls:
        if kind == "update" and out and out[-1] == "update":
            continue
        out.append(kind if kind in ("update", "flush", "generate") else (kind, details))
    return out


@pytest.fixture
def backend():
    engine = SGLangRollout(tiny_model(), tiny_tokenizer(), "cuda:3", engine_factory=FakeEngine)
    yield engine
    engine.shutdown()


def test_the_engine_starts_token_in_token_out_with_the_memory_saver_and_the_weights(backend):
    args = backend.engine.server_args
    assert args["skip_tokenizer_init"] and args["enable_memory_saver"]
    assert args["load_format"] == "dummy" and args["dtype"] == "float32"
    assert args["base_gpu_id"] == 3 and args["tp_size"] == 1
    config = json.loads((Path(args["model_path"]) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["eos_token_id"] == tiny_tokenizer().eos_token_id
    # the dummy weights are replaced at once, and no prefix computed with them survives
    assert kinds(backend.engine.calls) == ["update", "flush"]


def test_sglang_is_in_the_table_and_has_the_contracts_shape(backend):
    assert rollout_class("sglang") is SGLangRollout
    assert isinstance(backend, RolloutBackend)
    assert backend.device == torch.device("cuda:3") and backend.parts == ("weights", "kv_cache")


def test_its_methods_take_the_contracts_parameters_first_with_the_same_defaults():
    import inspect

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in ("generate", "offload", "reload", "sync_weights"):
        contract = params(getattr(RolloutBackend, name))
        ours = params(getattr(SGLangRollout, name))
        assert ours[: len(contract)] == contract, name
        for extra in ours[len(contract) :]:  # logprobs=False; parts=(...): all optional
            assert extra[2] is not inspect.Parameter.empty, (name, extra)


def test_weight_buckets_cover_every_parameter_once_within_the_size_and_without_copies():
    module = tiny_model()
    named = dict(module.named_parameters())
    limit = 8 * 1024  # bytes; the embedding (103 x 32 floats = 13 KB) exceeds it, alone
    buckets = list(weight_buckets(module.named_parameters(), limit))
    names = [name for bucket in buckets for name, _ in bucket]
    assert sorted(names) == sorted(named) and len(names) == len(set(names))
    assert len(buckets) > 1
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
        for name, tensor in bucket:  # the module's own storage, handed over as it is
            assert tensor.data_ptr() == named[name].data_ptr() and not tensor.requires_grad


def test_push_sends_every_parameter_in_buckets_then_flushes_once():
    module = tiny_model()
    engine = SGLangRollout(
        module, tiny_tokenizer(), "cuda:0", engine_factory=FakeEngine, bucket_bytes=8 * 1024
    )
    calls = engine.engine.calls
    updates = [c for c in calls if c[0] == "update"]
    assert len(updates) > 1 and calls[-1] == ("flush", None)
    pushed = {name: t for bucket in engine.engine.pushed for name, t in bucket}
    assert pushed.keys() == dict(module.named_parameters()).keys()
    for name, tensor in module.named_parameters():
        assert torch.equal(pushed[name], tensor)
    engine.shutdown()


def test_generate_strips_left_padding_repeats_each_prompt_n_times_and_maps_sampling(backend):
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    backend.generate(prompts, mask, n=2, max_new_tokens=5, temperature=0.7, top_k=0, top_p=0.9)
    assert backend.engine.requests == [[5, 6], [5, 6], [7, 8, 9, 4], [7, 8, 9, 4]]
    eos = tiny_tokenizer().eos_token_id
    assert backend.engine.sampling == {
        "max_new_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # flowrl's 0 (off) is SGLang's -1
        "stop_token_ids": [eos],
    }
    backend.generate(prompts, mask, max_new_tokens=5, do_sample=False, top_k=4, top_p=0.5)
    greedy = backend.engine.sampling
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (0.0, -1, 1.0)
    backend.generate(prompts, mask, max_new_tokens=5, temperature=1.0, top_k=4)
    assert backend.engine.sampling["top_k"] == 4


def test_responses_are_right_padded_with_the_mask_through_the_first_eos(backend):
    eos, pad = 2, 0
    outputs = [reply([5, 6, eos], -1.0), reply([7], -0.5), reply([8, eos, 9], -0.25)]
    out = response_tensors(outputs, eos, pad, logprobs=True)
    # row 0 stopped at EOS (kept, masked 1), row 1 hit the length, row 2's token after EOS goes
    assert out["responses"].tolist() == [[5, 6, eos], [7, pad, pad], [8, eos, pad]]
    assert out["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert out["logprobs"].tolist() == [[-1.0, -1.0, -1.0], [-0.5, 0, 0], [-0.25, -0.25, 0]]
    assert out["responses"].dtype == torch.long and out["logprobs"].dtype == torch.float32
    assert response_tensors(outputs, eos, pad, logprobs=False).keys() == {
        "responses",
        "response_mask",
    }


def test_generate_returns_the_engines_tokens_and_log_probs(backend):
    eos, pad = backend.eos, backend.pad
    backend.engine.queued.append([reply([11, eos], -1.5), reply([12, 13, 14], -2.0)])
    prompts, mask = torch.tensor([[4, 5]]), torch.ones(1, 2, dtype=torch.long)
    out = backend.generate(prompts, mask, n=2, max_new_tokens=3, logprobs=True)
    assert out["responses"].tolist() == [[11, eos, pad], [12, 13, 14]]
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert out["logprobs"].tolist() == [[-1.5, -1.5, 0.0], [-2.0, -2.0, -2.0]]
    empty = backend.generate(prompts, mask, n=2, max_new_tokens=0, logprobs=True)
    assert [tuple(v.shape) for v in empty.values()] == [(2, 0)] * 3


def test_mismatched_log_probs_are_an_error_not_a_silent_shift():
    outputs = [{"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [(-1.0, 5, None)]}}]
    with pytest.raises(RuntimeError, match="2 tokens but 1 log-probs"):
        response_tensors(outputs, eos=2, pad=0, logprobs=True)


def test_offload_releases_and_reload_resumes_weights_pushes_then_the_kv_cache(backend):
    calls = backend.engine.calls
    calls.clear()
    backend.offload(("weights", "kv_cache"))
    backend.offload(("kv_cache",))  # already released: no second release
    backend.reload(("weights",))  # before an update: SGLang's copy stays off the GPU
    backend.sync_weights(backend.module)  # released: pushed at the resume
    assert kinds(calls) == [("release", ("weights", "kv_cache"))]
    backend.reload(("weights", "kv_cache"))
    assert kinds(calls)[1:] == RESUME_ALL
    calls.clear()
    backend.offload(("kv_cache",))  # the weights stay: the next resume needs no push
    backend.reload(("kv_cache",))
    backend.sync_weights(backend.module)  # held: pushed at once
    kv_cache = ("kv_cache",)
    assert kinds(calls) == [("release", kv_cache), ("resume", kv_cache), "update", "flush"]


def test_generate_never_runs_on_released_memory(backend):
    backend.offload(("weights", "kv_cache"))
    backend.engine.calls.clear()
    backend.generate(torch.tensor([[4, 5]]), torch.ones(1, 2, dtype=torch.long), max_new_tokens=2)
    assert kinds(backend.engine.calls) == [*RESUME_ALL, "generate"]


def test_make_rollout_builds_it_with_the_default_factory(monkeypatch):
    monkeypatch.setattr(sglang_backend, "sglang_engine", FakeEngine)
    engine = make_rollout("sglang", tiny_model(), tiny_tokenizer(), "cuda:0")
    assert type(engine.engine) is FakeEngine
    engine.shutdown()
    assert not Path(engine.engine.server_args["model_path"]).exists()


def test_without_sglang_building_it_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang fails
    with pytest.raises(ImportError, match=r'pip install -e "\.\[sglang\]"'):
        SGLangRollout(tiny_model(), tiny_tokenizer(), "cuda:0")


# -- around a compiled plan's steps ---------------------------------------------------------


@pytest.fixture
def sglang_trainer(tmp_path, monkeypatch):
    """A Trainer over a tiny-model graph with the policy's rollout on "sglang": the pool is
    "cuda" in the plan (as the check requires) but built on the CPU, the engine a FakeEngine.
    Returns make(graph, offload) -> (trainer, the fake engines built)."""
    from flowrl.cli import load_plan
    from flowrl.runtime import controller, guards, pool_worker

    engines = []

    def factory(**server_args):
        engines.append(FakeEngine(**server_args))
        return engines[-1]

    monkeypatch.setattr(sglang_backend, "sglang_engine", factory)
    monkeypatch.setattr(pool_worker, "_device", lambda kind, rank: "cpu")
    monkeypatch.setattr(guards, "check_devices", lambda plan: None)
    monkeypatch.setattr(guards, "check_packages", lambda plan: None)
    trainers = []

    def make(graph: str, offload: str):
        from flowrl.front import dsl

        spec = dsl.load(ROOT / "graphs" / graph)
        overrides = [f'models.{m}.path="tiny"' for m in spec.models]
        overrides += [f'pools.{p}.device="cuda"' for p in spec.pools]
        overrides += [f'pools.{p}.offload="{offload}"' for p in spec.pools]
        overrides += [
            'models.policy.rollout="sglang"',
            "run.val_size=0",
            "data.batch_size=2",
            "data.train_size=8",
            "nodes.generate.n=2",
            "nodes.generate.max_new_tokens=6",
            f'run.out_dir="{tmp_path}"',
        ]
        plan = load_plan(str(ROOT / "graphs" / graph), overrides)
        trainers.append(controller.Trainer(plan, tmp_path / "run", "local"))
        return trainers[-1], engines

    yield make
    for trainer in trainers:
        trainer.close()


def test_offload_always_releases_after_generate_and_resumes_and_pushes_before_the_next(
    sglang_trainer,
):
    trainer, engines = sglang_trainer("grpo.toml", "always")
    trainer.step(1)
    trainer.step(2)
    (engine,) = engines  # the policy's; the reference generates nothing
    release = ("release", ("weights", "kv_cache"))
    # step 1: the weights pushed at start are current; after generate both parts leave; the
    # reload before the update and the sync after it leave SGLang's copy off the device;
    # step 2: resume the weights, push the trained ones, flush, resume the KV cache, generate
    assert kinds(engine.calls) == [
        "update",
        "flush",
        "generate",
        release,
        *RESUME_ALL,
        "generate",
        release,
    ]


def test_offload_never_pushes_and_flushes_after_each_update(sglang_trainer):
    trainer, engines = sglang_trainer("grpo.toml", "never")
    trainer.step(1)
    trainer.step(2)
    (engine,) = engines
    push = ["update", "flush"]
    assert kinds(engine.calls) == [*push, "generate", *push, "generate", *push]
    policy = trainer.executor.workers["main"][0].train["policy"].module
    pushed = {name: t for bucket in engine.pushed[-1:] for name, t in bucket}
    for name, tensor in policy.named_parameters():  # the last push: the trained weights
        if name in pushed:
            assert torch.equal(pushed[name], tensor)


def test_a_separate_rollout_pool_pushes_the_weights_it_receives(sglang_trainer):
    trainer, engines = sglang_trainer("grpo_disaggregated.toml", "never")
    trainer.step(1)
    (engine,) = engines  # on pool "gen": the import of the trained weights reaches SGLang
    assert kinds(engine.calls) == ["update", "flush", "generate", "update", "flush"]
    gen = trainer.executor.workers["gen"][0].train["policy"].module
    train = trainer.executor.workers["train"][0].train["policy"].module
    for name, tensor in gen.named_parameters():
        assert torch.equal(tensor, dict(train.named_parameters())[name])


# -- flowrl check --------------------------------------------------------------------------


def test_check_refuses_sglang_on_a_pool_that_is_not_cuda():
    from flowrl.errors import GraphErrors
    from flowrl.front import dsl

    graph = ROOT / "graphs/grpo_sglang.toml"
    with pytest.raises(GraphErrors) as info:
        dsl.load(graph, ['pools.main.device="cpu"'])
    (problem,) = info.value.problems
    assert problem.file == str(graph) and problem.where == "[models.policy] rollout"
    assert 'override "pools.main.device="cpu"": rollout = "sglang" runs on "cuda"' in (
        problem.message
    )
    assert 'set device = "cuda" in [pools.main], or rollout = "hf"' in problem.fix
    # a separate rollout pool is the one that must be a GPU pool
    disaggregated = ROOT / "graphs/grpo_disaggregated.toml"
    overrides = ["models.policy.rollout=sglang", 'pools.train.device="cuda"']
    with pytest.raises(GraphErrors) as info:
        dsl.load(disaggregated, overrides)
    (problem,) = info.value.problems
    assert 'its pool "gen" has device = "cpu"' in problem.message
    dsl.load(disaggregated, [*overrides, 'pools.gen.device="cuda"'])  # fine


def test_check_warns_with_the_install_command_when_the_package_is_missing(monkeypatch, capsys):
    from flowrl.cli import main
    from flowrl.engines import rollout

    graph = str(ROOT / "graphs/grpo_sglang.toml")
    monkeypatch.setitem(rollout.PACKAGE, "sglang", "no_such_package_here")
    assert main(["check", graph]) == 0  # the graph is right; this machine lacks a package
    out = capsys.readouterr().out
    assert '[models.policy] rollout = "sglang" needs the no_such_package_here package' in out
    assert 'pip install -e ".[sglang]"' in out
    monkeypatch.setitem(rollout.PACKAGE, "sglang", "json")  # one that is installed
    assert main(["check", graph]) == 0
    assert "needs the" not in capsys.readouterr().out


def test_run_stops_before_loading_a_model_when_the_package_is_missing(monkeypatch):
    from flowrl.cli import load_plan
    from flowrl.engines import rollout
    from flowrl.runtime.guards import MissingPackage, check_packages

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    plan = load_plan(str(ROOT / "graphs/grpo_sglang.toml"))
    monkeypatch.setitem(rollout.PACKAGE, "sglang", "no_such_package_here")
    with pytest.raises(MissingPackage) as info:
        check_packages(plan)
    message = str(info.value)
    assert message.startswith(f'{plan.file}: [models.policy] rollout = "sglang" needs')
    assert 'pip install -e ".[sglang]"' in message
    monkeypatch.setitem(rollout.PACKAGE, "sglang", "json")
    check_packages(plan)  # installed: nothing to say


BLOCKED = (
    "import sys; sys.modules['sglang'] = None  # any `import sglang` now fails\n"
    "from flowrl.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "assert 'flowrl.engines.sglang_backend' not in sys.modules\n"
    "sys.exit(code)\n"
)


def test_check_of_every_shipped_graph_runs_without_sglang():
    graphs = sorted(str(p) for p in (ROOT / "graphs").glob("*.toml"))
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED, "check", *graphs], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "grpo_sglang.toml: ok" in result.stdout
    assert 'rollout = "sglang" needs the sglang package, not installed here' in result.stdout
