"""SIGINT (Ctrl-C), or SIGTERM with run.term_grace_s = 0, in the middle of a checkpoint write
stops the run cleanly: the partial checkpoint is not published, the message says how to resume,
and --resume finishes. SIGTERM with a grace period (the default, as a spot or cluster scheduler
sends it) finishes the step, writes a checkpoint there (with the sampler's state and
run.staleness's queue) and stops; --resume then gives the values of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_overrides

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models


@pytest.mark.parametrize("backend, sig", [("local", "TERM"), ("ray", "INT")])
def test_signal_mid_checkpoint_stops_cleanly(tmp_path, backend, sig):
    settings = {"run.steps": 3, "run.save_every": 1, "run.term_grace_s": 0}
    overrides = tiny_overrides("grpo.toml", tmp_path, **settings)
    command = [sys.executable, "-m", "flowrl.cli", "run", str(ROOT / "graphs/grpo.toml")]
    command += ["--backend", backend, *overrides]
    env = {**os.environ, "FLOWRL_KILL_AT": f"checkpoint:2:{sig}"}
    stopped = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert f"stopped by SIG{sig}" in stopped.stderr and "Traceback" not in stopped.stderr
    (run_dir,) = tmp_path.glob("grpo-*")
    assert f"--resume {run_dir}" in stopped.stderr
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001"]  # no temp, no 2

    resumed = subprocess.run(
        [*command[:5], "--resume", str(run_dir), *command[5:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [
        json.loads(x).get("step")
        for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "event" not in json.loads(x)
    ]
    assert steps == [0, 1, 2, 3]
    assert signal.SIGTERM  # the module is used for the signal names above


@pytest.mark.parametrize("point", ["logged:3", "checkpoint:2"], ids=["mid-step", "mid-checkpoint"])
def test_sigterm_checkpoints_at_the_next_safe_point_then_resumes_equal(tmp_path, point):
    """run.staleness = 1 and a learning sampler: the checkpoint SIGTERM writes keeps the queued
    batch and the sampler's state, and the resumed run equals one never stopped."""
    from test_async import comparable
    from test_kill_resume import starter

    extra = {"run.steps": 5, "run.save_every": 2, "run.keep_checkpoints": 10}
    extra |= {"run.staleness": 1, "run.num_cpus": 2, "data.sampler": '"pass_rate"'}
    start = starter(tmp_path, "grpo_disaggregated.toml", "local", extra)
    whole = start("whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    stopped = start("stopped", FLOWRL_KILL_AT=f"{point}:TERM")
    stderr = stopped.stderr.decode()
    assert stopped.returncode == 1, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr and "Traceback" not in stderr
    (run_dir,) = (tmp_path / "stopped").glob("grpo_disaggregated-*")
    step = int(point.split(":")[1])
    kept = run_dir / "checkpoints" / f"step_{step:06d}"
    assert f"The last checkpoint, {kept}, is intact" in stderr
    assert sorted(p.name for p in kept.parent.iterdir())[-1] == kept.name  # no later, no temp
    state = json.loads((kept / "controller.json").read_text())
    assert [q["step"] for q in state["queue"]] == [step + 1]  # the batch made ahead
    assert state["loader"]["sampler"]  # the sampler's own state
    resumed = start("stopped", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    (reference,) = (tmp_path / "whole").glob("grpo_disaggregated-*")
    assert comparable(run_dir) == comparable(reference)
