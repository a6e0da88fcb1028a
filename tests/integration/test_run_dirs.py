"""Run directories and resumes as a user meets them, through the CLI on the tiny model: two
starts at once, two resumes at once, a refused start, a signal before any checkpoint, a full
disk, a damaged checkpoint and a changed graph.

Races are made exact without timing: a run pauses itself (SIGSTOP, FLOWRL_KILL_AT=...:STOP)
right after it locked its directory, the test waits for that pause with waitpid(WUNTRACED),
runs the rival command, then lets the first go on (SIGCONT)."""

import json
import os
import resource
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import ROOT, tiny_overrides

from flowrl.runtime import checkpoint

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

GRAPH = str(ROOT / "graphs/grpo.toml")


def command(tmp_path, *args, **extra) -> list[str]:
    overrides = tiny_overrides("grpo.toml", tmp_path / "runs", **extra)
    return [
        sys.executable,
        "-m",
        "flowrl.cli",
        "run",
        GRAPH,
        "--backend",
        "local",
        *overrides,
        *args,
    ]


def flowrl(cmd, env=None, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, **kw)


def steps_logged(run_dir: Path) -> Counter:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Counter(r["step"] for r in rows if "event" not in r)


def clean(result) -> str:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr


def test_two_runs_started_at_once_get_a_directory_each(tmp_path):
    cmd = command(tmp_path)
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in "ab"]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [e[-2000:] for _, e in outputs]
    run_dirs = sorted((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        assert steps_logged(run_dir) == Counter({0: 1, 1: 1, 2: 1})
        assert (run_dir / "checkpoints" / "step_000002" / "manifest.json").is_file()


def test_a_second_resume_of_a_run_in_progress_is_refused(tmp_path):
    first = flowrl(command(tmp_path, **{"run.save_every": 1}))
    assert first.returncode == 0, first.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    resume = command(tmp_path, "--resume", str(run_dir), **{"run.save_every": 1, "run.steps": 3})
    env = {**os.environ, "FLOWRL_KILL_AT": "locked:0:STOP"}
    holder = subprocess.Popen(resume, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, status = os.waitpid(holder.pid, os.WUNTRACED)  # paused, its lock held
        assert os.WIFSTOPPED(status)
        rival = flowrl(resume)
        assert rival.returncode == 1
        assert f"in use by another flowrl process (pid {holder.pid}" in clean(rival)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    _, err = holder.communicate(timeout=600)
    assert holder.returncode == 0, err[-2000:]
    assert steps_logged(run_dir) == Counter({0: 1, 1: 1, 2: 1, 3: 1})  # nothing lost or twice


def test_a_refused_start_creates_nothing(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    refused = flowrl(command(tmp_path, **{"data.source": f'"{tmp_path / "empty.jsonl"}"'}))
    assert refused.returncode == 1
    assert f"{tmp_path / 'empty.jsonl'}: the file is empty" in clean(refused)
    assert not (tmp_path / "runs").exists()


def test_sigterm_in_the_first_step_stops_without_claiming_a_checkpoint(tmp_path):
    (tmp_path / "stop.py").write_text(
        "import os, signal\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # arrives inside a node call\n"
        "    return 0.0\n"
    )
    scorer = f'"{tmp_path / "stop.py"}:compute_score"'
    stopped = flowrl(
        command(tmp_path, **{"nodes.reward.scorer": scorer, "nodes.reward.workers": 0})
    )
    assert stopped.returncode == 1
    err = clean(stopped)
    assert "stopped by SIGTERM" in err and "no checkpoint was written yet" in err
    assert "intact" not in err and "failed" not in err
    assert not list((tmp_path / "runs").glob("*/failures"))  # no failure dump for a signal


def test_a_full_disk_names_what_failed_and_leaves_no_half_checkpoint(tmp_path):
    def small_files():  # every file the run writes may hold 100 kB, a checkpoint's more
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    full = flowrl(command(tmp_path, **{"run.save_every": 1}), preexec_fn=small_files)
    assert full.returncode == 1
    err = clean(full)
    assert "the checkpoint of step 1 could not be written" in err and "File too large" in err
    assert "no complete checkpoint was written before" in err
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert list((run_dir / "checkpoints").iterdir()) == []  # no temp, no half checkpoint


def test_a_damaged_checkpoint_is_refused_and_the_complete_one_offered(tmp_path):
    extra = {"run.save_every": 1, "run.keep_checkpoints": 5}
    assert flowrl(command(tmp_path, **extra)).returncode == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    (run_dir / "checkpoints" / "step_000002" / "pool-main.pt").unlink()
    refused = flowrl(command(tmp_path, "--resume", str(run_dir), **extra))
    assert refused.returncode == 1
    err = clean(refused)
    good = run_dir / "checkpoints" / "step_000001"
    assert "step_000002 is incomplete or corrupted: pool-main.pt is missing" in err
    assert f"--resume {good}" in err
    resumed = flowrl(command(tmp_path, "--resume", str(good), **extra))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert steps_logged(run_dir) == Counter({0: 1, 1: 1, 2: 1})
    assert checkpoint.problems(run_dir / "checkpoints" / "step_000002") == []  # written anew
    assert len(list((run_dir / "checkpoints").glob(".superseded-step_000002-*"))) == 1


def test_a_changed_graph_is_refused_unless_allowed(tmp_path):
    assert flowrl(command(tmp_path)).returncode == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    changed = command(tmp_path, "--resume", str(run_dir), **{"run.seed": 7, "run.steps": 3})
    refused = flowrl(changed)
    assert refused.returncode == 1
    err = clean(refused)
    assert "run.seed: 0 -> 7" in err and "run.steps: " not in err and "--allow-graph-change" in err
    allowed = flowrl([*changed, "--allow-graph-change"])
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "run.seed: 0 -> 7" in allowed.stdout and "run.steps: 2 -> 3" in allowed.stdout
    assert "seed = 7" in (run_dir / "graph.toml").read_text()  # the next resume compares to it


@pytest.mark.parametrize("given", ["missing", "metrics.jsonl"])
def test_resume_of_a_wrong_path_creates_nothing(tmp_path, given):
    assert flowrl(command(tmp_path)).returncode == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    before = sorted(p for p in tmp_path.rglob("*"))
    refused = flowrl(command(tmp_path, "--resume", str(run_dir / given)))
    assert refused.returncode == 1
    words = "no such directory" if given == "missing" else "this is a file, not a run directory"
    assert f"--resume {run_dir / given}: {words}" in clean(refused)
    assert sorted(p for p in tmp_path.rglob("*")) == before
