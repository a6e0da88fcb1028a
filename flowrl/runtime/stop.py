"""SIGINT and SIGTERM stop a run cleanly, at any point: during set-up, a step or a checkpoint.

The handler raises `Stopped`, a BaseException (as KeyboardInterrupt is), so no `except
Exception` on the way, a node call's included, mistakes it for a failure of its own: the run
unwinds, a checkpoint being written is discarded (checkpoint.writing), workers and scorer
processes are shut down, and the controller replaces the message with what was kept and how
to go on (flowrl/runtime/controller.py). A second signal while unwinding is ignored, so the
clean-up finishes. Torch-free.
"""

import contextlib
import signal
import threading


class Stopped(BaseException):
    """SIGINT or SIGTERM stopped the run; str() says what was kept and how to go on."""

    def __init__(self, signal_name: str):
        super().__init__(f"stopped by {signal_name}")
        self.signal_name = signal_name

    def explain(self, text: str) -> "Stopped":
        self.args = (f"stopped by {self.signal_name}; {text}",)
        return self


@contextlib.contextmanager
def stopped_by_signals():
    """Within the block, SIGINT and SIGTERM raise `Stopped` once (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = []

    def stop(signum, frame):
        if raised:  # already unwinding: let the clean-up finish
            return
        raised.append(signum)
        raise Stopped(signal.Signals(signum).name)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Preemption:
    """`preemptible`'s record: whether SIGTERM asked the run to stop at its next safe point."""

    requested = False


@contextlib.contextmanager
def preemptible(grace_s: float):
    """Within the block (the training loop), the first SIGTERM asks for a stop at the next
    safe point (the step's end: the trainer writes a checkpoint, then stops), as a spot or
    cluster scheduler's notice expects; if the run has not stopped `grace_s` seconds later,
    it stops there (`Stopped`), as without this block. A second SIGTERM, or SIGINT, stops at
    once. `grace_s` 0 (or not the main thread): SIGTERM stops at once. Yields a `Preemption`."""
    told = Preemption()
    if not grace_s or threading.current_thread() is not threading.main_thread():
        yield told
        return

    def late(signum, frame):
        raise Stopped(f"SIGTERM (no safe point within run.term_grace_s = {grace_s:g} s)")

    def term(signum, frame):
        if told.requested:
            raise Stopped("SIGTERM")
        told.requested = True
        print(
            f"flowrl: SIGTERM: finishing this step and writing a checkpoint before stopping "
            f"(within run.term_grace_s = {grace_s:g} s; SIGTERM again stops at once)",
            flush=True,
        )
        signal.signal(signal.SIGALRM, late)
        signal.setitimer(signal.ITIMER_REAL, grace_s)

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGALRM)}
    signal.signal(signal.SIGTERM, term)
    try:
        yield told
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in previous.items():
            signal.signal(s, handler)
