"""How a step's batch is made (flowrl/runtime/steps.py): one source per way, chosen from the
plan; the prompt feed every source reads (feed.py); the one weight path between pools
(weights.py). The sources on the tiny model: tests/integration/test_async.py,
test_partial_rollouts.py, test_tiny_runs.py."""

from pathlib import Path

import pytest
import torch

from flowrl.front.compiler import compile_file
from flowrl.front.pipeline import version
from flowrl.protocol import DataProto
from flowrl.runtime import steps, weights
from flowrl.runtime.executor import StepResult
from flowrl.runtime.feed import PromptFeed
from flowrl.runtime.node_call import Timed

GRAPHS = Path(__file__).resolve().parents[3] / "graphs"
ASYNC = ("run.staleness=1", "nodes.generate.return_logprobs=true", "nodes.update_policy.tis_cap=2")


class Loader:
    """A prompt loader that counts the batches it gave."""

    learns = False  # its sampler ignores results (the uniform one's way)

    def __init__(self):
        self.read = 0

    def __next__(self):
        self.read += 1
        return DataProto.from_dict({"prompts": torch.full((2, 3), self.read)})

    def state_dict(self):
        return {"read": self.read}


class Walks:
    """An executor that keeps what each walk was asked."""

    def __init__(self):
        self.walks = []

    def run_step(self, batch, only=None, record=None):
        self.walks.append((batch.meta["step"], only, record.state_step))
        return StepResult(batch, {}, [])


def feed(tmp_path, keep=()):
    return PromptFeed(Loader(), {"seed": 3}, tmp_path, keep, 2)


@pytest.mark.parametrize(
    ("graph", "overrides", "kind"),
    [
        ("grpo.toml", (), steps.Walk),
        ("ppo.toml", ("run.critic_warmup=2",), steps.Walk),
        ("dapo.toml", (), steps.Refill),
        ("grpo_disaggregated.toml", ASYNC, steps.Pipelined),
        ("grpo_disaggregated.toml", (*ASYNC, "run.partial_rollout=8"), steps.Pipelined),
    ],
)
def test_each_plan_gets_its_way_of_making_a_step(tmp_path, graph, overrides, kind):
    plan = compile_file(str(GRAPHS / graph), list(overrides))
    assert type(steps.source(Walks(), plan, feed(tmp_path), tokenizer=None)) is kind


def test_the_critic_warmup_walks_the_critic_alone_then_the_whole_plan(tmp_path):
    plan = compile_file(str(GRAPHS / "ppo.toml"), ["run.critic_warmup=2"])
    executor = Walks()
    source = steps.source(executor, plan, feed(tmp_path), tokenizer=None)
    for step in (1, 2, 3):
        source.next(step)
    warmup = set(plan.spec.nodes) - set(plan.after_warmup)
    assert "update_policy" not in warmup and "update_critic" in warmup
    # each step reads its own prompts and sees the weights after the step before
    assert executor.walks == [(1, warmup, 0), (2, warmup, 1), (3, None, 2)]
    assert source.checkpoint(3) is None  # nothing to keep beside the models and the loader


def test_the_feed_produces_prompts_meta_and_where_their_calls_keep_inputs(tmp_path):
    prompts = feed(tmp_path, keep=("generate",))
    batch, loader, record = prompts.produce(5, 3)  # prompt batch 5 on the weights of update 3
    assert batch.meta == {"seed": 3, "step": 5} and loader == {"read": 1}
    assert (record.step, record.state_step, record.keep, record.keep_last) == (
        5,
        3,
        ("generate",),
        2,
    )
    assert record.run_dir == str(tmp_path.resolve()) and not record.validation
    assert prompts.next(5, round_=2).meta == {"seed": 3, "step": 5, "round": 2}
    checking = prompts.record(5, 5, validation=True)  # validation keeps failures only
    assert checking.keep == () and checking.validation


def test_one_version_rule_for_batches_and_rounds():
    # staleness 2: the first three batches on the initial weights, then two updates behind
    assert [version(done, 2, 0) for done in range(6)] == [0, 0, 0, 1, 2, 3]
    assert version(4, 2, 3) == 3  # never older than the weights a resume started with


class Pools:
    """An executor whose ranks answer export and import as a pool worker does."""

    def __init__(self):
        self.submitted = []

    def ranks(self, pool):
        return {"train": 2, "gen": 3}[pool]

    def submit(self, pool, method, args):
        self.submitted.append((pool, method, args))
        if method == "export_weights":
            return [Timed({"w": 1.0}, 1.0, 2.0), Timed(None, 1.0, 2.0)]
        return [Timed((1.0, 2.0), 3.0, 4.0 + rank) for rank in range(len(args))]

    def rank0_output(self, handle):
        return handle[0]

    def results(self, handle):
        return handle


def test_a_weight_transfer_exports_on_every_train_rank_and_loads_on_every_rollout_rank():
    pools = Pools()
    sliced = weights.sent(pools, "policy", "train", "gen")
    exported = pools.submitted[0][2]
    assert [(p, m) for p, m, _ in pools.submitted] == [
        ("train", "export_weights"),
        ("gen", "import_weights"),
    ]
    assert exported == [("policy",)] * 2  # under fsdp every rank gathers the shards
    loads = pools.submitted[1][2]
    assert len(loads) == 3 and all(a == ("policy", loads[0][1]) for a in loads)
    assert loads[0][1].value == {"w": 1.0}  # rank 0's export, passed on as it came
    # the export on train's rank 0 (its times from the loads' answer), then each load
    assert [(s.name, s.track, s.start, s.end) for s in sliced] == [
        ("export:policy", "train/rank0", 1.0, 2.0),
        ("sync:policy", "gen/rank0", 3.0, 4.0),
        ("sync:policy", "gen/rank1", 3.0, 5.0),
        ("sync:policy", "gen/rank2", 3.0, 6.0),
    ]
    # weights exported before (the pipeline's) are sent without a second export
    pools.submitted.clear()
    weights.sent(pools, "policy", "train", "gen", weights=Timed({"w": 2.0}, 0.0, 0.5))
    assert [m for _, m, _ in pools.submitted] == ["import_weights"]
