"""flowrl on one GPU, side by side with transformers and TRL on the same card: one command.

    python bench/gpu.py              # a CUDA machine: about 5.5 minutes, nothing downloaded
    python bench/gpu.py --smoke      # the CPU, tiny shapes: the whole script in a few minutes
    bash bench/gpu_run.sh            # the lent GPU machine (wheels carried: docs/performance.md)

Every step runs in a process of its own under its own time limit, within --budget-s in all
(a step that fails or runs out of time is recorded as such, with what it printed before its
limit, and the others still run):

    prepare              the embedded model's conversion; a Qwen2-0.5B-shaped model directory
    smoke                the correctness check first (~1 min): tiny Llama and Qwen2, fp32,
                         flowrl's runner under test against its eager runner: the same greedy
                         tokens, graphs captured (compiled step on), no warning
    decode_<engine>      tokens/s at 256 x 512 (first), 256 x 128 and 64 x 128 (Qwen2-0.5B
                         shape, bf16, random weights): flowrl's CUDA runner ("runner"; each
                         record says whether graphs replayed, the shapes captured, warnings),
                         its eager runner, transformers' generate (dynamic cache) and generate
                         with the static cache, compiled (at 256 x 512 only, after the small
                         GRPO pair: its two compiles must not eat the budget of the others)
    grpo_<shape>_<side>  a GRPO step of graphs/grpo.toml (local executor, offload "never",
                         the rollout in the model's dtype) and of TRL's GRPOTrainer: small =
                         SmolLM2-135M fp32, 8 prompts x 8 samples x <= 64 tokens, flowrl with
                         and without skipping zero-advantage rows ("_noskip": TRL's arithmetic);
                         large = Qwen2-0.5B shape bf16, 32 x 8 x 256 (random weights score 0,
                         so flowrl computes every row there: skip_zero_rows = false; TRL in
                         micro-batches of 32 rows x 8 accumulation steps, one generation of
                         256 and one optimizer step, as flowrl micro-batches)
    train                training tokens/s and MFU at the large shape: "mfu" from the FLOPs
                         the step does (a shared prompt once, the LM head at response tokens),
                         "mfu_naive" = 6 x parameters x all tokens
    colocation           the large flowrl run with offload "always": offload, reload and sync
                         times, peak memory (against "never" from grpo_large_flowrl)
    learning             flowrl run graphs/grpo.toml on the device, embedded model: validation
                         at steps 0, 10, 20

Writes bench/results/gpu_<step>.json, bench/results/gpu.json (the summary: `SUMMARY_KEYS`;
the ratios from this one run) and bench/results/gpu.md (the tables). --smoke writes
gpu_smoke*. The Hub is off (HF_HUB_OFFLINE=1): nothing is looked up on a machine without a
network.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from grpo_vs_trl import Work  # noqa: E402

ENGINES = ("runner", "eager", "generate", "static")


@dataclasses.dataclass(frozen=True)
class Shapes:
    device: str
    runner: str  # flowrl's runner under test: cuda_graph on a GPU, static on the CPU
    decode_arch: str
    decode_dtype: str
    decode_pairs: tuple  # (rows, new tokens), the headline first (kept if the step runs out)
    static_shapes: tuple  # the pairs of the static-cache anchor (a compile each)
    compile: bool
    prompt_len: int
    small: Work
    large: Work
    warmup: int  # GRPO steps per side before the timed ones
    steps: int
    micro_tokens: int  # the train step's micro-batches
    train_repeats: int
    learning: tuple  # graphs/grpo.toml overrides of the learning run
    model_dirs: tuple  # "arch/dtype" directories prepare builds


GPU = Shapes(
    device="cuda",
    runner="cuda_graph",
    decode_arch="qwen2-0.5b",
    decode_dtype="bfloat16",
    decode_pairs=((256, 512), (256, 128), (64, 128)),
    static_shapes=((256, 512),),
    compile=True,
    prompt_len=64,
    small=Work(prompts=8, samples=8, new_tokens=64, device="cuda"),
    large=Work(
        model="",
        dtype="bfloat16",
        prompts=32,
        samples=8,
        new_tokens=256,
        lr=1e-6,
        device="cuda",
        micro_rows=32,
    ),
    warmup=1,
    steps=3,
    micro_tokens=16384,
    train_repeats=3,
    learning=('pools.main.device="cuda"', "run.val_size=32"),  # 20 steps, 3 validations
    model_dirs=("qwen2-0.5b/bfloat16",),
)
SMOKE = Shapes(
    device="cpu",
    runner="static",
    decode_arch="small",
    decode_dtype="float32",
    decode_pairs=((4, 16), (4, 8), (2, 8)),
    static_shapes=((4, 16),),
    compile=False,
    prompt_len=8,
    small=Work(model="", prompts=2, samples=2, new_tokens=8, lr=1e-5),
    large=Work(model="", prompts=2, samples=2, new_tokens=8, lr=1e-5, micro_rows=2),
    warmup=1,
    steps=1,
    micro_tokens=4096,
    train_repeats=1,
    learning=(
        'pools.main.device="cpu"',
        "run.steps=2",
        "run.val_every=1",
        "run.val_size=4",
        "data.batch_size=2",
        "nodes.generate.n=2",
        "nodes.generate.max_new_tokens=4",
    ),  # fmt: skip
    model_dirs=("small/float32",),
)
# (step, the most seconds it may take), in the order they run: the correctness smoke, then
# what the summary's keys need, the slowest anchor after the small GRPO pair; a short budget
# drops the eager runner's row and the colocation figures. Budgets from the 11-27 H200 run and
# the pre-flight read (docs/performance.md): about 330 s spent in all.
STEPS = (
    ("prepare", 45),
    ("smoke", 90),  # two tiny compiles on a GPU
    ("decode_runner", 100),  # the step's compile (~30-60 s?) and the sampler's happen here
    ("decode_generate", 45),
    ("grpo_small_flowrl", 35),
    ("grpo_small_flowrl_noskip", 30),
    ("grpo_small_trl", 35),
    ("decode_static", 90),
    ("grpo_large_flowrl", 45),
    ("grpo_large_trl", 60),
    ("train", 30),
    ("learning", 75),
    ("decode_eager", 45),
    ("colocation", 35),
)
BUDGET_S = 330.0  # bench/gpu_run.sh's default: with the install and the tests, call 2 <= 7 min
SMOKE_SLOWER = 4  # --smoke: each step's limit and the budget times this (a CPU, maybe shared)
SUMMARY_KEYS = (
    "device",
    "smoke_passed",
    "decode_vs_generate",
    "decode_vs_static_compile",
    "decode_graphs",
    "grpo_vs_trl_small",
    "grpo_vs_trl_small_noskip",
    "grpo_vs_trl_large",
    "train_mfu",
    "train_mfu_naive",
    "learning_val",
    "decode_shape",
    "versions",
    "steps",
)


def shapes_of(smoke: bool, dirs: dict | None = None) -> Shapes:
    """The shapes, the model directories prepare built filled in."""
    shapes = SMOKE if smoke else GPU
    if not dirs:
        return shapes
    (large,) = dirs.values()
    small = shapes.small if shapes.small.model else dataclasses.replace(shapes.small, model=large)
    learning = shapes.learning
    if smoke:  # the small random model stands in for the embedded one
        learning += (f'models.policy.path="{large}"', f'models.ref.path="{large}"')
    large_work = dataclasses.replace(shapes.large, model=large)
    return dataclasses.replace(shapes, small=small, large=large_work, learning=learning)


def run_step(name: str, shapes: Shapes) -> dict:
    import gpu_steps as s

    if name == "prepare":
        return s.prepare(shapes)
    if name == "smoke":
        return s.smoke(shapes)
    if name.startswith("decode_"):
        return s.decode(shapes, name.removeprefix("decode_"))
    if name.startswith("grpo_"):
        _, size, side, *noskip = name.split("_")
        work = shapes.small if size == "small" else shapes.large
        if side == "trl":
            if importlib.util.find_spec("trl") is None:  # pip install -e ".[bench]"
                return {"skipped": "trl is not installed"}
            return s.trl_grpo(shapes, work)
        return s.flowrl_grpo(shapes, work, noskip=size == "large" or bool(noskip))
    if name == "colocation":
        return s.flowrl_grpo(shapes, shapes.large, offload="always", noskip=True)
    return {"train": s.train, "learning": s.learning}[name](shapes)


# -- the driver --------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="all steps together")
    parser.add_argument("--only", default="", help="comma-separated steps (default: all)")
    parser.add_argument("--out", default=str(BENCH / "results"))
    parser.add_argument("--step", help=argparse.SUPPRESS)  # internal: one step, JSON out
    parser.add_argument("--dirs", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        result = run_step(args.step, shapes_of(args.smoke, json.loads(args.dirs)))
        print("RESULT " + json.dumps(result), flush=True)
        return
    prefix = "gpu_smoke" if args.smoke else "gpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slower = SMOKE_SLOWER if args.smoke else 1
    deadline, results, dirs = time.time() + args.budget_s * slower, {}, {}
    chosen = set(args.only.split(",")) if args.only else None
    for name, most in STEPS:
        if chosen and name not in chosen and name != "prepare":
            continue
        limit = min(most * slower, deadline - time.time())
        record = one_step(name, args, dirs, limit) if limit > 5 else {"error": "no time left"}
        results[name] = record
        dirs = dirs or record.get("result", {}).get("dirs", {})
        (out / f"{prefix}_{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {record.get('error') or 'done'} ({record.get('s', 0):.0f} s)", flush=True)
    summary = summarise(results, args.smoke)
    (out / f"{prefix}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / f"{prefix}.md").write_text(markdown(results, summary))
    print(markdown(results, summary))


def one_step(name: str, args, dirs: dict, limit: float) -> dict:
    command = [sys.executable, __file__, "--step", name, "--dirs", json.dumps(dirs)]
    command += ["--smoke"] if args.smoke else []
    return run_limited(command, limit)


ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
ENV |= {"TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run_limited(command: list[str], limit: float) -> dict:
    """Run a step's command within `limit` seconds -> its record: {"result": the last RESULT
    line's dict, "s": seconds}, with "error" (and stderr's tail) when it failed or ran out of
    time, and "partial": True when the result is what it printed before that. A step past its
    limit is killed with its whole process group (inductor's compile workers too, which would
    otherwise hold its output open), and what it printed is kept."""
    start = time.time()
    pipe = subprocess.PIPE
    env = os.environ | ENV
    with subprocess.Popen(
        command, stdout=pipe, stderr=pipe, text=True, env=env, start_new_session=True
    ) as step:
        try:
            stdout, stderr = step.communicate(timeout=limit)
            error = f"exit {step.returncode}" if step.returncode else ""
        except subprocess.TimeoutExpired:
            os.killpg(step.pid, signal.SIGKILL)
            stdout, stderr = step.communicate()  # what it printed before its limit
            error = f"ran past its {limit:.0f} s"
    record = {"s": time.time() - start}
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if lines:
        record["result"] = json.loads(lines[-1][7:])
    if error or not lines:
        record["error"] = error or "no RESULT line"
        record["stderr"] = stderr[-2000:]
        record["partial"] = bool(lines)
    return record


def summarise(results: dict, smoke: bool) -> dict:
    """The keys the issue names, each None where its steps did not finish."""
    import torch
    import transformers

    def got(name):
        return results.get(name, {}).get("result")

    shapes = SMOKE if smoke else GPU
    rows, new = shapes.decode_pairs[0]
    key = f"{rows}x{new}"

    def rate(engine):
        return ((got(f"decode_{engine}") or {}).get(key) or {}).get("tokens_per_s")

    def ratio(a, b):
        return a / b if a and b else None

    def grpo(size, mine=""):
        mine, theirs = got(f"grpo_{size}_flowrl{mine}"), got(f"grpo_{size}_trl")
        return ratio((mine or {}).get("median_step_s"), (theirs or {}).get("median_step_s"))

    headline = (got("decode_runner") or {}).get(key) or {}
    graphs = {
        k: headline.get(k)
        for k in ("graphs", "compiled", "sampler_compiled", "capture_s", "warnings")
    }

    val = (got("learning") or {}).get("val", {})
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import trl

        versions["trl"] = trl.__version__
    except ImportError:
        pass
    return {
        "device": (got("prepare") or {}).get("device"),
        "smoke_passed": (got("smoke") or {}).get("passed"),
        "decode_vs_generate": ratio(rate("runner"), rate("generate")),
        "decode_vs_static_compile": ratio(rate("runner"), rate("static")),
        "decode_graphs": graphs,
        "grpo_vs_trl_small": grpo("small"),
        "grpo_vs_trl_small_noskip": grpo("small", "_noskip"),
        "grpo_vs_trl_large": grpo("large"),
        "train_mfu": (got("train") or {}).get("mfu"),
        "train_mfu_naive": (got("train") or {}).get("mfu_naive"),
        "learning_val": [val[k] for k in sorted(val, key=int)],
        "decode_shape": key,
        "versions": versions,
        "steps": {name: r.get("error", "done") for name, r in results.items()},
    }


def markdown(results: dict, summary: dict) -> str:
    def got(name):
        return results.get(name, {}).get("result") or {}

    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    lines = [f"Device: {summary['device']}; {versions}", ""]
    shapes = sorted({k for e in ENGINES for k in got(f"decode_{e}")}, key=lambda k: (len(k), k))
    lines += ["| decode, new tokens/s | " + " | ".join(ENGINES) + " |", "|---" * 5 + "|"]
    for shape in shapes:
        cells = [got(f"decode_{e}").get(shape, {}).get("tokens_per_s") for e in ENGINES]
        lines.append(f"| {shape} | " + " | ".join(f"{c:,.0f}" if c else "-" for c in cells) + " |")
    lines += ["", "| GRPO step (s, median) | flowrl | TRL | flowrl / TRL |", "|---|---|---|---|"]
    for size, mine in (("small", ""), ("small", "_noskip"), ("large", "")):
        a = got(f"grpo_{size}_flowrl{mine}").get("median_step_s")
        b = got(f"grpo_{size}_trl").get("median_step_s")
        ratio = summary[f"grpo_vs_trl_{size}{mine}"]
        label = size + (", every row (no skip)" if mine or size == "large" else ", skip_zero_rows")
        lines.append(f"| {label} | {_num(a)} | {_num(b)} | {_num(ratio, 3)} |")
    train, colocation = got("train"), got("colocation")
    moves = {
        k: statistics.median(i.get(k, 0.0) for i in colocation.get("items", []))
        for k in {k for i in colocation.get("items", []) for k in i}
        if k.split(":")[0] in ("offload", "reload", "sync")
    }
    never = got("grpo_large_flowrl").get("peak_gb")
    learned = got("learning").get("seconds")
    lines += [
        "",
        f"- training: {_num(train.get('tokens_per_s'), 0)} tokens/s, MFU from the FLOPs done "
        f"{_num(summary['train_mfu'], 3)} (naive, 6 x params x all tokens: "
        f"{_num(summary['train_mfu_naive'], 3)})",
        f"- smoke passed: {summary['smoke_passed']}; graphs at {summary['decode_shape']}: "
        f"{summary['decode_graphs']}",
        f"- colocated, offload always: step {_num(colocation.get('median_step_s'))} s, peak "
        f"{_num(colocation.get('peak_gb'))} GB (never: {_num(never)} GB); "
        + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(moves.items())),
        f"- learning: validation {summary['learning_val']} in {_num(learned, 0)} s",
        "- steps: " + ", ".join(f"{k} {v}" for k, v in summary["steps"].items()),
    ]
    return "\n".join(lines) + "\n"


def _num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


if __name__ == "__main__":
    main()
