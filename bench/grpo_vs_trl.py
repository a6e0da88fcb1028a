"""GRPO step time, side by side: flowrl (local and Ray executors) against TRL's GRPOTrainer.

    pip install -e .[bench]          # trl and datasets
    python bench/grpo_vs_trl.py      # ~13 min on the 2-core CPU machine

The same work on each side: SmolLM2-135M-Instruct (the embedded model, fp32, CPU, 2 torch
threads), the arithmetic task's training prompts in file order (no shuffling, so step k has the
same prompts everywhere), 2 prompts x 8 samples, at most 32 new tokens, temperature 1, no
top-k/top-p, group-normalised advantages, token-mean loss, no KL term (beta = 0: no reference
model on either side), one AdamW update per batch at a constant learning rate, grad clip 1.

The sides alternate: each round runs every side in a fresh process for `--warmup` untimed
steps and `--steps` timed ones, so slow drifts of the machine hit all sides alike. A step is
the wall time from the end of one optimizer step to the end of the next (generation, reward,
advantage, forward, backward, optimizer: everything). Prints and writes (JSON + markdown)
the median step time per side, the ratios, new tokens per second, and flowrl's time per plan
item. flowrl runs graphs/grpo.toml with command-line overrides (see FLOWRL_OVERRIDES).
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Work:
    """One GRPO step's work, the same on both sides: the model (an alias or a directory) in
    its dtype, prompts x samples, new tokens at most, the learning rate, the device."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    prompts: int = 2
    samples: int = 8
    new_tokens: int = 32
    lr: float = 2e-5
    device: str = "cpu"
    threads: int = 2  # torch threads on CPU
    # TRL's rows per forward/backward (per_device_train_batch_size; 0: all of a step's rows at
    # once), the rest gradient accumulation: one generation of every row and one optimizer step
    # either way, as flowrl micro-batches (256 rows of 300 tokens at once run out of memory)
    micro_rows: int = 0


# this script's work; bench/gpu.py runs GPU shapes through the same two sides
CPU = Work()
PROMPTS, SAMPLES, NEW_TOKENS, LR, THREADS = (
    CPU.prompts,
    CPU.samples,
    CPU.new_tokens,
    CPU.lr,
    CPU.threads,
)
# flowrl-<backend>[-noskip][-nice0]: -noskip computes every row's forward and backward, also
# rows whose advantage is zero (which add nothing to the gradient), i.e. TRL's arithmetic;
# -nice0 runs Ray's worker processes at nice 0, the driver's (Ray's own default is 15)
SIDES = ("trl", "flowrl-ray", "flowrl-local", "flowrl-ray-noskip")


def flowrl_overrides(work: Work = CPU) -> list[str]:
    """graphs/grpo.toml's command-line overrides for `work`."""
    out = [
        f"data.batch_size={work.prompts}",
        "data.shuffle=false",
        f"nodes.generate.n={work.samples}",
        f"nodes.generate.max_new_tokens={work.new_tokens}",
        "nodes.generate.temperature=1.0",
        "nodes.generate.top_p=1.0",
        "nodes.generate.top_k=0",
        "nodes.update_policy.kl_loss_coef=0",  # beta = 0: ref_logprob and the ref model skipped
        "nodes.update_policy.agg=token-mean",
        "nodes.advantage.scale_by_std=true",
        f"models.policy.lr={work.lr}",
        "models.policy.schedule=constant",
        "models.policy.grad_clip=1.0",
        "run.val_size=0",
        "run.log_samples=0",
    ]
    if work.model != CPU.model or work.dtype != CPU.dtype:  # graphs/grpo.toml's own
        out += [f'models.policy.path="{work.model}"', f'models.policy.dtype="{work.dtype}"']
    if work.device == "cpu":
        return out + [f"pools.main.cpus_per_worker={work.threads}", f"run.num_cpus={work.threads}"]
    # the rollout in the model's own dtype, as TRL's generate runs it (flowrl's default on
    # CUDA is a bfloat16 copy: HFOptions.dtype)
    rollout_dtype = f'models.policy.rollout_options.dtype="{work.dtype}"'
    return out + [f'pools.main.device="{work.device}"', rollout_dtype]


FLOWRL_OVERRIDES = flowrl_overrides(CPU)


