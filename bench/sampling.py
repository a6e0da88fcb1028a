"""The device's sampling step (`sample_tokens(..., sync_free=True)`, what the CUDA and static
runners call in a decode block) at a commit against the working tree, on the logits' shapes of
SmolLM2 (49,152 entries) and Qwen2 (151,936).

    python bench/sampling.py --before <commit> [--device cpu] [--repeats 7] [--out FILE]

The sampler at `<commit>` is read with `git show` and loaded beside the tree's; both draw
from the same uniforms. Prints the median milliseconds of each setting (temperature alone,
top-p, top-k + top-p), eager before and after and compiled (`compiled_sampler`, what the
CUDA runner calls when its step is compiled), and the share of tokens the two drew alike
(float rounding at a CDF boundary is the only allowed difference).
"""

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from flowrl.engines.hf.graphs import compiled_sampler
from flowrl.engines.hf.sampling import sample_tokens, stream_uniforms

SHAPES = ((32, 49152), (64, 151936))
SETTINGS = {"temperature": (0.8, 0, 1.0), "top_p": (1.0, 0, 0.9), "top_k+top_p": (1.0, 50, 0.9)}


def load_at(commit: str):
    text = subprocess.run(
        ["git", "show", f"{commit}:flowrl/engines/hf/sampling.py"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "sampling_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("sampling_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sample_tokens


def timed(fn, args, repeats: int, device) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out")
    a = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(a.device)
    before = load_at(a.before)
    sampler = compiled_sampler()
    rows_out = []
    for rows, vocab in SHAPES:
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
        u = stream_uniforms(torch.arange(rows), torch.zeros(rows, dtype=torch.long)).to(device)
        for name, (t, k, p) in SETTINGS.items():
            args = (logits, t, k, p, True, None, True, u, True)
            old, new = before(*args), sample_tokens(*args)
            row = {
                "rows": rows, "vocab": vocab, "setting": name,
                "before_ms": round(timed(before, args, a.repeats, device), 2),
                "after_ms": round(timed(sample_tokens, args, a.repeats, device), 2),
                "compiled_ms": round(timed(sampler, (logits, t, k, p, u), a.repeats, device), 2),
                "same_tokens": float((old[0] == new[0]).float().mean()),
                "max_logprob_diff": float((old[1] - new[1]).abs().max()),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "before": a.before, "after": commit, "device": str(device),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": 1, "repeats": a.repeats, "rows": rows_out,
    }  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
