"""GPU rollout: SGLang against flowrl's decode loop and `generate`, and colocated peak memory of
graphs/grpo_sglang.toml with offload "always" against "never".

    pip install -e ".[sglang]"
    python bench/sglang_rollout.py                        # both parts, Qwen2-0.5B-shaped, bf16
    python bench/sglang_rollout.py --part throughput --rows 64 --new 256 --n 8
    python bench/sglang_rollout.py --part memory --steps 3

Throughput: the three engines decode the same chat-templated arithmetic prompts (left-padded)
from the same module: `--n 1` greedy (the rows each engine returns identical to flowrl's are
counted), `--n > 1` sampling at temperature 1. Median of `--repeats` runs after a warm-up; new
tokens are those up to and including each row's EOS. SGLang holds its own copy of the weights
(mem_fraction 0.5 of the GPU for weights and KV cache), flowrl's engine and `generate` use the
module as it is.

Memory: each offload mode runs in a fresh process (local executor: the trainer's process and
SGLang's scheduler process share the GPU), so its peak is the device's used memory (total -
free, from torch.cuda.mem_get_info), sampled every 5 ms over the timed steps; the trainer
process's torch.cuda.max_memory_allocated is reported beside it.

Written without a GPU machine (none was available to the task); not yet run. Results go to
bench/results/sglang_rollout.{json,md}.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from colocation import ARCHS, model_dir  # noqa: E402

GB = 1024**3


def throughput(args) -> list[dict]:
    """tokens/s of SGLang, flowrl's HFRollout and `generate` on one batch."""
    import torch
    from generation import new_tokens, prompts, timed

    from flowrl.engines.batch import generate_batch
    from flowrl.engines.hf.engine import HFRollout
    from flowrl.engines.sglang.backend import SGLangRollout
    from flowrl.models import load_model

    path = str(model_dir(args.arch)) if args.arch in ARCHS else args.arch
    module, tokenizer = load_model(path, dtype="bfloat16")
    module.to("cuda:0")
    batch = prompts(tokenizer, args.rows // args.n)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    sample = args.n > 1
    kwargs = dict(n=args.n, max_new_tokens=args.new, do_sample=sample)
    ours = HFRollout(module, tokenizer, "cuda:0")
    sglang = SGLangRollout(module, tokenizer, "cuda:0")

    def run_ours():
        return generate_batch(ours, ids.cuda(), mask.cuda(), seed=0, **kwargs)["responses"]

    def run_generate():
        sampling = dict(top_k=0, top_p=1.0, temperature=1.0) if sample else {}
        with torch.inference_mode():
            out = module.generate(
                input_ids=ids.cuda(),
                attention_mask=mask.cuda(),
                max_new_tokens=args.new,
                do_sample=sample,
                num_return_sequences=args.n,
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
        return out[:, ids.shape[1] :].cpu()

    engines = {
        "SGLang": lambda: generate_batch(sglang, ids, mask, **kwargs)["responses"],
        "flowrl HFRollout": run_ours,
        "transformers generate": run_generate,
    }
    results, outputs = [], {}
    try:
        for name, fn in engines.items():
            fn()  # warm-up: kernels, allocator, CUDA graphs
            torch.cuda.synchronize()
            seconds, out = timed(lambda fn=fn: (fn(), torch.cuda.synchronize())[0], args.repeats)
            outputs[name] = out
            tokens = new_tokens(out, tokenizer.eos_token_id)
            results.append({"engine": name, "seconds": seconds, "new_tokens": tokens})
    finally:
        sglang.shutdown()
    if not sample:  # greedy: rows identical to flowrl's, token for token up to EOS
        reference = outputs["flowrl HFRollout"]
        for r in results:
            r["rows_as_flowrl"] = same_rows(outputs[r["engine"]], reference, tokenizer.eos_token_id)
    return results


def same_rows(a, b, eos: int) -> int:
    """How many rows of a and b agree up to and including their first EOS."""
    count = 0
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        cut = lambda row: row[: row.index(eos) + 1] if eos in row else row  # noqa: E731
        count += cut(x) == cut(y)
    return count


class DevicePeak:
    """The most device memory in use (every process on the GPU), sampled in a thread."""

    def __init__(self, every: float = 0.005):
        self.every, self.peak, self._stop = every, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import torch

        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def one_mode(args) -> dict:
    """graphs/grpo_sglang.toml with this offload mode, in this process: step time and peaks."""
    import torch

    from flowrl.cli import load_plan
    from flowrl.runtime.controller import Trainer

    path = model_dir(args.arch) if args.arch in ARCHS else args.arch
    overrides = [f'models.{m}.path="{path}"' for m in ("policy", "ref")]
    overrides += [
        f'pools.main.offload="{args.offload}"',
        f"run.steps={args.warmup + args.steps}",
        "run.val_size=0",
        "run.log_samples=0",
        f"data.batch_size={args.prompts}",
        f"nodes.generate.n={args.group}",
        f"nodes.generate.max_new_tokens={args.new}",
    ]
    with tempfile.TemporaryDirectory() as out:
        overrides.append(f'run.out_dir="{out}"')
        plan = load_plan(str(ROOT / "graphs" / "grpo_sglang.toml"), overrides)
        trainer = Trainer(plan, Path(out) / "run", "local")
        steps = []
        for step in range(1, args.warmup + 1):
            trainer.step(step)
        torch.cuda.reset_peak_memory_stats()
        with DevicePeak() as device:
            for step in range(args.warmup + 1, args.warmup + args.steps + 1):
                metrics = trainer.step(step).metrics
                steps.append(metrics["time_s"])
        worker = trainer.executor.workers["main"][0]
        worker.rollout["policy"].shutdown()
        trainer.close()
    return {
        "offload": args.offload,
        "median_step_s": statistics.median(steps),
        "device_peak_gb": device.peak / GB,
        "trainer_allocated_peak_gb": torch.cuda.max_memory_allocated() / GB,
    }


def memory(args) -> list[dict]:
    results = []
    for offload in ("always", "never"):
        command = [sys.executable, __file__, *sys.argv[1:], "--offload", offload]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"offload={offload} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(lines[0][7:]))
        print(f"offload={offload}: {results[-1]}", flush=True)
    return results


def report(args, speed: list[dict], peaks: list[dict]) -> str:
    lines = []
    if speed:
        mode = "greedy" if args.n == 1 else f"sampling, n = {args.n}"
        lines += [
            f"{args.arch}, bf16, one GPU: {args.rows} rows ({mode}), <= {args.new} new tokens, "
            f"median of {args.repeats}",
            "",
            "| engine | seconds | new tokens | new tokens / s | rows as flowrl's (greedy) |",
            "|---|---|---|---|---|",
        ]
        for r in speed:
            rate = r["new_tokens"] / r["seconds"]
            same = r.get("rows_as_flowrl", "-")
            lines.append(
                f"| {r['engine']} | {r['seconds']:.2f} | {r['new_tokens']} | {rate:.0f} | {same} |"
            )
        lines.append("")
    if peaks:
        lines += [
            f"graphs/grpo_sglang.toml on {args.arch}: {args.prompts} prompts x {args.group}, "
            f"<= {args.new} new tokens, median of {args.steps} steps",
            "",
            "| offload | device peak (GB, every process) | trainer allocated (GB) | step (s) |",
            "|---|---|---|---|",
        ]
        for r in peaks:
            lines.append(
                f"| {r['offload']} | {r['device_peak_gb']:.2f} | "
                f"{r['trainer_allocated_peak_gb']:.2f} | {r['median_step_s']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="both", choices=["both", "throughput", "memory"])
    parser.add_argument("--arch", default="qwen2-0.5b", help="an ARCHS name or a model path")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (>1: sampling)")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="memory: prompts per step")
    parser.add_argument("--group", type=int, default=8, help="memory: samples per prompt")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--offload", help=argparse.SUPPRESS)  # internal: one mode, JSON out
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "sglang_rollout"))
    args = parser.parse_args()
    if args.offload:
        print("RESULT " + json.dumps(one_mode(args)))
        return
    if args.arch in ARCHS:
        model_dir(args.arch)  # build once, outside the timed parts
    speed = throughput(args) if args.part in ("both", "throughput") else []
    peaks = memory(args) if args.part in ("both", "memory") else []
    text = report(args, speed, peaks)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"throughput": speed, "memory": peaks}))
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
