"""Recovery on a multi-node Ray test cluster (a head and three raylets on this machine): a rank
killed (rollout or train), a rank that stops answering, a whole raylet lost, during a weight
sync and during a checkpoint write, twice in one run; each run finishes every step once, with
its recovery events, and its values equal those of a run that never failed. A fault that
recurs at the same point stops the run with its cause.

Faults fire at exact points (`FLOWRL_KILL_AT`, flowrl/runtime/faults.py), each once
(`FLOWRL_FAULTS_ONCE`), through the job's environment: every rank of the run gets it."""

import json
from collections import Counter

import pytest
from test_async import comparable

from flowrl.runtime.controller import Trainer
from flowrl.runtime.recovery import RecoveryStop

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ray = pytest.importorskip("ray")

STEPS = 5
DISAGGREGATED = "grpo_disaggregated.toml"
# one pool of two ddp ranks, one on each of two nodes: their gradients meet in a collective
DDP = {"pools.main.workers": 2, "pools.main.nodes": 2, "data.batch_size": 2}
SETTINGS = {
    "run.steps": STEPS,
    "run.save_every": 2,
    "run.keep_checkpoints": 10,
    "run.restart_backoff_s": 0,
    "run.restart_wait_s": 60,
}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    fast = {  # a lost raylet is noticed within ~2 s, not the default ~30 s
        "health_check_initial_delay_ms": 0,
        "health_check_period_ms": 500,
        "health_check_failure_threshold": 3,
    }
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": fast})
    for _ in range(3):  # a node each for the train and gen pools, and one to spare
        made.add_node(num_cpus=1)
    made.wait_for_nodes()
    yield made
    if ray.is_initialized():
        ray.shutdown()
    made.shutdown()


def run(cluster, tiny_plan, run_dir, faults="", marks=None, graph=DISAGGREGATED, **extra):
    """A tiny run on the cluster (the disaggregated GRPO graph unless told), with `faults`
    (FLOWRL_KILL_AT, each fired once: marks in `marks`); the run directory."""
    env = {"FLOWRL_KILL_AT": faults} if faults else {}
    if marks is not None:
        marks.mkdir(exist_ok=True)
        env["FLOWRL_FAULTS_ONCE"] = str(marks)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=cluster.address, runtime_env={"env_vars": env})
    plan = tiny_plan(graph, **{**SETTINGS, **extra})
    trainer = Trainer(plan, run_dir, "ray")
    try:
        trainer.fit()
    finally:
        trainer.close()
    return run_dir


def unfailed_run(cluster, folder, graph=DISAGGREGATED, **extra) -> list[dict]:
    from conftest import ROOT, tiny_overrides

    from flowrl.cli import load_plan

    def plan(graph, **more):
        return load_plan(str(ROOT / "graphs" / graph), tiny_overrides(graph, folder, **more))

    return comparable(run(cluster, plan, folder / "run", graph=graph, **extra))


@pytest.fixture(scope="module")
def unfailed(cluster, tmp_path_factory):
    """The run without a fault: what every recovered run must equal."""
    return unfailed_run(cluster, tmp_path_factory.mktemp("unfailed"))


def events(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == "recovery"]


def assert_like_unfailed(run_dir, unfailed, recoveries: int) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = Counter(r["step"] for r in rows if "event" not in r)
    assert steps == {s: 1 for s in range(STEPS + 1)}  # every step once; step 0: validation
    samples = Counter(json.loads(x)["step"] for x in (run_dir / "samples.jsonl").open())
    assert set(samples) == set(range(1, STEPS + 1)) and len(set(samples.values())) == 1
    assert comparable(run_dir) == unfailed  # every value of every step
    found = events(run_dir)
    assert len(found) == recoveries, found
    return found


def test_a_rollout_rank_and_a_train_rank_killed_in_one_run(cluster, tiny_plan, tmp_path, unfailed):
    faults = "gen.0.generate:1,train.0.update_policy:4"  # before the first checkpoint; after it
    run_dir = run(cluster, tiny_plan, tmp_path / "run", faults, tmp_path / "marks")
    first, second = assert_like_unfailed(run_dir, unfailed, recoveries=2)
    assert (first["step"], first["lost"], first["what"]) == (1, "pool gen, rank 0", "died")
    assert first["restored_from"] == "the run's start (no checkpoint yet)"
    assert (second["step"], second["lost"], second["restored_step"]) == (4, "pool train, rank 0", 2)
    assert second["restored_from"] == "checkpoint step_000002" and second["seconds"] > 0
    assert "pid" in first["where"] and "update_policy" in second["cause"]


def test_killed_during_a_weight_sync_and_a_checkpoint_write(cluster, tiny_plan, tmp_path, unfailed):
    faults = "train.0.export:1,gen.0.save:4"
    run_dir = run(cluster, tiny_plan, tmp_path / "run", faults, tmp_path / "marks")
    sync, save = assert_like_unfailed(run_dir, unfailed, recoveries=2)
    assert "weights" in sync["cause"] and sync["lost"] == "pool train, rank 0"
    assert save["step"] == 4 and "save" in save["cause"] and save["restored_step"] == 2
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_000002", "step_000004", "step_000005"]  # no temp left


