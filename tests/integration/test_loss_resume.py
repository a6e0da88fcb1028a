"""A loss's state across a kill and --resume: docs/extending.md's adaptive-KL loss (beta
doubled or halved after each step) in graphs/ppo.toml, killed with SIGKILL after step 3 was
logged (its last checkpoint: step 2), resumed, has the beta of an uninterrupted run at every
step; a beta kept at module level would restart from its first value."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from flowrl import testing

pytestmark = pytest.mark.slow  # runs flowrl in child processes

PAGE = (ROOT / "docs/extending.md").read_text()
STEPS = 4


def block(kind: str, first_line: str) -> str:
    blocks = re.findall(rf"```{kind}\n(.*?)```", PAGE, flags=re.S)
    return next(b for b in blocks if first_line in b)


def graph(folder: Path) -> Path:
    """graphs/ppo.toml with the page's update node, beside the page's adaptive_kl.py."""
    folder.mkdir()
    (folder / "adaptive_kl.py").write_text(block("python", "# adaptive_kl.py"))
    text = (ROOT / "graphs/ppo.toml").read_text()
    start = text.index("[nodes.update_policy]")
    end = text.find("\n[", start + 1)
    node = block("toml", 'loss = "adaptive_kl.py:ADAPTIVE_KL"')
    (folder / "ppo_kl.toml").write_text(text[:start] + node + (text[end:] if end > 0 else ""))
    return folder / "ppo_kl.toml"


def run(folder: Path, *extra: str, env=None) -> subprocess.CompletedProcess:
    toml = folder / "ppo_kl.toml"
    overrides = testing.tiny_overrides(
        toml,
        folder / "runs",
        **{
            "run.steps": STEPS,
            "run.save_every": 2,
            "run.keep_checkpoints": 10,
            "run.critic_warmup": 0,
        },
    )
    command = [sys.executable, "-m", "flowrl.cli", "run", str(toml), *extra]
    command += ["--backend", "local", *overrides]
    env = {**os.environ, **(env or {})}
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def betas(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["update_policy/loss_state/beta"] for r in rows if "time_s" in r}


def test_beta_after_a_kill_and_resume_equals_the_uninterrupted_runs(tmp_path):
    straight_folder, killed_folder = tmp_path / "straight", tmp_path / "killed"
    graph(straight_folder), graph(killed_folder)
    straight = run(straight_folder)
    assert straight.returncode == 0, straight.stderr[-2000:]
    (straight_dir,) = (straight_folder / "runs").iterdir()
    expected = betas(straight_dir)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert len(set(expected.values())) > 1, expected  # beta moved: the test can tell a reset

    killed = run(killed_folder, env={"FLOWRL_KILL_AT": "logged:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (run_dir,) = (killed_folder / "runs").iterdir()
    saved = json.loads((run_dir / "checkpoints/step_000002/nodes-main.json").read_text())
    assert saved == {"update_policy": {"loss": {"beta": expected[2]}}}

    resumed = run(killed_folder, "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert betas(run_dir) == expected
    final = run_dir / f"checkpoints/step_{STEPS:06d}/nodes-main.json"
    assert json.loads(final.read_text())["update_policy"]["loss"]["beta"] == expected[STEPS]
