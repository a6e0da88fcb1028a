"""A loss of the user's with params and state (docs/extending.md, "A loss with params and
state"): the page's adaptive-KL example checks, keeps its state across steps and in the
update worker's state_dict, and what breaks the contract is refused with the fix."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from flowrl.errors import GraphErrors, StateError
from flowrl.front import compiler
from flowrl.math.components import ComponentError
from flowrl.testing import run_tiny, tiny_model, tiny_tokenizer, try_loss, update_rows

ROOT = Path(__file__).resolve().parents[3]
PAGE = (ROOT / "docs/extending.md").read_text()


def block(kind: str, first_line: str) -> str:
    blocks = re.findall(rf"```{kind}\n(.*?)```", PAGE, flags=re.S)
    return next(b for b in blocks if first_line in b)


def write_example(tmp_path, old: str = "", new: str = "", table: str = "") -> Path:
    """adaptive_kl.py of the page (with `old` replaced by `new`) beside graphs/ppo.toml whose
    update node is the page's table (or `table`)."""
    text = block("python", "# adaptive_kl.py")
    assert old in text
    (tmp_path / "adaptive_kl.py").write_text(text.replace(old, new))
    graph = (ROOT / "graphs/ppo.toml").read_text()
    start = graph.index("[nodes.update_policy]")
    end = graph.find("\n[", start + 1)
    node = table or block("toml", 'loss = "adaptive_kl.py:ADAPTIVE_KL"')
    graph = graph[:start] + node + (graph[end:] if end > 0 else "")
    (tmp_path / "g.toml").write_text(graph)
    return tmp_path / "g.toml"


def problems(graph: Path, *overrides) -> list[str]:
    try:
        compiler.compile_file(graph, list(overrides))
    except GraphErrors as e:
        return [f"{p.where}: {p.message} | fix: {p.fix}" for p in e.problems]
    return []


