"""What a node writes under a documented key (docs/keys.md) is checked where it comes back:
a per-token key (b, t) as wide as response_mask, a score (b,), finite on trained tokens."""

import re
from pathlib import Path

import pytest
import torch

from flowrl.protocol import DataProto
from flowrl.runtime.node_call import NodeFailure
from flowrl.runtime.writes_check import check_writes
from flowrl.testing import run_tiny

ROOT = Path(__file__).resolve().parents[3]
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def check(**writes):
    batch = DataProto.from_dict({"response_mask": MASK, **writes})
    check_writes("advantage", "my_estimators.py", DataProto.from_dict(writes), batch)


@pytest.mark.parametrize(
    "writes, said",
    [
        ({"advantages": torch.ones(2)}, "wrote advantages of shape (2,), but advantages is one"),
        ({"values": torch.ones(2, 5)}, "(b, t) = (2, 3) here"),
        ({"advantages": torch.tensor([[1.0, float("nan"), 0], [0, 0, 0]])}, "= nan at row 0"),
        ({"scores": torch.ones(2, 1)}, "wrote scores of shape (2, 1)"),
        ({"scores": torch.tensor([1.0, float("inf")])}, "wrote scores = inf at row 1"),
    ],
)
def test_a_documented_key_of_the_wrong_shape_or_value_stops_naming_the_node(writes, said):
    with pytest.raises(NodeFailure) as caught:
        check(**writes)
    assert said in str(caught.value) and "node advantage (my_estimators.py)" in str(caught.value)


def test_right_writes_and_non_finite_values_past_the_response_pass():
    check(advantages=torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("-inf"), 0]]))
    check(scores=torch.tensor([0.0, 1.0]), my_key=torch.ones(2, 7))  # a key of the user's


def test_an_estimator_writing_one_advantage_per_row_stops_the_run_naming_it(tmp_path):
    page = (ROOT / "docs/extending.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    (estimator,) = [b for b in blocks if b.startswith("# my_estimators.py")]
    line = '    return {"advantages": advantages[:, None] * batch["response_mask"]}  # (b, t)'
    assert line in estimator
    (tmp_path / "flat.py").write_text(
        estimator.replace(line, '    return {"advantages": advantages}')
    )
    graph = (ROOT / "graphs/grpo.toml").read_text()
    graph = graph.replace('uses = "advantage.grpo"', 'uses = "flat.py"')
    (tmp_path / "g.toml").write_text(graph)
    with pytest.raises(NodeFailure, match=r"node advantage \(flat.py\) wrote advantages of shape"):
        run_tiny(tmp_path / "g.toml", tmp_path / "runs")
