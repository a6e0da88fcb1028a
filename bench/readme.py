"""The README's table "What the defaults do on a 2-core CPU": each graph run exactly as a user
runs it, `flowrl run graphs/<graph>.toml` (its own defaults: seed, steps, executor,
validations), timed as a whole command, and the table written between the README's MEASURED
markers with the commit and date it was measured at.

    python bench/readme.py --write                 # both rows (~15 min on 2 free cores)
    python bench/readme.py --graphs grpo --write   # one row again; the other row stays

The raw results go to bench/results/readme.json (one entry per graph, each with its commit),
so a change that moves a figure shows up in the diff of the README and of that file.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results" / "readme.json"
BEGIN = "<!-- BEGIN MEASURED: python bench/readme.py --write -->"
END = "<!-- END MEASURED -->"
GRAPHS = ("grpo", "ppo")


def describe(graph: str) -> dict:
    """What the graph's defaults are, from its compiled plan (no model loaded)."""
    sys.path.insert(0, str(ROOT))
    import flowrl

    plan = flowrl.compile(ROOT / "graphs" / f"{graph}.toml")
    spec, batch = plan.spec, plan.batch
    generate = next(d for d in spec.nodes.values() if d.mode == "rollout")
    update = next(n for n, d in spec.nodes.items() if d.uses == "update.policy")
    mini = spec.nodes[update].params.mini_batch_size
    parts = [
        f"{batch.prompts} prompts x {batch.samples} samples",
        f"<= {generate.params.max_new_tokens} tokens",
        f"lr {spec.models[generate.model].lr:g}",
    ]
    if mini and batch.rows // mini > 1:
        parts.append(f"{batch.rows // mini} mini-batches")
    if spec.run.critic_warmup:
        parts.append(f"{spec.run.critic_warmup} warm-up steps")
    return {
        "steps": spec.run.steps,
        "seed": spec.run.seed,
        "backend": spec.run.backend,
        "val_every": spec.run.val_every,
        "batch": ", ".join(parts),
    }


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "flowrl", "nodes", "graphs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.stdout.decode().strip() + ("+changes" if dirty else "")


def run_one(graph: str) -> dict:
    """`flowrl run graphs/<graph>.toml` in a fresh process, into a temporary run directory."""
    measured_at = commit()  # the code the run starts with
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "flowrl.cli", "run", f"graphs/{graph}.toml"]
        start = time.time()
        subprocess.run([*command, f'run.out_dir="{out}"'], check=True, cwd=ROOT)
        wall = time.time() - start
        (run_dir,) = Path(out).iterdir()
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = {row["step"]: row["val/score"] for row in rows if "val/score" in row}
    steps = [row["time_s"] for row in rows if "time_s" in row]
    timed = sorted({k for row in rows for k in row if k.startswith("timing_s/")})
    items = {  # the median of each plan item over the steps (docs/performance.md's profiles)
        key.removeprefix("timing_s/"): statistics.median(r[key] for r in rows if key in r)
        for key in timed
    }
    return {
        "graph": graph,
        **describe(graph),
        "val": scores,
        "median_step_s": statistics.median(steps),
        "median_item_s": items,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r),
        "wall_s": wall,
        "commit": measured_at,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores",
    }


def table(results: dict) -> str:
    lines = [
        "| graph | steps | batch | val. accuracy, step 0 -> 10 -> 20 | median step | wall time "
        "| measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for graph in GRAPHS:
        if graph not in results:
            continue
        r = results[graph]
        val = " -> ".join(f"{v:.3f}" for _, v in sorted((int(k), v) for k, v in r["val"].items()))
        lines.append(
            f"| `{graph}.toml` | {r['steps']} | {r['batch']} | {val} | {r['median_step_s']:.1f} s "
            f"| {r['wall_s'] / 60:.1f} min | {r['commit']}, {r['date']}, {r['backend']} executor |"
        )
    return "\n".join(lines)


def write_readme(text: str) -> None:
    doc = README.read_text()
    head, found, rest = doc.partition(BEGIN)
    if not found:
        raise SystemExit(f"{README}: no {BEGIN} marker; put the two markers where the table goes")
    _, _, tail = rest.partition(END)
    README.write_text(f"{head}{BEGIN}\n\n{text}\n\n{END}{tail}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graphs", default=",".join(GRAPHS), help="comma-separated, of " + str(GRAPHS))
    p.add_argument("--write", action="store_true", help=f"write README.md and {RESULTS.name}")
    args = p.parse_args(argv)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for graph in args.graphs.split(","):
        results[graph] = run_one(graph)
        print(json.dumps(results[graph], indent=2))
    text = table(results)
    print(text)
    if args.write:
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
        write_readme(text)


if __name__ == "__main__":
    main()
