"""The rollout-backend contract: the table of backends by name, the protocol, and the pool
worker and graph file choosing a backend through them."""

import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flowrl.engines import HFRollout, RolloutEngine, make_rollout
from flowrl.engines.rollout import ROLLOUT_BACKENDS, RolloutBackend, rollout_class
from flowrl.errors import GraphErrors
from flowrl.front import dsl, schema
from flowrl.runtime.pool_worker import PoolWorker
from flowrl.runtime.setup import PoolSetup
from flowrl.testing import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
METHODS = {"generate", "offload", "reload", "sync_weights"}


class FakeRollout:
    """A backend that records how it was built."""

    def __init__(self, module, tokenizer, device):
        self.module, self.tokenizer, self.device = module, tokenizer, device

    def generate(self, prompts, prompt_mask, **sampling):
        raise NotImplementedError

    def offload(self):
        pass

    def reload(self):
        pass

    def sync_weights(self, source):
        pass


@pytest.fixture
def fake_backend(monkeypatch):
    """Registers FakeRollout as backend "fake", from an importable module "fake_rollout"."""
    module = types.ModuleType("fake_rollout")
    module.FakeRollout = FakeRollout
    monkeypatch.setitem(sys.modules, "fake_rollout", module)
    monkeypatch.setitem(ROLLOUT_BACKENDS, "fake", "fake_rollout:FakeRollout")


def test_hf_resolves_to_the_decode_loop():
    assert rollout_class("hf") is HFRollout
    assert RolloutEngine is HFRollout  # the former name still imports
    engine = make_rollout("hf", tiny_model(), tiny_tokenizer(), "cpu")
    assert type(engine) is HFRollout and engine.device.type == "cpu"


def test_unknown_backend_names_the_allowed_ones():
    message = 'unknown rollout backend "no_such"; the backends are: "hf"'
    with pytest.raises(ValueError, match=message):
        make_rollout("no_such", tiny_model(), tiny_tokenizer())


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
        "from flowrl.engines.rollout import ROLLOUT_BACKENDS\n"
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
