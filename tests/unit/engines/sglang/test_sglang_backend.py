"""The sglang rollout backend against a fake engine that behaves as the pinned SGLang (0.5.21)
does (tests/support/fake_sglang.py): what it sends and returns, the weight push in a session with
every answer checked, verify mode, LoRA folded into the pushed weights, aborted requests, a
child's death and the shutdown, and the order of release, resume, push, flush and generate
around a compiled plan's steps. No SGLang here: the real engine runs in `make gpu-smoke`."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_sglang import FakeEngine

from flowrl.backends import SGLangOptions
from flowrl.engines.batch import generate_batch
from flowrl.engines.rollout import Result, RolloutBackend, make_rollout, rollout_class
from flowrl.engines.served_weights import weight_buckets
from flowrl.engines.sglang import backend as sglang_backend
from flowrl.engines.sglang import process as sglang_process
from flowrl.engines.sglang.backend import PushRefused, SGLangRollout
from flowrl.engines.sglang.io import request_result
from flowrl.testing import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[4]
WHERE = "pool main, rank 0, model policy"


def bf16_model():
    return tiny_model().to(torch.bfloat16)


def reply(tokens, logprob, finish="length") -> dict:
    """One request's output as SGLang gives it, every token with log-prob `logprob`."""
    meta = {"output_token_logprobs": [(logprob, t, None) for t in tokens]}
    return {"output_ids": tokens, "meta_info": {**meta, "finish_reason": {"type": finish}}}


PUSH = ["begin", "update", "end", "flush"]  # a weight-update session, then a flush
RESUME_ALL = [("resume", ("weights",)), *PUSH, ("resume", ("kv_cache",))]


def kinds(calls) -> list:
    """The calls with consecutive weight updates folded into one "update" (a push), without
    verify mode's reads (they change nothing)."""
    out = []
    for kind, details in calls:
        kind = "generate" if kind == "async_generate" else kind  # a rollout's requests
        folded = kind in ("update", "generate") and out and out[-1] == kind
        if kind == "get_weights" or folded:
            continue
        plain = kind in ("update", "flush", "generate", "begin", "end")
        out.append(kind if plain else (kind, details))
    return out


def build(module=None, engine_factory=FakeEngine, **options):
    module = bf16_model() if module is None else module
    options.setdefault("verify", True)  # every push in these tests is read back
    return SGLangRollout(
        module,
        tiny_tokenizer(),
        "cuda:0",
        options=SGLangOptions(**options),
        where=WHERE,
        engine_factory=engine_factory,
    )


@pytest.fixture
def backend():
    engine = SGLangRollout(
        bf16_model(),
        tiny_tokenizer(),
        "cuda:3",
        options=SGLangOptions(verify=True),
        engine_factory=FakeEngine,
    )
    yield engine
    engine.shutdown()