def test_the_pages_example_checks_and_its_own_test_passes(tmp_path):
    graph = write_example(tmp_path)
    plan = compiler.compile_file(graph)
    params = plan.spec.nodes["update_policy"].params
    assert params.loss_options == {"target_kl": 0.02, "init_beta": 0.5}
    test_file = tmp_path / "test_adaptive_kl.py"
    test_file.write_text(block("python", "# test_adaptive_kl.py"))
    spec = importlib.util.spec_from_file_location("test_adaptive_kl", test_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.test_beta_doubles_above_and_halves_below_the_target()


@pytest.mark.parametrize(
    "override, said",
    [
        ("nodes.update_policy.loss_options.target_kl=-1.0", "target_kl"),
        ("nodes.update_policy.loss_options.target=0.1", 'unknown key "target"'),
    ],
)
def test_its_options_are_checked_like_node_params(tmp_path, override, said):
    (problem,) = problems(write_example(tmp_path), override)
    assert "loss_options" in problem and said in problem


def test_options_given_to_a_loss_without_options_are_refused(tmp_path):
    table = '[nodes.update_policy]\nuses = "update.policy"\nmodel = "policy"\n'
    table += "loss_options = { beta = 1.0 }\n"
    (problem,) = problems(write_example(tmp_path, table=table))
    assert 'loss "ppo" has no options of its own' in problem and "remove loss_options" in problem


@pytest.mark.parametrize(
    "old, new, said",
    [
        ("options=Options,", "options=dict,", "is not an attrs class"),
        ("state=first_state,", "state=3,", "state = 3 is not a function"),
        ("state=first_state,", "", "after_update but no state"),
    ],
)
def test_a_record_that_cannot_work_is_refused_at_check(tmp_path, old, new, said):
    (problem,) = problems(write_example(tmp_path, old, new))
    assert said in problem and "adaptive_kl.py" in problem


def worker(tmp_path, **options):
    from flowrl.engines import TrainEngine
    from flowrl.nodes.update import policy

    engine = TrainEngine(tiny_model(seed=0), tiny_tokenizer(), lr=1e-2)
    params = policy.Params(loss="adaptive_kl.py:ADAPTIVE_KL", loss_options=options)
    return policy.PolicyUpdateWorker(engine, params)


def rows(tmp_path):
    batch = update_rows()
    batch.meta["base_dir"] = str(tmp_path)  # as the pool worker passes it
    return batch


def test_the_state_moves_after_each_update_and_round_trips_its_state_dict(tmp_path):
    write_example(tmp_path)
    first = worker(tmp_path, target_kl=1e-9, init_beta=0.5)  # any KL is above: beta doubles
    _, metrics = first(rows(tmp_path))
    assert first.state_dict() == {"loss": {"beta": 1.0}}
    assert metrics["loss_state/beta"] == 1.0 and metrics["kl"] > 0
    first(rows(tmp_path))
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert saved == {"loss": {"beta": 2.0}}
    resumed = worker(tmp_path, target_kl=1e-9, init_beta=0.5)
    resumed.load_state_dict(saved)  # before its first call, as a resume loads it
    _, metrics = resumed(rows(tmp_path))
    assert resumed.state_dict() == {"loss": {"beta": 4.0}}


def test_state_that_json_cannot_hold_stops_the_step_naming_the_function(tmp_path):
    write_example(tmp_path, 'return {"beta": state["beta"] * 2}', 'return {"beta": {1, 2}}')
    with pytest.raises(StateError, match=r"adapt \(.*adaptive_kl.py:\d+\): after_update returned"):
        worker(tmp_path, target_kl=1e-9)(rows(tmp_path))


def test_a_beta_kept_at_module_level_is_refused(tmp_path):
    naive = block("python", "# adaptive_kl.py").replace(
        "def first_state(options):", "BETA = [1.0]\n\n\ndef first_state(options):"
    )
    naive = naive.replace(
        'chunk.state["beta"] * kl)', "BETA[0] * kl)\n    BETA[0] *= 2  # the naive route"
    )
    (tmp_path / "adaptive_kl.py").write_text(naive)
    with pytest.raises(ComponentError, match="changed the module-level BETA during a step"):
        worker(tmp_path)(rows(tmp_path))


def test_try_loss_checks_the_options_and_the_state(tmp_path):
    write_example(tmp_path)
    with pytest.raises(ComponentError, match='unknown key "target"'):
        try_loss("adaptive_kl.py:ADAPTIVE_KL", tmp_path, options={"target": 1})
    value, rates = try_loss("adaptive_kl.py:ADAPTIVE_KL", tmp_path, options={"init_beta": 2.0})
    assert value.requires_grad and set(rates) == {"kl"}


def test_a_tiny_run_logs_beta_at_every_step_and_saves_it(tmp_path):
    graph = write_example(tmp_path)
    run = run_tiny(graph, tmp_path / "runs", **{"run.steps": 3, "run.critic_warmup": 0})
    steps = [m for m in run.metrics if "time_s" in m]
    betas = [m["update_policy/loss_state/beta"] for m in steps]
    beta = 0.5  # init_beta of the page's table; target_kl 0.02
    for m, logged in zip(steps, betas, strict=True):  # the rule, from each step's logged KL
        kl = m["update_policy/kl"]
        beta = beta * 2 if kl > 0.03 else beta / 2 if kl < 0.02 / 1.5 else beta
        assert logged == beta
    (checkpoint,) = (run.run_dir / "checkpoints").glob("step_*")
    (saved,) = checkpoint.glob("nodes-*.json")
    assert json.loads(saved.read_text()) == {"update_policy": {"loss": {"beta": betas[-1]}}}


def test_a_loss_that_makes_a_nan_from_finite_inputs_is_named(tmp_path):
    write_example(tmp_path, 'rates = {"kl": float(', 'rates = {"kl": float("nan") + float(')
    with pytest.raises(ComponentError, match=r'the rate "kl" = nan from finite inputs'):
        worker(tmp_path)(rows(tmp_path))
