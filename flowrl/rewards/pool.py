"""Rule scorers run in child processes, each row under a timeout.

A user's scorer may raise, hang or kill its process. None of that may stop a run: rows are sent
one at a time to a few child processes; a row whose scorer raises, exceeds `timeout_s` or takes
its process down gets the fallback score and is counted, the stuck or dead process is replaced,
and the first failure's traceback is printed once. Children are started with "spawn" (the
trainer holds threads that a fork would copy mid-flight) and resolve the scorer themselves from
its name, so nothing but plain row data crosses the pipe. A spawned child imports nothing of
the parent's `__main__` (`clean_main`): a user's script that calls `run_tiny` without an
`if __name__ == "__main__":` guard is not run again by each child.
"""

import atexit
import contextlib
import multiprocessing
import signal
import sys
import threading
import time
import traceback
import types
from multiprocessing.connection import wait

from flowrl.rewards import BadValue, resolve_scorer, score_value

STARTUP_S = 300.0  # the most a scorer process may take to start and import its scorer


def _serve(connection, scorer: str, base_dir: str) -> None:
    """Child process: say it is ready, then score rows until the pipe closes. Ctrl-C reaches
    the whole process group: the parent stops us, so the child ignores it (no traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    function = resolve_scorer(scorer, base_dir)
    connection.send("ready")
    while True:
        try:
            index, row = connection.recv()
        except EOFError:
            return
        connection.send((index, *score_row(function, scorer, row)))


def score_row(function, scorer: str, row: tuple) -> tuple[str, object, dict]:
    """(status, score or message, extra) of one row: "ok", "bad value" (the scorer returned
    no finite number: the message names the scorer and the value) or "error" (it raised: its
    traceback, from the scorer's own frames on)."""
    try:
        result = function(*row)
    except Exception as e:
        frames = traceback.format_exception(type(e), e, e.__traceback__.tb_next)
        return "error", "".join(frames), {}
    try:
        score, extra = score_value(result, f"scorer {scorer}")
    except BadValue as e:
        return "bad value", str(e), {}
    return "ok", score, extra


_MAIN = threading.Lock()


@contextlib.contextmanager
def clean_main():
    """While children start, `__main__` is an empty module: "spawn" re-imports the parent's
    main script (or module) in every child it starts, which runs a script's top level again
    when it has no `if __name__ == "__main__":` guard. The child's target and arguments come
    from flowrl's own modules, so it needs nothing of the script."""
    with _MAIN:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


class _Child:
    def __init__(self, context, scorer: str, base_dir: str):
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, scorer, base_dir), daemon=True)
        with clean_main():
            self.process.start()
        theirs.close()
        self.row, self.deadline = None, 0.0  # the row in flight, and when it times out
        self.ready = False  # a row's timeout starts once the child has imported its scorer

    def wait_ready(self) -> bool:
        """Block until the child has started (on a busy machine a spawn takes seconds);
        False if it died first (its scorer failed to import)."""
        if not self.ready:
            try:
                self.ready = self.connection.poll(STARTUP_S) and self.connection.recv() == "ready"
            except (EOFError, OSError):
                self.ready = False
        return self.ready

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.connection.close()


class ScorerPool:
    """`score(rows)` -> (one (score, extra) or None per row, counts) for rows of verl's
    `compute_score(data_source, solution_str, ground_truth, extra_info)` arguments."""

    def __init__(self, scorer: str, base_dir: str, workers: int = 2, timeout_s: float = 10.0):
        self.scorer, self.base_dir, self.timeout_s = scorer, base_dir, timeout_s
        self.context = multiprocessing.get_context("spawn")
        self.children = [self._start() for _ in range(max(workers, 1))]
        self.reported = set()  # the kinds of failure already printed

    def _start(self) -> _Child:
        return _Child(self.context, self.scorer, self.base_dir)

    def score(self, rows: list[tuple]) -> tuple[list, dict]:
        results, counts = [None] * len(rows), {"errors": 0, "timeouts": 0}
        todo = list(range(len(rows)))[::-1]
        while todo or any(c.row is not None for c in self.children):
            for k, child in enumerate(self.children):
                if child.row is None and todo and not child.wait_ready():
                    self._fail(rows, todo[-1], "crash", "its scorer process did not start")
                    counts["errors"] += 1
                    todo.pop()
                    self._replace(k)
                    continue
                if child.row is None and todo:
                    child.row, child.deadline = todo.pop(), time.monotonic() + self.timeout_s
                    child.connection.send((child.row, rows[child.row]))
            busy = [c for c in self.children if c.row is not None]
            if not busy:  # every child failed to start: the rows left go round again
                continue
            soonest = min(c.deadline for c in busy)
            ready = wait([c.connection for c in busy], max(soonest - time.monotonic(), 0))
            for k, child in enumerate(self.children):
                if child.row is None:
                    continue
                if child.connection in ready:
                    self._receive(k, child, rows, results, counts)
                elif time.monotonic() >= child.deadline:
                    self._fail(rows, child.row, "timeout", f"took over {self.timeout_s} s")
                    counts["timeouts"] += 1
                    self._replace(k)
        return results, counts

    def _receive(self, k: int, child: _Child, rows, results, counts) -> None:
        try:
            index, status, value, extra = child.connection.recv()
        except (EOFError, OSError):  # the scorer took its process down
            code = child.process.exitcode
            self._fail(rows, child.row, "crash", f"its process exited (code {code})")
            counts["errors"] += 1
            self._replace(k)
            return
        child.row = None
        if status == "ok":
            results[index] = (value, extra)
        else:
            self._fail(rows, index, status, value)
            counts["errors"] += 1

    def _replace(self, k: int) -> None:
        self.children[k].kill()
        self.children[k] = self._start()

    def _fail(self, rows, index: int, kind: str, detail: str) -> None:
        if kind in self.reported:
            return
        self.reported.add(kind)  # the first failure of a kind in full; all are counted
        print(failure_message(self.scorer, rows, index, kind, detail), file=sys.stderr)

    def close(self) -> None:
        for child in self.children:
            child.kill()
        self.children = []


def failure_message(scorer: str, rows, index: int, kind: str, detail: str) -> str:
    source, text = rows[index][0], str(rows[index][1])[:80]
    where = f"row {index} of the batch (data_source {source!r}, response {text!r})"
    if kind == "bad value":
        return (
            f"flowrl: {detail} on {where}; that row gets the fallback score, counted in the "
            "reward node's errors metric (val/... in validation), as are further ones"
        )
    return (
        f"flowrl: scorer {scorer} failed ({kind}) on {where}; that row gets the fallback score, "
        "and failures are counted in the reward node's errors and timeouts metrics (val/... "
        f"in validation):\n{detail}"
    )


_POOLS: dict[tuple, ScorerPool] = {}


def pool_for(scorer: str, base_dir: str, workers: int, timeout_s: float) -> ScorerPool:
    """One pool per scorer setting, kept for the run (children start once)."""
    key = (scorer, base_dir, workers, timeout_s)
    if key not in _POOLS:
        _POOLS[key] = ScorerPool(scorer, base_dir, workers, timeout_s)
    return _POOLS[key]


@atexit.register
def close_all() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
