"""`flowrl run` killed with SIGKILL resumes with --resume and finishes: the checkpoint it resumed
from is intact, a half-written checkpoint is removed, and metrics.jsonl / samples.jsonl hold
every step once.

The run kills itself at an exact place (`FLOWRL_KILL_AT`, flowrl/runtime/faults.py), so the
test does not depend on timing: in the middle of a checkpoint write, and after a step was
logged but before its checkpoint."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import ROOT, tiny_overrides

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

STEPS = 5


def digest(directory: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def steps_logged(path: Path) -> Counter:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return Counter(r["step"] for r in rows if "event" not in r)


@pytest.mark.parametrize(
    "kill_at, save_every", [("checkpoint:3", 1), ("logged:3", 2)], ids=["mid-checkpoint", "logged"]
)
def test_sigkill_then_resume(tmp_path, kill_at, save_every):
    overrides = tiny_overrides(
        "grpo.toml",
        tmp_path,
        **{"run.steps": STEPS, "run.save_every": save_every, "run.keep_checkpoints": 10},
    )
    command = [sys.executable, "-m", "flowrl.cli", "run", str(ROOT / "graphs/grpo.toml")]
    command += ["--backend", "local", *overrides]
    env = {**os.environ, "FLOWRL_KILL_AT": kill_at}
    killed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]

    (run_dir,) = tmp_path.glob("grpo-*")
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*"))[-1] == "step_000002"
    temps = list(checkpoints.glob(".tmp-*"))
    assert len(temps) == (1 if kill_at.startswith("checkpoint") else 0)
    assert steps_logged(run_dir / "metrics.jsonl")[3] == 1  # step 3 was logged before the kill
    before = digest(checkpoints / "step_000002")

    resumed = subprocess.run(
        [*command[:5], "--resume", str(run_dir), *command[5:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    assert ("did not finish" in resumed.stdout) == bool(temps)
    assert not list(checkpoints.glob(".tmp-*"))
    assert digest(checkpoints / "step_000002") == before  # untouched by the resume
    assert (checkpoints / f"step_{STEPS:06d}").is_dir()
    every_step_once = {step: 1 for step in range(STEPS + 1)}  # step 0: validation
    assert dict(steps_logged(run_dir / "metrics.jsonl")) == every_step_once
    samples = steps_logged(run_dir / "samples.jsonl")
    assert set(samples) == set(range(1, STEPS + 1))
    assert len(set(samples.values())) == 1  # the same number of samples for every step
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"event": "resume", "step": 2} in events


def starter(tmp_path, graph: str, backend: str, extra: dict):
    """start(folder, *more args, **env): `flowrl run` of the tiny `graph` with `extra`, its run
    directory under tmp_path / folder."""
    command = [sys.executable, "-m", "flowrl.cli", "run", str(ROOT / "graphs" / graph)]
    command += ["--backend", backend]

    def start(folder: str, *more, **env):
        overrides = tiny_overrides(graph, tmp_path / folder, **extra)
        environment = {**os.environ, **env}
        return subprocess.run(
            [*command, *more, *overrides], cwd=tmp_path, env=environment, capture_output=True
        )

    return start


def whole_and_killed(start, tmp_path) -> Path:
    """Run it whole (in "whole"), then killed once step 3 is logged (in "killed"); the killed
    run's directory."""
    whole = start("whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = start("killed", FLOWRL_KILL_AT="logged:3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (run_dir,) = (tmp_path / "killed").glob("grpo_disaggregated-*")
    return run_dir


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_sigkill_then_resume_with_staleness_one(tmp_path, backend):
    """run.staleness = 1: the checkpoint of step 2 keeps the queued batch of step 3 (generated
    with the weights of update 1, which no checkpoint holds); the resumed run trains on it and
    equals an uninterrupted run, step for step."""
    from test_async import comparable

    extra = {"run.steps": STEPS, "run.save_every": 2, "run.keep_checkpoints": 10}
    extra |= {"run.staleness": 1, "run.num_cpus": 2}
    start = starter(tmp_path, "grpo_disaggregated.toml", backend, extra)
    run_dir = whole_and_killed(start, tmp_path)
    kept = run_dir / "checkpoints/step_000002"
    assert [p.name for p in (kept / "queue").iterdir()] == ["step_000003.pt"]
    queue = json.loads((kept / "controller.json").read_text())["queue"]
    assert [(q["step"], q["version"]) for q in queue] == [(3, 1)]
    resumed = start("killed", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    every_step_once = {step: 1 for step in range(STEPS + 1)}
    assert dict(steps_logged(run_dir / "metrics.jsonl")) == every_step_once
    (reference,) = (tmp_path / "whole").glob("grpo_disaggregated-*")
    assert comparable(run_dir) == comparable(reference)
