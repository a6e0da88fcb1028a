"""The OpenAI-endpoint door against the native agent node on one task (issue 46's overhead
target: <= 1.2x): graphs/grpo_openai_agent.toml (an `openai` SDK program calling the run's
endpoint, a tool loop of its own) and graphs/grpo_tools.toml (the agent node's tool loop), the
same data, seeds, batch, samples and per-turn limits, each run as a user runs it
(`flowrl run`, bench/readme.py's `run_one`), one after the other, alternating.

    python bench/agent_overhead.py [--seeds 0] [--out bench/results/agent_overhead.json]

Writes each run (validation scores, median step and plan-item seconds, tokens/s, load) and
the ratios openai_agent / tools of the median step and of the median generate item.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from readme import commit, machine, machine_line, run_one  # noqa: E402

GRAPHS = ("grpo_tools", "grpo_openai_agent")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/agent_overhead.json"))
    a = parser.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    here = machine()
    result = {"commit": commit(), "machine": machine_line(here), "runs": {g: [] for g in GRAPHS}}
    for seed in seeds:
        for graph in GRAPHS:
            run = run_one(graph, seed)
            result["runs"][graph].append(run)
            print(graph, seed, json.dumps({k: run[k] for k in ("val", "median_step_s", "wall_s")}))
            Path(a.out).write_text(json.dumps(result, indent=1) + "\n")  # keeps what finished
    tools, agent = (result["runs"][g] for g in GRAPHS)
    step = statistics.median(r["median_step_s"] for r in agent) / statistics.median(
        r["median_step_s"] for r in tools
    )
    generate = statistics.median(r["median_item_s"]["generate"] for r in agent) / statistics.median(
        r["median_item_s"]["generate"] for r in tools
    )
    result["ratio"] = {"median_step": round(step, 3), "median_generate": round(generate, 3)}
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print("openai_agent / tools:", result["ratio"])


if __name__ == "__main__":
    main()
