"""The measurements of bench/gpu.py, one function per step; each runs in a process of its own
(`python bench/gpu.py --step NAME`) and returns a JSON-able dict.

Decode: a Qwen2-0.5B-shaped model with random weights from a config (bench/colocation.py's
`qwen2-0.5b`, no download) in bf16, fixed random prompts of `prompt_len` ids, greedy, the same
weights in every process (seeded). Each engine's tokens/s counts the tokens it produced (up to
and including an eos, which random weights rarely sample). The CUDA runner is timed on its
second run of a shape (its first captures the graphs), the eager engines after a short warm-up,
and transformers' static cache after a first, compiling run of the same shape.

A step prints a `RESULT` line with what it has measured so far after every shape (decode) or
timed step (flowrl's GRPO): bench/gpu.py keeps the last one of a step that runs out of time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from colocation import ARCHS  # noqa: E402
from grpo_vs_trl import flowrl_overrides, run_trl  # noqa: E402

# bf16 dense matmul peak (TFLOP/s) by the card's name, for MFU (the vendors' data sheets)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0}


def report(out: dict) -> None:
    """What the step has measured so far, for bench/gpu.py (the last line counts)."""
    print("RESULT " + json.dumps(out), flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


# -- models -------------------------------------------------------------------------------------
def qwen(arch: str, dtype: str, device: str):
    """A random-initialised Qwen2 of one of bench/colocation.py's shapes (`qwen2-0.5b`;
    `small` for --smoke), seeded: the same weights in every process."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**ARCHS[arch], eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(getattr(torch, dtype)).eval()


def tokenizer_dir() -> Path:
    """The embedded model's tokenizer: its cached conversion, or the copy of its files that
    bench/gpu_prepare.sh carries ($FLOWRL_BENCH_TOKENIZER) where the model could not travel."""
    from flowrl.models.embedded import ModelNotFound, ensure_cached

    try:
        return ensure_cached()
    except ModelNotFound:
        if os.environ.get("FLOWRL_BENCH_TOKENIZER"):
            return Path(os.environ["FLOWRL_BENCH_TOKENIZER"])
        raise


def model_dir(arch: str, dtype: str, device: str) -> Path:
    """`qwen(arch)` saved with the embedded model's tokenizer (its ids fit the vocabulary), for
    the GRPO runs of both sides; built once."""
    from transformers import AutoTokenizer

    from flowrl.models.embedded import cache_root

    out = cache_root() / "bench" / f"{arch}-{dtype}"
    if not (out / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
        model = qwen(arch, dtype, device)
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.bos_token_id = tokenizer.bos_token_id
        temp = Path(tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None))
        model.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        out.parent.mkdir(parents=True, exist_ok=True)
        temp.rename(out)
    return out


def prepare(shapes) -> dict:
    """The embedded model's conversion and the GRPO model directories, before any timing."""
    from flowrl.models.embedded import ModelNotFound, ensure_cached

    start = time.time()
    try:
        ensure_cached()
        embedded = "converted"
    except ModelNotFound as e:  # the steps that need it fail; the others run
        embedded = f"missing: {e}"
    dirs = {w: str(model_dir(*w.split("/"), shapes.device)) for w in shapes.model_dirs}
    device = torch.cuda.get_device_name() if shapes.device == "cuda" else "cpu (smoke)"
    return {"device": device, "dirs": dirs, "embedded": embedded, "s": time.time() - start}