def test_the_engine_starts_token_in_token_out_with_the_memory_saver_and_the_weights(backend):
    args = backend.engine.server_args
    assert args["skip_tokenizer_init"] and args["enable_memory_saver"]
    assert args["load_format"] == "dummy" and args["dtype"] == "bfloat16"
    assert args["base_gpu_id"] == 3 and args["tp_size"] == 1
    config = json.loads((Path(args["model_path"]) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["eos_token_id"] == tiny_tokenizer().eos_token_id
    # the dummy weights are replaced at once, and no prefix computed with them survives
    assert kinds(backend.engine.calls) == PUSH


def test_sglang_is_in_the_table_and_has_the_contracts_shape(backend):
    assert rollout_class("sglang") is SGLangRollout
    assert isinstance(backend, RolloutBackend)
    assert backend.device == torch.device("cuda:3") and backend.parts == ("weights", "kv_cache")


def test_its_methods_take_the_contracts_parameters_first_with_the_same_defaults():
    import inspect

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in ("generate", "release", "offload", "reload", "sync_weights"):
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
    module = bf16_model()
    engine = build(module, bucket_mb=4 / 1024)  # 4 KB
    calls = engine.engine.calls
    updates = [c for c in calls if c[0] == "update"]
    assert len(updates) > 1 and kinds(calls)[-2:] == ["end", "flush"]  # one flush, last
    pushed = {name: t for bucket in engine.engine.pushed for name, t in bucket}
    assert pushed.keys() == dict(module.named_parameters()).keys()
    for name, tensor in module.named_parameters():
        assert torch.equal(pushed[name], tensor)
    engine.shutdown()


def test_generate_sends_each_row_and_sample_as_a_request_and_maps_sampling(backend):
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    generate_batch(
        backend, prompts, mask, n=2, max_new_tokens=5, temperature=0.7, top_k=0, top_p=0.9
    )
    sent = backend.engine.async_requests
    assert [ids for batch, _, _ in sent for ids in batch] == [[5, 6], [5, 6], [7, 8, 9, 4]] + [
        [7, 8, 9, 4]
    ]
    assert backend.engine.batches == [4]  # issued together: one batch for SGLang's scheduler
    eos = tiny_tokenizer().eos_token_id
    assert sent[-1][1] == {
        "max_new_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # flowrl's 0 (off) is SGLang's -1
        "stop_token_ids": [eos],
    }
    generate_batch(backend, prompts, mask, max_new_tokens=5, do_sample=False, top_k=4, top_p=0.5)
    greedy = backend.engine.async_requests[-1][1]
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (0.0, -1, 1.0)
    generate_batch(backend, prompts, mask, max_new_tokens=5, temperature=1.0, top_k=4)
    assert backend.engine.async_requests[-1][1]["top_k"] == 4


def test_an_answer_is_cut_after_the_first_eos_with_its_log_probs_and_finish_reason():
    eos = 2
    assert request_result(reply([5, 6, eos], -1.0), eos, True) == Result(
        [5, 6, eos], [-1.0] * 3, "length"
    )
    cut = request_result(reply([8, eos, 9], -0.25, "stop"), eos, True)
    assert cut == Result([8, eos], [-0.25, -0.25], "stop")  # the token after EOS goes
    assert request_result(reply([7], -0.5), eos, False).logprobs == [0.0]


def test_generate_returns_the_engines_tokens_and_log_probs(backend):
    eos, pad = backend.eos, backend.pad
    backend.engine.queued.append([reply([11, eos], -1.5), reply([12, 13, 14], -2.0)])
    prompts, mask = torch.tensor([[4, 5]]), torch.ones(1, 2, dtype=torch.long)
    out = generate_batch(backend, prompts, mask, n=2, max_new_tokens=3, logprobs=True)
    assert out["responses"].tolist() == [[11, eos, pad], [12, 13, 14]]
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert out["logprobs"].tolist() == [[-1.5, -1.5, 0.0], [-2.0, -2.0, -2.0]]
    empty = generate_batch(backend, prompts, mask, n=2, max_new_tokens=0, logprobs=True)
    assert [tuple(v.shape) for v in empty.values()] == [(2, 0)] * 3


def test_mismatched_log_probs_are_an_error_not_a_silent_shift():
    output = {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [(-1.0, 5, None)]}}
    with pytest.raises(RuntimeError, match="2 ids but 1 log-probs"):
        request_result(output, eos=2, logprobs=True)


def test_a_multi_turn_rollout_sends_each_turn_with_the_whole_conversation(backend):
    """The agent driver on SGLang: every request is a task on the engine's loop; each turn
    is one async_generate with the conversation so far (prompt, earlier turns, tool output),
    which SGLang's radix cache extends."""
    from flowrl.agent.chat import ChatTokens
    from flowrl.agent.driver import run_requests
    from flowrl.agent.episode import Episode, Limits
    from flowrl.agent.parsers import user_parser
    from flowrl.agent.tools.toolbox import FunctionTool, Toolbox

    def echo(text: str) -> str:
        """Echo.

        Args:
            text: anything.
        """
        return f"echo:{text}"

    chat = ChatTokens(tiny_tokenizer())
    box = Toolbox([])
    box.tools, box.names = [FunctionTool(echo)], ["echo"]
    calls = user_parser(lambda text: [("echo", {"text": text[:3]})])
    prompts = [chat.encode([{"role": "user", "content": q}], True) for q in ("hi", "yo", "ok")]
    limits = Limits(max_new_tokens=200, max_turn_tokens=5, max_assistant_turns=3)
    episodes = [Episode(ids, chat, calls, box.open({}), limits) for ids in prompts]
    stats = backend.run(run_requests(episodes, backend))
    assert [e.reason for e in episodes] == ["max_turns"] * 3 and stats.turns == 9
    sent = [batch[0] for batch, _, _ in backend.engine.async_requests]
    for episode in episodes:
        turns = [ids for ids in sent if ids[: len(episode.prompt_ids)] == episode.prompt_ids]
        assert len(turns) == 3 and turns[0] == episode.prompt_ids
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later[: len(earlier)] == earlier  # a turn extends the conversation
        assert episode.prompt_ids + episode.ids[: len(turns[2]) - len(turns[0])] == turns[2]
        assert episode.mask.count(0) > 0  # tool output inside the response


def test_forced_first_turns_are_refused_with_the_backend_to_use(backend):
    from flowrl.engines.rollout import Request

    with pytest.raises(ValueError, match='need rollout = "hf"'):
        backend.run(backend.generate(Request([4, 5], 3, forced=[6])))


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
    assert kinds(calls) == [("release", kv_cache), ("resume", kv_cache), *PUSH]


def test_generate_never_runs_on_released_memory(backend):
    backend.offload(("weights", "kv_cache"))
    backend.engine.calls.clear()
    ids, mask = torch.tensor([[4, 5]]), torch.ones(1, 2, dtype=torch.long)
    generate_batch(backend, ids, mask, max_new_tokens=2)
    assert kinds(backend.engine.calls) == [*RESUME_ALL, "generate"]


def test_make_rollout_builds_it_with_the_default_factory_its_options_and_seed(monkeypatch):
    monkeypatch.setattr(sglang_backend, "sglang_engine", FakeEngine)
    options = SGLangOptions(mem_fraction_static=0.3, verify=True)
    engine = make_rollout(
        "sglang", bf16_model(), tiny_tokenizer(), "cuda:0", options=options, seed=7, where=WHERE
    )
    assert type(engine.engine) is FakeEngine and engine.where == WHERE and engine.verify
    # the graph's options and the run's seed reach SGLang's server args
    assert engine.engine.server_args["mem_fraction_static"] == 0.3
    assert engine.engine.server_args["random_seed"] == 7
    engine.shutdown()
    assert not Path(engine.engine.server_args["model_path"]).exists()


def test_the_old_verify_variable_still_turns_verify_on_with_a_warning(monkeypatch):
    from flowrl.compat import FlowrlDeprecationWarning

    monkeypatch.setattr(sglang_backend, "sglang_engine", FakeEngine)
    monkeypatch.setenv("FLOWRL_SGLANG_VERIFY", "1")
    with pytest.warns(FlowrlDeprecationWarning, match=r"rollout_options\] verify = true"):
        engine = make_rollout("sglang", bf16_model(), tiny_tokenizer(), "cuda:0")
    assert engine.verify and engine.options.verify is False
    engine.shutdown()


def test_without_sglang_building_it_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang fails
    with pytest.raises(ImportError, match=r'pip install -e "\.\[sglang\]"'):
        SGLangRollout(bf16_model(), tiny_tokenizer(), "cuda:0")


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
        overrides += [f'models.{m}.dtype="bfloat16"' for m in spec.models]
        overrides += [f'pools.{p}.device="cuda"' for p in spec.pools]
        overrides += [f'pools.{p}.offload="{offload}"' for p in spec.pools]
        overrides += [
            'models.policy.rollout="sglang"',
            "models.policy.rollout_options.verify=true",  # every push read back
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
    assert kinds(engine.calls) == [*PUSH, "generate", release, *RESUME_ALL, "generate", release]


def test_offload_never_pushes_and_flushes_after_each_update(sglang_trainer):
    trainer, engines = sglang_trainer("grpo.toml", "never")
    trainer.step(1)
    trainer.step(2)
    (engine,) = engines
    assert kinds(engine.calls) == [*PUSH, "generate", *PUSH, "generate", *PUSH]
    policy = trainer.executor.workers["main"][0].train["policy"].module
    pushed = {name: t for bucket in engine.pushed[-1:] for name, t in bucket}
    for name, tensor in policy.named_parameters():  # the last push: the trained weights
        if name in pushed:
            assert torch.equal(pushed[name], tensor)


def test_a_separate_rollout_pool_pushes_the_weights_it_receives(sglang_trainer):
    trainer, engines = sglang_trainer("grpo_disaggregated.toml", "never")
    trainer.step(1)
    (engine,) = engines  # on pool "gen": the import of the trained weights reaches SGLang
    assert kinds(engine.calls) == [*PUSH, "generate", *PUSH]
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
    overrides = [
        "models.policy.rollout=sglang",
        'models.policy.dtype="bfloat16"',
        'pools.train.device="cuda"',
    ]
    with pytest.raises(GraphErrors) as info:
        dsl.load(disaggregated, overrides)
    (problem,) = info.value.problems
    assert 'its pool "gen" has device = "cpu"' in problem.message
    dsl.load(disaggregated, [*overrides, 'pools.gen.device="cuda"'])  # fine


def _needs(monkeypatch, package: str) -> None:
    """Backend "sglang" needs `package` for this test (its record otherwise as shipped)."""
    import attrs

    from flowrl.backends import ROLLOUT_BACKENDS

    record = attrs.evolve(ROLLOUT_BACKENDS["sglang"], package=package)
    monkeypatch.setitem(ROLLOUT_BACKENDS, "sglang", record)


def test_check_warns_with_the_install_command_when_the_package_is_missing(monkeypatch, capsys):
    from flowrl.cli import main

    graph = str(ROOT / "graphs/grpo_sglang.toml")
    _needs(monkeypatch, "no_such_package_here")
    assert main(["check", graph]) == 0  # the graph is right; this machine lacks a package
    out = capsys.readouterr().out
    assert '[models.policy] rollout = "sglang" needs the no_such_package_here package' in out
    assert 'pip install -e ".[sglang]"' in out
    _needs(monkeypatch, "json")  # one that is installed
    assert main(["check", graph]) == 0
    assert "needs the" not in capsys.readouterr().out


def test_run_stops_before_loading_a_model_when_the_package_is_missing(monkeypatch):
    from flowrl.cli import load_plan
    from flowrl.runtime.guards import MissingPackage, check_packages

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    plan = load_plan(str(ROOT / "graphs/grpo_sglang.toml"))
    _needs(monkeypatch, "no_such_package_here")
    with pytest.raises(MissingPackage) as info:
        check_packages(plan)
    message = str(info.value)
    assert message.startswith(f'{plan.file}: [models.policy] rollout = "sglang" needs')
    assert 'pip install -e ".[sglang]"' in message
    _needs(monkeypatch, "json")
    check_packages(plan)  # installed: nothing to say


BLOCKED = (
    "import sys; sys.modules['sglang'] = None  # any `import sglang` now fails\n"
    "from flowrl.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "assert 'flowrl.engines.sglang.backend' not in sys.modules\n"
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


# -- what the pinned SGLang does that the backend must handle ------------------------------


def test_the_extra_pins_the_sglang_whose_torch_pin_is_the_projects():
    """sglang 0.5.21's METADATA: torch==2.13.0, the torch the Makefile installs."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'sglang = ["sglang==0.5.21"]' in pyproject
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()
    assert "sglang 0.5.21" in (ROOT / "docs/scaling.md").read_text()


def test_the_fake_refuses_what_sglang_refuses():
    backend = build()
    engine = FakeEngine(**backend.engine.server_args)
    with pytest.raises(TypeError, match="Unexpected keyword argument 'mem_fraction'"):
        FakeEngine(model_path=engine.server_args["model_path"], mem_fraction=0.5)
    tensor = torch.zeros(1)
    assert engine.update_weights_from_tensor([("x", tensor)], flush_cache=False) == (
        False,
        "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
    )
    assert engine.end_weight_update()[0] is False
    assert engine.begin_weight_update() == (True, "Success")
    assert engine.begin_weight_update()[0] is False  # one session at a time
    assert engine.update_weights_from_tensor([("no.such", tensor)], flush_cache=False)[0]
    assert engine.skipped == ["no.such"]  # skipped with a warning, as models/llama.py does
    with pytest.raises(KeyError):
        engine.resume_memory_occupation(tags=["kv_cache"])  # not released
    backend.shutdown()


def test_the_push_lands_in_a_session_so_sglang_serves_the_modules_weights():
    module = bf16_model()
    engine = build(module)
    fake = engine.engine
    assert kinds(fake.calls) == PUSH and not fake.session and not fake.skipped
    for name, tensor in module.named_parameters():  # not the dummy weights
        assert torch.equal(fake.weights[name], tensor.detach()), name
    engine.shutdown()


def test_a_refused_push_raises_with_sglangs_message_and_where_and_closes_the_session():
    engines = []

    def refusing(**server_args):
        engines.append(FakeEngine(**server_args))
        engines[-1].refuse = "Failed to update weights: out of memory"
        return engines[-1]

    with pytest.raises(PushRefused) as info:
        build(engine_factory=refusing)
    message = str(info.value)
    assert "SGLang refused update_weights_from_tensor on pool main, rank 0, model policy" in (
        message
    )
    assert "Failed to update weights: out of memory" in message
    (fake,) = engines
    assert not fake.session and fake.calls[-1][0] == "end"  # closed before raising
    assert fake.scheduler.poll() is not None  # and the engine it started is stopped


def test_verify_reads_parameters_back_and_catches_weights_that_did_not_land():
    engine = build(verify=True)
    fake = engine.engine
    read = [details for kind, details in fake.calls if kind == "get_weights"]
    assert read == ["model.embed_tokens.weight", "model.norm.weight"]
    engine.shutdown()

    class Forgetful(FakeEngine):  # answers success but keeps its old values for one name
        def update_weights_from_tensor(self, named_tensors, **kwargs):
            named_tensors = [(n, t) for n, t in named_tensors if n != "model.norm.weight"]
            return super().update_weights_from_tensor(named_tensors, **kwargs)

    with pytest.raises(PushRefused, match="verify read back model.norm.weight and it differs"):
        build(engine_factory=Forgetful, verify=True)


def test_a_lora_model_pushes_its_merged_weights_under_the_base_names():
    from flowrl.models import lora

    module = lora.add_adapter(bf16_model(), {"rank": 4, "alpha": 8})
    for name, parameter in module.named_parameters():  # a trained adapter: B is no longer 0
        if "lora_B" in name:
            torch.nn.init.normal_(parameter.data)
    q = module.model.layers[0].self_attn.q_proj
    base = q.base_layer.weight.detach().clone()
    merged = base + q.get_delta_weight("default").to(base.dtype)
    engine = build(module, verify=True)
    fake = engine.engine
    assert fake.skipped == []  # every pushed name is one SGLang knows
    assert torch.equal(fake.weights["model.layers.0.self_attn.q_proj.weight"], merged)
    assert not torch.equal(merged, base)
    assert torch.equal(q.base_layer.weight, base) and not q.merged  # the module is unchanged
    engine.shutdown()


def test_a_32_bit_model_is_refused_by_check_and_by_the_backend():
    from flowrl.errors import GraphErrors
    from flowrl.front import dsl

    graph = ROOT / "graphs/grpo_sglang.toml"
    with pytest.raises(GraphErrors) as info:
        dsl.load(graph, ['models.policy.dtype="float32"'])
    (problem,) = info.value.problems
    assert problem.where == "[models.policy] dtype"
    assert 'rollout = "sglang" serves dtype "bfloat16" or "float16"' in problem.message
    assert 'set dtype = "bfloat16"' in problem.fix
    built = []
    with pytest.raises(ValueError, match="SGLang serves 16-bit weights"):
        build(tiny_model(), engine_factory=lambda **a: built.append(a))
    assert built == []  # before any engine starts


def test_an_aborted_request_raises_instead_of_passing_for_a_short_response(backend):
    backend.engine.abort = {1}
    prompts, mask = torch.tensor([[4, 5]]), torch.ones(1, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="request 1 of 2 was aborted after 1 tokens"):
        generate_batch(backend, prompts, mask, n=2, max_new_tokens=4, logprobs=True)


def test_sglangs_signal_handlers_are_replaced_by_flowrls():
    def own_term(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, own_term)
    try:
        engine = build()
        generate_batch(engine, torch.tensor([[4, 5]]), torch.ones(1, 2, dtype=torch.long))
        # SGLang's asyncio handlers (drain on SIGTERM, kill the tree on SIGQUIT) are gone
        assert signal.getsignal(signal.SIGTERM) is own_term
        assert signal.getsignal(signal.SIGQUIT) is sglang_process.on_sigquit
        engine.shutdown()
    finally:
        signal.signal(signal.SIGTERM, previous)


DEATH = """
import sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from fake_sglang import FakeEngine
from flowrl.cli import load_plan
from flowrl.engines.sglang import backend as sglang_backend
from flowrl.runtime import controller, guards, pool_worker

class Dying(FakeEngine):  # its scheduler dies while serving the second generate (an OOM)
    generates = 0
    async def async_generate(self, *args, **kwargs):
        Dying.generates += 1
        if Dying.generates == 5:  # the second step's first request (4 requests a step)
            self.scheduler.kill()
            self.scheduler.wait()
        return await super().async_generate(*args, **kwargs)

sglang_backend.sglang_engine = Dying
pool_worker._device = lambda kind, rank: "cpu"
guards.check_devices = guards.check_packages = lambda plan: None
run = Path(sys.argv[1])
overrides = [f'models.{m}.{k}={v}' for m in ("policy", "ref")
             for k, v in (("path", '"tiny"'), ("dtype", '"bfloat16"'))]
overrides += ['models.policy.rollout="sglang"', 'pools.main.device="cuda"',
              "models.policy.rollout_options.verify=true",
              'pools.main.offload="never"', "run.val_size=0",
              "data.batch_size=2", "data.train_size=8", "nodes.generate.n=2",
              "nodes.generate.max_new_tokens=4", "run.steps=2", "run.save_every=1",
              f'run.out_dir="{run}"']
plan = load_plan(sys.argv[3], overrides)
trainer = controller.Trainer(plan, run / "run", "local")
try:
    trainer.fit()
except Exception as e:
    print(f"FLOWRL ERROR {type(e).__name__}: {e}")
    print("CHECKPOINTS", sorted(p.name for p in (run / "run/checkpoints").iterdir()))
    sys.exit(3)
finally:
    trainer.close()
"""


@pytest.mark.slow  # a child process: a Python start-up with torch
def test_the_trainer_survives_an_sglang_childs_death_with_its_own_error(tmp_path):
    """Run in a child process: with SGLang's handlers the whole process tree is killed."""
    args = [str(tmp_path), str(ROOT / "tests/support"), str(ROOT / "graphs/grpo.toml")]
    result = subprocess.run(
        [sys.executable, "-c", DEATH, *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 3, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    out = result.stdout
    assert "FLOWRL ERROR NodeFailure: node generate failed on pool main, rank 0" in out
    assert "EngineDied: SGLang's process" in out
    assert f"on host {os.uname().nodename} (pool main, rank 0, model policy)" in out
    assert "resume with flowrl run <graph> --resume <run dir>" in out
    assert "replay it: flowrl replay" in out  # the node failure's usual inputs and command
    assert "CHECKPOINTS ['step_000001']" in out  # step 1's checkpoint, intact


SHUTDOWN = """
import json, sys
import psutil
sys.path.insert(0, sys.argv[1])
import torch
from fake_sglang import FakeEngine
from flowrl.backends import SGLangOptions
from flowrl.engines.sglang.backend import SGLangRollout
from flowrl.rewards.pool import pool_for
from flowrl.testing import tiny_model, tiny_tokenizer

scorers = pool_for("arithmetic", ".", 2, 30.0)
assert all(child.wait_ready() for child in scorers.children)
rollout = SGLangRollout(tiny_model().to(torch.bfloat16), tiny_tokenizer(), "cuda:0",
                        options=SGLangOptions(verify=True), engine_factory=FakeEngine)
scheduler = rollout.engine.scheduler
pids = [c.process.pid for c in scorers.children]
rollout.shutdown()

def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

state = {"scorers": [alive(pid) for pid in pids], "scheduler": alive(scheduler.pid)}
_, counts = scorers.score([("arithmetic", "7", "7", {})])
state["failures"] = counts["errors"] + counts["timeouts"]
print(json.dumps(state))
"""


@pytest.mark.slow  # a child process: a Python start-up with torch
def test_shutting_sglang_down_leaves_flowrls_scorer_processes_running():
    result = subprocess.run(
        [sys.executable, "-c", SHUTDOWN, str(ROOT / "tests/support")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads(result.stdout.strip().splitlines()[-1])
    assert state == {"scorers": [True, True], "scheduler": False, "failures": 0}


def test_the_gpu_smoke_command_skips_with_a_clear_message_without_a_gpu(monkeypatch, capsys):
    from flowrl.engines.sglang import smoke

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert smoke.main(["--gpu"]) == 0
    assert capsys.readouterr().out == (
        "skip gpu-smoke: no CUDA device (torch.cuda.is_available() is False); run it on a GPU "
        "machine\n"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(smoke.importlib.util, "find_spec", lambda name: None)
    assert smoke.main(["--gpu"]) == 0
    assert 'SGLang is not installed: pip install -e ".[sglang]"' in capsys.readouterr().out
    assert [name for name, _ in smoke.CHECKS] == [
        "start",
        "greedy",
        "release x3",
        "push",
        "sampled n=8",
        "two ranks",
    ]


def test_a_dead_engine_raises_at_the_next_call_and_the_resource_tracker_is_not_its_own():
    from multiprocessing import resource_tracker

    class Spawning(FakeEngine):  # SGLang's first spawn start launches the resource tracker
        def __init__(self, **server_args):
            resource_tracker.ensure_running()
            super().__init__(**server_args)

    engine = build(engine_factory=Spawning)
    fake = engine.engine
    tracker = resource_tracker._resource_tracker._pid
    assert [p.pid for p in engine.guard.own] == [fake.scheduler.pid] != [tracker]
    fake.scheduler.kill()
    fake.scheduler.wait()
    calls = len(fake.calls)
    with pytest.raises(sglang_process.EngineDied, match=f"exited .* \\({WHERE}\\)"):
        engine.offload(("kv_cache",))
    assert len(fake.calls) == calls  # refused before reaching the dead engine
    engine.shutdown()


def test_flowrls_sigquit_handler_survives_the_pickling_into_sglangs_children():
    """SGLang pickles its server arguments, the handler among them, into spawned children."""
    import pickle

    assert pickle.loads(pickle.dumps(sglang_process.on_sigquit)) is sglang_process.on_sigquit


def test_a_scheduler_exception_reported_by_sigquit_raises_in_the_waiting_call():
    """A scheduler that hit an exception sends SIGQUIT before it exits: still alive then."""
    engine = build()
    assert signal.getsignal(signal.SIGQUIT) is sglang_process.on_sigquit  # else: not safe here
    engine.engine.failing = True
    prompts, mask = torch.tensor([[4, 5]]), torch.ones(1, 2, dtype=torch.long)
    with pytest.raises(sglang_process.EngineDied, match="an SGLang child reported a failure"):
        generate_batch(engine, prompts, mask, max_new_tokens=2)
    assert engine.engine.scheduler.poll() is None  # it had not exited
    with pytest.raises(sglang_process.EngineDied):  # and the engine stays refused
        engine.offload(("kv_cache",))
    engine.shutdown()
