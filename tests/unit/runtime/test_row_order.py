"""Nodes that change the rows (generate with n samples, filters) are ordered against every
other node; a refilling filter's step samples more prompt batches; a partial walk of a plan
keeps each pool's transitions in order."""

from functools import partial
from pathlib import Path

import networkx as nx
import torch

from flowrl import testing
from flowrl.protocol import DataProto
from flowrl.runtime.executor import LEFT_PADDED, Executor
from flowrl.runtime.local_executor import LocalExecutor
from flowrl.runtime.node_call import CallResult, Timed
from flowrl.runtime.refill import first_groups, refilled_step

TOY = Path(__file__).resolve().parents[2] / "support" / "toy"
GOOD = (TOY / "good.toml.template").read_text()  # a graph of the toy nodes; {toy} is TOY
compile_text = partial(testing.compile_text, toy=TOY)
problems = partial(testing.graph_problems, toy=TOY)


# a filter between the reward and the rest; `early` reads only the responses and sits above
# the filter in the file, `late` reads the same and sits below it
FILTERED = (
    GOOD.replace(
        "[nodes.old_logprob]",
        """[nodes.early]
uses = "{toy}/lp.py"
model = "policy"
rename = {{ logprobs = "early_logprobs" }}

[nodes.filter]
uses = "filter.dynamic_sampling"

[nodes.late]
uses = "{toy}/lp.py"
model = "policy"
rename = {{ logprobs = "late_logprobs" }}

[nodes.old_logprob]""",
    )
    + """
[nodes.reads_both]
uses = "{toy}/train.py"
model = "policy"
rename = {{ old_logprobs = "early_logprobs", ref_logprobs = "late_logprobs" }}
"""
)


def position(plan, name):
    return [i.name for i in plan.items].index(name)


def test_filter_runs_before_every_node_below_it_and_after_those_above(tmp_path):
    plan = compile_text(tmp_path, FILTERED)
    dag = plan.graph.dag
    # early and late read nothing the filter writes: only the row edges order them
    assert dag.edges["early", "filter"]["kind"] == "rows"
    assert dag.edges["filter", "late"]["kind"] == "rows"
    # every other node is ordered with the filter, one way or the other
    related = nx.ancestors(dag, "filter") | nx.descendants(dag, "filter")
    assert related == set(plan.spec.nodes) - {"filter"}
    assert position(plan, "collect:early") < position(plan, "filter")
    for reader in ("late", "old_logprob", "ref_logprob", "advantage", "update"):
        dispatch = plan.item(f"dispatch:{reader}" if reader != "advantage" else reader)
        assert plan.item("filter").id in ancestors(plan, dispatch.id)


def ancestors(plan, item_id):
    by_id = {i.id: i for i in plan.items}
    seen, todo = set(), [item_id]
    while todo:
        for dep in by_id[todo.pop()].deps:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


PROMPT_ONLY = (
    'rename = {{ responses = "prompts", response_mask = "prompt_mask", logprobs = "ref_logprobs" }}'
)
REF = """[nodes.ref_logprob]
uses = "{toy}/lp.py"
model = "ref"
"""


def test_a_node_the_samples_do_not_reach_runs_on_the_side_of_generate_it_is_written(tmp_path):
    # ref_logprob reads only dataset keys here; the file's order says whether it runs on the
    # prompts (above generate: its output is repeated to the samples) or on the samples
    below = GOOD.replace(REF + 'rename = {{ logprobs = "ref_logprobs" }}', REF + PROMPT_ONLY)
    plan = compile_text(tmp_path, below)
    assert plan.graph.dag.edges["generate", "ref_logprob"]["kind"] == "rows"
    assert plan.batch.rows_per_node["ref_logprob"] == 8  # 2 prompts x 4 samples
    assert position(plan, "collect:generate") < position(plan, "dispatch:ref_logprob")
    above = below.replace(REF + PROMPT_ONLY, "").replace(
        "[nodes.generate]", REF + PROMPT_ONLY + "\n\n[nodes.generate]"
    )
    plan = compile_text(tmp_path, above)
    assert plan.graph.dag.edges["ref_logprob", "generate"]["kind"] == "rows"
    assert plan.batch.rows_per_node["ref_logprob"] == 2  # the prompts
    assert position(plan, "collect:ref_logprob") < position(plan, "dispatch:generate")


def test_refill_plan_and_its_text(tmp_path):
    plan = compile_text(tmp_path, FILTERED, ["nodes.filter.min_groups=3"])
    refill = plan.refill
    assert refill.node == "filter" and (refill.groups, refill.rounds) == (3, 4)
    assert refill.before == ("generate", "score", "early", "filter")
    assert set(refill.after) == set(plan.spec.nodes) - set(refill.before)
    assert "refill: generate, score, early, filter run on up to 4 prompt batches" in plan.text()
    # after the filter at most 3 groups x 4 samples remain
    assert plan.batch.rows_per_node["late"] == 12
    assert plan.batch.rows_per_node["early"] == 8


def test_a_refill_that_cannot_be_reached_is_a_check_error(tmp_path):
    found = problems(tmp_path, FILTERED, ["nodes.filter.min_groups=9", "nodes.filter.max_rounds=4"])
    assert [p.where for p in found] == ["[nodes.filter]"]
    assert "can never be reached: 4 prompt batches of 2 prompts hold 8 groups" in found[0].message


# -- a partial walk keeps each pool's transitions in order -----------------------------------


