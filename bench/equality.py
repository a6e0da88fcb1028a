"""Are two runs the same run? Every value two run directories logged in metrics.jsonl, compared
row by row, timings and memory left out (they are the machine's, not the run's).

    python bench/equality.py runs/grpo-A runs/grpo-B --before d74feff --after 0462f21 \
        --command "flowrl run graphs/grpo.toml --backend local" -o bench/results/x.json

Exit status 0 when every value both runs logged is equal, 1 otherwise (the first differences
are printed). Keys logged by one run only are listed apart: a new metric is no difference in
what was trained.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# keys that measure the machine: wall times, rates, memory and process figures
TIMINGS = ("timing_s/", "process/", "time_s", "tokens_per_s", "_per_s", "memory/", "_mb")


def rows(run_dir: Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def is_timing(key: str) -> bool:
    return any(part in key for part in TIMINGS)


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare(before: list[dict], after: list[dict]) -> dict:
    """{values_compared, equal, differences: [(row, key, before, after)], keys_only_*}."""
    if len(before) != len(after):
        raise SystemExit(f"the runs logged {len(before)} and {len(after)} rows")
    compared, differences, only_before, only_after = 0, [], set(), set()
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        keys_b = {k for k in b if not is_timing(k)}
        keys_a = {k for k in a if not is_timing(k)}
        only_before |= keys_b - keys_a
        only_after |= keys_a - keys_b
        for key in sorted(keys_b & keys_a):
            compared += 1
            if not same(b[key], a[key]):
                differences.append((i, key, b[key], a[key]))
    return {
        "logged_rows": len(before),
        "values_compared": compared,
        "equal": compared - len(differences),
        "timings_left_out": list(TIMINGS),
        "keys_only_before": sorted(only_before),
        "keys_only_after": sorted(only_after),
        "differences": differences[:50],
        "val_score": {
            str(r["step"]): r[key]
            for r in after
            for key in r
            if key.startswith("val/") and key.endswith("score") and "/" not in key[4:]
        },
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--before", dest="before_commit", default="")
    parser.add_argument("--after", dest="after_commit", default="")
    parser.add_argument("--command", default="")
    parser.add_argument("-o", "--out", type=Path)
    args = parser.parse_args(argv)
    result = compare(rows(args.before), rows(args.after))
    record = {
        "command": args.command,
        "before": args.before_commit,
        "after": args.after_commit,
        **result,
    }
    print(
        f"{result['equal']} of {result['values_compared']} values equal over "
        f"{result['logged_rows']} rows"
    )
    for row, key, b, a in result["differences"][:10]:
        print(f"  row {row} {key}: {b} -> {a}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if not result["differences"] else 1


if __name__ == "__main__":
    sys.exit(main())
