"""Several pools on Ray: concurrent pools, disaggregated rollout with weight sync, and pools
spanning the nodes of a multi-node Ray test cluster."""

import json

import pytest
import torch

from flowrl.runtime.controller import Trainer
from flowrl.testing import on_ranks, parameters, rank_host

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ray = pytest.importorskip("ray")


def calls_by_track(run_dir, kind: str = "call") -> dict:
    """trace.json -> {track name: [(item name, start us, end us)]} for the pools' slices of a
    kind (calls, by default)."""
    trace = json.loads((run_dir / "trace.json").read_text())
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    out = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == kind:
            track = names[(e["pid"], e["tid"])]
            out.setdefault(track, []).append((e["name"], e["ts"], e["ts"] + e["dur"]))
    return out


def test_ref_on_its_own_pool_overlaps_the_other_pools(tiny_plan, tmp_path):
    plan = tiny_plan(
        "ppo_pools.toml",
        **{"run.num_cpus": 3, "data.batch_size": 4, "nodes.generate.max_new_tokens": 12},
    )
    assert ("ref_logprob", ("reward", "old_logprob", "values")) in plan.overlaps
    trainer = Trainer(plan, tmp_path / "run", "ray")
    try:
        trainer.fit()
    finally:
        trainer.close()
    tracks = calls_by_track(tmp_path / "run")
    assert {"actor/rank0", "ref/rank0", "critic/rank0"} <= set(tracks)
    refs = [(start, end) for name, start, end in tracks["ref/rank0"] if name == "ref_logprob"]
    overlapping = [
        (track, name)
        for start, end in refs
        for track, slices in tracks.items()
        if track != "ref/rank0"
        for name, s, e in slices
        if s < end and start < e  # the two intervals intersect
    ]
    assert overlapping, f"ref_logprob ran alone: {tracks}"


def test_disaggregated_rollout_generates_with_the_synced_weights(tiny_plan, tmp_path):
    plan = tiny_plan("grpo_disaggregated.toml", **{"run.num_cpus": 2})
    sync = plan.item("sync:policy")
    assert (sync.pool, sync.to_pool) == ("train", "gen")
    assert "policy: weights train -> rollout on pool gen" in plan.text()
    assert plan.item("generate").pool == "gen" and plan.item("update_policy").pool == "train"
    trainer = Trainer(plan, tmp_path / "run", "ray")
    try:
        executor = trainer.executor
        before = on_ranks(executor, "gen", parameters, "policy")[0]
        trainer.fit()
        trained = on_ranks(executor, "train", parameters, "policy")[0]
        served = on_ranks(executor, "gen", parameters, "policy")[0]
        assert trained.keys() == served.keys()
        for key, value in trained.items():
            assert torch.equal(value, served[key]), key  # bit for bit
        assert any(not torch.equal(before[k], served[k]) for k in before)  # it did change
        # the gen pool loaded a frozen copy: no optimizer there
        assert "frozen" in plan.pools["gen"].model_lines["policy"]
        assert "optimizer" not in plan.pools["gen"].memory_bytes["policy"]
        tracks = calls_by_track(tmp_path / "run")
        assert [n for n, *_ in tracks["gen/rank0"]] == ["generate"] * 2
        # each sync is timed whole: the export on the train pool after its update, then the
        # gen pool's load (the transfer between them), before the next generate
        syncs = calls_by_track(tmp_path / "run", "sync")
        exports, loads = syncs["train/rank0"], syncs["gen/rank0"]
        assert [n for n, *_ in exports] == ["export:policy"] * 2
        assert [n for n, *_ in loads] == ["sync:policy"] * 2
        updates = [(s, e) for n, s, e in tracks["train/rank0"] if n == "update_policy"]
        generates = [s for n, s, _ in tracks["gen/rank0"]]
        later = generates[1:] + [float("inf")]
        for update, export, load, after in zip(updates, exports, loads, later, strict=True):
            assert update[1] <= export[1] <= export[2] <= load[1] <= load[2] <= after
        logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
        assert all(r["timing_s/export:policy"] > 0 for r in logged if "time_s" in r)
    finally:
        trainer.close()


def test_disaggregated_rollout_resumes_with_the_checkpointed_weights(tiny_plan, tmp_path):
    plan = tiny_plan("grpo_disaggregated.toml", **{"run.num_cpus": 2})
    first = Trainer(plan, tmp_path / "run", "local")
    try:
        first.fit()
        trained = parameters(first.executor.workers["train"][0], "policy")
    finally:
        first.close()
    resumed = Trainer(plan, tmp_path / "run", "local")
    try:
        resumed._resume(None)
        served = parameters(resumed.executor.workers["gen"][0], "policy")
        for key, value in trained.items():
            assert torch.equal(value, served[key]), key
    finally:
        resumed.close()


@pytest.fixture
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster, [n.node_id for n in nodes]
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_pool_spanning_two_nodes_places_a_rank_on_each(tiny_plan, tmp_path, two_node_cluster):
    from ray.util import placement_group_table

    _, worker_nodes = two_node_cluster
    plan = tiny_plan(
        "grpo.toml", **{"pools.main.workers": 2, "pools.main.nodes": 2, "data.batch_size": 2}
    )
    main = plan.pools["main"]
    assert main.placement == "STRICT_SPREAD" and main.ranks_by_node == ((0,), (1,))
    assert "placement: STRICT_SPREAD over 2 nodes (node 0: rank 0; node 1: rank 1)" in plan.text()
    trainer = Trainer(plan, tmp_path / "run", "ray")
    try:
        ranks = [w["node_id"] for w in on_ranks(trainer.executor, "main", rank_host)]
        table = placement_group_table(trainer.executor.groups["main"])["bundles_to_node_id"]
        assert ranks == [table[i] for i in sorted(table)]  # rank k runs on bundle k's node
        assert sorted(ranks) == sorted(worker_nodes)  # one on each worker node
        trainer.fit()
        lines = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
        assert json.loads(lines[-1])["step"] == 2
    finally:
        trainer.close()
