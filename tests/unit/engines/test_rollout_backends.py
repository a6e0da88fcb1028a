"""The rollout-backend contract: the table of backends by name (flowrl/backends.py), the
protocol, and the pool worker and graph file choosing a backend through them."""

import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flowrl.backends import ROLLOUT_BACKENDS, Backend, NoOptions
from flowrl.engines import HFRollout, make_rollout
from flowrl.engines.rollout import RolloutBackend, mix, rollout_class
from flowrl.errors import GraphErrors
from flowrl.front import dsl, schema
from flowrl.runtime.pool_worker import PoolWorker
from flowrl.runtime.setup import PoolSetup
from flowrl.testing import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]
METHODS = {"generate", "run", "release", "offload", "reload", "sync_weights"}


# A backend in a user's own file, written from docs/extending.md's member table alone: it
# samples each request's tokens from its own seed (no model), and says what check reads.
USER_BACKEND = """
import asyncio
import random

import attrs

from flowrl.api import Result


@attrs.frozen
class EchoOptions:
    vocab: int = 40  # tokens are drawn from 3..vocab-1


class Echo:
    Options = EchoOptions
    multi_turn = True
    runs_on = None
    dtypes = ()
    pad, lockstep = 0, False
    built = []

    def __init__(self, module, tokenizer, device, *, options, seed, where):
        self.module, self.tokenizer, self.device = module, tokenizer, device
        self.options, self.seed, self.where = options, seed, where
        Echo.built.append(self)
        self.calls = []

    async def generate(self, request):
        self.calls.append(request)
        draw = random.Random(request.seed * 1000 + request.turn)
        ids = [draw.randrange(3, self.options.vocab) for _ in range(request.max_new_tokens)]
        return Result(ids, [-1.0] * len(ids), "length")

    def run(self, coroutine):
        return asyncio.run(coroutine)

    def release(self, request_id):
        pass

    def offload(self, parts):
        pass

    def reload(self, parts):
        pass

    def sync_weights(self, source):
        pass
"""


def backend_module(name: str) -> types.ModuleType:
    """USER_BACKEND's source as an importable module `name`."""
    module = types.ModuleType(name)
    exec(USER_BACKEND, vars(module))
    return module


FakeRollout = backend_module("fake_rollout").Echo


@pytest.fixture
def fake_backend(monkeypatch):
    """Registers FakeRollout as backend "fake", from an importable module "fake_rollout"."""
    module = backend_module("fake_rollout")
    monkeypatch.setitem(sys.modules, "fake_rollout", module)
    monkeypatch.setitem(ROLLOUT_BACKENDS, "fake", Backend("fake_rollout:Echo"))


def test_hf_resolves_to_the_decode_loop():
    assert rollout_class("hf") is HFRollout
    engine = make_rollout("hf", tiny_model(), tiny_tokenizer(), "cpu")
    assert type(engine) is HFRollout and engine.device.type == "cpu"


def test_unknown_backend_names_the_allowed_ones(fake_backend):
    with pytest.raises(ValueError) as info:
        make_rollout("no_such", tiny_model(), tiny_tokenizer())
    names = ", ".join(f'"{name}"' for name in sorted(ROLLOUT_BACKENDS))  # "fake", "hf", ...
    assert str(info.value) == (
        f'unknown rollout backend "no_such"; the backends are: {names}, or your own class by '
        'reference ("my_rollout.py:MyRollout")'
    )


def test_hf_rollout_has_the_protocol_methods_with_the_same_parameters():
    methods = {n for n, v in vars(RolloutBackend).items() if inspect.isfunction(v)}
    assert {n for n in methods if not n.startswith("_")} == METHODS
    for name in METHODS:
        ours = inspect.signature(getattr(HFRollout, name)).parameters.values()
        contract = inspect.signature(getattr(RolloutBackend, name)).parameters.values()
        assert [(p.name, p.kind, p.default) for p in ours] == [
            (p.name, p.kind, p.default) for p in contract
        ], name
    assert set(RolloutBackend.__annotations__) == {"device", "tokenizer", "pad", "lockstep"}
    assert isinstance(HFRollout(tiny_model(), tiny_tokenizer()), RolloutBackend)


def test_protocol_check_rejects_a_backend_without_sync_weights():
    methods = {k: v for k, v in vars(FakeRollout).items() if k != "sync_weights"}
    lacking = type("Lacking", (), methods)
    built = {"options": None, "seed": 0, "where": ""}
    assert isinstance(FakeRollout(None, None, "cpu", **built), RolloutBackend)
    assert not isinstance(lacking(None, None, "cpu", **built), RolloutBackend)


def test_contract_and_schema_import_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from flowrl.backends import ROLLOUT_BACKENDS\n"
        "from flowrl.engines.rollout import RolloutBackend, make_rollout\n"
        "from flowrl.front.schema import ModelConfig\n"
        "assert ModelConfig().rollout == 'hf' and 'hf' in ROLLOUT_BACKENDS\n"
        "loaded = [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "assert 'torch' not in loaded and 'transformers' not in loaded, sorted(loaded)\n"
        "assert 'flowrl.engines.hf.engine' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_graph_file_selects_a_backend_by_a_name_in_the_table(fake_backend):
    graph = ROOT / "graphs/grpo.toml"
    assert dsl.load(graph).models["policy"].rollout == "hf"  # the default
    assert dsl.load(graph, ["models.policy.rollout=fake"]).models["policy"].rollout == "fake"
    with pytest.raises(GraphErrors) as info:
        dsl.load(graph, ["models.policy.rollout=no_such"])
    (problem,) = [p for p in info.value.problems if p.where == "[models.policy]"]
    assert "rollout" in problem.message and "no_such" in problem.message


