"""SIGTERM or SIGINT (Ctrl-C) in the middle of a checkpoint write stops the run cleanly: the
partial checkpoint is not published, the message says how to resume, and --resume finishes."""

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
    overrides = tiny_overrides("grpo.toml", tmp_path, **{"run.steps": 3, "run.save_every": 1})
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