def test_a_ddp_rank_killed_while_its_peer_waits_in_the_collective(cluster, tiny_plan, tmp_path):
    """Rank 1 dies in its update: rank 0's all-reduce fails on the lost peer (gloo), and the
    rank named lost is the dead one, not the one whose call failed first."""
    reference = unfailed_run(cluster, tmp_path / "unfailed", "grpo.toml", **DDP)
    faults = "main.1.update_policy:3"
    run_dir = run(
        cluster, tiny_plan, tmp_path / "run", faults, tmp_path / "marks", "grpo.toml", **DDP
    )
    (event,) = assert_like_unfailed(run_dir, reference, recoveries=1)
    assert (event["lost"], event["what"], event["restored_step"]) == (
        "pool main, rank 1",
        "died",
        2,
    )


def test_a_lost_node_and_a_rank_that_stops_answering(cluster, tiny_plan, tmp_path, unfailed):
    faults = "train.0.update_policy:2:NODE,gen.0.generate:3:HANG"
    marks = tmp_path / "marks"
    run_dir = run(cluster, tiny_plan, tmp_path / "run", faults, marks, **{"run.call_timeout_s": 8})
    node, hang = assert_like_unfailed(run_dir, unfailed, recoveries=2)
    assert node["what"] == "node lost" and node["lost"] == "pool train, rank 0"
    assert hang["what"] == "no answer" and "run.call_timeout_s = 8 s" in hang["cause"]
    ray.init(address=cluster.address)  # the run's close shut its connection down
    alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
    assert len(alive) == 2  # the run finished on the two raylets left


def test_lost_while_the_pools_start_and_during_the_first_validation(
    cluster, tiny_plan, tmp_path, unfailed
):
    """A rank lost while the models load is made again at once; one lost in the validation
    before the first step sends the run back to its start, and validation runs again."""
    faults = "gen.0.load:0,gen.0.generate:0"
    run_dir = run(cluster, tiny_plan, tmp_path / "run", faults, tmp_path / "marks")
    (event,) = assert_like_unfailed(run_dir, unfailed, recoveries=1)
    assert (event["step"], event["restored_step"]) == (0, 0)
    assert len(list((tmp_path / "marks").iterdir())) == 2  # both faults fired


def test_a_fault_that_recurs_at_the_same_point_stops_the_run(cluster, tiny_plan, tmp_path):
    # no FLOWRL_FAULTS_ONCE: the rank dies there every time, as a deterministic crash would
    with pytest.raises(RecoveryStop, match="same fault stopped step 3 again") as stopped:
        run(cluster, tiny_plan, tmp_path / "run", "gen.0.generate:3")
    assert "--resume" in str(stopped.value) and "step_000002" in str(stopped.value)
    (only,) = events(tmp_path / "run")  # the first was recovered from
    assert only["step"] == 3


def test_max_restarts_zero_stops_at_the_first_lost_rank(cluster, tiny_plan, tmp_path):
    with pytest.raises(RecoveryStop, match=r"pool gen, rank 0.*run.max_restarts = 0"):
        run(cluster, tiny_plan, tmp_path / "run", "gen.0.generate:1", **{"run.max_restarts": 0})
    assert events(tmp_path / "run") == []


def test_lost_ranks_under_run_staleness_one(cluster, tiny_plan, tmp_path):
    """The rollout stage runs a step ahead in its own thread: a train rank lost while it
    generates, then a rollout rank lost while the trainer checkpoints; its thread ends before
    the pools are made again, and the queue comes back from the checkpoint."""
    ahead = {"run.staleness": 1}
    reference = unfailed_run(cluster, tmp_path / "unfailed", **ahead)
    faults = "train.0.update_policy:2,gen.0.generate:4"
    run_dir = run(cluster, tiny_plan, tmp_path / "run", faults, tmp_path / "marks", **ahead)
    events = assert_like_unfailed(run_dir, reference, recoveries=2)
    assert {e["lost"] for e in events} == {"pool train, rank 0", "pool gen, rank 0"}


def test_flowrl_run_on_a_cluster_named_by_ray_address_recovers(cluster, tmp_path):
    """The command line on a running cluster (RAY_ADDRESS): the fault reaches the ranks through
    the job's environment, the run recovers and says so on the console."""
    import os
    import subprocess
    import sys

    from conftest import ROOT, tiny_overrides

    if ray.is_initialized():
        ray.shutdown()
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "RAY_ADDRESS": cluster.address, "FLOWRL_FAULTS_ONCE": str(marks)}
    env["FLOWRL_KILL_AT"] = "gen.0.generate:2"
    overrides = tiny_overrides(DISAGGREGATED, tmp_path, **SETTINGS)
    command = [sys.executable, "-m", "flowrl.cli", "run", str(ROOT / "graphs" / DISAGGREGATED)]
    done = subprocess.run(
        [*command, *overrides], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pool gen, rank 0 died" in done.stdout + done.stderr
    (run_dir,) = tmp_path.glob("grpo_disaggregated-*")
    (event,) = events(run_dir)
    assert (event["step"], event["lost"]) == (2, "pool gen, rank 0")