# -- one side, in its own process ------------------------------------------------------------
def run_flowrl(variant: str, steps: int, out_dir: str) -> dict:
    backend, *flags = variant.split("-")
    command = [
        sys.executable,
        "-m",
        "flowrl.cli",
        "run",
        str(ROOT / "graphs" / "grpo.toml"),
        "--backend",
        backend,
        *FLOWRL_OVERRIDES,
        f"run.steps={steps}",
        f"run.out_dir={out_dir}",
        *(["nodes.update_policy.skip_zero_rows=false"] if "noskip" in flags else []),
    ]
    env = os.environ | ({"RAY_worker_niceness": "0"} if "nice0" in flags else {})
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)
    (run_dir,) = Path(out_dir).iterdir()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [m for m in lines if "time_s" in m]
    return {
        "step_s": [m["time_s"] for m in lines],
        "new_tokens": [m["response_length/mean"] * PROMPTS * SAMPLES for m in lines],
        "items": [{k[9:]: v for k, v in m.items() if k.startswith("timing_s/")} for m in lines],
        "zero_advantage_rows": [1 - m["update_policy/computed_rows"] for m in lines]
        if "noskip" not in flags
        else [],
    }


def run_trl(steps: int, out_dir: str, work: Work = CPU) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from flowrl.data import make_rows
    from flowrl.models.embedded import ALIAS, ensure_cached
    from flowrl.rewards.arithmetic import compute_score

    if work.device == "cpu":
        torch.set_num_threads(work.threads)
    path = ensure_cached() if work.model == ALIAS else work.model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, work.dtype))
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    rows = make_rows("arithmetic", "train", 0, 0, ROOT)[: work.prompts * steps]
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )

    def reward(completions, ground_truth, **_):
        return [
            compute_score("arithmetic", c[0]["content"], truth)
            for c, truth in zip(completions, ground_truth, strict=True)
        ]

    class Timer(TrainerCallback):
        def __init__(self):
            self.ends, self.lengths, self.zero_std = [], [], []

        def on_train_begin(self, args, state, control, **_):
            self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **_):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])
                self.zero_std.append(logs["frac_reward_zero_std"])

    rows_per_step = work.prompts * work.samples
    micro = work.micro_rows or rows_per_step
    if rows_per_step % micro:
        raise ValueError(f"Work.micro_rows = {micro} does not divide {rows_per_step} rows")
    accumulation = rows_per_step // micro
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=micro,
        num_generations=work.samples,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_iterations=1,
        max_completion_length=work.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",  # token-mean over the batch, as flowrl's agg = "token-mean"
        scale_rewards="group",
        learning_rate=work.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=steps,
        shuffle_dataset=False,
        use_cpu=work.device == "cpu",
        bf16=work.dtype == "bfloat16",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        gradient_checkpointing=False,  # TRL's default recomputes the forward in the backward
    )
    timer = Timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    step_s = [b - a for a, b in zip(timer.ends, timer.ends[1:], strict=False)]
    return {
        "step_s": step_s,
        "new_tokens": [x * work.prompts * work.samples for x in timer.lengths],
        "items": [],
        "zero_advantage_rows": timer.zero_std,  # groups with one score have zero advantage
    }


