"""Fault injection for tests: stop a run at an exact place instead of after a guessed delay.

`FLOWRL_KILL_AT=<point>:<step>` makes the process SIGKILL itself when it reaches `point` during
step `step`, as a crash or an out-of-memory kill would; `<point>:<step>:TERM` (or `:INT`) sends
that signal instead, as `kill` or Ctrl-C would; `:STOP` pauses the process there until it gets
SIGCONT (a test waits for the pause with waitpid(WUNTRACED), then races another command
against it). Points:

- `checkpoint`: the step's checkpoint files are written in the temp directory, which is not yet
  renamed into place (a kill in the middle of a checkpoint write);
- `logged`: the step's metrics and samples are written, its checkpoint (if due) is not;
- `locked` (step 0): the run directory is made (or found, for --resume) and locked, nothing
  else is done yet.

Unset (the default), `point` does nothing.
"""

import os
import signal

VARIABLE = "FLOWRL_KILL_AT"


def point(name: str, step: int) -> None:
    where, _, kind = os.environ.get(VARIABLE, "").partition(f"{name}:{step}")
    if where or not _ or kind not in ("", ":KILL", ":TERM", ":INT", ":STOP"):
        return
    os.kill(os.getpid(), getattr(signal, "SIG" + (kind[1:] or "KILL")))
