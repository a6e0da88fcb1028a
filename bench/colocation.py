"""Hybrid-engine colocation: policy, reference and critic on one device, offload "always"
against "never": peak device memory, step time, and a bit-exact offload/reload round trip.

    python bench/colocation.py --device cuda                 # Qwen2-0.5B-shaped, on a GPU
    python bench/colocation.py --device cpu --arch small     # the same code paths on CPU

The models are random-initialised from a config (no download): `qwen2-0.5b` has the shape of
Qwen2-0.5B (24 layers, hidden 896, 14 heads / 2 KV heads, vocab 151936, tied embeddings,
~494M parameters); `small` is a 4-layer version for checking the script on CPU. The tokenizer
is the embedded SmolLM2 one (its ids fit the larger vocabulary). graphs/ppo.toml runs with the
local executor (one process, so the device's peak memory is this process's), each offload
mode in a fresh process. On CUDA the peak is torch.cuda.max_memory_allocated over the timed
steps; on CPU, where offloading moves nothing, the process's peak RSS.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}
GB = 1024**3


def model_dir(arch: str) -> Path:
    """A random-initialised Qwen2 of `arch`'s shape saved as an HF directory (built once)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from flowrl.models.embedded import cache_root, ensure_cached

    out = cache_root() / "bench" / arch
    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(ensure_cached())
    config = Qwen2Config(
        **ARCHS[arch],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=out.parent))  # renamed into place when complete
    model.save_pretrained(temp)
    tokenizer.save_pretrained(temp)
    temp.rename(out)
    return out


def one_mode(args) -> dict:
    """Run graphs/ppo.toml with this offload mode in this process; measure."""
    import resource

    import torch

    from flowrl.cli import load_plan
    from flowrl.runtime.controller import Trainer

    path = model_dir(args.arch)
    overrides = [f'models.{m}.path="{path}"' for m in ("policy", "ref", "critic")]
    overrides += [
        f'pools.main.device="{args.device}"',
        f'pools.main.offload="{args.offload}"',
        f"pools.main.cpus_per_worker={args.threads}",
        f"run.steps={args.warmup + args.steps}",
        "run.val_size=0",
        "run.log_samples=0",
        f"data.batch_size={args.prompts}",
        f"nodes.generate.max_new_tokens={args.new_tokens}",
    ]
    with tempfile.TemporaryDirectory() as out:
        overrides.append(f'run.out_dir="{out}"')
        plan = load_plan(str(ROOT / "graphs" / "ppo.toml"), overrides)
        trainer = Trainer(plan, Path(out) / "run", "local")
        cuda = args.device == "cuda"
        steps, peaks = [], []
        for step in range(1, args.warmup + args.steps + 1):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            metrics = trainer.step(step).metrics
            if cuda:
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() / GB)
            if step > args.warmup:
                steps.append(metrics["time_s"])
        worker = trainer.executor.workers["main"][0]
        exact = {name: round_trip_is_exact(worker.train[name]) for name in ("policy", "critic")}
        trainer.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB -> GiB
    return {
        "offload": args.offload,
        "median_step_s": statistics.median(steps),
        "steps_s": steps,
        "peak_gb": max(peaks[args.warmup :]) if peaks else rss,
        "peak_kind": "torch.cuda.max_memory_allocated" if peaks else "process peak RSS",
        "reload_bit_identical": exact,
    }


def round_trip_is_exact(engine) -> bool:
    """Offload weights, grads and optimizer state, reload them: every tensor bit-identical."""
    import torch

    def snapshot():
        tensors = {f"p.{k}": v for k, v in engine.module.state_dict().items()}
        for i, state in enumerate(engine.optimizer.state.values()):
            tensors |= {f"o{i}.{k}": v for k, v in state.items() if torch.is_tensor(v)}
        return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}

    before = snapshot()
    parts = ("weights", "grads", "optimizer")
    engine.offload(parts)
    engine.reload(parts)
    after = snapshot()
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--arch", default="qwen2-0.5b", choices=sorted(ARCHS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--offload", help=argparse.SUPPRESS)  # internal: one mode, JSON out
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.offload:
        print("RESULT " + json.dumps(one_mode(args)))
        return
    model_dir(args.arch)  # build once, outside the timed processes
    results = []
    for offload in ("always", "never"):
        start = time.time()
        command = [sys.executable, __file__, *sys.argv[1:], "--offload", offload]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"offload={offload} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(lines[0][7:]))
        print(f"offload={offload}: {results[-1]} ({time.time() - start:.0f} s)", flush=True)
    table = [
        f"{args.arch} x3 (policy, ref, critic) on one {args.device}, {args.prompts} prompts x 4 "
        f"samples, <= {args.new_tokens} new tokens, median of {args.steps} steps",
        "",
        f"| offload | peak memory (GB, {results[0]['peak_kind']}) | step (s) | reload exact |",
        "|---|---|---|---|",
    ]
    for r in results:
        exact = all(r["reload_bit_identical"].values())
        table.append(
            f"| {r['offload']} | {r['peak_gb']:.2f} | {r['median_step_s']:.2f} | {exact} |"
        )
    text = "\n".join(table) + "\n"
    print(text)
    out = Path(args.out or ROOT / "bench" / "results" / f"colocation_{args.device}_{args.arch}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(text)
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
