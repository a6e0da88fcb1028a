"""A rollout pool's weight sync on Ray: exported weights from one actor to another, sent as
torch pickles them and as `flowrl.runtime.weights.Weights` (each tensor's bytes a buffer).

    python bench/weight_transfer.py [--params 135] [--repeats 5] [--cores]

Two actors of one CPU and one torch thread each (the pools of graphs/grpo_disaggregated.toml):
the first copies a state dict of `--params` million fp32 parameters (30 tensors, SmolLM2-135M's
size by default) and returns it; the second takes the reference, loads every tensor into its
own copy and reports when each phase ended. The two ways alternate; medians of `--repeats`
after one untimed round each. Also `--cores`: a one-thread matmul and a 0.5 GB matrix-vector
product alone and two at once in separate processes, to see whether the two pools' cores
slow each other.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from flowrl.runtime.weights import Weights

ROOT = Path(__file__).resolve().parents[1]


def transfer(params: int, repeats: int) -> dict:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=1)
    class Rank:
        def __init__(self):
            torch.set_num_threads(1)
            self.state = {f"w{i}": torch.randn(params * 10**6 // 30) for i in range(30)}

        def export(self, buffers: bool):
            start = time.time()
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.state.items()}
            return (Weights(state) if buffers else state), start, time.time()

        def load(self, exported):
            state, start, end = exported
            arrived = time.time()
            with torch.no_grad():
                for k, v in state.items():
                    self.state[k].copy_(v)
            return {
                "export_s": end - start,
                "transfer_s": arrived - end,
                "load_s": time.time() - arrived,
                "total_s": time.time() - start,
            }

    sender, receiver = Rank.remote(), Rank.remote()
    runs = {"torch pickle": [], "Weights buffers": []}
    for i in range(repeats + 1):
        for name, buffers in (("torch pickle", False), ("Weights buffers", True)):
            timed = ray.get(receiver.load.remote(sender.export.remote(buffers)))
            if i:  # the first round warms the object store
                runs[name].append(timed)
    ray.shutdown()
    return {
        name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"runs": rows}
        for name, rows in runs.items()
    }


CORE_JOB = """
import sys, time, torch
torch.set_num_threads(1)
if sys.argv[1] == "matmul":
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    job, reps = (lambda: a @ b), 60
else:  # 8 rows against 0.5 GB of weights, as a decode step reads them
    ws, x = [torch.randn(2048, 8192) for _ in range(8)], torch.randn(8, 2048)
    job, reps = (lambda: [x @ w for w in ws]), 20
job()
start = time.perf_counter()
for _ in range(reps):
    job()
print((time.perf_counter() - start) / reps * 1000)
"""


def cores() -> dict:
    def run(*kinds):
        procs = [
            subprocess.Popen([sys.executable, "-c", CORE_JOB, k], stdout=subprocess.PIPE, text=True)
            for k in kinds
        ]
        return [round(float(p.communicate()[0]), 2) for p in procs]

    out = {}
    for kind in ("matmul", "matvec"):
        out[f"{kind} alone (ms)"] = run(kind)[0]
        out[f"{kind} two at once (ms)"] = run(kind, kind)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=135, help="millions of fp32 parameters")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cores", action="store_true", help="also the two-cores check")
    parser.add_argument("--out", default=str(ROOT / "bench/results/weight_transfer.json"))
    args = parser.parse_args()
    result = {"params_millions": args.params, "transfer": transfer(args.params, args.repeats)}
    if args.cores:
        result["cores"] = cores()
    for name, timed in result["transfer"].items():
        print(name, {k: round(v, 3) for k, v in timed.items() if k != "runs"})
    if args.cores:
        print(result["cores"])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
