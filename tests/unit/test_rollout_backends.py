"""The rollout-backend contract: the table of backends by name (flowrl/backends.py), the
protocol, and the pool worker and graph file choosing a backend through them."""

import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flowrl.backends import ROLLOUT_BACKENDS, Backend
from flowrl.engines import HFRollout, make_rollout
from flowrl.engines.rollout import RolloutBackend, rollout_class
from flowrl.errors import GraphErrors
from flowrl.front import dsl, schema
from flowrl.runtime.pool_worker import PoolWorker
from flowrl.runtime.setup import PoolSetup
from flowrl.testing import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
METHODS = {"generate", "release", "offload", "reload", "sync_weights"}


class FakeRollout:
    """A backend that records how it was built."""

    def __init__(self, module, tokenizer, device):
        self.module, self.tokenizer, self.device = module, tokenizer, device

    async def generate(self, request):
        raise NotImplementedError

    def release(self, request_id):
        pass

    def offload(self, parts):
        pass

    def reload(self, parts):
        pass

    def sync_weights(self, source):
        pass


@pytest.fixture
def fake_backend(monkeypatch):
    """Registers FakeRollout as backend "fake", from an importable module "fake_rollout"."""
    module = types.ModuleType("fake_rollout")
    module.FakeRollout = FakeRollout
    monkeypatch.setitem(sys.modules, "fake_rollout", module)
    monkeypatch.setitem(ROLLOUT_BACKENDS, "fake", Backend("fake_rollout:FakeRollout"))


def test_hf_resolves_to_the_decode_loop():
    assert rollout_class("hf") is HFRollout
    engine = make_rollout("hf", tiny_model(), tiny_tokenizer(), "cpu")
    assert type(engine) is HFRollout and engine.device.type == "cpu"


def test_unknown_backend_names_the_allowed_ones(fake_backend):
    with pytest.raises(ValueError) as info:
        make_rollout("no_such", tiny_model(), tiny_tokenizer())
    names = ", ".join(f'"{name}"' for name in sorted(ROLLOUT_BACKENDS))  # "fake", "hf", ...
    assert str(info.value) == f'unknown rollout backend "no_such"; the backends are: {names}'


def test_hf_rollout_has_the_protocol_methods_with_the_same_parameters():
    methods = {n for n, v in vars(RolloutBackend).items() if inspect.isfunction(v)}
    assert {n for n in methods if not n.startswith("_")} == METHODS
    for name in METHODS:
        ours = inspect.signature(getattr(HFRollout, name)).parameters.values()
        contract = inspect.signature(getattr(RolloutBackend, name)).parameters.values()
        assert [(p.name, p.kind, p.default) for p in ours] == [
            (p.name, p.kind, p.default) for p in contract
        ], name
    assert set(RolloutBackend.__annotations__) == {"device", "tokenizer"}
    assert isinstance(HFRollout(tiny_model(), tiny_tokenizer()), RolloutBackend)


def test_protocol_check_rejects_a_backend_without_sync_weights():
    methods = {k: v for k, v in vars(FakeRollout).items() if k != "sync_weights"}
    lacking = type("Lacking", (), methods)
    assert isinstance(FakeRollout(None, None, "cpu"), RolloutBackend)
    assert not isinstance(lacking(None, None, "cpu"), RolloutBackend)


def test_contract_and_schema_import_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from flowrl.backends import ROLLOUT_BACKENDS\n"
        "from flowrl.engines.rollout import RolloutBackend, make_rollout\n"
        "from flowrl.front.schema import ModelConfig\n"
        "assert ModelConfig().rollout == 'hf' and 'hf' in ROLLOUT_BACKENDS\n"
        "loaded = [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "assert 'torch' not in loaded and 'transformers' not in loaded, sorted(loaded)\n"
        "assert 'flowrl.engines.hf_rollout' not in sys.modules\n"
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
    assert type(fake) is FakeRollout and type(hf) is HFRollout
    # colocated: the rollout engine shares the train engine's module, on the pool's device
    assert fake.module is worker.train["policy"].module and fake.device == "cpu"
    assert fake.tokenizer is worker.tokenizers["policy"]


def test_hf_offload_drops_held_requests_only_with_the_kv_cache_part():
    from flowrl.engines.rollout import Request, run_sync

    engine = HFRollout(tiny_model(), tiny_tokenizer())
    run_sync(engine.generate(Request([5, 6, 7], 3, request_id="r", keep=True)))
    engine.offload(("weights",))  # its weights are the train engine's module, moved there
    assert engine.cache is not None and "r" in engine.scheduler.held
    engine.offload(("weights", "kv_cache"))  # a request never released is dropped too
    assert engine.cache is None and not engine.scheduler.held


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
