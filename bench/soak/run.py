"""Soak test (`make soak`): a long tiny-model run with a flaky scorer, killed and resumed.

300 steps of graphs/grpo.toml on the tiny random model, local executor, a scorer that fails on
about 5% of rows; the run is SIGKILLed every 50 steps (alternately in the middle of a checkpoint
write and just after a step was logged) and resumed with --resume. A second, uninterrupted run
with the same seed and the same failures is the reference. Checked at the end:

- every step is in metrics.jsonl exactly once;
- the controller's memory (RSS) and open file descriptors are flat: the last 50 steps' median
  within 10% / equal to that of steps 51-100 (after warm-up);
- the final weights equal the uninterrupted run's, bit for bit;
- the uninterrupted run, started twice at once, gets two directories, each complete (the same
  weights);
- the last resume, raced by a second resume of the same directory, holds it: the second is
  refused naming the first's pid (the first pauses after its lock, FLOWRL_KILL_AT=locked:0:STOP,
  so the race does not depend on timing).

With --staleness K > 0 the run is graphs/grpo_disaggregated.toml with run.staleness = K (the
rollout stage running K steps ahead, its queue kept in every checkpoint): the same checks.

Writes bench/results/soak.json (soak_staleness<K>.json) and prints a summary; exits non-zero if
a condition fails.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCORER = Path(__file__).with_name("flaky_scorer.py")
GRAPH = {"graph": ROOT / "graphs/grpo.toml", "stem": "grpo", "pools": ["main"], "train": "main"}


def use_staleness(k: int) -> None:
    """Soak the disaggregated graph with run.staleness = k (k = 0: grpo.toml, as always)."""
    if k:
        GRAPH.update(
            graph=ROOT / "graphs/grpo_disaggregated.toml",
            stem="grpo_disaggregated",
            pools=["train", "gen"],
            train="train",
            staleness=k,
        )


def overrides(out_dir: Path, steps: int, every: int = 10) -> list[str]:
    pools = [f"pools.{name}.cpus_per_worker=1" for name in GRAPH["pools"]]
    if GRAPH.get("staleness"):
        pools.append(f"run.staleness={GRAPH['staleness']}")
    return [
        *pools,
        'models.policy.path="tiny"',
        'models.ref.path="tiny"',
        "models.policy.lr=0.01",
        f"run.steps={steps}",
        "run.val_size=4",
        "run.val_every=0",
        f"run.save_every={every}",
        "run.keep_checkpoints=2",
        "data.batch_size=2",
        "data.train_size=64",
        "nodes.generate.max_new_tokens=6",
        f'nodes.reward.scorer="{SCORER}:compute_score"',
        "nodes.reward.timeout_s=30",
        f'run.out_dir="{out_dir}"',
    ]


def flowrl(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flowrl.cli", "run", str(GRAPH["graph"]), *args]
    return subprocess.run(
        command, env={**os.environ, **(env or {})}, capture_output=True, text=True
    )


def steps_of(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r and r.get("step", 0) > 0]


def launch(args: list[str], env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "flowrl.cli", "run", str(GRAPH["graph"]), *args]
    env = {**os.environ, **(env or {})}
    return subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def steps_once(run_dir: Path, steps: int) -> bool:
    counts: dict = {}
    for row in steps_of(run_dir):
        counts[row["step"]] = counts.get(row["step"], 0) + 1
    return sorted(counts) == list(range(1, steps + 1)) and set(counts.values()) == {1}


def final_weights(run_dir: Path, steps: int) -> dict:
    import torch

    path = run_dir / f"checkpoints/step_{steps:06d}/pool-{GRAPH['train']}.pt"
    return torch.load(path, weights_only=True)["policy"]["module"]


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-every", type=int, default=50)
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    use_staleness(args.staleness)
    suffix = f"_staleness{args.staleness}" if args.staleness else ""
    args.out = args.out or str(ROOT / f"bench/results/soak{suffix}.json")
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        straight_dir, soak_dir = tmp / "straight", tmp / "soak"
        twins = [  # the reference run, started twice at once: a directory each
            launch(["--backend", "local", *overrides(straight_dir, args.steps)]) for _ in "ab"
        ]
        for twin in twins:
            _, err = twin.communicate()
            assert twin.returncode == 0, err[-3000:]
        straight, twin_dir = sorted(straight_dir.glob(f"{GRAPH['stem']}-*"))

        base = ["--backend", "local", *overrides(soak_dir, args.steps)]
        kills, run_dir = [], None
        for k, step in enumerate(range(args.kill_every, args.steps, args.kill_every)):
            point = ("checkpoint" if k % 2 == 0 else "logged") + f":{step}"
            resume = ["--resume", str(run_dir)] if run_dir else []
            killed = flowrl([*resume, *base], {"FLOWRL_KILL_AT": point})
            assert killed.returncode == -9, f"not killed at {point}: {killed.stderr[-3000:]}"
            (run_dir,) = soak_dir.glob(f"{GRAPH['stem']}-*")
            kills.append(point)
        # the last resume races a second one: paused right after taking the lock, it holds
        # the run directory while the rival is refused, then goes on
        finisher = launch(["--resume", str(run_dir), *base], {"FLOWRL_KILL_AT": "locked:0:STOP"})
        _, status = os.waitpid(finisher.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        rival = flowrl(["--resume", str(run_dir), *base])
        os.kill(finisher.pid, signal.SIGCONT)
        _, err = finisher.communicate()
        assert finisher.returncode == 0, err[-3000:]
        refused = rival.returncode == 1 and f"(pid {finisher.pid}" in rival.stderr

        rows = steps_of(run_dir)
        counts = {}
        for r in rows:
            counts[r["step"]] = counts.get(r["step"], 0) + 1
        early = [r for r in rows if 51 <= r["step"] <= 100]
        late = [r for r in rows if r["step"] > args.steps - 50]
        rss = [statistics.median(r["process/rss_mb"] for r in part) for part in (early, late)]
        fds = [statistics.median(r["process/open_fds"] for r in part) for part in (early, late)]
        errors = sum(r.get("reward/errors", 0) for r in rows)
        result = {
            "graph": str(GRAPH["graph"].relative_to(ROOT)),
            "staleness": args.staleness,
            "steps": args.steps,
            "kills": kills,
            "every_step_once": sorted(counts) == list(range(1, args.steps + 1))
            and set(counts.values()) == {1},
            "rss_mb_steps_51_100": rss[0],
            "rss_mb_last_50": rss[1],
            "open_fds_steps_51_100": fds[0],
            "open_fds_last_50": fds[1],
            "scorer_failures": errors,
            "rows_scored": sum(r["rows"] for r in rows),
            "weights_equal_uninterrupted": same(
                final_weights(run_dir, args.steps), final_weights(straight, args.steps)
            ),
            "double_start_two_directories": same(
                final_weights(twin_dir, args.steps), final_weights(straight, args.steps)
            )
            and steps_once(twin_dir, args.steps)
            and steps_once(straight, args.steps),
            "concurrent_resume_refused": refused,
            "wall_s": round(time.time() - start, 1),
        }
    result["rss_flat"] = rss[1] <= rss[0] * 1.10
    result["fds_flat"] = fds[1] <= fds[0]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    ok = all(
        result[k]
        for k in (
            "every_step_once",
            "rss_flat",
            "fds_flat",
            "weights_equal_uninterrupted",
            "double_start_two_directories",
            "concurrent_resume_refused",
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
