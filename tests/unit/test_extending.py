"""The node examples of docs/extending.md, taken from the page, work as the page says."""

import copy
import re
from pathlib import Path

import torch
from test_update_workers import assert_same, batch

from flowrl.engines import TrainEngine
from flowrl.front import compiler, registry
from flowrl.protocol import DataProto
from flowrl.testing import tiny_model, tiny_tokenizer

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

    model, rows = tiny_model(seed=0), batch()
    grads = []
    engine = TrainEngine(copy.deepcopy(model), tiny_tokenizer(), lr=1e-2, micro_tokens=9)
    step = engine.step

    def record():
        grads.append({n: p.grad.clone() for n, p in engine.module.named_parameters()})
        return step()

    engine.step = record
    _, metrics = spec.worker(engine, spec.params())(rows)
    reference = TrainEngine(copy.deepcopy(model), tiny_tokenizer())
    logprobs = reference.forward(rows, grad=True)["logprobs"]
    mask = rows["response_mask"].float()
    loss = -(rows["advantages"] * logprobs * mask).sum() / mask.sum()
    loss.backward()
    expected = {n: p.grad for n, p in reference.module.named_parameters()}
    assert_same(grads[0], expected)  # micro-batches of 9 tokens add up to the whole loss
    assert abs(metrics["pg_loss"] - float(loss.detach())) < 1e-5 and metrics["grad_norm"] > 0
