"""Asynchronous training: graphs/grpo_disaggregated.toml at run.staleness 0, 1 and 2, side by
side: median step time, samples per second, validation accuracy at steps 0, 10 and 20.

    python bench/async_training.py                        # 20 steps each, the embedded model
    python bench/async_training.py --max-new-tokens 64 --out bench/results/async_training_64.json
    python bench/async_training.py --staleness 0 1 --steps 4 --tiny   # checks the script
    python bench/async_training.py --long-tail --staleness 0 1 1:32 --out bench/results/lt.json

A run is `k` (run.staleness = k) or `k:L` (with run.partial_rollout = L: partial rollouts).
--long-tail is the simulated long-tail workload: a prompt file where one prompt in four asks
for a long list ("List the numbers from 1 to 87, separated by commas.", 40 to 100) and the
others for a number ("What is 12 + 30?"); sampled at temperature 1, SmolLM2's responses to
either run from a few tokens to the cap (--max-new-tokens, 128 with --long-tail), so nearly
every batch has a tail. 2 prompts x 4 samples per step, no KL term (a cheap update: generation
is the larger stage, where the tail matters), no validation.

Each run is a fresh `flowrl run` process on the Ray executor: the train pool and the gen pool
one CPU and one torch thread each (the graph's cpus_per_worker = 1, num_cpus = 2), so on a
2-core machine each pool has a core. Every run uses the same off-policy correction, truncated
importance sampling on the sampler's log-probs (generate's return_logprobs, update_policy's
tis_cap = 2), so the three differ only in staleness. --max-new-tokens lengthens the responses
(the graph's: 20), which makes generation a larger share of the step. Results:
bench/results/async_training.json (and the per-step metrics of each run under "runs").
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRAPH = ROOT / "graphs" / "grpo_disaggregated.toml"
CORRECTION = ["nodes.generate.return_logprobs=true", "nodes.update_policy.tis_cap=2.0"]
PER_STEP = ("time_s", "async/wait_s", "async/staleness", "reward/score", "response_length/mean")
PER_STEP += ("response_length/max", "async/token_staleness_mean", "partial/split_rows")


def run(setting: str, steps: int, tiny: bool, out_dir: Path, more: list) -> dict:
    """One `flowrl run` at `setting` ("k" or "k:L"); its metrics.jsonl summarised."""
    staleness, _, partial = setting.partition(":")
    overrides = [f"run.staleness={staleness}", f"run.steps={steps}", f'run.out_dir="{out_dir}"']
    overrides.append(f"run.partial_rollout={partial or 0}")
    overrides += ["run.val_every=10", "run.save_every=0", *CORRECTION, *more]
    command = [sys.executable, "-m", "flowrl.cli", "run", str(GRAPH), *overrides]
    if tiny:
        command.append("--tiny")
    start = time.time()
    subprocess.run(command, cwd=ROOT, check=True)
    wall = time.time() - start
    (run_dir,) = [p for p in out_dir.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if "event" not in r and r["step"] > 0]
    times = [r["time_s"] for r in step_rows]
    samples = step_rows[0]["rows"]  # prompts x samples: every row is a sample
    median = statistics.median(times)
    return {
        "staleness": int(staleness),
        "partial_rollout": int(partial or 0),
        "steps": len(step_rows),
        "rows_per_step": samples,
        "median_step_s": median,
        "samples_per_s": samples / median,
        "train_loop_s": sum(times),  # the steps alone, without loading and validation
        "samples_per_s_overall": samples * len(times) / sum(times),
        "process_wall_s": wall,
        "val_score": {r["step"]: r["val/score"] for r in rows if "val/score" in r},
        "median_timing_s": {
            k: statistics.median(r.get(k, 0.0) for r in step_rows)
            for k in step_rows[-1]
            if k.startswith("timing_s/")
        },
        "per_step": [
            {k: v for k, v in r.items() if k in ("step", *PER_STEP) or k.startswith("timing_s/")}
            for r in step_rows
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staleness", nargs="+", default=["0", "1", "2"], help="k or k:L")
    parser.add_argument("--long-tail", action="store_true", help="the long-tail prompt file")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="the tiny random model (a check)")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="0: the graph's (20)")
    parser.add_argument("--set", action="append", default=[], help="another override, a=b")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "async_training.json"))
    args = parser.parse_args()
    results, more = [], []
    if args.long_tail:
        data = Path(tempfile.mkdtemp()) / "long_tail.jsonl"
        long_tail(data)
        more += [f'data.source="{data}"', "run.val_size=0", "data.batch_size=2"]
        more += ["nodes.generate.n=4", "nodes.update_policy.kl_loss_coef=0"]
        args.max_new_tokens = args.max_new_tokens or 128
    if args.max_new_tokens:
        more.append(f"nodes.generate.max_new_tokens={args.max_new_tokens}")
    more += args.set
    for k in args.staleness:  # one at a time: the pools of two runs would share the cores
        with tempfile.TemporaryDirectory() as out_dir:
            result = run(k, args.steps, args.tiny, Path(out_dir), more)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "per_step"}), flush=True)
        write(args, more, results)  # after each run: a stopped bench keeps what it measured
    print(f"wrote {args.out}")


def long_tail(path: Path, rows: int = 400) -> None:
    """The long-tail prompts (verl rows): one in four a long list, the others a sum."""
    rng, lines = random.Random(0), []
    for i in range(rows):
        if i % 4 == 3:
            k = rng.randint(40, 100)
            text, answer = f"List the numbers from 1 to {k}, separated by commas.", str(k)
            system = "Answer with the list only."
        else:
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            text, answer = f"What is {a} + {b}?", str(a + b)
            system = "Answer with just the number."
        prompt = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        row = {"prompt": prompt, "data_source": "arithmetic"}
        lines.append(json.dumps(row | {"reward_model": {"ground_truth": answer}}))
    path.write_text("\n".join(lines) + "\n")


def write(args, more: list, results: list) -> None:
    # throughput over the run (samples / the steps' time): at staleness > 0 the steps alternate
    # between short (a batch was waiting) and long (the trainer waited), so the median step
    # says little about the total; its ratio is kept beside
    base, base_median = results[0]["samples_per_s_overall"], results[0]["samples_per_s"]
    for r in results:
        r["speedup_vs_first"] = r["samples_per_s_overall"] / base
        r["speedup_vs_first_by_median_step"] = r["samples_per_s"] / base_median
    report = {
        "graph": "graphs/grpo_disaggregated.toml",
        "overrides": CORRECTION + more,
        "model": "tiny" if args.tiny else "smollm2-135m-instruct",
        "backend": "ray",
        "runs": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
