"""Continuous batching for flowrl's own engine (hf_rollout.py): requests join and leave the
batch at every decode step.

    while there is work:                                  (a thread of its own)
        take the requests that arrived; each gets a slot of the KV cache (a returning
            request keeps its slot and the prefix it holds)
        prefill the new requests' tokens in one model call (n samples of one prompt: once,
            then copied; a prefix all new prompts share: once, then copied)
        sample one token for every decoding request, each from its own random stream
        requests that finished leave at once: their result goes back to the caller's event
            loop; their slot is freed, or held for their next turn (keep)
        one model call feeds the sampled token of every request still decoding and the new
            tokens of the requests back from their tools (packed.py: one sequence, so the
            weights are read once; a model that cannot be packed gets a prefill call first)

The model calls are blocking torch, so they run on one thread while the callers' event loop
runs tools and interactions on another. A synchronous caller (`HFRollout.run`: the generate
node, validation, the agent node) lends its own thread to the loop and runs its requests'
event loop on a helper thread (`drive`): torch's intra-op threads (OpenMP) are set up for the
thread that configured them, and a forward pass from a thread of its own ran 1.4x slower with
2 torch threads on the 2-core machine (the same with 1). A caller already inside an event loop
gets the loop on a thread of its own (`submit` starts it).

Decoding requests occupy slots 0..d-1, so a decode call reads a contiguous view of the cache;
a request that joins or leaves swaps rows with the slot at the boundary (kv_cache.py). A
request's tokens depend only on its own stream and the model: which other requests share a
call changes its logits by floating-point noise at most.

`lockstep`: the loop runs no step while a held request is away (its caller is running its
tools), so every batch's composition is a function of the requests alone and a rollout is
reproducible bit for bit; slower, since decoding waits for tools. A caller must then come back
or release every request it kept, or the engine waits for it (the agent driver releases in a
`finally`). Free-running is the default.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import attrs
import torch

from flowrl.engines.rollout import Request, Result, mix, run_sync, start_thread
from flowrl.engines.sampling import sample_rows

# a prefix shared by new prompts is prefilled once when that saves this many prompt tokens:
# below it, the extra model call (a read of all weights, ~65 ms for SmolLM2 on CPU) costs more
MIN_SAVED_PREFIX_TOKENS = 64


@attrs.define(eq=False)
class Row:
    """One request inside the engine."""

    request: Request
    deliver: Callable  # (Result | BaseException) -> None, on the caller's loop
    slot: int = -1
    tokens: list = attrs.Factory(list)  # ids whose keys and values fill the slot's columns
    new: list = attrs.Factory(list)  # ids to feed before this turn's first sample
    stream: torch.Generator | None = None  # None: greedy
    out: list = attrs.Factory(list)
    logprobs: list = attrs.Factory(list)
    next: int = -1  # the token sampled last, fed at the next decode call
    stopped: str = ""  # "abort" once released or cancelled while running


class Scheduler:
    """The batching loop over an engine's `_forward(ids, offsets, last, lo, hi)` (logits of
    each row's last new token) and a slot cache from `new_cache(slots, columns)`."""

    def __init__(self, engine, new_cache: Callable, eos: int, lockstep: bool = False):
        self.engine, self.new_cache, self.eos = engine, new_cache, eos
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
        # owned by the loop thread
        self.cache = None
        self.slots: list[Row | None] = []
        self.decoding = 0
        self.held: dict[str, Row] = {}
        self.logits = None  # (decoding, v) next-token logits of slots 0..d-1
        self.counts = {
            "decode_calls": 0,
            "prefill_calls": 0,
            "packed_calls": 0,
            "prefill_tokens": 0,
        }
        self.turn_columns = 0  # the columns the admitted requests' turns need

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
            self._wake()

    def release(self, request_id: str) -> None:
        with self.cv:
            self.away.discard(request_id)
            self.releases.append(request_id)
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
                        done = not (self.held or self.away) or self.dropping
                    if done and not self.decoding:
                        self._exit()
                        return
                    self.cv.wait()
                arrivals, self.inbox = self.inbox, []
                releases, self.releases = self.releases, []
            try:
                with torch.inference_mode():
                    self._release(releases, arrivals)
                    joining = self._joining(arrivals)
                    self._admit([r for r in arrivals if all(r is not j for j in joining)])
                    self._step(joining)
            except BaseException as e:  # every request in the engine gets the error
                self._fail(e, arrivals)

    def _ready(self) -> bool:
        if self.releases:
            return True
        # wait for every held request, unless none can come back
        if self.lockstep and self.away and not (self.dropping or self.caller_done):
            return False
        return bool(self.inbox or self.decoding)

    def _exit(self) -> None:
        for row in self.inbox:
            row.deliver(Result([], [], "abort"))
        self.inbox = []
        for row in self.held.values():
            self.slots[row.slot] = None
        self.held.clear()
        self.away.clear()
        self.cache, self.slots, self.logits, self.turn_columns = None, [], None, 0
        self.thread, self.driven, self.caller_done = None, False, False
        self.cv.notify_all()

    def _fail(self, error: BaseException, arrivals: list[Row]) -> None:
        for row in [*self.slots[: self.decoding], *arrivals]:
            if row is not None:
                row.deliver(error)
        self.held.clear()  # their caches may be half written: the next turn starts afresh
        self.cache, self.slots, self.decoding, self.logits = None, [], 0, None

    def _release(self, releases: list[str], arrivals: list[Row]) -> None:
        for request_id in releases:
            row = self.held.pop(request_id, None)
            if row is not None:
                self.slots[row.slot] = None
            for running in [*self.slots[: self.decoding], *arrivals]:
                if running is not None and running.request.request_id == request_id:
                    running.stopped = "abort"

    # -- joining -----------------------------------------------------------------------------
    def _admit(self, arrivals: list[Row]) -> None:
        rows = []
        for row in arrivals:
            if row.stopped:
                row.deliver(Result([], [], "abort"))
                continue
            self._place(row)
            rows.append(row)
        if not rows:
            return
        fresh = [r for r in rows if not r.tokens]
        firsts: dict = {}  # a prompt's n samples: the first is prefilled, the others copy it
        for row in fresh:
            firsts.setdefault(tuple(row.new), row)
        leaders = list(firsts.values())
        copies = [(r, firsts[tuple(r.new)]) for r in fresh if firsts[tuple(r.new)] is not r]
        computed = [r for r in rows if r.tokens] + leaders
        for k, row in enumerate(computed + [c for c, _ in copies]):  # into the decoding slots
            self._swap(row.slot, self.decoding + k)
        self._reserve(rows)
        self._shared_prefix(leaders)
        logits = self._prefill(computed, self.decoding)  # (m, v)
        for row, leader in copies:
            self.cache.move([leader.slot], [row.slot], len(leader.tokens))
            row.tokens, row.new = list(leader.tokens), []
        if copies:
            index = {id(r): k for k, r in enumerate(computed)}
            logits = torch.cat([logits, logits[[index[id(leader)] for _, leader in copies]]])
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.decoding += len(rows)

    def _reserve(self, rows: list[Row]) -> None:
        """Room for every admitted request's whole turn now, not by doublings as it decodes."""
        turn = max(len(r.request.ids) + r.request.max_new_tokens for r in rows)
        if self.cache is not None:
            self.cache.reserve(len(self.slots), turn)
        self.turn_columns = max(self.turn_columns, turn)

    def _joining(self, arrivals: list[Row]) -> list[Row]:
        """The arrivals whose new tokens ride in the next decode call: requests back for a next
        turn (their slot held), when the engine packs calls and a request decodes."""
        if not (self.decoding and getattr(self.engine, "packs", False)):
            return []
        held = self.held
        return [r for r in arrivals if not r.stopped and r.request.request_id in held]

    def _join(self, rows: list[Row]) -> list[Row]:
        """Returning requests into the slots after the decoding ones (fed by `_step`)."""
        for k, row in enumerate(rows):
            self._place(row)
            self._swap(row.slot, self.decoding + k)
        if rows:
            self._reserve(rows)
        return rows

    def _place(self, row: Row) -> None:
        """A slot and the ids to feed: a held request keeps its slot and the longest prefix of
        its conversation already cached (at least one id is fed, for the next logits)."""
        request = row.request
        row.stream = None
        if not request.sampling.greedy:
            row.stream = torch.Generator().manual_seed(mix(request.seed, request.turn))
        held = self.held.pop(request.request_id, None) if request.request_id else None
        ids = list(request.ids)
        if held is not None:
            same = _common_prefix(held.tokens, ids, len(ids) - 1)
            row.slot, row.tokens, row.new = held.slot, ids[:same], ids[same:]
            self.slots[row.slot] = row
            return
        free = [s for s in range(self.decoding, len(self.slots)) if self.slots[s] is None]
        row.slot = free[0] if free else len(self.slots)
        if not free:
            self.slots.append(None)
        self.slots[row.slot] = row
        row.tokens, row.new = [], ids

    def _shared_prefix(self, leaders: list[Row]) -> None:
        """Prefill the prefix all new prompts share once (a chat template's system prompt) and
        copy it to the other prompts' slots, leaving each prompt one token of its own."""
        if len(leaders) < 2:
            return
        shortest = min(len(r.new) for r in leaders) - 1
        shared = _common_prefix(leaders[0].new, leaders[1].new, shortest)
        for row in leaders[2:]:
            shared = _common_prefix(leaders[0].new, row.new, shared)
        if (len(leaders) - 1) * shared < MIN_SAVED_PREFIX_TOKENS:
            return
        first = leaders[0]
        self._call([first.new[:shared]], [0], first.slot)
        self.cache.move([first.slot] * (len(leaders) - 1), [r.slot for r in leaders[1:]], shared)
        for row in leaders:
            row.tokens, row.new = row.new[:shared], row.new[shared:]

    def _prefill(self, rows: list[Row], lo: int) -> torch.Tensor:
        """Feed each row's new ids (rows in slots lo..) in one call -> last logits (m, v)."""
        logits = self._call([r.new for r in rows], [len(r.tokens) for r in rows], lo)
        for row in rows:
            row.tokens, row.new = row.tokens + row.new, []
        return logits

    # -- decoding ----------------------------------------------------------------------------
    def _step(self, joining: list[Row]) -> None:
        """Sample a token for every decoding row; then one call feeds them, with the new tokens
        of `joining` (returning requests) packed beside them."""
        if self.decoding:
            self._sample()
        if not self.decoding:  # nothing decodes: the returning requests get a prefill call
            self.logits = None
            self._admit(joining)
            return
        rows, joined = self.slots[: self.decoding], self._join(joining)
        chunks = [[r.next] for r in rows] + [r.new for r in joined]
        offsets = [len(r.tokens) for r in rows + joined]
        self.logits = self._call(chunks, offsets, 0, packed=True)
        for row in rows:
            row.tokens.append(row.next)
        for row in joined:
            self.counts["prefill_tokens"] += len(row.new)
            row.tokens, row.new = row.tokens + row.new, []
        self.decoding += len(joined)

    def _sample(self) -> None:
        """Each decoding row's next token; the rows that finished leave their slots."""
        rows = self.slots[: self.decoding]
        tokens, logprobs = sample_rows(rows, self.logits)
        leaving = []
        for row, token, logprob in zip(rows, tokens, logprobs, strict=True):
            if row.stopped:
                leaving.append(row)
                continue
            row.out.append(token)
            row.logprobs.append(logprob if row.request.logprobs else 0.0)
            if token == self.eos:
                row.stopped = "stop"
            elif len(row.out) >= row.request.max_new_tokens:
                row.stopped = "length"
            row.next = token
            if row.stopped:
                leaving.append(row)
        for row in sorted(leaving, key=lambda r: -r.slot):
            last = self.decoding - 1
            if self._keeps(row):  # its cache goes on living past the decoding slots
                self._swap(row.slot, last)
            else:  # nothing of it is kept: the last decoding row moves into its slot
                self._vacate(row.slot, last)
            self.decoding -= 1
            self._finish(row)

    def _keeps(self, row: Row) -> bool:
        request = row.request
        return bool(request.keep and request.request_id and row.stopped != "abort")

    def _vacate(self, slot: int, last: int) -> None:
        """Free `slot` (its row is done) by moving the row at `last` into it: one row's
        columns copied, where a swap copies two."""
        moved = self.slots[last]
        if slot != last:
            self.cache.move([last], [slot], len(moved.tokens))
            self.slots[slot], moved.slot = moved, slot
        self.slots[last] = None

    def _finish(self, row: Row) -> None:
        request = row.request
        if self._keeps(row):
            self.held[request.request_id] = row
            with self.cv:
                self.away.add(request.request_id)
        elif self.slots[row.slot] is row:
            self.slots[row.slot] = None
        row.deliver(Result(list(row.out), list(row.logprobs), row.stopped))

    # -- the cache -----------------------------------------------------------------------------
    def _call(self, chunks: list[list[int]], offsets: list[int], lo: int, packed=False):
        """One model call over slots lo..lo+len(chunks)-1: row k feeds chunks[k] at columns
        offsets[k].. (right-padded to the longest; `packed`: chunks of different lengths in
        one sequence, packed.py) -> the logits after each chunk (a, v)."""
        w = max(len(c) for c in chunks)
        if self.cache is None:
            columns = max(max(offsets) + w, self.turn_columns)
            self.cache = self.new_cache(len(self.slots), columns)
        self.cache.reserve(len(self.slots), max(offsets) + w)
        if packed and any(len(c) != w for c in chunks):
            self.counts["packed_calls"] += 1
            return self.engine._forward_packed(chunks, offsets, lo)
        device = self.engine.device
        ids = torch.full((len(chunks), w), self.eos, dtype=torch.long)
        for k, chunk in enumerate(chunks):
            ids[k, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        last = torch.tensor([len(c) - 1 for c in chunks], device=device)
        offsets = torch.tensor(offsets, dtype=torch.long, device=device)
        self.counts["decode_calls" if w == 1 else "prefill_calls"] += 1
        if w > 1:
            self.counts["prefill_tokens"] += sum(len(c) for c in chunks)
        return self.engine._forward(ids.to(device), offsets, last, lo, lo + len(chunks))

    def _swap(self, a: int, b: int) -> None:
        """Exchange slots a and b: their rows and their cached columns."""
        if a == b:
            return
        x, y = self.slots[a], self.slots[b]
        columns = max(len(x.tokens) if x else 0, len(y.tokens) if y else 0)
        if self.cache is not None:
            self.cache.move([a, b], [b, a], columns)
        self.slots[a], self.slots[b] = y, x
        for row, slot in ((x, b), (y, a)):
            if row is not None:
                row.slot = slot
        if self.logits is not None and a < len(self.logits) and b < len(self.logits):
            self.logits[[a, b]] = self.logits[[b, a]]


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for k in range(n):
        if a[k] != b[k]:
            return k
    return max(n, 0)


def _settle(future: asyncio.Future, value) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)