# -- decode -------------------------------------------------------------------------------------
def decode(shapes, engine: str) -> dict:
    """Tokens/s of one engine at every decode shape: "runner" (flowrl's CUDA runner; on CPU
    the same calls eagerly), "eager" (flowrl's eager runner), "generate" (transformers,
    dynamic cache), "static" (transformers, static cache, compiled on CUDA)."""
    device = shapes.device
    model = qwen(shapes.decode_arch, shapes.decode_dtype, device)
    g = torch.Generator().manual_seed(1)
    pairs = shapes.static_shapes if engine == "static" else shapes.decode_pairs
    out = {}
    for rows, new in pairs:
        ids = torch.randint(3, 49152, (rows, shapes.prompt_len), generator=g).to(device)
        run = _decoder(engine, model, ids, device, shapes)
        warm = new if engine in ("runner", "static") else 8  # graphs, compile: the same shape
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warm_s = timed(lambda run=run, warm=warm: run(warm), device)[0]
            seconds, tokens = timed(lambda run=run, new=new: run(new), device)
        record = {"s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
        record |= {"warm_s": warm_s, **getattr(run, "facts", dict)()}
        record["warnings"] = record.get("warnings", []) + [str(w.message)[:300] for w in caught]
        out[f"{rows}x{new}"] = record
        report(out)
        if engine == "runner" and (rows, new) == shapes.decode_pairs[0]:
            # warm first: the sampled block's first call compiles the sampler (cuda)
            timed(lambda run=run: run(8, sample=True), device)
            seconds, tokens = timed(lambda run=run, new=new: run(new, sample=True), device)
            out[f"{rows}x{new} sampled"] = {"s": seconds, "tokens_per_s": tokens / seconds}
            report(out)
    return out


def runner_facts(rollout) -> dict:
    """Whether flowrl's runner replayed graphs, compiled its step, which shapes it captured,
    its warnings, and its decode calls: a fallback to eager is seen, not guessed."""
    runner = rollout.runner
    return {
        "runner": type(runner).__name__,
        "graphs": bool(getattr(runner, "graphs", False)),
        "compiled": getattr(runner, "compiled", None) is not None,
        "sampler_compiled": getattr(runner, "sampler", None) is not None,
        "captured": sorted(f"{b}x{w}" for b, w in getattr(runner, "captured", {})),
        "capture_s": getattr(runner, "capture_s", 0.0),
        "regrows": getattr(runner, "regrows", 0),
        "warnings": list(getattr(runner, "warnings", [])),
        "decode_calls": rollout.scheduler.batch.counts["decode_calls"],
    }


def smoke(shapes) -> dict:
    """The correctness check before anything is timed (~1 min): tiny Llama and Qwen2 in fp32,
    greedy, flowrl's runner under test (graphs and the compiled step on a GPU) against the
    eager runner: the same tokens, graphs captured, no warning."""
    from flowrl.backends import HFOptions
    from flowrl.engines import HFRollout
    from flowrl.engines.batch import generate_batch
    from flowrl.testing import tiny_model, tiny_qwen2, tiny_tokenizer

    device, out = shapes.device, {}
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 100, (11, 9), generator=g)
    mask = torch.ones_like(prompts)
    for family, model in (("llama", tiny_model(seed=3)), ("qwen2", tiny_qwen2(layers=3))):
        model = model.to(device).eval()
        start = time.time()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = {}
            for runner in ("eager", shapes.runner):
                options = HFOptions(runner=runner, memory_fraction=0.05, dtype="float32")
                rollout = HFRollout(model, tiny_tokenizer(), device, options=options)
                results[runner] = generate_batch(
                    rollout, prompts, mask, max_new_tokens=40, do_sample=False, logprobs=True
                )
        a, b = results["eager"], results[shapes.runner]
        out[family] = {
            "same_tokens": bool(torch.equal(a["responses"], b["responses"])),
            "max_logprob_diff": float((a["logprobs"] - b["logprobs"]).abs().max()),
            "s": time.time() - start,
            **runner_facts(rollout),
        }
        out[family]["warnings"] += [str(w.message)[:300] for w in caught]
        report(out)
    out["passed"] = all(
        r["same_tokens"] and r["max_logprob_diff"] < 1e-3 and not r["warnings"]
        and (r["graphs"] and r["captured"] if shapes.runner == "cuda_graph" else True)
        for r in out.values()
    )  # fmt: skip
    return out


