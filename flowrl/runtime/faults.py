"""Fault injection for tests: stop a run, or one of its ranks, at an exact place instead of
after a guessed delay.

`FLOWRL_KILL_AT=<point>:<step>` makes the process SIGKILL itself when it reaches `point` during
step `step`, as a crash or an out-of-memory kill would; `<point>:<step>:TERM` (or `:INT`) sends
that signal instead, as `kill` or Ctrl-C would; `:STOP` pauses the process there until it gets
SIGCONT (a test waits for the pause with waitpid(WUNTRACED), then races another command
against it); `:HANG` sleeps there for an hour (a rank that stops answering); `:NODE` kills the
process's Ray node (its raylet, the parent of a Ray worker process), as a lost machine would.
Several faults are separated by commas. Points of the controller:

- `checkpoint`: the step's checkpoint files are written in the temp directory, which is not yet
  renamed into place (a kill in the middle of a checkpoint write);
- `logged`: the step's metrics and samples are written, its checkpoint (if due) is not;
- `locked` (step 0): the run directory is made (or found, for --resume) and locked, nothing
  else is done yet.

Points of a pool's rank are `<pool>.<rank>.<what>` (flowrl/runtime/pool_worker.py), the step
being the one the rank last worked on (validation's calls count as step 0 before the first
step, and as the step they follow after it): `load` (step 0: the rank starts, before its
models load), `<node>` (a node's call, e.g. `gen.0.generate:3`),
`sync` (weights synced in place to the rollout engine), `export` and `import` (weights sent
from a training pool to a rollout pool), `save` (the rank writing its part of a checkpoint).

With `FLOWRL_FAULTS_ONCE=<folder>` each fault fires once: the first process to reach it leaves
a mark in the folder (a run that recovers passes the point again; without it, the fault
recurs there, as a deterministic crash would).

Unset (the default), `point` does nothing.
"""

import hashlib
import os
import signal
import time
from pathlib import Path

VARIABLE = "FLOWRL_KILL_AT"
ONCE = "FLOWRL_FAULTS_ONCE"
KINDS = ("KILL", "TERM", "INT", "STOP", "HANG", "NODE")


def point(name: str, step: int) -> None:
    """Fire the fault set for `name` during `step`, if any."""
    spec = os.environ.get(VARIABLE, "")
    if not spec:
        return
    for fault in spec.split(","):
        where, _, rest = fault.strip().partition(f"{name}:{step}")
        if where or not _ or rest not in ("", *(":" + k for k in KINDS)):
            continue
        if _fired_before(fault.strip()):
            continue
        _fire(rest[1:] or "KILL")


def _fired_before(fault: str) -> bool:
    """With FLOWRL_FAULTS_ONCE: whether another process (or this one) fired it already; the
    first to ask leaves the mark."""
    folder = os.environ.get(ONCE)
    if not folder:
        return False
    mark = Path(folder) / hashlib.sha256(fault.encode()).hexdigest()[:16]
    try:
        fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return True
    os.write(fd, f"{fault} pid {os.getpid()}\n".encode())
    os.close(fd)
    return False


def _fire(kind: str) -> None:
    if kind == "HANG":
        time.sleep(3600)
        return
    if kind == "NODE":  # a Ray worker's parent is its node's raylet: the node goes with it
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(3600)  # this process ends with its node
        return
    os.kill(os.getpid(), getattr(signal, "SIG" + kind))
