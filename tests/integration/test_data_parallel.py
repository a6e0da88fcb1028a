"""Data parallelism on CPU: one update on a 2-rank Ray pool (gloo) equals the 1-rank update."""

import pytest
import torch
from conftest import fixed_batch

from flowrl.runtime.local_executor import LocalExecutor
from flowrl.runtime.node_call import NodeFailure
from flowrl.testing import on_ranks, parameters

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ray = pytest.importorskip("ray")


def test_two_ranks_match_one_rank(tiny_plan):
    from flowrl.runtime.ray_executor import RayExecutor

    lr = 1e-4
    batch = fixed_batch()  # 7 rows: ranks get 4 and 3
    plan1 = tiny_plan("grpo.toml", **{"models.policy.lr": lr})
    local = LocalExecutor(plan1)
    before = parameters(local.workers["main"][0], "policy")
    one = local.workers["main"][0].call("update_policy", batch).metrics
    expected = parameters(local.workers["main"][0], "policy")

    plan2 = tiny_plan(
        "grpo.toml", **{"models.policy.lr": lr, "pools.main.workers": 2, "run.num_cpus": 2}
    )
    executor = RayExecutor(plan2, num_cpus=2)
    try:
        handle = executor.submit(
            "main", "call", [("update_policy", c, None) for c in batch.chunk(2)]
        )
        results = executor.results(handle)
        ranks = on_ranks(executor, "main", parameters, "policy")
        # the loss and the summed gradient's norm agree to float precision
        for key in ("pg_loss", "kl_loss", "grad_norm"):
            assert results[0].metrics[key] == pytest.approx(one[key], rel=1e-4), key
            assert results[1].metrics[key] == results[0].metrics[key]
        for key, value in expected.items():
            assert torch.equal(ranks[0][key], ranks[1][key])  # the ranks stay in lockstep
            # AdamW's first step is about lr * sign(grad): equal up to a sign flip of a
            # gradient entry at rounding level, hence the tolerance of 2 lr
            torch.testing.assert_close(ranks[0][key], value, atol=2 * lr, rtol=0)
            assert not torch.equal(before[key], value)
    finally:
        executor.shutdown()


def test_dead_rank_is_named(tiny_plan):
    from flowrl.runtime.ray_executor import RayExecutor
    from flowrl.runtime.recovery import LostWorker

    plan = tiny_plan("grpo.toml", **{"run.num_cpus": 2})
    executor = RayExecutor(plan, num_cpus=2)
    try:
        ray.kill(executor.actors["main"][0])
        batch = fixed_batch()
        with pytest.raises(
            NodeFailure, match="update_policy failed on pool main, rank 0: the rank's process died"
        ) as raised:
            executor.results(executor.submit("main", "call", [("update_policy", batch, None)]))
        # an infrastructure fault, which the trainer recovers from (docs/recovery.md)
        assert isinstance(raised.value, LostWorker) and raised.value.what == "died"
        assert (raised.value.pool, raised.value.rank) == ("main", 0)
    finally:
        executor.shutdown()
