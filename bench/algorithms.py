"""The learning table of docs/algorithms.md: every algorithm graph on the embedded model, the
same step budget for all, a few seeds.

    make algorithms       # --steps 10 --seeds 0,1 --jobs 2 --write pools.main.cpus_per_worker=1
    python bench/algorithms.py --graphs dapo --steps 2 run.val_size=8    # a quick try
    python bench/algorithms.py --graphs ppo --steps 10 --write --merge ...  # one row again

Each (graph, seed) runs `flowrl run graphs/<graph>.toml` in a fresh process (the local
executor unless --backend ray) with run.steps = --steps, run.seed = seed, validation at step
0, at the middle (--steps // 2) and at the end (run.val_every = --steps // 2), plus any
KEY=VALUE overrides given. From each run's
metrics.jsonl it takes the greedy validation score (`val/score`: the share of validation
prompts answered right, for the arithmetic task's 0/1 scorer) at those three steps and the
median step time (`time_s`: generation to optimizer step, validation excluded). It prints the
table; with --write also the raw results to bench/results/algorithms.json and the table into
docs/algorithms.md between the MEASURED markers. With --merge the graphs and seeds run replace
theirs among the stored results and the others stay (after a graph's defaults change), and the
table says which rows were measured again, with what.
"""

import argparse
import concurrent.futures
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme import commit  # noqa: E402  (bench/readme.py: HEAD, "+changes" when the code differs)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "algorithms.md"
RESULTS = ROOT / "bench" / "results" / "algorithms.json"
BEGIN = "<!-- BEGIN MEASURED: python bench/algorithms.py --write -->"
END = "<!-- END MEASURED -->"
WATCHED = ("clip_frac", "clip_frac_lower", "approx_kl", "/kl", "kl_loss")
KL_KEYS = ("kl_penalty/kl", "update_policy/kl_loss")  # the drift from the reference
# one graph per algorithm; ppo_pools and grpo_disaggregated place ppo and grpo differently
ALGORITHMS = (
    "ppo",
    "grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "dr_grpo",
    "dapo",
    "gspo",
)