def _decoder(engine: str, model, ids, device: str, shapes):
    """run(new, sample=False) -> the tokens produced, up to and including each row's eos."""
    from types import SimpleNamespace

    from flowrl.backends import HFOptions
    from flowrl.engines import HFRollout
    from flowrl.engines.batch import generate_batch

    mask = torch.ones_like(ids)
    if engine in ("runner", "eager"):
        kind = "eager" if engine == "eager" else shapes.runner
        tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
        rollout = HFRollout(model, tokenizer, device, options=HFOptions(runner=kind))

        def run(new, sample=False):
            out = generate_batch(rollout, ids, mask, max_new_tokens=new, do_sample=sample)
            return int(out["response_mask"].sum())

        run.facts = lambda: runner_facts(rollout)
        return run

    def run(new, sample=False):
        extra = {"cache_implementation": "static"} if engine == "static" else {}
        if engine == "static" and not shapes.compile:
            extra["disable_compile"] = True
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                pad_token_id=0, eos_token_id=2, **extra,
            )[:, ids.shape[1] :]  # fmt: skip
        is_eos = out == 2
        return int(((is_eos.cumsum(-1) - is_eos.long()) == 0).sum())

    return run


# -- GRPO against TRL, colocation, learning ----------------------------------------------------
def flowrl_grpo(shapes, work, offload: str = "never", noskip: bool = False) -> dict:
    """graphs/grpo.toml on `work` through the local executor in this process: the timed
    steps' seconds, plan items, new tokens, and the device's peak memory."""
    from flowrl.cli import load_plan
    from flowrl.runtime.controller import Trainer

    total = shapes.warmup + shapes.steps
    overrides = flowrl_overrides(work) + [f'pools.main.offload="{offload}"', f"run.steps={total}"]
    overrides += ["nodes.update_policy.skip_zero_rows=false"] if noskip else []
    out = {"step_s": [], "items": [], "new_tokens": [], "peak_gb": 0.0, "overrides": overrides}
    with tempfile.TemporaryDirectory() as directory:
        graph = str(ROOT / "graphs" / "grpo.toml")
        plan = load_plan(graph, [*overrides, f'run.out_dir="{directory}"'])
        trainer = Trainer(plan, Path(directory) / "run", "local")
        for step in range(1, total + 1):
            if work.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            metrics = trainer.step(step).metrics
            if step <= shapes.warmup:
                continue
            out["step_s"].append(metrics["time_s"])
            out["items"].append({k[9:]: v for k, v in metrics.items() if k.startswith("timing_s/")})
            out["new_tokens"].append(metrics["response_length/mean"] * work.prompts * work.samples)
            if work.device == "cuda":
                out["peak_gb"] = max(out["peak_gb"], torch.cuda.max_memory_allocated() / 2**30)
            out["median_step_s"] = statistics.median(out["step_s"])
            report(out)
        trainer.close()
    return out


def trl_grpo(shapes, work) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        out = run_trl(shapes.warmup + shapes.steps, directory, work)
    out["step_s"] = out["step_s"][shapes.warmup :]
    out["new_tokens"] = out["new_tokens"][shapes.warmup :]
    out["median_step_s"] = statistics.median(out["step_s"])
    return out


def learning(shapes) -> dict:
    """`flowrl run graphs/grpo.toml --backend local` with the shapes' overrides, as a user
    runs it: validation score by step, and the seconds of the whole command."""
    from flowrl.cli import main

    with tempfile.TemporaryDirectory() as directory:
        start = time.time()
        args = [*shapes.learning, f'run.out_dir="{directory}"']
        code = main(["run", str(ROOT / "graphs" / "grpo.toml"), "--backend", "local", *args])
        seconds = time.time() - start
        (run,) = Path(directory).iterdir()
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    val = {int(m["step"]): m["val/score"] for m in lines if "val/score" in m}
    steps = [m["time_s"] for m in lines if "time_s" in m]
    return {"exit": code, "seconds": seconds, "val": val, "step_s": steps}


