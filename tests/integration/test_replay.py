"""A failed node call keeps its inputs and is replayed in-process (flowrl/runtime/replay.py);
a healthy step's saved update, replayed, gives the metrics the run logged."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, tiny_overrides

from flowrl import cli
from flowrl.protocol import DataProto
from flowrl.runtime import replay
from flowrl.runtime.controller import Trainer
from flowrl.runtime.node_call import NodeFailure

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

FAILING = Path(__file__).resolve().parents[1] / "support" / "toy" / "failing_update.py"
ERROR = "ValueError: update_policy: a deliberate failure at step 2"


def failing_run(tmp_path, *extra) -> list[str]:
    """`flowrl run` arguments: tiny GRPO whose update raises at step 2."""
    return [
        "run",
        str(ROOT / "graphs" / "grpo.toml"),
        *tiny_overrides("grpo.toml", tmp_path),
        f'nodes.update_policy.uses="{FAILING}"',
        "nodes.update_policy.fail_at_step=2",
        "run.steps=3",
        "run.save_every=1",
        "run.val_size=0",
        *extra,
    ]


def replay_cli(*args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flowrl.cli", "replay", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_failure_on_ray_is_saved_and_replayed(tmp_path, monkeypatch, capsys):
    seen, real = [], replay.in_this_process  # the error `flowrl run --pdb` handled
    monkeypatch.setattr(replay, "in_this_process", lambda e: seen.append(e) or real(e))
    monkeypatch.setattr(replay, "post_mortem", lambda e: pytest.fail("no debugger on Ray"))
    argv = failing_run(tmp_path, "pools.main.workers=2", "--backend", "ray", "--pdb")
    assert cli.main(argv) == 1
    [run_dir] = [p for p in tmp_path.iterdir() if p.name.startswith("grpo-")]
    command = f"flowrl replay {run_dir} --step 2 --node update_policy --rank 0"
    # the message ends with the command that replays the failed call
    [error] = seen
    assert str(error).splitlines()[-1] == f"  replay it: {command}"
    assert ERROR in str(error)
    err = capsys.readouterr().err
    assert "--pdb: the node failed in a Ray worker process" in err and command in err
    # both ranks kept what they received; saving inputs of healthy steps is off by default
    for rank in (0, 1):
        saved = run_dir / "failures" / f"step_2_update_policy_rank{rank}"
        info = json.loads((saved / "call.json").read_text())
        assert (info["step"], info["state_step"], info["rank"], info["world_size"]) == (
            2,
            1,
            rank,
            2,
        )
        assert info["error"] == ERROR and "failing_update.py" in info["traceback"]
        assert info["params"]["fail_at_step"] == 2
        batch = DataProto.load(saved / "batch.pt")
        assert len(batch) == 8 and batch.meta["step"] == 2  # 2 prompts x 8 samples, half
        assert "advantages" in batch and "ref_logprobs" in batch
    assert not (run_dir / "inputs").exists()

    # in-process, the same exception from the node's own code
    with pytest.raises(NodeFailure) as info:
        replay.load(run_dir, 2, "update_policy", rank=1).run()
    cause = replay.innermost(info.value)
    assert f"{type(cause).__name__}: {cause}" == ERROR
    assert cause.__traceback__.tb_next is not None  # frames of the node, for a debugger
    frames = []
    tb = cause.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    assert frames[-1] == str(FAILING)

    # the CLI: the failure again, then "fixed" by a param override: it runs and prints
    failed = replay_cli(run_dir, "--step", 2, "--node", "update_policy")
    assert failed.returncode == 1, failed.stderr
    assert ERROR in failed.stderr and str(FAILING) in failed.stderr
    fixed = replay_cli(
        run_dir, "--step", 2, "--node", "update_policy", "nodes.update_policy.fail_at_step=0"
    )
    assert fixed.returncode == 0, fixed.stderr
    assert "model state: step_000001" in fixed.stdout
    assert "the run had 2 ranks on this pool; rank 0 runs here alone" in fixed.stdout
    assert "outputs: none" in fixed.stdout and "  pg_loss: " in fixed.stdout
    assert "  grad_norm: " in fixed.stdout
    rank1 = replay.load(run_dir, 2, "update_policy", 1, ["nodes.update_policy.fail_at_step=0"])
    assert any("the run had 2 ranks" in note for note in rank1.notes)
    metrics = rank1.run().metrics
    assert metrics["grad_norm"] > 0


def test_ray_worker_failure_is_not_in_this_process():
    ray_exceptions = pytest.importorskip("ray.exceptions")
    remote = NodeFailure("call update_policy failed on pool main, rank 0")
    remote.__cause__ = ray_exceptions.RayTaskError("call", "traceback", ValueError("x"))
    assert isinstance(remote.__cause__, ray_exceptions.RayError)
    local = NodeFailure("node update_policy failed")
    local.__cause__ = ValueError("x")
    assert not replay.in_this_process(remote) and replay.in_this_process(local)


def test_run_pdb_on_the_local_executor_debugs_the_failed_frame(tmp_path, monkeypatch):
    debugged = []
    monkeypatch.setattr("pdb.post_mortem", debugged.append)
    argv = failing_run(tmp_path, "nodes.update_policy.fail_at_step=1", "--backend", "local")
    assert cli.main([*argv, "--pdb"]) == 1
    [tb] = debugged
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_filename == str(FAILING)  # where the node raised
    assert tb.tb_frame.f_locals["step"] == 1


def test_replayed_healthy_update_gives_the_logged_metrics(tiny_plan, tmp_path):
    extra = {
        "run.steps": 3,
        "run.save_every": 1,
        "run.keep_checkpoints": 3,
        "run.val_size": 0,
        "run.save_inputs": '["update_policy", "advantage"]',
        "run.save_inputs_last": 2,
    }
    plan = tiny_plan("grpo.toml", **extra)
    run_dir = tmp_path / "run"
    trainer = Trainer(plan, run_dir, "local")
    try:
        trainer.fit()
    finally:
        trainer.close()
    logged = {
        row["step"]: row
        for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }
    # the last 2 steps are kept, step 1's inputs were pruned
    assert sorted(p.name for p in (run_dir / "inputs").iterdir()) == [
        "step_2_advantage_rank0",
        "step_2_update_policy_rank0",
        "step_3_advantage_rank0",
        "step_3_update_policy_rank0",
    ]
    assert not (run_dir / "failures").exists()
    replayed = {}
    for step in (2, 3):
        call = replay.load(run_dir, step, "update_policy")
        # step N's update started from the weights after step N-1: checkpoint N-1
        assert f"model state: step_{step - 1:06d}" in call.notes
        metrics = call.run().metrics
        replayed[step] = metrics
        expected = {
            k.split("/", 1)[1]: v for k, v in logged[step].items() if k.startswith("update_policy/")
        }
        assert set(metrics) == set(expected)
        for key, value in expected.items():
            assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    # the comparison can tell steps apart (the loss terms changed from step 2 to 3)
    assert replayed[2]["kl_loss"] != pytest.approx(replayed[3]["kl_loss"], rel=1e-3)
    # a controller node's saved call replays too
    writes = replay.load(run_dir, 3, "advantage").run().writes
    assert writes.keys() == ["advantages"] and writes["advantages"].shape[0] == 16