class Recording(Executor):
    """One rank per pool; records every call and transition; a call returns zeros for its
    node's writes (n rows per row for a repeat node)."""

    def __init__(self, plan):
        super().__init__(plan)
        self.log = []

    def pools(self):
        return list(self.plan.pools)

    def ranks(self, pool):
        return 1

    def submit(self, pool, method, per_rank_args):
        args = per_rank_args[0]
        if method == "transition":
            self.log.append((args[0], args[1], args[2]))
            return [Timed(None, 0.0, 0.0)]
        node, chunk = args[0], args[1]
        self.log.append(("call", node))
        decl = self.spec.nodes[node]
        rows = len(chunk) * (decl.params.n if decl.spec.rows == "repeat" else 1)
        writes = {k: torch.ones(rows, 3, dtype=torch.long) for k in decl.writes}
        return [CallResult(DataProto.from_dict(writes), {}, 0.0, 0.0)]

    def finished(self, handles):
        return handles

    def results(self, handle):
        return handle


def prompts(uids, width=3):
    uid = torch.tensor(uids)
    return DataProto.from_dict(
        {
            "prompts": torch.ones(len(uid), width, dtype=torch.long),
            "prompt_mask": torch.ones(len(uid), width, dtype=torch.long),
            "uid": uid,
        }
    )


def test_a_partial_walk_moves_models_in_plan_order_around_the_calls_it_runs(tmp_path):
    plan = compile_text(tmp_path, GOOD)  # offload = "always": every call reloads its model
    executor = Recording(plan)
    executor.run_step(prompts([0, 1]), only={"generate", "score"})
    log = executor.log
    assert ("call", "generate") in log and all(e[0] != "call" or e[1] == "generate" for e in log)
    assert all(e[1] != "ref" for e in log)  # no running call uses the reference: never moved
    call = log.index(("call", "generate"))
    # the policy's weights are on the device for generate and leave only after it
    before = [e for e in log[:call] if e[1] == "policy"]
    assert before and before[-1][0] == "reload" and "weights" in before[-1][2]
    assert not any(e[0] == "offload" and "weights" in e[2] for e in before)
    # the walk ends with the pool as a whole step leaves it: the policy offloaded
    assert log[-1][0] == "offload" and log[-1][1] == "policy"


# -- a refilling step ------------------------------------------------------------------------

REFILL = """
[run]
steps = 1

[data]
batch_size = 2

[nodes.sample]
uses = "{toy}/sample.py"
n = 2

[nodes.score]
uses = "{toy}/score.py"

[nodes.filter]
uses = "filter.dynamic_sampling"
min_groups = 3
max_rounds = 4

[nodes.advantage]
uses = "{toy}/seen.py"
"""


def test_refilled_step_samples_until_enough_groups_then_trims(tmp_path):
    plan = compile_text(tmp_path, REFILL)
    executor = LocalExecutor(plan)
    # uids: even ones give all-equal groups (dropped); 1 and 3 are kept, then 5 and 7
    batches = {1: prompts([4, 5], width=5), 2: prompts([7, 6], width=1)}
    asked = []

    def more(round_):
        asked.append(round_)
        batch = batches[round_]
        batch.meta["round"] = round_
        return batch

    result = refilled_step(executor, plan.refill, prompts([0, 1]), more)
    out, metrics, slices = result.batch, result.metrics, result.slices
    # round 0 keeps uid 1, round 1 uid 5, round 2 uid 7: 3 groups, no fourth batch asked
    assert asked == [1, 2]
    assert metrics["refill/rounds"] == 3 and metrics["refill/groups"] == 3
    assert out["uid"].tolist() == [1, 1, 5, 5, 7, 7]
    assert "advantages" in out and metrics["refill/rows"] == 6
    assert executor.node_state["advantage"]["rows"] == 6  # the rest of the step ran once
    # rounds had responses of width 2, 3 and 4: right-padded; prompts of width 3, 5, 1: left
    assert out["responses"].shape == (6, 4) and out["prompts"].shape == (6, 5)
    assert out["response_mask"].sum(-1).tolist() == [2, 2, 3, 3, 4, 4]
    assert out["prompt_mask"][:, :2].sum() == 2 * 2  # only the width-5 round's rows reach col 0
    assert [s.name for s in slices].count("sample") == 3
    assert [s.name for s in slices].count("advantage") == 1


def test_refill_stops_at_max_rounds_and_skips_the_rest_when_nothing_is_kept(tmp_path):
    plan = compile_text(tmp_path, REFILL, ["nodes.filter.max_rounds=2"])
    result = refilled_step(
        LocalExecutor(plan), plan.refill, prompts([0, 2]), lambda r: prompts([4, 6])
    )
    out, metrics, slices = result.batch, result.metrics, result.slices
    assert metrics["refill/rounds"] == 2 and len(out) == 0
    assert "advantage" not in [s.name for s in slices]  # no update on an empty batch


def test_first_groups_and_padded_concat():
    batch = DataProto.from_dict({"uid": torch.tensor([3, 3, 1, 1, 2, 2])})
    assert first_groups(batch, 2)["uid"].tolist() == [3, 3, 1, 1]
    a = DataProto.from_dict(
        {"prompts": torch.tensor([[7, 8]]), "responses": torch.tensor([[1, 2, 3]])}
    )
    b = DataProto.from_dict(
        {"prompts": torch.tensor([[9, 9, 9]]), "responses": torch.tensor([[4]])}
    )
    both = DataProto.concat_padded([a, b], LEFT_PADDED)
    assert both["prompts"].tolist() == [[0, 7, 8], [9, 9, 9]]  # left-padded
    assert both["responses"].tolist() == [[1, 2, 3], [4, 0, 0]]  # right-padded