def test_pool_worker_builds_the_backend_its_model_names(fake_backend):
    models = {
        "policy": schema.ModelConfig(path="tiny", rollout="fake"),
        "other": schema.ModelConfig(path="tiny"),  # the default backend
    }
    setup = PoolSetup("main", "cpu", 1, 0, str(ROOT), models, {}, ("policy", "other"), ())
    worker = PoolWorker(setup)
    fake, hf = worker.rollout["policy"], worker.rollout["other"]
    assert type(fake).__name__ == "Echo" and type(hf) is HFRollout
    # colocated: the rollout engine shares the train engine's module, on the pool's device
    assert fake.module is worker.train["policy"].module and fake.device == "cpu"
    assert fake.tokenizer is worker.tokenizers["policy"]
    # the contract's keywords: its options record, a seed from run.seed and the rank, where
    assert fake.options == NoOptions() and fake.where == "pool main, rank 0, model policy"
    assert fake.seed == mix(setup.seed, 0) and fake.seed != mix(setup.seed + 1, 0)


def test_hf_offload_drops_held_requests_only_with_the_kv_cache_part():
    from flowrl.engines.rollout import Request
    from flowrl.engines.threads import run_sync

    engine = HFRollout(tiny_model(), tiny_tokenizer())
    run_sync(engine.generate(Request([5, 6, 7], 3, request_id="r", keep=True)))
    engine.offload(("weights",))  # its weights are the train engine's module, moved there
    assert engine.runner.cache is not None and "r" in engine.scheduler.batch.held
    engine.offload(("weights", "kv_cache"))  # a request never released is dropped too
    assert engine.runner.cache is None and not engine.scheduler.batch.held


def test_an_agent_node_on_a_single_turn_backend_is_refused_before_any_model_loads(fake_backend):
    """A backend whose record says multi_turn = False (here "fake") cannot serve the agent
    node: `flowrl check` says so and names the backends that can."""
    assert not ROLLOUT_BACKENDS["fake"].multi_turn
    graph = ROOT / "graphs/grpo_tools.toml"
    with pytest.raises(GraphErrors) as info:
        dsl.load(graph, ["models.policy.rollout=fake"])
    (problem,) = info.value.problems
    assert problem.where == "[nodes.generate]"
    assert 'rollout = "fake", which generates single turns only' in problem.message
    assert problem.fix == 'set rollout to one of "hf", "sglang" in [models.policy]'
    dsl.load(graph)  # the shipped backend serves it


def test_sglang_serves_the_agent_node(capsys):
    """SGLang's record says multi_turn: `flowrl check` accepts an agent node on it."""
    from flowrl.cli import main

    assert ROLLOUT_BACKENDS["sglang"].multi_turn
    graph = str(ROOT / "graphs/grpo_tools.toml")
    overrides = ["models.policy.rollout=sglang", 'pools.main.device="cuda"']
    overrides.append('models.policy.dtype="bfloat16"')
    assert main(["check", graph, *overrides]) == 0, capsys.readouterr().err


def user_backend(tmp_path, **attributes) -> Path:
    text = USER_BACKEND
    for name, value in attributes.items():
        text = text.replace(f"    {name} = ", f"    {name} = {value!r}  # was ", 1)
    path = tmp_path / "echo_rollout.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_backend_from_a_users_file_is_checked_by_the_attributes_of_its_class(tmp_path):
    user_backend(tmp_path)
    graph = tmp_path / "g.toml"
    graph.write_text((ROOT / "graphs/grpo_tools.toml").read_text())
    ref = 'models.policy.rollout="echo_rollout.py:Echo"'
    spec = dsl.load(graph, [ref, "models.policy.rollout_options.vocab=50"])
    assert spec.models["policy"].rollout_options == {"vocab": 50}
    with pytest.raises(GraphErrors) as info:
        dsl.load(graph, [ref, "models.policy.rollout_options.vocab=1.5"])
    (problem,) = info.value.problems
    assert problem.where == "[models.policy.rollout_options]" and "should be an integer" in (
        problem.message
    )
    # the class's attributes are its record: single-turn, one device, some dtypes
    user_backend(tmp_path / "single", multi_turn=False)
    with pytest.raises(GraphErrors, match="generates single turns only"):
        dsl.load(graph, ['models.policy.rollout="single/echo_rollout.py:Echo"'])
    user_backend(tmp_path / "gpu", runs_on="cuda", dtypes=("bfloat16",))
    with pytest.raises(GraphErrors) as info:
        dsl.load(graph, ['models.policy.rollout="gpu/echo_rollout.py:Echo"'])
    wheres = sorted(p.where for p in info.value.problems)
    assert wheres == ["[models.policy] dtype", "[models.policy] rollout"]
    with pytest.raises(GraphErrors) as info:
        dsl.load(graph, ['models.policy.rollout="nowhere.py:Echo"'])
    (problem,) = info.value.problems
    assert problem.where == "[models.policy] rollout" and "no file" in problem.message
    assert "file.py:Class" in problem.fix
