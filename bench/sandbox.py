"""What confining the python tool's code costs per call: the wall time of `print(1)` through
`run_python`, confined to its view and not (the same network and PID namespaces, limits and
per-call cgroups, the unconfined variant of the seccomp filter, no mount namespace),
alternating which runs first, in one process; and the CPU time the
call's processes used (user + system, from getrusage of reaped children), which a busy
machine disturbs less than the wall time.

    python bench/sandbox.py --calls 50 --write   # -> bench/results/sandbox_overhead.json
"""

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path

from flowrl.agent.tools import sandbox

ROOT = Path(__file__).resolve().parents[1]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def call_ms(confined: bool) -> tuple[float, float]:
    """(wall, CPU) milliseconds of one call."""
    sandbox.use_view = lambda setting: confined  # the setting's outcome, fixed for the bench
    start, cpu = time.perf_counter(), children_cpu_s()
    result = asyncio.run(sandbox.run_python("print(1)"))
    if (result.status, result.stdout) != ("ok", "1"):
        raise SystemExit(f"the run failed: {result}")
    return (time.perf_counter() - start) * 1000, (children_cpu_s() - cpu) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    state = sandbox.confinement()
    if not state.available:
        raise SystemExit(f"no confinement on this machine: {state.reason}")
    call_ms(True), call_ms(False)  # warm: the probe, the file cache
    times, cpu = {True: [], False: []}, {True: [], False: []}
    for k in range(args.calls):
        for confined in (k % 2 == 0, k % 2 == 1):
            wall, used = call_ms(confined)
            times[confined].append(wall)
            cpu[confined].append(used)
    confined, plain = statistics.median(times[True]), statistics.median(times[False])
    cpu_confined, cpu_plain = statistics.median(cpu[True]), statistics.median(cpu[False])
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    out = {
        "what": "run_python('print(1)') per call (ms): wall time and the CPU time of its "
        "processes, medians; alternating order",
        "calls_each": args.calls,
        "confined_ms": round(confined, 1),
        "unconfined_ms": round(plain, 1),
        "added_ms": round(confined - plain, 1),
        "confined_quartiles_ms": [round(q, 1) for q in statistics.quantiles(times[True])],
        "unconfined_quartiles_ms": [round(q, 1) for q in statistics.quantiles(times[False])],
        "cpu_confined_ms": round(cpu_confined, 1),
        "cpu_unconfined_ms": round(cpu_plain, 1),
        "cpu_added_ms": round(cpu_confined - cpu_plain, 1),
        "commit": commit,
        "cpus": os.cpu_count(),
        "load_average_1min_after": os.getloadavg()[0],  # the machine is shared: context
    }
    print(json.dumps(out, indent=2))
    if args.write:
        path = ROOT / "bench/results/sandbox_overhead.json"
        path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
