"""What a node call keeps for `flowrl replay` (flowrl/runtime/inputs.py through call_node), the
run.save_inputs settings, and loading a run's graph against its original folder."""

import json
import shutil
from functools import partial
from pathlib import Path

import attrs
import pytest
import torch

from flowrl import testing
from flowrl.front import dsl
from flowrl.nodespec import NodeSpec
from flowrl.protocol import DataProto
from flowrl.runtime import inputs, replay
from flowrl.runtime.node_call import NodeCall, NodeFailure, call_node

TOY = Path(__file__).resolve().parents[2] / "support" / "toy"
GOOD = (TOY / "good.toml.template").read_text()  # a graph of the toy nodes; {toy} is TOY
write = partial(testing.write_graph, toy=TOY)
compile_text = partial(testing.compile_text, toy=TOY)
problems = partial(testing.graph_problems, toy=TOY)


@attrs.frozen
class Params:
    scale: float = 2.0


def scaled(batch, params):
    return {"advantages": batch["scores"] * params.scale}


SPEC = NodeSpec(("scores",), ("advantages",), Params, fn=scaled)
RENAME = {"scores": "my_scores"}  # declared key -> graph key


def batch_of(*scores):
    return DataProto.from_dict({"my_scores": torch.tensor(scores)}, meta={"step": 3})


def call(batch, run, record, node="shaping", rank=0):
    saver = record.saver(node, "shaping.py", Params(), rank, 2)
    return call_node(
        NodeCall(node, SPEC, RENAME, Params(), "here"), batch, run, {"rank": rank}, saver
    )


def broken(view):
    raise ZeroDivisionError("no rows")


def test_a_failed_call_keeps_its_graph_keyed_batch_and_ends_with_the_replay_command(tmp_path):
    record = inputs.Recording(str(tmp_path), step=3, state_step=2)
    with pytest.raises(NodeFailure) as info:
        call(batch_of(1.0, 2.0), broken, record, rank=1)
    saved = tmp_path / "failures" / "step_3_shaping_rank1"
    last = str(info.value).splitlines()[-1]
    assert last == f"  replay it: flowrl replay {tmp_path} --step 3 --node shaping --rank 1"
    kept = DataProto.load(saved / "batch.pt")
    assert kept.keys() == ["my_scores"]  # as dispatched: graph keys, before the renames
    torch.testing.assert_close(kept["my_scores"], torch.tensor([1.0, 2.0]))
    assert kept.meta == {"step": 3}  # the rank is in call.json, not added to the batch
    info = json.loads((saved / "call.json").read_text())
    assert info["params"] == {"scale": 2.0} and info["uses"] == "shaping.py"
    assert (info["step"], info["state_step"], info["rank"], info["world_size"]) == (3, 2, 1, 2)
    assert info["error"] == "ZeroDivisionError: no rows"
    assert "def broken" not in info["traceback"] and "in broken" in info["traceback"]
    assert not (tmp_path / "inputs").exists()  # nothing kept of healthy calls by default


def test_a_call_returning_the_wrong_keys_is_kept_too(tmp_path):
    record = inputs.Recording(str(tmp_path), step=1, state_step=0)
    with pytest.raises(NodeFailure, match="missing: advantages") as info:
        call(batch_of(1.0), lambda view: {}, record)
    assert str(info.value).endswith("--step 1 --node shaping --rank 0")
    assert (tmp_path / "failures" / "step_1_shaping_rank0" / "batch.pt").is_file()


def test_healthy_inputs_are_kept_only_for_named_nodes_and_before_the_call(tmp_path):
    def in_place(view):  # a node that changes its input: the saved copy must not see it
        view["scores"].mul_(10)
        return scaled(view, Params())

    off = inputs.Recording(str(tmp_path), 1, 0)
    call(batch_of(1.0, 2.0), in_place, off)
    assert not (tmp_path / "inputs").exists()
    on = inputs.Recording(str(tmp_path), 1, 0, keep=("shaping",))
    call(batch_of(1.0, 2.0), in_place, on)
    kept = DataProto.load(tmp_path / "inputs" / "step_1_shaping_rank0" / "batch.pt")
    torch.testing.assert_close(kept["my_scores"], torch.tensor([1.0, 2.0]))
    validation = inputs.Recording(str(tmp_path), 2, 2, keep=("shaping",), validation=True)
    call(batch_of(1.0), in_place, validation)
    assert not (tmp_path / "inputs" / "step_2_shaping_rank0").exists()


def test_healthy_inputs_keep_the_last_steps_of_their_own_node_and_rank(tmp_path):
    for step in range(1, 5):
        keep = ("shaping", "my_shaping")
        record = inputs.Recording(str(tmp_path), step, step - 1, keep, keep_last=2)
        call(batch_of(1.0), lambda v: scaled(v, Params()), record)
        if step == 1:
            call(batch_of(1.0), lambda v: scaled(v, Params()), record, rank=1)
            call(batch_of(1.0), lambda v: scaled(v, Params()), record, node="my_shaping")
    assert sorted(p.name for p in (tmp_path / "inputs").iterdir()) == [
        "step_1_my_shaping_rank0",  # another node: pruned only by its own calls
        "step_1_shaping_rank1",  # another rank: likewise
        "step_3_shaping_rank0",
        "step_4_shaping_rank0",
    ]


