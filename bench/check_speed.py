"""`flowrl check` wall time per shipped graph, with torch and ray unimportable, in a fresh
process each (the start-up a user pays), and for all graphs in one command.

    python bench/check_speed.py --repeats 3 --write   # -> bench/results/check_speed.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = (
    "import sys; sys.modules['torch'] = None; sys.modules['ray'] = None\n"
    "from flowrl.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "assert 'transformers' not in sys.modules\n"
    "sys.exit(code)\n"
)


def seconds(args: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED, "check", *args], capture_output=True, text=True, cwd=ROOT
    )
    if result.returncode:
        raise SystemExit(result.stderr)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    graphs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "graphs").glob("*.toml"))
    per_graph = {
        g: round(statistics.median(seconds([g]) for _ in range(args.repeats)), 3) for g in graphs
    }
    together = round(statistics.median(seconds(graphs) for _ in range(args.repeats)), 3)
    out = {
        "what": "flowrl check wall time (s), fresh process, torch and ray unimportable, median",
        "repeats": args.repeats,
        "per_graph": per_graph,
        "all_graphs_one_command": together,
        "graphs": len(graphs),
        "load_average_1min_after": os.getloadavg()[0],  # the machine is shared: context
    }
    print(json.dumps(out, indent=2))
    if args.write:
        (ROOT / "bench/results/check_speed.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
