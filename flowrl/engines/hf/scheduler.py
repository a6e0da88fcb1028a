"""Continuous batching for flowrl's own engine (engine.py): requests join and leave the
batch at every decode step.

    while there is work:                                  (a thread of its own)
        take the requests that arrived; each gets a slot of the KV cache (a returning
            request keeps its slot and the prefix it holds; a new prompt copies the longest
            prefix of it another slot holds)
        if nothing decodes, or many new prompts arrived: prefill their tokens in one model
            call (n samples of one prompt: once, then copied; a prefix all new prompts share:
            once, then copied)
        sample one token for every decoding request, each from its own random stream
        requests that finished leave at once: their result goes back to the caller's event
            loop; their slot is freed, or held for their next turn (keep)
        one model call feeds the sampled token of every request still decoding and the new
            tokens of the requests back from their tools, and of a few new prompts (packed.py:
            one sequence, so the weights are read once; a model that cannot be packed gets a
            prefill call first)

The model calls are blocking torch, so they run on one thread while the callers' event loop
runs tools and interactions on another. A synchronous caller (`HFRollout.run`: the generate
node, validation, the agent node) lends its own thread to the loop and runs its requests'
event loop on a helper thread (`drive`): torch's intra-op threads (OpenMP) are set up for the
thread that configured them, and a forward pass from a thread of its own ran 1.4x slower with
2 torch threads on the 2-core machine (the same with 1). A caller already inside an event loop
gets the loop on a thread of its own (`submit` starts it).

The batch itself (which request sits in which cache slot, and the model calls) is slots.py.

`lockstep`: the loop runs no step while a held request is away (its caller is running its
tools), so every batch's composition is a function of the requests alone and a rollout is
reproducible bit for bit; slower, since decoding waits for tools. A caller must then come back
or release every request it kept, or the engine waits for it (the agent driver releases in a
`finally`). Free-running is the default.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from flowrl.engines.hf.slots import Batch, Row
from flowrl.engines.rollout import Request, Result
from flowrl.engines.threads import run_sync, start_thread


class Scheduler:
    """The batching loop over a `Batch` (slots.py) of an engine's requests, whose model calls
    a model runner makes (runner.py); `eos` ends a request's turn."""

    def __init__(self, runner, eos: int, lockstep: bool = False):
        self.lockstep = lockstep
        self.cv = threading.Condition()
        self.gathering: dict = {}  # event loop -> rows submitted in its current iteration
        self.inbox: list[Row] = []
        self.releases: list[str] = []
        self.away: set[str] = set()  # held requests whose caller has not come back yet
        self.thread: threading.Thread | None = None  # the thread running the loop
        self.driven = False  # the loop runs on a caller's thread (`drive`)
        self.caller_done = False  # ... and that caller's requests have all come back
        self.dropping = False
        self.stalled = False  # the inbox waits for room in the cache (a release, a return)
        self.batch = Batch(runner, eos, self._hold)  # owned by the loop thread

    # -- the callers' side (any event loop) ------------------------------------------------
    async def submit(self, request: Request) -> Result:
        if not request.ids:
            raise ValueError("a request needs at least one token id (the prompt)")
        if request.max_new_tokens <= 0:
            return Result([], [], "length")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def deliver(value):
            try:
                loop.call_soon_threadsafe(_settle, future, value)
            except RuntimeError:  # the caller's loop has closed: nobody waits any more
                pass

        row = Row(request, deliver)
        with self.cv:
            # requests issued in one iteration of the loop (a gather) arrive together
            if loop not in self.gathering:
                self.gathering[loop] = []
                loop.call_soon(self._hand_over, loop)
            self.gathering[loop].append(row)
        try:
            return await future
        except asyncio.CancelledError:
            row.stopped = "abort"
            raise

    def _hand_over(self, loop) -> None:
        with self.cv:
            rows = self.gathering.pop(loop, [])
            self.inbox += rows
            self.away -= {r.request.request_id for r in rows}
            self.stalled = False
            self._wake()

    def release(self, request_id: str) -> None:
        with self.cv:
            self.away.discard(request_id)
            self.releases.append(request_id)
            self.stalled = False
            self._wake()

    def idle(self, drop: bool = False) -> None:
        """Wait until the loop has nothing left and has exited (its cache freed); `drop`:
        also free requests held for a next turn."""
        with self.cv:
            self.dropping = drop
            self.cv.notify_all()
            while self.thread is not None:
                self.cv.wait()
            self.dropping = False

    def drive(self, coroutine):
        """Run `coroutine` (requests to this engine) to its end: its event loop on a helper
        thread, the batching loop on this one, until the coroutine has finished and no request
        of it runs. Requests it left held are dropped then (nobody is left to come back for
        them). If the loop already runs (another caller's), the coroutine joins it instead."""
        with self.cv:
            busy = self.thread is not None
            if not busy:
                self.thread, self.driven, self.caller_done = threading.current_thread(), True, False
        if busy:
            return run_sync(coroutine)

        def finished():
            with self.cv:
                self.caller_done = True
                self.cv.notify_all()

        join = start_thread(coroutine, finished)
        self._run()  # returns once `finished` has run and no request decodes
        return join()

    def _wake(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="flowrl-rollout", daemon=True)
            self.thread.start()
        self.cv.notify_all()

    # -- the loop thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cv:
                while not self._ready():
                    if self.driven:  # until the caller's requests have all come back
                        done = self.caller_done
                    else:  # until nothing is held (or held requests are being dropped)
                        done = not (self.batch.held or self.away) or self.dropping
                    if done and not self.batch.decoding:
                        self._exit()
                        return
                    self.cv.wait()
                arrivals, self.inbox = self.inbox, []
                releases, self.releases = self.releases, []
            waiting = []
            try:
                with torch.inference_mode():
                    batch = self.batch
                    batch.release(releases, arrivals)
                    arrivals, waiting = batch.fits(arrivals)  # the others wait for room
                    joining = batch.joining(arrivals)
                    batch.admit([r for r in arrivals if all(r is not j for j in joining)])
                    batch.step(joining)
            except BaseException as e:  # every request in the engine gets the error
                self.batch.fail(e, arrivals + waiting)
                waiting = []
            if waiting:
                with self.cv:
                    self.inbox = waiting + self.inbox
                    self.stalled = not (arrivals or self.batch.decoding)

    def _ready(self) -> bool:
        if self.releases:
            return True
        # wait for every held request, unless none can come back
        if self.lockstep and self.away and not (self.dropping or self.caller_done):
            return False
        return bool((self.inbox and not self.stalled) or self.batch.decoding)

    def _exit(self) -> None:
        for row in self.inbox:
            row.deliver(Result([], [], "abort"))
        self.inbox = []
        self.batch.drop_held()
        self.away.clear()
        self.thread, self.driven, self.caller_done = None, False, False
        self.cv.notify_all()

    def _hold(self, request_id: str) -> None:
        with self.cv:
            self.away.add(request_id)


def _settle(future: asyncio.Future, value) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)