def one_side(side: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-{side}-") as out:
        if side == "trl":
            return run_trl(steps, out)
        return run_flowrl(side.removeprefix("flowrl-"), steps, out)


# -- the driver ------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side per round")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side per round")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "grpo_vs_trl"))
    parser.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side, print JSON
    args = parser.parse_args()
    if args.side:
        print("RESULT " + json.dumps(one_side(args.side, args.warmup + args.steps)))
        return
    sides = args.sides.split(",")
    runs = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            start = time.time()
            result = _subprocess_side(side, args.warmup, args.steps)
            timed = {k: v[args.warmup :] for k, v in result.items()}
            runs[side].append(timed)
            print(
                f"round {r + 1} {side}: steps {[round(x, 1) for x in timed['step_s']]} s "
                f"({time.time() - start:.0f} s with start-up)",
                flush=True,
            )
    summary = summarise(runs, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    out.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def _subprocess_side(side: str, warmup: int, steps: int) -> dict:
    command = [sys.executable, __file__, "--side", side, "--warmup", str(warmup)]
    done = subprocess.run(
        [*command, "--steps", str(steps)], cwd=ROOT, capture_output=True, text=True
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{side} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def summarise(runs: dict, args) -> dict:
    import platform

    import torch
    import transformers

    out = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {THREADS}",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "work": f"{PROMPTS} prompts x {SAMPLES} samples, <= {NEW_TOKENS} new tokens, fp32",
        "rounds": args.rounds,
        "timed_steps_per_round": args.steps,
        "sides": {},
    }
    try:
        import trl

        out["versions"]["trl"] = trl.__version__
    except ImportError:
        pass
    for side, rounds in runs.items():
        steps = [x for r in rounds for x in r["step_s"]]
        tokens = [x for r in rounds for x in r["new_tokens"]]
        zero = [x for r in rounds for x in r["zero_advantage_rows"]]
        items = [i for r in rounds for i in r["items"]]
        # the framework's own time: the step minus the time inside the nodes' code (plan items
        # without a ":" are node calls; dispatch:, collect:, reload: ... are the framework's)
        outside = [
            t - sum(v for k, v in i.items() if ":" not in k)
            for r in rounds
            if r["items"]
            for t, i in zip(r["step_s"], r["items"], strict=True)
        ]
        out["sides"][side] = {
            "median_step_s": statistics.median(steps),
            "median_outside_nodes_s": statistics.median(outside) if items else None,
            "steps_s": steps,
            "mean_new_tokens": statistics.mean(tokens) if tokens else None,
            "zero_advantage_share": statistics.mean(zero) if zero else None,
            "new_tokens_per_s": sum(tokens) / sum(steps) if tokens else None,
            "items_median_s": {
                k: statistics.median(i.get(k, 0.0) for i in items) for k in _item_names(items)
            },
        }
    median = {s: v["median_step_s"] for s, v in out["sides"].items()}
    for side in median:
        if side != "trl" and "trl" in median:
            out[f"{side} / trl"] = median[side] / median["trl"]
    ray_sides = [s for s in median if s.startswith("flowrl-ray") and "noskip" not in s]
    for ray_side in ray_sides if "flowrl-local" in median else []:
        out[f"{ray_side} / flowrl-local"] = median[ray_side] / median["flowrl-local"]
        # both sample the same responses (seeded by step), so step k is the same work on both:
        # the median of the per-step ratios is the fairer comparison on a noisy machine
        pairs = [
            a / b
            for ray, local in zip(runs[ray_side], runs["flowrl-local"], strict=True)
            for a, b in zip(ray["step_s"], local["step_s"], strict=True)
        ]
        out[f"{ray_side} / flowrl-local, median of per-step ratios"] = statistics.median(pairs)
    return out


def _item_names(items: list[dict]) -> list[str]:
    """Plan items that take time (dispatch, collect and moves on CPU take ~0), in plan order."""
    names = dict.fromkeys(k for i in items for k in i)
    return [k for k in names if max(i.get(k, 0.0) for i in items) >= 0.005]


def markdown(summary: dict) -> str:
    lines = [
        f"Machine: {summary['machine']}; "
        + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()),
        f"Work per step: {summary['work']}; {summary['rounds']} rounds x "
        f"{summary['timed_steps_per_round']} timed steps per side.",
        "",
        "| side | median step (s) | outside nodes (s) | new tokens / step | new tokens / s "
        "| zero-advantage rows |",
        "|---|---|---|---|---|---|",
    ]
    for side, s in summary["sides"].items():
        tokens = f"{s['mean_new_tokens']:.0f}" if s["mean_new_tokens"] else "-"
        rate = f"{s['new_tokens_per_s']:.1f}" if s["new_tokens_per_s"] else "-"
        zero = "-" if s["zero_advantage_share"] is None else f"{s['zero_advantage_share']:.0%}"
        outside = (
            "-" if s["median_outside_nodes_s"] is None else f"{s['median_outside_nodes_s']:.3f}"
        )
        lines.append(
            f"| {side} | {s['median_step_s']:.2f} | {outside} | {tokens} | {rate} | {zero} |"
        )
    lines.append("")
    lines += [f"- {k}: {v:.3f}" for k, v in summary.items() if " / " in k]
    for side, s in summary["sides"].items():
        if s["items_median_s"]:
            lines += ["", f"{side}, median time per plan item (s):", ""]
            lines += [f"- {k}: {v:.2f}" for k, v in s["items_median_s"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
