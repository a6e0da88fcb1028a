"""The README's table "What the defaults do on a 2-core CPU": each graph run exactly as a user
runs it, `flowrl run graphs/<graph>.toml` (its own defaults: steps, executor, validations), at
seeds 0, 1 and 2 (`run.seed=N`), each timed as a whole command, and the table written between
the README's MEASURED markers with the machine, the commit and the date it was measured at.

    python bench/readme.py --write                    # 2 graphs x 3 seeds (~55 min, 2 free cores)
    python bench/readme.py --graphs ppo --seeds 0 --write   # one run again; the rest stays
    python bench/readme.py --resume --write           # only the runs not yet in the results
    python bench/readme.py --compare graphs/ppo.toml  # the newest runs/ppo-* against the table
    python bench/readme.py --table --write            # the table again from the results

Each run goes to bench/results/readme.json as soon as it ends (with --write), so an interrupted
measurement keeps what finished and `--resume` goes on from there; each run records the machine
(CPU model, vector extensions, torch's build) and the load average while it ran; a row keeps
one machine's runs (measuring on another drops the row's runs of the first).
Float results differ between CPU models, so a run of the same commit on another CPU gives other
values: `--compare` (which `make run` calls) says which values to expect where.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results" / "readme.json"
BEGIN = "<!-- BEGIN MEASURED: python bench/readme.py --write -->"
END = "<!-- END MEASURED -->"
GRAPHS = ("grpo", "ppo")
SEEDS = (0, 1, 2)
# the CPU flags that decide which kernels torch and oneDNN/MKL pick (and so the float results)
VECTOR_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
# the machine facts read in a child process, so this process never holds torch during the runs
_TORCH_FACTS = """
import json, re, torch
show = torch.__config__.show()
def version(pattern):
    found = re.search(pattern, show)
    return found and found.group(1)
blas = re.search(r"BLAS_INFO=(\\w+)", show)
print(json.dumps({
    "torch": torch.__version__,
    "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    "blas": blas and blas.group(1),
    "mkl": version(r"Math Kernel Library Version ([\\w.]+)"),
    "onednn": version(r"MKL-DNN v([\\w.]+)") if torch.backends.mkldnn.is_available() else None,
    "threads": torch.get_num_threads(),
}))
"""


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
        "graph": graph,
        "steps": spec.run.steps,
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


def cpu_facts(cpuinfo: str) -> dict:
    """The CPU model and the vector extensions that matter to torch, from /proc/cpuinfo's text."""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    have = set(flags.group(1).split()) if flags else set()
    return {
        "cpu": model.group(1).strip() if model else "unknown",
        "vector": [f for f in VECTOR_FLAGS if f in have],
    }


def machine() -> dict:
    """The machine a run measures on: CPU model and extensions, cores, torch and its BLAS."""
    try:
        facts = cpu_facts(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux
        import platform

        facts = {"cpu": platform.processor() or platform.machine(), "vector": []}
    facts["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    probe = subprocess.run(
        [sys.executable, "-c", _TORCH_FACTS], capture_output=True, text=True, check=True
    )
    return {**facts, **json.loads(probe.stdout)}


def machine_line(m: dict) -> str:
    """One line naming the machine, e.g. for the README and `make run`'s closing lines."""
    vector = m.get("vector", ())
    avx512 = [f for f in vector if f.startswith("avx512")]
    isa = f"AVX-512: {', '.join(avx512)}" if avx512 else "no AVX-512"
    isa += ", AMX" if any(f.startswith("amx") for f in vector) else ", no AMX"
    text = f"{m['cpu']} ({isa}; torch's kernels: {m.get('torch_cpu_capability', '?')})"
    if m.get("cores"):
        text += f", {m['cores']} cores"
    if m.get("torch"):
        libs = [f"MKL {m['mkl']}" if m.get("mkl") else m.get("blas")]
        libs.append(f"oneDNN {m['onednn']}" if m.get("onednn") else None)
        blas = ", ".join(x for x in libs if x)
        text += f", torch {m['torch']}" + (f" ({blas})" if blas else "")
    return text


@contextmanager
def load_sampled(every: float = 30.0):
    """Yields a list that gets the 1-minute load average every `every` seconds while the block
    runs (the machine may be shared: step times are only comparable at a like load)."""
    samples, stop = [], threading.Event()

    def sample():
        samples.append(os.getloadavg()[0])
        while not stop.wait(every):
            samples.append(os.getloadavg()[0])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def load_summary(samples: list[float]) -> dict:
    s = samples or [os.getloadavg()[0]]
    return {"min": min(s), "median": statistics.median(s), "max": max(s), "samples": len(s)}


def run_one(graph: str, seed: int) -> dict:
    """`flowrl run graphs/<graph>.toml run.seed=<seed>` in a fresh process, into a temporary
    run directory."""
    measured_at = commit()  # the code the run starts with
    with tempfile.TemporaryDirectory() as out, load_sampled() as load:
        command = [sys.executable, "-m", "flowrl.cli", "run", f"graphs/{graph}.toml"]
        start = time.time()
        subprocess.run([*command, f"run.seed={seed}", f'run.out_dir="{out}"'], check=True, cwd=ROOT)
        wall = time.time() - start
        (run_dir,) = Path(out).iterdir()
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row["time_s"] for row in rows if "time_s" in row]
    timed = sorted({k for row in rows for k in row if k.startswith("timing_s/")})
    items = {  # the median of each plan item over the steps (docs/performance.md's profiles)
        key.removeprefix("timing_s/"): statistics.median(r[key] for r in rows if key in r)
        for key in timed
    }
    return {
        "seed": seed,
        "val": val_scores(rows),
        "median_step_s": statistics.median(steps),
        "median_item_s": items,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r),
        "wall_s": wall,
        "commit": measured_at,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_1min": load_summary(load),
    }