def run_one(
    graph: str, seed: int, steps: int, overrides: list[str], out: Path, backend: str, quiet=False
):
    """Train one graph at one seed in its own process; returns its measurements."""
    file = Path(graph) if graph.endswith(".toml") else ROOT / "graphs" / f"{graph}.toml"
    graph = file.stem  # a path (e.g. examples/grpo_lora.toml) or a name in graphs/
    out_dir = out / f"{graph}-seed{seed}"
    command = [
        sys.executable,
        "-m",
        "flowrl.cli",
        "run",
        str(file.resolve()),
        f"--backend={backend}",
        f"run.steps={steps}",
        f"run.seed={seed}",
        f"run.val_every={max(steps // 2, 1)}",
        f'run.out_dir="{out_dir}"',
        *overrides,
    ]
    start = time.time()
    if quiet:  # runs side by side: each one's output to its own file
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "output.log", "w") as log:
            subprocess.run(command, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    else:
        subprocess.run(command, check=True, cwd=ROOT)
    runs = sorted(p for p in out_dir.iterdir() if p.is_dir())
    lines = [json.loads(x) for x in (runs[-1] / "metrics.jsonl").read_text().splitlines()]
    scores = {row["step"]: row["val/score"] for row in lines if "val/score" in row}
    middle = steps // 2
    trained = [row for row in lines if "time_s" in row]
    watched = sorted({k for row in trained for k in row if k.endswith(WATCHED)})
    return {
        "graph": graph,
        "seed": seed,
        "steps": steps,
        "val_start": scores.get(0),
        "val_middle": scores.get(middle),
        "val_end": scores.get(steps),
        "middle_step": middle,
        "val": scores,  # every validation: step -> score
        "median_step_s": statistics.median(r["time_s"] for r in trained),
        # per-step means of the update's clip and KL metrics (did the clip act? the KL drift?)
        "means": {k: statistics.mean(r[k] for r in trained if k in r) for k in watched},
        "max_kl": max((r[k] for r in trained for k in KL_KEYS if k in r), default=None),
        "wall_s": time.time() - start,
        "run_dir": str(runs[-1]),
    }


def _cell(values: list) -> str:
    """The mean over seeds, then each seed's value."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    seeds = ", ".join("-" if v is None else f"{v:.3f}" for v in values)
    return f"{statistics.mean(known):.3f} ({seeds})" if len(values) > 1 else f"{known[0]:.3f}"


def table(results: list[dict], command: str, backend: str) -> str:
    """The measured table, one row per graph, in ALGORITHMS order. A result carries the command,
    date and commit that measured it (`command` and today for one that does not); the header
    names the most common, and a line under the table names the graphs re-measured by another
    (--merge)."""
    today = time.strftime("%Y-%m-%d")
    made = {
        r["graph"]: (r.get("command", command), _when(r.get("date", today), r.get("commit")))
        for r in results
    }
    # the command behind the most graphs; on a tie the earliest, which the others re-measured
    main = max(sorted(set(made.values()), key=lambda m: m[1]), key=list(made.values()).count)
    graphs = sorted({r["graph"] for r in results}, key=_order)
    seeds = sorted({r["seed"] for r in results})
    steps = results[0]["steps"]
    middle = results[0]["middle_step"]
    lines = [
        f"Measured with `{main[0]}` ({backend} executor, {platform.machine()}, "
        f"{main[1]}): {steps} steps, seeds {', '.join(map(str, seeds))}; "
        "each cell is the mean over seeds, then each seed's value.",
        "",
        f"| graph | val step 0 | val step {middle} | val step {steps} | median step (s) |",
        "|---|---|---|---|---|",
    ]
    for graph in graphs:
        rows = [next(r for r in results if r["graph"] == graph and r["seed"] == s) for s in seeds]
        cells = [_cell([r[key] for r in rows]) for key in ("val_start", "val_middle", "val_end")]
        step = statistics.mean(r["median_step_s"] for r in rows)
        lines.append(f"| {graph} | {' | '.join(cells)} | {step:.1f} |")
    for graph in graphs:
        if made[graph] != main:
            lines += [
                "",
                f"The {graph} row was measured again with `{made[graph][0]}` ({made[graph][1]}).",
            ]
    return "\n".join(lines)


def _when(date: str, at: str | None) -> str:
    return f"{date} at {at}" if at else date


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """The stored results with each (graph, seed) measured again replaced by its new result;
    the step budget must be the one the table was measured with."""
    budgets = {r["steps"] for r in old} | {r["steps"] for r in new}
    if len(budgets) > 1:
        raise SystemExit(
            f"--merge: {RESULTS} holds runs of {sorted({r['steps'] for r in old})} steps and "
            f"these have {new[0]['steps']}; fix: give --steps {old[0]['steps']}, "
            "or measure the whole table again without --merge"
        )
    again = {(r["graph"], r["seed"]) for r in new}
    kept = [r for r in old if (r["graph"], r["seed"]) not in again]
    return sorted(kept + new, key=lambda r: (_order(r["graph"]), r["graph"], r["seed"]))


def _order(graph: str) -> int:
    return ALGORITHMS.index(graph) if graph in ALGORITHMS else len(ALGORITHMS)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(f"{head}{BEGIN}\n\n{text}\n\n{END}{tail}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides for every run")
    p.add_argument(
        "--graphs", default=",".join(ALGORITHMS), help="comma-separated names in graphs/ or paths"
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--backend", default="local", choices=["local", "ray"])
    p.add_argument("--out", default=str(ROOT / "runs" / "algorithms"), help="run directories")
    p.add_argument("--write", action="store_true", help=f"write the table and {RESULTS.name}")
    p.add_argument(
        "--merge",
        action="store_true",
        help=f"with --write: keep {RESULTS.name}'s other graphs and seeds, replace those run",
    )
    p.add_argument("--json", help="also write the raw results to this file")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs side by side (give each its share of the cores, e.g. "
        "pools.main.cpus_per_worker=1 for 2 jobs on 2 cores)",
    )
    args = p.parse_args(argv)
    graphs = [g for g in args.graphs.split(",") if g]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    jobs = [(graph, seed) for graph in graphs for seed in seeds]
    quiet = args.jobs > 1
    command = " ".join(["python bench/algorithms.py", *(argv or sys.argv[1:])])
    date, at = time.strftime("%Y-%m-%d"), commit()

    def one(job):
        graph, seed = job
        out = Path(args.out)
        result = run_one(graph, seed, args.steps, args.overrides, out, args.backend, quiet)
        result.update(command=command, date=date, commit=at)
        print(json.dumps(result), flush=True)
        return result

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(one, jobs))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.merge:
        results = merged(json.loads(RESULTS.read_text()), results)
    text = table(results, command, args.backend)
    print(text)
    if args.write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
        write_doc(text)
        print(f"wrote {DOC} and {RESULTS}")


if __name__ == "__main__":
    main()