def test_find_prefers_a_failure_and_lists_what_is_saved(tmp_path):
    for kind in ("inputs", "failures"):
        (tmp_path / kind / "step_2_update_rank0").mkdir(parents=True)
        (tmp_path / kind / "step_2_update_rank0" / "call.json").write_text("{}")
    assert inputs.find(tmp_path, 2, "update", 0) == tmp_path / "failures/step_2_update_rank0"
    shutil.rmtree(tmp_path / "failures")
    assert inputs.find(tmp_path, 2, "update", 0) == tmp_path / "inputs/step_2_update_rank0"
    with pytest.raises(FileNotFoundError, match=r"saved: inputs/step_2_update_rank0"):
        inputs.find(tmp_path, 3, "update", 0)


def test_stateful_controller_node_state_is_kept(tmp_path):
    record = inputs.Recording(str(tmp_path), 1, 0)
    saver = record.saver("shaping", "s.py", Params(), state={"seen": 5})
    with pytest.raises(NodeFailure):
        call_node(
            NodeCall("shaping", SPEC, RENAME, Params(), ""), batch_of(1.0), broken, None, saver
        )
    saved = tmp_path / "failures" / "step_1_shaping_rank0" / "state.pt"
    assert torch.load(saved, weights_only=False) == {"seen": 5}


def test_save_inputs_must_name_nodes_of_the_graph(tmp_path):
    plan = compile_text(tmp_path, GOOD, ['run.save_inputs=["update"]'])
    assert plan.spec.run.save_inputs == ["update"] and plan.spec.run.save_inputs_last == 1
    found = problems(tmp_path, GOOD, ['run.save_inputs=["updte"]'])
    assert len(found) == 1 and 'save_inputs names "updte"' in found[0].message
    assert 'did you mean "update"' in found[0].message
    twice = problems(tmp_path, GOOD, ['run.save_inputs=["update", "update"]'])
    assert "must be a list of distinct node ids" in twice[0].message
    assert problems(tmp_path, GOOD, ["run.save_inputs_last=0"])


def test_a_run_graph_loads_against_its_original_folder(tmp_path):
    relative = GOOD.replace('"{toy}/adv.py"', '"nodes/adv.py"')
    source = tmp_path / "project"
    (source / "nodes").mkdir(parents=True)
    shutil.copy(TOY / "adv.py", source / "nodes" / "adv.py")
    graph = write(tmp_path, relative, "graph.toml")  # as in a run directory, away from nodes/
    with pytest.raises(Exception, match="no node file"):
        dsl.load(graph)
    spec = dsl.load(graph, base_dir=source)
    assert spec.base_dir == source and spec.nodes["advantage"].uses == "nodes/adv.py"


def test_replay_params_are_the_saved_ones_unless_overridden():
    @attrs.frozen
    class Decl:  # the parts of a dsl.NodeDecl that _params reads
        id: str
        spec: NodeSpec
        params: Params

    decl = Decl("shaping", SPEC, Params(scale=7.0))  # what the graph says now
    saved = {"scale": 3.0, "gone": 1}  # a field the node no longer has is dropped
    assert replay._params(decl, saved, []) == Params(scale=3.0)
    assert replay._params(decl, saved, ["nodes.shaping.scale=7.0"]) == Params(scale=7.0)
    assert replay._params(decl, saved, ["nodes.other.scale=7.0"]) == Params(scale=3.0)


def test_replay_of_a_stateful_controller_node_restores_its_state_and_params(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "graph.toml").write_text(
        GOOD.format(toy=TOY).replace(f'"{TOY}/adv.py"', '"counting_adv.py"')
    )
    (run_dir / "run.json").write_text(json.dumps({"base_dir": str(TOY)}))  # where it ran from
    counting = replay.load_plan(run_dir).spec.nodes["advantage"]
    batch = DataProto.from_dict(
        {"scores": torch.tensor([1.0, 2.0])}, {"uid": ["a", "a"]}, {"step": 5}
    )
    record = inputs.Recording(str(run_dir), step=5, state_step=4)
    params = counting.spec.params(scale=3.0)
    state = {"calls": 3}  # the node's state when step 5 ran: 3 calls before
    saver = record.saver("advantage", "counting_adv.py", params, state=state)
    with pytest.raises(NodeFailure):  # the call fails: its batch, params and state are kept
        call_node(NodeCall("advantage", counting.spec, {}, params, ""), batch, broken, None, saver)
    call = replay.load(run_dir, 5, "advantage")
    assert call.params.scale == 3.0 and "node state: as saved with the call" in call.notes
    writes = call.run().writes
    # 4th call, scale 3: [1, 2] * 4 * 3
    torch.testing.assert_close(writes["advantages"], torch.tensor([12.0, 24.0]))
