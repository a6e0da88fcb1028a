"""The node examples of docs/extending.md, taken from the page, work as the page says."""

import copy
import importlib.util
import inspect
import re
from pathlib import Path

import attrs
import pytest
import torch

from flowrl.engines import TrainEngine
from flowrl.errors import GraphErrors
from flowrl.front import compiler, dsl, registry
from flowrl.nodespec import CheckContext
from flowrl.protocol import DataProto
from flowrl.testing import assert_same, tiny_model, tiny_tokenizer, update_rows

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs/extending.md").read_text()


def example(first_line: str) -> str:
    """The ```python block of the page whose first line (or docstring line) is given."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE, flags=re.S)
    return next(b for b in blocks if first_line in b.splitlines()[0:2])


def write_node(tmp_path, first_line, name):
    path = tmp_path / "my_nodes" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(example(first_line))
    return registry.resolve(str(path), tmp_path).spec


def test_the_controller_example_adds_its_bonus(tmp_path):
    spec = write_node(tmp_path, '"""A length bonus on the scores.', "bonus.py")
    rows = DataProto.from_dict(
        {"scores": torch.tensor([1.0, 0.0]), "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    )
    out = spec.fn(rows, spec.params(scale=0.5))
    torch.testing.assert_close(out["bonus_scores"], torch.tensor([2.0, 0.5]))


def recording_engine(model):
    """(a TrainEngine on a copy of `model`, the gradients of each of its optimizer steps as
    {parameter name: grad}), so a test can compare them with a loss's formula."""
    grads = []
    engine = TrainEngine(copy.deepcopy(model), tiny_tokenizer(), lr=1e-2, micro_tokens=9)
    step = engine.step

    def record():
        grads.append({n: p.grad.clone() for n, p in engine.module.named_parameters()})
        return step()

    engine.step = record
    return engine, grads


def test_the_custom_loss_example_compiles_and_takes_the_formulas_gradient(tmp_path):
    spec = write_node(tmp_path, "# my_nodes/reinforce_update.py", "reinforce_update.py")
    graph = (ROOT / "graphs/grpo.toml").read_text()
    graph = graph[: graph.index("[nodes.update_policy]")] + (
        '[nodes.update_policy]\nuses = "my_nodes/reinforce_update.py"\nmodel = "policy"\n'
    )
    (tmp_path / "g.toml").write_text(graph)
    plan = compiler.compile_file(tmp_path / "g.toml")
    assert plan.pools["main"].updates_per_step == {"policy": 1}
    assert "ref_logprob" not in plan.spec.nodes  # nothing reads the reference any more

    model, rows = tiny_model(seed=0), update_rows()
    engine, grads = recording_engine(model)
    _, metrics = spec.worker(engine, spec.params())(rows)
    reference = TrainEngine(copy.deepcopy(model), tiny_tokenizer())
    logprobs = reference.forward(rows, grad=True)["logprobs"]
    mask = rows["response_mask"].float()
    loss = -(rows["advantages"] * logprobs * mask).sum() / mask.sum()
    loss.backward()
    expected = {n: p.grad for n, p in reference.module.named_parameters()}
    assert_same(grads[0], expected)  # micro-batches of 9 tokens add up to the whole loss
    assert abs(metrics["pg_loss"] - float(loss.detach())) < 1e-5 and metrics["grad_norm"] > 0


def write_example(tmp_path, first_line, name):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(example(first_line))
    return path


def toml_example(first_line: str) -> str:
    """The ```toml block of the page whose first line is given."""
    blocks = re.findall(r"```toml\n(.*?)```", PAGE, flags=re.S)
    return next(b for b in blocks if b.startswith(first_line) and "my_" in b)


def test_the_rollout_backend_example_runs_from_a_users_file_and_from_a_table_line(
    tmp_path, monkeypatch
):
    from flowrl import backends
    from flowrl.engines import HFRollout, make_rollout
    from flowrl.engines.batch import generate_batch
    from flowrl.engines.rollout import RolloutBackend

    write_example(tmp_path, "# generate_rollout.py", "generate_rollout.py")
    ref = "generate_rollout.py:GenerateRollout"
    model, tokenizer = tiny_model(seed=0), tiny_tokenizer()
    engine = make_rollout(ref, model, tokenizer, "cpu", base_dir=tmp_path)
    assert isinstance(engine, RolloutBackend) and engine.options.use_cache
    for name in ("generate", "run", "release", "offload", "reload", "sync_weights"):
        ours = inspect.signature(getattr(type(engine), name)).parameters
        contract = inspect.signature(getattr(RolloutBackend, name)).parameters
        assert list(ours) == list(contract), name
    ids = torch.randint(3, 60, (3, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    ids = ids * mask
    greedy = {"n": 2, "max_new_tokens": 6, "do_sample": False}
    ours = generate_batch(engine, ids, mask, **greedy)
    reference = generate_batch(HFRollout(model, tokenizer), ids, mask, **greedy)
    assert ours.keys() == reference.keys()
    for key in ours:  # token for token, masks and padding included
        assert torch.equal(ours[key], reference[key]), key
    # the page's graph lines: by reference, with its option from the graph
    graph = (ROOT / "graphs/grpo.toml").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", PAGE, flags=re.S)
    (models,) = [b for b in blocks if "rollout_options]" in b]
    graph = graph.replace(graph[graph.index("[models.policy]") : graph.index("[models.ref]")], "")
    (tmp_path / "g.toml").write_text(models + "\n" + graph)
    config = dsl.load(tmp_path / "g.toml").models["policy"]
    assert config.rollout == ref and config.rollout_options == {"use_cache": False}
    bad = ["models.policy.rollout_options.use_cach=false"]
    with pytest.raises(GraphErrors, match=r'rollout_options\].*unknown key "use_cach"'):
        dsl.load(tmp_path / "g.toml", bad)
    # the page's table line names the same class in a folder of flowrl's
    table = {}
    exec(example("ROLLOUT_BACKENDS = {"), vars(backends) | {"GenerateOptions": object}, table)
    record = table["ROLLOUT_BACKENDS"]["generate"]
    assert record.ref == "flowrl.engines.generate.backend:GenerateRollout" and record.multi_turn
    path = tmp_path / "generate_rollout.py"
    local = backends.Backend(f"{path}:GenerateRollout", multi_turn=True, options=engine.Options)
    monkeypatch.setitem(backends.ROLLOUT_BACKENDS, "generate", local)
    assert dsl.load(ROOT / "graphs/grpo.toml", ["models.policy.rollout=generate"])


def test_the_tool_example_is_called_through_a_session(tmp_path):
    import asyncio

    from flowrl.agent.parsers import ToolCall
    from flowrl.agent.tools import Toolbox

    write_example(tmp_path, "# my_tools.py", "my_tools.py")
    box = Toolbox(["calculator", "my_tools.py:word_count"], tmp_path)
    assert box.names[-1] == "word_count"
    (schema,) = [s for s in box.schemas if s["function"]["name"] == "word_count"]
    assert schema["function"]["parameters"]["required"] == ["text"]

    async def call():
        session = box.open({})
        await session.start()
        result = await session.call(ToolCall("word_count", {"text": "one two three"}), 5.0)
        await session.close()
        return result

    assert asyncio.run(call()).text == "3"
    node = toml_example("[nodes.generate]")
    graph = (ROOT / "graphs/grpo_tools.toml").read_text()
    start = graph.index("[nodes.generate]")
    end = graph.index("\n[", start + 1)
    kept = [line for line in graph[start:end].splitlines()[3:] if not line.startswith("tools")]
    (tmp_path / "g.toml").write_text(graph[:start] + node + "\n".join(kept) + "\n" + graph[end:])
    spec = dsl.load(tmp_path / "g.toml")
    assert list(spec.nodes["generate"].params.tools) == ["calculator", "my_tools.py:word_count"]


def test_the_scorer_example_scores_and_is_named_by_path(tmp_path):
    from flowrl.rewards import resolve_scorer, score_value

    write_example(tmp_path, "# my_scorer.py", "my_scorer.py")
    score = resolve_scorer("my_scorer.py:compute_score", tmp_path)
    assert score_value(score("calculator", "so it is 42", "42", {})) == (1.0, {"numbers": 1.0})
    assert score_value(score("calculator", "7 then 41", "42", {})) == (0.0, {"numbers": 2.0})
    graph = (ROOT / "graphs/grpo.toml").read_text()
    block = '[nodes.reward]\nuses = "reward.rule"\n'
    assert block in graph
    (tmp_path / "g.toml").write_text(graph.replace(block, toml_example("[nodes.reward]")))
    plan = compiler.compile_file(tmp_path / "g.toml")  # the node's check resolves the scorer
    assert plan.spec.nodes["reward"].params.scorer == "my_scorer.py:compute_score"


def test_the_policy_loss_example_is_one_function_and_one_table_line(tmp_path, monkeypatch):
    # the page's function, saved as a module, and its table line, evaluated as it stands in
    # LOSSES: update.policy with loss = "plain" then takes the gradient of -A r (token-mean)
    from flowrl.math import losses
    from flowrl.nodes.update import policy

    path = tmp_path / "plain.py"
    path.write_text(example("# flowrl/math/losses/plain.py"))
    module_spec = importlib.util.spec_from_file_location("plain", path)
    plain = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(plain)
    line = re.search(r"```python\n(    \"plain\": Loss\(.*?\),)\n```", PAGE).group(1)
    entry = eval("{" + line + "}", {"Loss": losses.Loss, "plain": plain})
    monkeypatch.setattr(losses, "LOSSES", losses.LOSSES | entry)
    monkeypatch.setattr(policy, "LOSSES", losses.LOSSES)

    model, rows = tiny_model(seed=0), update_rows()
    params = policy.Params(loss="plain")
    assert policy.check(params, context(rows)) == []
    refused = policy.check(attrs.evolve(params, tau_pos=2.0), context(rows))
    assert [f.message.split(" = ")[0] for f in refused] == ["tau_pos"]

    engine, grads = recording_engine(model)
    _, metrics = policy.PolicyUpdateWorker(engine, params)(rows)
    reference = TrainEngine(copy.deepcopy(model), tiny_tokenizer())
    logprobs = reference.forward(rows, grad=True)["logprobs"]
    mask = rows["response_mask"].float()
    ratio = torch.exp(logprobs - rows["old_logprobs"])
    loss = -(rows["advantages"] * ratio * mask).sum() / mask.sum()
    loss.backward()
    expected = {n: p.grad for n, p in reference.module.named_parameters()}
    assert_same(grads[0], expected)
    assert abs(metrics["pg_loss"] - float(loss.detach())) < 1e-5 and "approx_kl" in metrics


def context(rows):
    return CheckContext("update_policy", len(rows), 1, len(rows), 1, ".")


def grpo_with(tmp_path, table: str, after: str = "[nodes.ref_logprob]") -> Path:
    """graphs/grpo.toml with `table` inserted above `after`, written to tmp_path/g.toml."""
    graph = (ROOT / "graphs/grpo.toml").read_text().replace(after, table + "\n" + after)
    (tmp_path / "g.toml").write_text(graph)
    return tmp_path / "g.toml"


def test_the_filter_example_keeps_the_best_of_each_group(tmp_path):
    spec = write_node(tmp_path, "# my_nodes/top_k.py", "top_k.py")
    rows = DataProto.from_dict(
        {
            "scores": torch.tensor([0.0, 2.0, 1.0, 5.0, 5.0, 3.0]),
            "uid": torch.tensor([7, 7, 7, 9, 9, 9]),
        }
    )
    keep, metrics = spec.fn(rows, spec.params(keep_top=2))
    # uid 7: scores 0, 2, 1 -> rows 1 and 2; uid 9: 5, 5, 3 -> rows 3 and 4 (a tie: both)
    assert keep["keep"].tolist() == [False, True, True, True, True, False]
    assert metrics == {"kept_fraction": pytest.approx(4 / 6)}


def test_the_filter_example_in_a_graph_shows_the_rows_after_it(tmp_path, capsys):
    from flowrl.cli import main

    write_node(tmp_path, "# my_nodes/top_k.py", "top_k.py")
    table = example_toml('uses = "my_nodes/top_k.py"')
    graph = grpo_with(tmp_path, table)
    plan = compiler.compile_file(graph)
    assert plan.after("best") == ["ref_logprob", "advantage", "update_policy"]
    assert (
        "after best: ref_logprob, advantage, update_policy receive the rows best keeps: at most 32 "
        "(4 prompts x 8 samples), varying by step"
    ) in plan.text()
    assert not [w for w in plan.warnings if "keep" in w]
    assert main(["check", str(graph)]) == 0
    out = capsys.readouterr().out
    assert "32 rows per step, at most 32 after best" in out
    assert "scores, uid -> (keeps rows: keep)" in out


def test_the_filter_example_trains_on_the_kept_rows(tmp_path):
    """A tiny run (2 prompts x 8 samples): the update receives each prompt's 4 best rows."""
    from flowrl.testing import run_tiny

    write_node(tmp_path, "# my_nodes/top_k.py", "top_k.py")
    graph = grpo_with(tmp_path, example_toml('uses = "my_nodes/top_k.py"'))
    run = run_tiny(graph, tmp_path / "runs", **{"run.save_inputs": '["update_policy"]'})
    assert run.metrics[-1]["best/kept_fraction"] == 0.5
    rows = DataProto.load(run.run_dir / "inputs/step_2_update_policy_rank0/batch.pt")
    prompts = [tuple(p) for p in rows["prompts"].tolist()]  # the update reads no uid
    assert len(rows) == 8 and sorted(prompts.count(p) for p in set(prompts)) == [4, 4]


def test_a_filter_that_declares_writes_is_refused(tmp_path):
    node = tmp_path / "bad_filter.py"
    node.write_text(example("# my_nodes/top_k.py").replace("writes=()", 'writes=("keep",)'))
    graph = grpo_with(tmp_path, '[nodes.best]\nuses = "bad_filter.py"\n')
    with pytest.raises(GraphErrors, match="a filter returns only its keep mask"):
        compiler.compile_file(graph)


def example_toml(first_line: str) -> str:
    """The ```toml block of the page that contains `first_line`."""
    blocks = re.findall(r"```toml\n(.*?)```", PAGE, flags=re.S)
    return next(b for b in blocks if first_line in b)


@pytest.mark.parametrize(
    "keep", [torch.tensor([1, 0, 1]), torch.tensor([True, False]), [True, False, True]]
)
def test_a_keep_that_is_not_a_bool_mask_over_the_rows_stops_the_call(tmp_path, keep):
    from flowrl.runtime.node_call import NodeCall, NodeFailure, call_node

    spec = write_node(tmp_path, "# my_nodes/top_k.py", "top_k.py")
    rows = DataProto.from_dict({"scores": torch.zeros(3), "uid": torch.tensor([0, 0, 1])})
    call = NodeCall("best", spec, {}, spec.params(), "on the controller")
    with pytest.raises(NodeFailure, match=r"keep must be a torch.bool tensor of shape \(3,\)"):
        call_node(call, rows, lambda batch: {"keep": keep})
