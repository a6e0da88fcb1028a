"""Recovery's costs: the time to recover from each kind of fault, and what being able to recover
costs a run in which nothing fails.

    python bench/recovery.py faults   -o bench/results/recovery_faults.json
    python bench/recovery.py overhead --baseline c3c5f8b -o bench/results/recovery_overhead.json

`faults`: a Ray test cluster on this machine (a head and three raylets of one CPU each, as
tests/integration/test_recovery.py), the tiny disaggregated GRPO run (8 steps, a checkpoint
every 2) once without a fault, then once per fault kind. For each: the recovery's own time
(every pool made again and the checkpoint loaded: the `recovery` event's `seconds`), the time
from the fault to the recovery's start (how long the loss took to be noticed), the run's extra
wall time over the unfailed run (both, plus the steps run again), and whether every logged
value equals the unfailed run's.

`overhead`: the same tiny run without faults (`flowrl run --tiny`, Ray on this machine), at
this tree and at `--baseline` (a commit before recovery, checked out in a temporary worktree),
alternated `--reps` times; the median step time and whole-command wall time of each, and
their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # conftest's tiny_overrides
from equality import is_timing, rows  # noqa: E402 (bench/, beside this file)

GRAPH = "grpo_disaggregated.toml"
SETTINGS = {
    "run.steps": 8,
    "run.save_every": 2,
    "run.keep_checkpoints": 10,
    "run.restart_backoff_s": 0,
    "run.restart_wait_s": 60,
}
FAULTS = {  # kind -> (FLOWRL_KILL_AT, extra settings)
    "rollout rank killed": ("gen.0.generate:5", {}),
    "train rank killed": ("train.0.update_policy:5", {}),
    "killed in a weight sync": ("train.0.export:5", {}),
    "killed in a checkpoint write": ("gen.0.save:6", {}),
    "rank stops answering": ("gen.0.generate:5:HANG", {"run.call_timeout_s": 10}),
    "node lost": ("train.0.update_policy:5:NODE", {}),  # last: the cluster keeps 2 raylets
}


def comparable(run_dir: Path) -> list[dict]:
    """metrics.jsonl's step rows without the machine's figures (bench/equality.py's)."""
    return [
        {k: v for k, v in r.items() if not is_timing(k)} for r in rows(run_dir) if "event" not in r
    ]


def fit(cluster, run_dir: Path, faults: str, marks: Path, extra: dict) -> float:
    import ray
    from conftest import tiny_overrides

    from flowrl.cli import load_plan
    from flowrl.runtime.controller import Trainer

    env = {"FLOWRL_KILL_AT": faults, "FLOWRL_FAULTS_ONCE": str(marks)} if faults else {}
    marks.mkdir(parents=True, exist_ok=True)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=False)
    overrides = tiny_overrides(GRAPH, run_dir.parent, **{**SETTINGS, **extra})
    plan = load_plan(str(ROOT / "graphs" / GRAPH), overrides)
    start = time.monotonic()
    trainer = Trainer(plan, run_dir, "ray")
    try:
        trainer.fit()
    finally:
        trainer.close()
    return time.monotonic() - start


def faults() -> dict:
    from ray.cluster_utils import Cluster

    fast = {
        "health_check_initial_delay_ms": 0,
        "health_check_period_ms": 500,
        "health_check_failure_threshold": 3,
    }
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": fast})
    for _ in range(3):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    result = {"settings": SETTINGS, "graph": GRAPH, "kinds": {}}
    try:
        with tempfile.TemporaryDirectory() as folder:
            base = Path(folder)
            wall = fit(cluster, base / "unfailed" / "run", "", base / "none", {})
            reference = comparable(base / "unfailed" / "run")
            result["unfailed_wall_s"] = round(wall, 2)
            print(f"unfailed: {wall:.1f} s", flush=True)
            for kind, (fault, extra) in FAULTS.items():
                name = kind.replace(" ", "_")
                run_dir, marks = base / name / "run", base / name / "marks"
                wall = fit(cluster, run_dir, fault, marks, extra)
                rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
                (event,) = [r for r in rows if r.get("event") == "recovery"]
                (mark,) = marks.iterdir()
                entry = {
                    "fault": fault,
                    "what": event["what"],
                    "noticed_after_s": round(event["time"] - mark.stat().st_mtime, 2),
                    "recovery_s": event["seconds"],
                    "steps_run_again": event["step"] - event["restored_step"],
                    "extra_wall_s": round(wall - result["unfailed_wall_s"], 2),
                    "values_equal_unfailed": comparable(run_dir) == reference,
                }
                result["kinds"][kind] = entry
                print(f"{kind}: {entry}", flush=True)
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    return result


def worktree(commit: str, folder: Path) -> Path:
    """`commit` checked out in `folder`, its nodes/ and graphs/ reachable as flowrl.nodes and
    flowrl.graphs without installing it."""
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(folder), commit], cwd=ROOT, check=True
    )
    for name in ("nodes", "graphs"):
        (folder / "flowrl" / name).symlink_to(folder / name)
    return folder


def one_run(tree: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "flowrl.cli", "run", str(tree / "graphs" / GRAPH), "--tiny"]
    command += ["run.steps=8", f'run.out_dir="{out}"']
    start = time.monotonic()
    subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True)
    wall = time.monotonic() - start
    (run_dir,) = out.iterdir()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["time_s"] for r in rows if "time_s" in r][1:]  # the first warms up
    return {"wall_s": wall, "median_step_s": statistics.median(steps)}


def overhead(baseline: str, reps: int) -> dict:
    runs = {"this tree": [], f"baseline {baseline}": []}
    with tempfile.TemporaryDirectory() as folder:
        base = worktree(baseline, Path(folder) / "baseline")
        try:
            trees = {"this tree": ROOT, f"baseline {baseline}": base}
            for rep in range(reps):
                for name, tree in trees.items():
                    out = Path(folder) / f"{rep}-{name.split()[0]}"
                    out.mkdir()
                    runs[name].append(one_run(tree, out))
                    print(f"{name} #{rep}: {runs[name][-1]}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    summary = {
        name: {
            "median_step_s": statistics.median(r["median_step_s"] for r in rs),
            "median_wall_s": statistics.median(r["wall_s"] for r in rs),
            "runs": rs,
        }
        for name, rs in runs.items()
    }
    this, before = summary["this tree"], summary[f"baseline {baseline}"]
    summary["step_ratio"] = this["median_step_s"] / before["median_step_s"]
    summary["wall_ratio"] = this["median_wall_s"] / before["median_wall_s"]
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("faults", "overhead"))
    p.add_argument("--baseline", default="c3c5f8b", help="a commit before recovery")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("-o", "--out", type=Path)
    args = p.parse_args()
    result = faults() if args.what == "faults" else overhead(args.baseline, args.reps)
    result["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    result["cpu"] = _cpu()
    result["load_1min_after"] = os.getloadavg()[0]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