def val_scores(rows) -> dict:
    """{step (as a string, as JSON keeps it): validation score} from metrics.jsonl's rows."""
    return {str(row["step"]): row["val/score"] for row in rows if "val/score" in row}


def _steps(val: dict) -> list[tuple[int, float]]:
    return sorted((int(k), v) for k, v in val.items())


def seed_range(runs: dict) -> list[tuple[int, float, float]]:
    """(step, lowest, highest) over the seeds, at each validation step every seed reached."""
    steps = set.intersection(*(set(map(int, r["val"])) for r in runs.values()))
    return [
        (
            s,
            min(r["val"][str(s)] for r in runs.values()),
            max(r["val"][str(s)] for r in runs.values()),
        )
        for s in sorted(steps)
    ]


def arrow(val: dict) -> str:
    """Validation scores in step order: 0.266 -> 0.625 -> 0.578."""
    return " -> ".join(f"{v:.3f}" for _, v in _steps(val))


def _span(low: float, high: float) -> str:
    return f"{low:.3f}" if low == high else f"{low:.3f}-{high:.3f}"


def _machines(results: dict) -> list[dict]:
    seen = []
    for graph in GRAPHS:
        for r in results.get(graph, {}).get("runs", {}).values():
            if r["machine"] not in seen:
                seen.append(r["machine"])
    return seen


