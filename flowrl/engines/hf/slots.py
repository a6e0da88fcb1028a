"""The continuous batch of the rollout engine: its requests in the cache slots, and the layout
of the model calls that prefill, join and decode them (the model runner, runner.py, makes the
calls over the cache it owns). The scheduler's loop thread (scheduler.py) owns the batch and
calls `release`, `joining`, `admit` and `step` once per iteration.

Decoding requests occupy slots 0..d-1, so a decode call reads a contiguous view of the cache;
a request that joins or leaves swaps rows with the slot at the boundary (kv_cache.py); a
request held for its next turn keeps its slot past the decoding ones. A request's tokens
depend only on its own stream and the model: which other requests share a call changes its
logits by floating-point noise at most.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flowrl.engines.hf.decoding import Decoding, Row
from flowrl.engines.rollout import Result, mix

# a prefix shared by new prompts is prefilled once when that saves this many prompt tokens:
# below it, the extra model call (a read of all weights, ~65 ms for SmolLM2 on CPU) costs more
MIN_SAVED_PREFIX_TOKENS = 64
# a new prompt copies the prefix another request's slot holds (no model call) from this length
MIN_COPIED_PREFIX_TOKENS = 16
# new prompts (distinct) that ride in a decode call, packed; more get a prefill call of their
# own: a packed call attends per row (a kernel call per row and layer), a prefill call reads
# the weights once more (~65 ms) but computes a shared prefix once
MAX_PACKED_NEW = 8


class Batch(Decoding):
    """The requests in the engine's cache slots, over a model runner (runner.py), which owns
    the slot cache and makes the calls this batch lays out; `hold(request_id)` is told of each
    request kept for a next turn. Its decode steps are decoding.py's."""

    def __init__(self, runner, eos: int, hold: Callable[[str], None]):
        self.runner, self.eos, self.hold = runner, eos, hold
        self.slots: list[Row | None] = []
        self.decoding = 0
        self.held: dict[str, Row] = {}
        self.logits = None  # (decoding, v) next-token logits of slots 0..d-1
        self.counts = {
            "decode_calls": 0,
            "prefill_calls": 0,
            "packed_calls": 0,
            "prefill_tokens": 0,
            "copied_prefix_tokens": 0,
        }

    def drop_held(self) -> None:
        """Forget the requests held for a next turn, and the cache (the engine goes idle)."""
        for row in self.held.values():
            self.slots[row.slot] = None
        self.held.clear()
        self.slots, self.logits = [], None
        self.runner.drop()

    def fail(self, error: BaseException, arrivals: list[Row]) -> None:
        """Every request in the batch, and `arrivals`, end with `error`."""
        for row in [*self.slots[: self.decoding], *arrivals]:
            if row is not None:
                row.deliver(error)
        self.held.clear()  # their caches may be half written: the next turn starts afresh
        self.slots, self.decoding, self.logits = [], 0, None
        self.runner.drop()

    def release(self, releases: list[str], arrivals: list[Row]) -> None:
        """Free the slots held for `releases`; those running or arriving now end "abort"."""
        for request_id in releases:
            row = self.held.pop(request_id, None)
            if row is not None:
                self.slots[row.slot] = None
            for running in [*self.slots[: self.decoding], *arrivals]:
                if running is not None and running.request.request_id == request_id:
                    running.stopped = "abort"

    # -- joining -----------------------------------------------------------------------------
    def fits(self, arrivals: list[Row]) -> tuple[list[Row], list[Row]]:
        """(the arrivals the runner's cache has room for now, the later ones, which wait), in
        order of arrival. A runner without a limit takes all; a request back for its next
        turn keeps its slot. CacheFull if not even one request fits an empty cache."""
        if not arrivals:
            return arrivals, []
        columns = max(len(r.request.ids) + r.request.max_new_tokens for r in arrivals)
        most = self.runner.capacity(columns)
        if most is None:
            return arrivals, []
        if most < 1:
            self.runner.reserve(1, columns)  # raises, saying why and what helps
        used = sum(row is not None for row in self.slots)
        now, later = [], []
        for row in arrivals:
            seated = bool(row.stopped) or row.request.request_id in self.held
            if seated or (not later and used < most):
                now.append(row)
                used += not seated
            else:
                later.append(row)
        return now, later

    def admit(self, arrivals: list[Row]) -> None:
        """Place `arrivals` in the slots after the decoding ones and prefill them in one call
        (the next `step` samples their first token)."""
        rows = []
        for row in arrivals:
            if row.stopped:
                row.deliver(Result([], [], "abort"))
                continue
            rows.append(row)
        if not rows:
            return
        fed, leaders, copies = self._seat(rows)
        self._shared_prefix(self._cached_prefix(leaders))
        logits = self._prefill(fed, self.decoding)  # (m, v)
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.decoding += len(fed)
        self._copy_rows(copies)

    def _seat(self, rows: list[Row]) -> tuple[list[Row], list[Row], list[tuple[Row, Row]]]:
        """Place `rows` in the slots after the decoding ones, in the order they are fed: the
        requests back for a next turn (each keeps what its slot holds), one of each distinct
        new prompt (its leader), then the prompt's other samples, which copy the leader's
        slot once it is fed. -> (the rows fed, the leaders, [(a copy, its leader)])"""
        if not rows:
            return [], [], []
        for row in rows:
            self._place(row)
        fresh = [r for r in rows if not r.tokens]
        firsts: dict = {}  # a prompt's n samples: the first is prefilled, the others copy it
        for row in fresh:
            firsts.setdefault(tuple(row.new), row)
        leaders = list(firsts.values())
        copies = [(r, firsts[tuple(r.new)]) for r in fresh if firsts[tuple(r.new)] is not r]
        fed = [r for r in rows if r.tokens] + leaders
        self._reserve(rows)  # a slot appended by `_place` may be past the cache's
        for k, row in enumerate(fed + [c for c, _ in copies]):  # into the decoding slots
            self._swap(row.slot, self.decoding + k)
        return fed, leaders, copies

    def _copy_rows(self, copies: list[tuple[Row, Row]]) -> None:
        """Each (copy, leader), the leader just fed and decoding: the copy's slot (the next
        after the decoding ones, in order) gets the leader's columns, tokens and logits."""
        if not copies:
            return
        for row, leader in copies:
            self.runner.move([leader.slot], [row.slot], len(leader.tokens))
            row.tokens, row.new = list(leader.tokens), []
        logits = self.logits[[leader.slot for _, leader in copies]]  # row k: slot k
        self.logits = torch.cat([self.logits, logits])
        self.decoding += len(copies)

    def _reserve(self, rows: list[Row]) -> None:
        """Room for every admitted request's whole turn now, not by doublings as it decodes."""
        turn = max(len(r.request.ids) + r.request.max_new_tokens for r in rows)
        self.runner.reserve(len(self.slots), turn)

    def joining(self, arrivals: list[Row]) -> list[Row]:
        """The arrivals whose new tokens ride in the next decode call, when the engine packs
        calls and a request decodes: requests back for a next turn (their slot held), and new
        prompts while they are few (MAX_PACKED_NEW distinct ones): a prompt arriving while
        others decode then costs no weight read of its own. A larger batch of new prompts
        gets a prefill call of its own, where the prefix they share is computed once."""
        if not (self.decoding and self.runner.packs):
            return []
        live = [r for r in arrivals if not r.stopped]
        back = [r for r in live if r.request.request_id in self.held]
        new = [r for r in live if r.request.request_id not in self.held]
        if len({tuple(r.request.ids) for r in new}) > MAX_PACKED_NEW:
            new = []
        return back + new

    def _place(self, row: Row) -> None:
        """A slot and the ids to feed: a held request keeps its slot and the longest prefix of
        its conversation already cached (at least one id is fed, for the next logits)."""
        request = row.request
        row.stream = None
        if not request.sampling.greedy:  # keyed by (seed, turn): sampling.py
            key = mix(request.seed, request.turn)
            row.stream = key if self.runner.device_sampling else torch.Generator().manual_seed(key)
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

    def _cached_prefix(self, leaders: list[Row]) -> list[Row]:
        """Copy into each new prompt's slot the longest prefix of it that another request's
        slot already holds (the system prompt of requests admitted earlier), from
        MIN_COPIED_PREFIX_TOKENS on: a copy of columns, no model call. -> the prompts that
        found none."""
        new = {id(r) for r in leaders}
        cached = [r for r in self.slots if r is not None and r.tokens and id(r) not in new]
        rest = []
        for row in leaders:
            best, source = 0, None
            for other in cached:
                n = _common_prefix(other.tokens, row.new, len(row.new) - 1)
                if n > best:
                    best, source = n, other
            if best < MIN_COPIED_PREFIX_TOKENS:
                rest.append(row)
                continue
            self.runner.move([source.slot], [row.slot], best)
            row.tokens, row.new = row.new[:best], row.new[best:]
            self.counts["copied_prefix_tokens"] += best
        return rest

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
        self.runner.move([first.slot] * (len(leaders) - 1), [r.slot for r in leaders[1:]], shared)
        for row in leaders:
            row.tokens, row.new = row.new[:shared], row.new[shared:]

    def _prefill(self, rows: list[Row], lo: int) -> torch.Tensor:
        """Feed each row's new ids (rows in slots lo..) in one call -> last logits (m, v)."""
        logits = self._call([r.new for r in rows], [len(r.tokens) for r in rows], lo)
        for row in rows:
            row.tokens, row.new = row.tokens + row.new, []
        return logits

    # -- the model calls ------------------------------------------------------------------------
    def _call(self, chunks: list[list[int]], offsets: list[int], lo: int, packed=False):
        """One model call over slots lo..lo+len(chunks)-1, made by the runner: row k feeds
        chunks[k] at columns offsets[k].. (right-padded to the longest; `packed`: chunks of
        different lengths in one sequence, packed.py) -> the logits after each chunk (a, v)."""
        w = max(len(c) for c in chunks)
        self.runner.reserve(len(self.slots), max(offsets) + w)
        if packed and any(len(c) != w for c in chunks):
            self.counts["packed_calls"] += 1
            return self.runner.packed(chunks, offsets, lo)
        if w == 1:
            self.counts["decode_calls"] += 1
            return self.runner.decode([c[0] for c in chunks], offsets, lo)
        self.counts["prefill_calls"] += 1
        self.counts["prefill_tokens"] += sum(len(c) for c in chunks)
        return self.runner.prefill(chunks, offsets, lo)

    def _swap(self, a: int, b: int) -> None:
        """Exchange slots a and b: their rows and their cached columns."""
        if a == b:
            return
        x, y = self.slots[a], self.slots[b]
        columns = max(len(x.tokens) if x else 0, len(y.tokens) if y else 0)
        self.runner.move([a, b], [b, a], columns)
        self.slots[a], self.slots[b] = y, x
        for row, slot in ((x, b), (y, a)):
            if row is not None:
                row.slot = slot
        if self.logits is not None and a < len(self.logits) and b < len(self.logits):
            self.logits[[a, b]] = self.logits[[b, a]]


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the longest common prefix of a and b, at most `limit` (list slices are
    compared in C: a binary search over them, not a loop over tokens)."""
    n = max(min(len(a), len(b), limit), 0)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