# -- training throughput ------------------------------------------------------------------------
def train(shapes) -> dict:
    """Forward + backward + AdamW over the large shape's rows (prompts x samples, every
    response `new_tokens` long, as random weights sample): tokens/s and MFU against the
    card's bf16 dense peak, two ways (`train_flops`): "mfu" from the FLOPs the step does,
    "mfu_naive" as 6 x parameters x every prompt and response token."""
    from flowrl.data.arithmetic import arithmetic_rows
    from flowrl.engines import TrainEngine
    from flowrl.models import load_model
    from flowrl.protocol import DataProto

    work, device = shapes.large, shapes.device
    model, tokenizer = load_model(work.model, dtype=work.dtype)
    model.to(device)
    texts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in arithmetic_rows("train", work.prompts)
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    rows = work.prompts * work.samples
    g = torch.Generator().manual_seed(0)
    data = DataProto.from_dict(
        {
            "prompts": batch["input_ids"].repeat_interleave(work.samples, 0),
            "prompt_mask": batch["attention_mask"].repeat_interleave(work.samples, 0),
            "responses": torch.randint(3, 49152, (rows, work.new_tokens), generator=g),
            "response_mask": torch.ones(rows, work.new_tokens, dtype=torch.long),
        }
    )
    engine = TrainEngine(model, tokenizer, lr=1e-6, device=device, micro_tokens=shapes.micro_tokens)

    def step():  # a policy-gradient step's shape: token-mean of log-probs, advantage 1
        for micro in engine.micro_batches(data):
            micro = micro.to(device)  # the loss next to the log-probs, as the update loop does
            out = engine.forward(micro, grad=True)
            engine.backward(-(out["logprobs"] * micro["response_mask"]).sum() / data_tokens)
        engine.step()

    data_tokens = rows * work.new_tokens

    step()  # warm-up
    seconds = statistics.median(timed(step, device)[0] for _ in range(shapes.train_repeats))
    tokens = int(data["prompt_mask"].sum() + data["response_mask"].sum())
    name = torch.cuda.get_device_name() if device == "cuda" else ""
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    flops = train_flops(engine, model, data)
    out = {"s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "peak_tflops": peak}
    for key, done in (("", flops["done"]), ("_naive", flops["naive"])):
        out[f"tflops{key}"] = done / seconds / 1e12
        out[f"mfu{key}"] = done / seconds / (peak * 1e12) if peak else None
    out |= {k: v for k, v in flops.items() if k not in ("done", "naive")}
    out["micro_tokens"] = shapes.micro_tokens
    out["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return out


def train_flops(engine, model, data) -> dict:
    """A training step's FLOPs (forward + backward = 6 per parameter and token), two ways:

    - done: the decoder's matmuls (parameters but the input embedding, a lookup) at every
      token the step computes, each distinct prompt of a micro-batch once where the engine
      shares it among its samples (`_share_prompts`), plus the LM head (vocab x hidden) at
      response positions only, where log-probs are taken;
    - naive: 6 x all parameters x every prompt and response token (the usual shortcut,
      which counts the shared prompts n times and the head at prompt positions).
    Neither counts attention's own FLOPs (score and value products, ~2-5% at 300 tokens)."""
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == embedding.data_ptr()
    body = params - embedding.numel() - (0 if tied else head.numel())
    prompt_done = 0
    for micro in engine.micro_batches(data):
        prompts, mask = micro["prompts"], micro["prompt_mask"]
        if engine._share_prompts(prompts, mask, grad=True):
            distinct = torch.unique(torch.cat([prompts, mask], dim=1), dim=0)
            prompt_done += int(distinct[:, prompts.shape[1] :].sum())
        else:
            prompt_done += int(mask.sum())
    response = int(data["response_mask"].sum())
    tokens = int(data["prompt_mask"].sum()) + response
    return {
        "done": 6 * (body * (prompt_done + response) + head.numel() * response),
        "naive": 6 * params * tokens,
        "prompt_tokens_done": prompt_done,
        "params_body": body,
        "params_head": head.numel(),
    }