def table(results: dict) -> str:
    """The README's text between the markers: the machine, then one row per graph."""
    runs_all = [r for g in GRAPHS for r in results.get(g, {}).get("runs", {}).values()]
    if not runs_all:
        return "(no runs measured yet: python bench/readme.py --write)"
    lines = [
        "Measured on "
        + "; ".join(machine_line(m) for m in _machines(results))
        + ". "
        + load_sentence(runs_all),
        "",
        "| graph | steps | batch | val. accuracy, seed 0, step 0 -> 10 -> 20 | seeds | range "
        "over the seeds | median step | wall time | measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for graph in GRAPHS:
        entry = results.get(graph)
        if not entry or not entry.get("runs"):
            continue
        runs = {int(k): r for k, r in entry["runs"].items()}
        first = runs[min(runs)]
        seed0 = arrow(first["val"])
        if min(runs) != 0:
            seed0 = f"(seed {min(runs)}) {seed0}"
        spread = " -> ".join(_span(lo, hi) for _, lo, hi in seed_range(runs))
        step_s = statistics.median(r["median_step_s"] for r in runs.values())
        wall = statistics.median(r["wall_s"] for r in runs.values())
        commits = ", ".join(sorted({r["commit"] for r in runs.values()}))
        dates = sorted(r["date"][:10] for r in runs.values())
        day = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
        lines.append(
            f"| `{graph}.toml` | {entry['steps']} | {entry['batch']} | {seed0} "
            f"| {', '.join(map(str, sorted(runs)))} | {spread} | {step_s:.1f} s "
            f"| {wall / 60:.1f} min | {commits}, {day}, {entry['backend']} executor |"
        )
    total = sum(r["wall_s"] for r in runs_all)
    lines += [
        "",
        f"The {len(runs_all)} runs took {total / 60:.0f} min in all (`python bench/readme.py "
        "--write`); median step and wall time are medians over the seeds.",
    ]
    lines += elsewhere_lines(results)
    return "\n".join(lines)


def load_sentence(runs) -> str:
    loads = [r["load_1min"] for r in runs if r.get("load_1min")]
    if not loads:
        return ""
    low, high = min(x["min"] for x in loads), max(x["max"] for x in loads)
    median = statistics.median(x["median"] for x in loads)
    cores = max((r["machine"].get("cores") or 0) for r in runs)
    busy = (
        " (shared with other jobs: times are longer than on a free machine)"
        if median > cores * 1.2
        else ""
    )
    return (
        f"1-minute load average during the runs: {low:.1f}-{high:.1f}, median {median:.1f}{busy}."
    )


def elsewhere_lines(results: dict) -> list[str]:
    """The same command on another CPU model, as measured there (results["elsewhere"])."""
    out = []
    for e in results.get("elsewhere", []):
        out.append(
            f"On {e['cpu']}, `{e['command']}` (seed {e['seed']}) at {e['commit']} gave "
            f"{arrow(e['val'])} ({e['note']})."
        )
    return [""] + out if out else []


def compare_text(results: dict, graph: str, mine: dict | None, here: dict) -> str:
    """What `make run` prints at its end: where the README's row came from and how this run
    compares with it. `mine`: this run's validation scores ({step: score}) or None, `here`:
    this machine (machine())."""
    elsewhere = [
        f"  seed {e['seed']} on {e['cpu']} ({e['commit']}): {arrow(e['val'])}"
        for e in results.get("elsewhere", [])
        if e["graph"] == graph
    ]
    entry = results.get(graph)
    if not entry or not entry.get("runs"):
        head = f"bench/readme.py: no measured runs of graphs/{graph}.toml to compare with"
        mine_line = [f"this run, on {machine_line(here)}: {arrow(mine)}"] if mine else []
        return "\n".join([head, *elsewhere, *mine_line])
    runs = {int(k): r for k, r in entry["runs"].items()}
    ref = runs.get(0, runs[min(runs)])
    lines = [
        f"README's graphs/{graph}.toml row: {ref['commit']}, {ref['date'][:10]}, on "
        f"{machine_line(ref['machine'])}",
        f"  seed {ref['seed']}: {arrow(ref['val'])}; seeds {', '.join(map(str, sorted(runs)))} "
        "range: " + " -> ".join(_span(lo, hi) for _, lo, hi in seed_range(runs)),
        *elsewhere,
    ]
    if mine is None:
        lines.append("this run: no validation scores found to compare")
        return "\n".join(lines)
    lines.append(f"this run, on {machine_line(here)}: {arrow(mine)}")
    return "\n".join(lines + verdict(results, graph, ref, runs, mine, here))


def _same_machine(a: dict, b: dict) -> bool:
    """Whether two machines pick the same kernels: CPU model, extensions, torch and its BLAS."""
    keys = ("cpu", "vector", "torch_cpu_capability", "torch", "mkl", "onednn")
    return all(a.get(k) == b.get(k) for k in keys)


def verdict(results, graph, ref, runs, mine, here) -> list[str]:
    """The lines that tell a different CPU from a broken install."""
    steps = _steps(ref["val"])
    base_step, base = steps[0]
    got = dict(_steps(mine))
    if base_step in got and abs(got[base_step] - base) > 1e-9:
        return [
            f"  step {base_step} is {got[base_step]:.3f}, not {base:.3f}: the base model's greedy "
            "score, the same on every CPU measured so far; this points to a broken install, "
            "another model or a changed graph"
        ]
    if _same_machine(here, ref["machine"]):
        if arrow(mine) == arrow(ref["val"]):
            return [
                f"  the same values as the README's seed {ref['seed']} on this machine: as expected"
            ]
        return [
            "  the same CPU model, extensions and torch as the README's row, other values: at the "
            "graph's defaults this should not happen (the graph, an override or the code differs)"
        ]
    for e in results.get("elsewhere", []):
        if e["graph"] == graph and e["seed"] == ref["seed"] and arrow(e["val"]) == arrow(mine):
            return [
                f"  the same values as seed {e['seed']} measured on {e['cpu']}: as expected there"
            ]
    out = [
        "  another CPU model (or torch) than the README's row, so other values after the start: "
        "float results differ between vector units and BLAS paths, sampled tokens differ from the "
        "first differing float on, and RL amplifies it"
    ]
    last_step, last = _steps(mine)[-1]
    if last_step > base_step and last > base:
        out.append(f"  learning from the base model's {base:.3f}, as on every CPU measured")
    else:
        out.append(
            f"  no higher than the base model's {base:.3f} at step {last_step}: not seen on any "
            "CPU measured; look at the run's metrics.jsonl"
        )
    outside = [
        f"step {s} ({got[s]:.3f})"
        for s, lo, hi in seed_range(runs)
        if s in got and not lo <= got[s] <= hi
    ]
    where = ", ".join(outside) if outside else "none"
    out.append(f"  outside the README's seed range: {where}")
    return out


def newest_run(graph_file: str) -> Path | None:
    """The newest run directory of the graph under runs/ (where `make run` puts it)."""
    stem = Path(graph_file).stem
    runs = (ROOT / "runs").glob(f"{stem}-[0-9]*")  # {stem}-{date}-{time}[-k], not {stem}-x-...
    found = [p for p in runs if (p / "metrics.jsonl").exists()]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def compare(graph_file: str) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    run_dir = newest_run(graph_file)
    mine = None
    if run_dir is not None:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        mine = val_scores(json.loads(x) for x in lines) or None
        print(f"\n{run_dir.relative_to(ROOT)}:")
    print(compare_text(results, Path(graph_file).stem, mine, machine()))


def save(results: dict) -> None:
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graphs", default=",".join(GRAPHS), help="comma-separated, of " + str(GRAPHS))
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated")
    p.add_argument("--write", action="store_true", help=f"write README.md and {RESULTS.name}")
    p.add_argument("--resume", action="store_true", help="skip runs already in the results")
    p.add_argument("--compare", metavar="GRAPH_FILE", help="compare the newest run, run nothing")
    p.add_argument("--table", action="store_true", help="the table from the results, run nothing")
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.table:
        print(table(results))
        return write_readme(table(results)) if args.write else None
    here = machine()
    print(machine_line(here), flush=True)
    graphs, seeds = args.graphs.split(","), [int(s) for s in args.seeds.split(",")]
    for seed in seeds:  # seed 0 of every graph first: it is the row's headline
        for graph in graphs:
            entry = results.setdefault(graph, {})
            if "runs" not in entry:  # a result of the one-seed layout: measured again
                entry.clear()
            entry.update(describe(graph))
            runs = entry.setdefault("runs", {})
            for other in [k for k, r in runs.items() if r["machine"] != here]:
                print(f"{graph} seed {other}: measured on another machine, dropped from the row")
                del runs[other]  # one row's seed range is one machine's
            if args.resume and str(seed) in runs and runs[str(seed)]["machine"] == here:
                print(f"{graph} seed {seed}: measured already ({runs[str(seed)]['commit']})")
                continue
            runs[str(seed)] = {**run_one(graph, seed), "machine": here}
            runs_sorted = dict(sorted(runs.items(), key=lambda kv: int(kv[0])))
            entry["runs"] = runs_sorted
            print(json.dumps({k: v for k, v in runs[str(seed)].items() if k != "median_item_s"}))
            if args.write:  # now, so an interrupted measurement keeps this run
                save(results)
                write_readme(table(results))
    text = table(results)
    print(text)
    if args.write:
        save(results)
        write_readme(text)


def write_readme(text: str) -> None:
    doc = README.read_text()
    head, found, rest = doc.partition(BEGIN)
    if not found:
        raise SystemExit(f"{README}: no {BEGIN} marker; put the two markers where the table goes")
    _, _, tail = rest.partition(END)
    README.write_text(f"{head}{BEGIN}\n\n{text}\n\n{END}{tail}")


if __name__ == "__main__":
    main()
